"""What the functions on score matrices accept: the computation dtype, and the value checks of their inputs.

The math functions check shapes and dtypes (free: no device value is read) and nothing else, so they run without a
host-device sync and compile whole. The values (finite scores, positives in range, 0/1 targets) are checked where a
loss receives its inputs, with one sync per step; someone who calls the math directly checks them with
:func:`check_scores`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from st_weince.utils.hotpath import DeferredChecks


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the statistics, logits and losses are computed in: the widest floating input dtype, at least float32
    (float64 stays float64; float16 and bfloat16, e.g. under autocast, are computed in float32)."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def require_valid_scores(
    checks: DeferredChecks,
    scores: Tensor,
    positive_index: Tensor | None = None,
    valid_mask: Tensor | None = None,
    *,
    targets: Tensor | None = None,
    every_row_has_positive: bool = False,
) -> None:
    """Add the value checks of a score matrix and its labels to ``checks`` (read later, with the others of the step):
    every valid score finite, ``positive_index`` in ``[-1, C - 1]`` (with ``every_row_has_positive``: in ``[0, C - 1]``
    and not masked out), ``targets`` only 0 and 1, and at least one valid entry."""
    num_candidates = scores.shape[1]
    if positive_index is not None and positive_index.numel():
        checks.require(
            (positive_index < num_candidates) & (positive_index >= -1),
            f"positive_index must lie in [-1, {num_candidates - 1}] (-1 = no positive in this row)",
        )
        if every_row_has_positive:
            message = "every row needs a positive for the cross-entropy (positive_index >= 0)"
            checks.require(positive_index >= 0, message)
            if valid_mask is not None:
                checks.require(
                    valid_mask.gather(1, positive_index.clamp(0, num_candidates - 1)[:, None]),
                    "the positive of a row is masked out by valid_mask",
                )
    if targets is not None:
        checks.require((targets == 0) | (targets == 1), "targets must contain only 0 (non-matching) and 1 (matching)")
    detached = scores.detach()
    if valid_mask is not None:
        checks.require(valid_mask.any(), "valid_mask excludes every entry: there is nothing to compute a loss on")
        detached = detached.masked_fill(~valid_mask, 0.0)
    # One reduction pass: NaN or +-Inf in any valid entry makes the sum non-finite.
    checks.require(
        torch.isfinite(detached.sum(dtype=compute_dtype(scores))),
        "scores contain NaN or Inf (check the embeddings: a NaN embedding gives NaN scores)",
    )


def check_scores(
    scores: Tensor, positive_index: Tensor | None = None, valid_mask: Tensor | None = None, **requirements: Any
) -> None:
    """Raise a ValueError naming the problem if the inputs of a function of :mod:`st_weince.functional` hold invalid
    values; ``requirements`` (``targets=``, ``every_row_has_positive=``) and the checks as in
    :func:`require_valid_scores`; one host-device sync. The loss classes make these checks themselves
    (``check_inputs=True``); call this when you use the math directly on data you do not trust."""
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 2-D [anchors, candidates] matrix, got shape {shape}")
    checks = DeferredChecks()
    require_valid_scores(checks, scores, positive_index, valid_mask, **requirements)
    checks.raise_if_failed()
