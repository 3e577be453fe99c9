"""Input checks shared by the loss adapters: column counts, shapes, batch sizes and dtypes (free: no device value is
read). The values (NaN, Inf, overflowing norms) are checked by :func:`st_weince.functional.normalize_rows`, in the
loss's one host sync."""

from __future__ import annotations

from torch import Tensor


def check_embedding_columns(
    embeddings: list[Tensor],
    loss_name: str,
    min_columns: int = 2,
) -> None:
    """Raise a clear ValueError for too few columns, wrong shapes, and mismatched batch sizes or dimensions."""
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
