"""Input checks shared by the loss adapters: column counts, shapes, batch sizes, finite embeddings."""

from __future__ import annotations

import torch
from torch import Tensor

from st_weince.utils.hotpath import DeferredChecks


def check_embedding_columns(
    embeddings: list[Tensor],
    loss_name: str,
    min_columns: int = 2,
    checks: DeferredChecks | bool = True,
) -> None:
    """Raise a clear ValueError for too few columns, wrong shapes, mismatched batch sizes or dimensions, and
    non-finite embeddings.

    Shapes are checked at once (free). The finiteness of the values needs the host to read the device: with
    ``checks=True`` all columns are read with one sync here; a :class:`DeferredChecks` collects them for the caller,
    who reads every check of its forward pass at once; ``False`` skips them (no sync at all).
    """
    if len(embeddings) < min_columns:
        raise ValueError(
            f"{loss_name} needs at least {min_columns} input columns (anchor, positive[, negative_1, ...]), "
            f"got {len(embeddings)}. Check the columns of your dataset: a single text column is not enough."
        )
    for index, embedding in enumerate(embeddings):
        if not isinstance(embedding, Tensor) or embedding.dim() != 2:
            shape = tuple(embedding.shape) if isinstance(embedding, Tensor) else type(embedding).__name__
            raise ValueError(
                f"{loss_name}: column {index} must be a 2-D [batch, dimension] embedding matrix, got shape {shape}"
            )
        if not embedding.is_floating_point():
            raise ValueError(f"{loss_name}: column {index} must hold floating-point embeddings, got {embedding.dtype}")
    sizes = [e.shape[0] for e in embeddings]
    if any(size != sizes[0] for size in sizes):
        raise ValueError(f"{loss_name}: all columns must have the same batch size, got {sizes}")
    if sizes[0] < 1:
        raise ValueError(f"{loss_name}: the batch is empty")
    dims = [e.shape[1] for e in embeddings]
    if any(dim != dims[0] for dim in dims):
        raise ValueError(f"{loss_name}: all columns must have the same embedding dimension, got {dims}")
    if checks is False:
        return
    deferred = checks if isinstance(checks, DeferredChecks) else DeferredChecks()
    for index, embedding in enumerate(embeddings):
        deferred.require(
            torch.isfinite(embedding.detach()).all(),
            f"{loss_name}: column {index} has NaN or Inf embeddings; the model diverged or its input is broken",
        )
    if checks is True:
        deferred.raise_if_failed()
