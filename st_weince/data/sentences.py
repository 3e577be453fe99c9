"""Text files of one sentence a line, read in the two ways the project needs them.

- :func:`read_first_lines`: the first ``limit`` non-empty lines, in file order, duplicates kept (a training file:
  unsupervised SimCSE trains on ``wiki1m_for_simcse.txt`` as it is).
- :func:`sample_distinct_lines`: the distinct non-empty lines, then a seeded random subset of them (the diagnostics'
  negative pool: a sentence paired with its own copy is no negative, its score is exactly 1); :func:`sample_distinct`
  does the same on texts already in memory (e.g. the two sides of sentence pairs).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

# Unsupervised SimCSE's training file, as its authors host it on the Hugging Face hub.
WIKI1M_HUB = ("princeton-nlp/datasets-for-simcse", "wiki1m_for_simcse.txt")

Item = TypeVar("Item")


def read_first_lines(path: str | Path, limit: int | None = None) -> list[str]:
    """The first ``limit`` non-empty lines of a UTF-8 text file, stripped (all of them for ``None``)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    lines: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line:
                lines.append(line)
                if limit is not None and len(lines) >= limit:
                    break
    return lines


def seeded_subset(items: Sequence[Item], limit: int | None, seed: int = 0) -> list[Item]:
    """A seeded random subset of ``limit`` of the items, in their order (all of them when ``limit`` is None or not
    smaller than their number)."""
    if limit is None or limit >= len(items):
        return list(items)
    keep = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in keep]


def sample_distinct(
    texts: Iterable[str], limit: int | None = None, seed: int = 0, source: str = "the input"
) -> list[str]:
    """Non-empty, distinct texts (stripped) in first-seen order; a seeded random subset of ``limit`` of them.
    ``source`` names where the texts come from in the errors."""
    sentences = [text for text in dict.fromkeys(text.strip() for text in texts) if text]
    if len(sentences) < 2:
        raise ValueError(f"{source} holds {len(sentences)} distinct sentences; at least 2 are needed")
    if limit is not None and limit < 2:
        raise ValueError(f"limit must be at least 2, got {limit}")
    return seeded_subset(sentences, limit, seed)


def sample_distinct_lines(path: str | Path, limit: int | None = None, seed: int = 0) -> list[str]:
    """Non-empty, distinct lines of a text file in file order; a seeded random subset of ``limit`` of them."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sentence file {path} not found")
    return sample_distinct(path.read_text(encoding="utf-8").splitlines(), limit, seed, source=str(path))


def fetch_wiki1m() -> str:
    """The local path of ``wiki1m_for_simcse.txt`` from the hub (downloaded once into the hub cache); offline, a
    ValueError says where to get it and to pass ``--train-file``."""
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(WIKI1M_HUB[0], WIKI1M_HUB[1], repo_type="dataset")
    except Exception as error:  # noqa: BLE001 - offline hub errors come in many types
        raise ValueError(
            f"could not fetch {WIKI1M_HUB[1]} from the hub dataset {WIKI1M_HUB[0]} ({type(error).__name__}). "
            f"Offline, download https://huggingface.co/datasets/{WIKI1M_HUB[0]}/resolve/main/{WIKI1M_HUB[1]} "
            "where the hub is reachable and pass --train-file PATH."
        ) from error


def read_training_file(path: str | Path, limit: int | None = None, at_least: int = 1) -> list[str]:
    """:func:`read_first_lines` of a training file, which must exist and hold at least ``at_least`` sentences (one
    batch); the errors name ``--train-file``, the recipes' flag for it."""
    if not Path(path).is_file():
        raise ValueError(
            f"training file {str(path)!r} not found. Pass --train-file with a text file of one sentence per line "
            "(e.g. recipes/assets/wiki1m_slice.txt from the repository, or wiki1m_for_simcse.txt)."
        )
    sentences = read_first_lines(path, limit)
    if len(sentences) < at_least:
        raise ValueError(
            f"training file {str(path)!r} has {len(sentences)} non-empty lines, fewer than one batch ({at_least})"
        )
    return sentences
