"""Data for the diagnostics (docs/diagnostics.md, "What is measured"): encode sentences or images, pool the negative
scores of all pairs ``i < j`` of distinct inputs (the frozen encoder in eval mode: every in-batch negative of every
batch), and build top-1 choice data: two views of each input, cut into batches in the ``"pairs"`` or ``"nt_xent"``
layout (docs/algorithms.md 1.3), each row's observed winner its own other view.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from st_weince.diagnostics.inputs import load_table, normalise_whitespace, read_pair_csv, seeded_subset, table_columns
from st_weince.functional.layouts import nt_xent_layout

LAYOUTS = ("pairs", "nt_xent")


@dataclass(frozen=True)
class SentencePairs:
    """Sentence pairs: ``anchors[i]`` and ``positives[i]`` form pair ``i``; ``labels[i]`` its label (e.g. the intent),
    None without a label column."""

    anchors: list[str]
    positives: list[str]
    labels: list[Hashable] | None = None

    def __len__(self) -> int:
        return len(self.anchors)

    def texts(self) -> list[str]:
        """The distinct texts of both sides, in first-seen order."""
        return list(dict.fromkeys(self.anchors + self.positives))


def read_pairs(
    path: str | Path,
    min_score: float | None = None,
    limit: int | None = None,
    seed: int = 0,
    *,
    columns: Sequence[str] | None = None,
    score_column: str = "score",
    label_column: str | None = None,
    split: str | None = None,
) -> SentencePairs:
    """Sentence pairs for the choice data, from

    - a ``.csv`` file without ``columns``: CSV ``sentence1,sentence2[,score]`` without header (STS-B's layout here),
      read by :func:`st_weince.diagnostics.inputs.read_pair_csv`;
    - otherwise any table :func:`st_weince.diagnostics.inputs.load_table` reads (CSV with a header row, JSON lines,
      Parquet, a ``save_to_disk`` folder and its ``split``): the ``columns`` (anchor, positive), by default its first
      two (sentence-transformers' trainer takes a dataset's columns in order too), the ``score_column`` when
      ``min_score`` is given and the ``label_column`` when named. A missing column is a ValueError naming it and
      listing the table's columns.

    ``min_score`` keeps pairs whose score is at least this value (e.g. 4.0 of 5 for near-paraphrases); pairs are
    deduplicated on their first sentence so that no anchor appears twice, a pair with an empty side or of identical
    sentences is dropped (it is no choice), and ``limit`` keeps a seeded random subset.
    """
    if columns is not None and len(columns) != 2:
        raise ValueError(f"--columns takes two names, ANCHOR POSITIVE; got {list(columns)}")
    if columns is None and Path(path).suffix.lower() == ".csv" and Path(path).is_file():
        if label_column is not None:
            raise ValueError(f"--label-column needs --columns: without it, {path} is read as CSV without a header")
        first, second, scores = read_pair_csv(path, scored=min_score is not None)
        labels = None
    else:
        table = load_table(path, split)
        if columns is None and len(table.column_names) < 2:
            raise ValueError(f"{path} has {len(table.column_names)} column(s); pairs need two (--columns)")
        first, second = table_columns(table, columns or table.column_names[:2], path)
        scores = table_columns(table, [score_column], path, "--score-column")[0] if min_score is not None else []
        scores = _numeric_scores(scores, path, score_column)
        labels = table_columns(table, [label_column], path, "--label-column")[0] if label_column else None
    first, second = ([_text(value) for value in column] for column in (first, second))
    kept: dict[str, int] = {}  # anchor -> row of its first usable pair
    for row, (a, b) in enumerate(zip(first, second)):
        if min_score is not None and (scores[row] is None or not scores[row] >= min_score):
            continue
        if a and b and a != b:
            kept.setdefault(a, row)
    rows = seeded_subset(list(kept.values()), limit, seed)
    if len(rows) < 2:
        raise ValueError(f"{path} yields {len(rows)} usable pairs (min_score={min_score}); at least 2 are needed")
    return SentencePairs(
        anchors=[first[row] for row in rows],
        positives=[second[row] for row in rows],
        labels=None if labels is None else [labels[row] for row in rows],
    )


def _numeric_scores(values: Sequence[object], path: str | Path, column: str) -> list[float | None]:
    """The score column as numbers (a missing cell stays None, and its pair is dropped); a cell that is no number
    is a ValueError naming the file, the row and the column: ``--min-pair-score`` compares numbers."""
    scores: list[float | None] = []
    for row, value in enumerate(values, start=1):
        if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
            scores.append(value)
            continue
        try:
            scores.append(float(value))
        except (TypeError, ValueError):
            raise ValueError(
                f"{path}, data row {row}: score {value!r} in column {column!r} is not a number; --min-pair-score "
                "needs a numeric score column (name it with --score-column)"
            ) from None
    return scores


def _text(value: object) -> str:
    """A table cell as a sentence: whitespace-normalised as SentEval's loaders do; a missing cell (None) is ""."""
    return "" if value is None else normalise_whitespace(str(value))


@torch.no_grad()
def encode_texts(
    model: torch.nn.Module,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    train_mode: bool = False,
    show_progress_bar: bool = False,
) -> Tensor:
    """L2-normalised sentence embeddings [N, D] (float32, CPU) of a SentenceTransformer.

    ``train_mode=True`` keeps dropout active (SentenceTransformer.encode always switches to eval mode), so two calls
    give two stochastic views of each sentence, as in unsupervised SimCSE. The model's mode is restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if len(texts) == 0:
        raise ValueError("no texts to encode")
    from tqdm.auto import tqdm

    was_training = model.training
    model.train(train_mode)
    device = next(model.parameters()).device
    # longest first, as SentenceTransformer.encode does: a batch of similar lengths carries little padding
    order = sorted(range(len(texts)), key=lambda k: -len(texts[k]))
    chunks = []
    try:
        starts = range(0, len(texts), batch_size)
        for start in tqdm(starts, desc="encode", disable=not show_progress_bar):
            features = model.preprocess([texts[k] for k in order[start : start + batch_size]])
            features = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in features.items()}
            chunks.append(model(features)["sentence_embedding"].float().cpu())
    finally:
        model.train(was_training)
    embeddings = torch.empty(len(texts), chunks[0].shape[1])
    embeddings[torch.tensor(order, dtype=torch.long)] = torch.cat(chunks)
    return F.normalize(embeddings, dim=-1)


@torch.no_grad()
def encode_images(
    encoder: Callable[[Tensor], Tensor],
    images: Tensor,
    *,
    transform: Callable[[Tensor], Tensor] | None = None,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    show_progress_bar: bool = False,
) -> Tensor:
    """L2-normalised embeddings [N, D] of uint8 images [N, 3, H, W]; ``transform`` maps a uint8 batch to the
    encoder's float input (augmentation and/or normalisation)."""
    if images.dim() != 4 or images.shape[0] == 0:
        raise ValueError(f"images must be a non-empty [N, C, H, W] tensor, got {tuple(images.shape)}")
    from tqdm.auto import tqdm

    chunks = []
    for start in tqdm(range(0, images.shape[0], batch_size), desc="encode", disable=not show_progress_bar):
        batch = images[start : start + batch_size].to(device)
        batch = transform(batch) if transform is not None else batch.float() / 255.0
        chunks.append(encoder(batch).float().cpu())
    return F.normalize(torch.cat(chunks), dim=-1)


def negative_pool(embeddings: Tensor, *, max_values: int | None = None, seed: int = 0, chunk: int = 1024) -> np.ndarray:
    """Cosine scores of all pairs ``i < j`` of distinct inputs (each negative pair once), float64.

    ``max_values`` keeps a seeded uniform random subset of that many pair scores.
    """
    if embeddings.dim() != 2 or embeddings.shape[0] < 2:
        raise ValueError(f"embeddings must be [N, D] with N >= 2, got {tuple(embeddings.shape)}")
    emb = F.normalize(embeddings.float(), dim=-1)
    n = emb.shape[0]
    parts = []
    for start in range(0, n, chunk):
        block = emb[start : start + chunk] @ emb.T  # rows start.., all columns
        rows = torch.arange(start, min(start + chunk, n))[:, None]
        upper = torch.arange(n)[None, :] > rows
        parts.append(block[upper].clamp(-1.0, 1.0).double().numpy())
    pool = np.concatenate(parts)
    if max_values is not None and max_values < pool.size:
        pool = np.random.default_rng(seed).choice(pool, size=max_values, replace=False)
    return pool


def choice_data(
    view_a: Tensor, view_b: Tensor, *, batch_size: int, layout: str = "pairs"
) -> tuple[Tensor, Tensor, Tensor]:
    """Stack the per-batch candidate layouts of two views into ``(scores, winner_index, valid_mask)``.

    Inputs are cut into consecutive batches of ``batch_size`` (an incomplete last batch is dropped, so every row has
    the same candidates count). ``"pairs"``: B rows x B candidates, winner on the diagonal. ``"nt_xent"``: 2B rows x 2B
    candidates, the self-pair masked.
    """
    if view_a.shape != view_b.shape or view_a.dim() != 2:
        raise ValueError(f"both views must be [N, D] of one shape, got {tuple(view_a.shape)} and {tuple(view_b.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if batch_size < 2:
        raise ValueError(f"batch_size must be at least 2, got {batch_size}")
    num_batches = view_a.shape[0] // batch_size
    if num_batches == 0:
        raise ValueError(f"{view_a.shape[0]} inputs do not fill one batch of {batch_size}")
    scores, winners, masks = [], [], []
    for k in range(num_batches):
        a = view_a[k * batch_size : (k + 1) * batch_size]
        b = view_b[k * batch_size : (k + 1) * batch_size]
        if layout == "pairs":
            s = F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T
            winner = torch.arange(batch_size)
            mask = torch.ones_like(s, dtype=torch.bool)
        else:
            s, winner, mask = nt_xent_layout(a.float(), b.float())
        scores.append(s)
        winners.append(winner)
        masks.append(mask)
    return torch.cat(scores).clamp(-1.0, 1.0), torch.cat(winners), torch.cat(masks)


def hardest_negatives(scores: Tensor, winner_index: Tensor, valid_mask: Tensor) -> Tensor:
    """The largest negative score of each row (the row's hardest negative)."""
    negatives = valid_mask.clone()
    negatives[torch.arange(scores.shape[0]), winner_index] = False
    return scores.masked_fill(~negatives, float("-inf")).max(1).values
