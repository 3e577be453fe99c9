"""Data for the diagnostics: encode sentences (or images), pool negative scores, build top-1 choice data.

- Negative-score pool (for the POT fit): all pairs ``i < j`` of distinct inputs, cosine similarity of their
  embeddings from the frozen encoder in eval mode: the "in-batch" negatives of every possible batch.
- Choice data (for the link fit): two views of each input (for text: the same sentence encoded twice in train mode,
  i.e. with dropout, as unsupervised SimCSE trains; or the two sides of given sentence pairs; for images: two
  augmentations), cut into batches; row ``a`` of a batch scores view A of input ``a`` against the candidates of its
  batch and the observed winner is its own other view. Two layouts (docs/algorithms.md 1.3): ``"pairs"`` (candidates =
  the B views B of the batch, as sentence-transformers' (anchor, positive) columns) and ``"nt_xent"`` (2B views,
  each an anchor, self excluded, as SimCLR).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from st_weince.data.sts import read_pair_csv
from st_weince.functional.layouts import nt_xent_layout

LAYOUTS = ("pairs", "nt_xent")


def read_pairs(
    path: str | Path, min_score: float | None = None, limit: int | None = None, seed: int = 0
) -> list[tuple[str, str]]:
    """Sentence pairs from a CSV ``sentence1,sentence2[,score]`` without header (STS-B's layout here), read by
    :func:`st_weince.data.sts.read_pair_csv`.

    ``min_score`` keeps pairs whose score is at least this value (e.g. 4.0 of 5 for near-paraphrases; the file then
    needs the score column); pairs are deduplicated on their first sentence so that no anchor appears twice, and a
    pair of identical sentences is dropped (it is no choice).
    """
    first, second, scores = read_pair_csv(path, scored=min_score is not None)
    pairs: dict[str, str] = {}
    for index, (a, b) in enumerate(zip(first, second)):
        if min_score is not None and scores[index] < min_score:
            continue
        if a and b and a != b:
            pairs.setdefault(a, b)
    out = list(pairs.items())
    if len(out) < 2:
        raise ValueError(f"{path} yields {len(out)} usable pairs (min_score={min_score}); at least 2 are needed")
    if limit is not None and limit < len(out):
        keep = sorted(random.Random(seed).sample(range(len(out)), limit))
        out = [out[i] for i in keep]
    return out


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
    chunks = []
    try:
        starts = range(0, len(texts), batch_size)
        for start in tqdm(starts, desc="encode", disable=not show_progress_bar):
            features = model.preprocess(list(texts[start : start + batch_size]))
            features = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in features.items()}
            chunks.append(model(features)["sentence_embedding"].float().cpu())
    finally:
        model.train(was_training)
    return F.normalize(torch.cat(chunks), dim=-1)


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
