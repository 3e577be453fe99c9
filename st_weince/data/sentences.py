"""Text files of one sentence a line, read in the two ways the project needs them.

- :func:`read_first_lines`: the first ``limit`` non-empty lines, in file order, duplicates kept (a training file:
  unsupervised SimCSE trains on ``wiki1m_for_simcse.txt`` as it is).
- :func:`sample_distinct_lines`: the distinct non-empty lines, then a seeded random subset of them (the diagnostics'
  negative pool: a sentence paired with its own copy is no negative, its score is exactly 1).
"""

from __future__ import annotations

import random
from pathlib import Path


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


def sample_distinct_lines(path: str | Path, limit: int | None = None, seed: int = 0) -> list[str]:
    """Non-empty, distinct lines of a text file in file order; a seeded random subset of ``limit`` of them."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sentence file {path} not found")
    lines = dict.fromkeys(line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    sentences = [line for line in lines if line]
    if len(sentences) < 2:
        raise ValueError(f"{path} holds {len(sentences)} distinct sentences; at least 2 are needed")
    if limit is not None:
        if limit < 2:
            raise ValueError(f"limit must be at least 2, got {limit}")
        if limit < len(sentences):
            keep = sorted(random.Random(seed).sample(range(len(sentences)), limit))
            sentences = [sentences[i] for i in keep]
    return sentences
