"""Input checks shared by the loss adapters: column counts, batch sizes, finite embeddings."""

from __future__ import annotations

import torch
from torch import Tensor


def check_embedding_columns(embeddings: list[Tensor], loss_name: str, min_columns: int = 2) -> None:
    """Raise a clear ValueError for too few columns, mismatched batch sizes or non-finite embeddings."""
    if len(embeddings) < min_columns:
        raise ValueError(
            f"{loss_name} needs at least {min_columns} input columns (anchor, positive[, negative_1, ...]), "
            f"got {len(embeddings)}. Check the columns of your dataset: a single text column is not enough."
        )
    batch_size = embeddings[0].shape[0]
    sizes = [e.shape[0] for e in embeddings]
    if any(size != batch_size for size in sizes):
        raise ValueError(f"{loss_name}: all columns must have the same batch size, got {sizes}")
    if batch_size < 1:
        raise ValueError(f"{loss_name}: the batch is empty")
    for index, embedding in enumerate(embeddings):
        if not torch.isfinite(embedding).all():
            raise ValueError(
                f"{loss_name}: column {index} has NaN or Inf embeddings; the model diverged or its input is broken"
            )
