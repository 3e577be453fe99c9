"""What the functions on score matrices accept: the computation dtype, and the value checks of their inputs.

The math functions check shapes and dtypes (free: no device value is read) and nothing else, so they run without a
host-device sync and compile whole. The values (finite scores, positives in range, 0/1 targets) are checked where a
loss receives its inputs, with one sync per step; someone who calls the math directly checks them with
:func:`check_scores`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

from st_weince.utils.hotpath import DeferredChecks


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the statistics, logits and losses are computed in: the widest floating input dtype, at least float32
    (float64 stays float64; float16 and bfloat16, e.g. under autocast, are computed in float32)."""
    # in Python, not torch.promote_types (an operator call per tensor on the hot path)
    wide = any(tensor.dtype == torch.float64 for tensor in tensors)
    return torch.float64 if wide else torch.float32


_INTEGER_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def order_keys(values: Tensor) -> Tensor:
    """Integer keys that order like the floating ``values``: their bits, with the magnitude bits flipped where the sign
    bit is set (ties stay ties; -0.0 ranks below 0.0, and NaN gets no rank of its own). On CPU torch's top-k on such
    keys makes the float top-k's comparisons without its NaN-aware comparator, about a third of its time. The map is
    its own inverse on the keys: ``order_keys(keys).view(dtype)`` are the floats of the keys, bit for bit."""
    bits = values.view(_INTEGER_OF_SIZE[values.element_size()])  # keys (an integer tensor) stay as they are
    sign = 8 * bits.element_size() - 1
    return (bits >> sign).bitwise_and_((1 << sign) - 1).bitwise_xor_(bits)


#: The order key of -inf in each floating dtype (a Python int: what a row's excluded entry is set to).
NEGATIVE_INFINITY_KEY = {
    dtype: int(order_keys(torch.full((), float("-inf"), dtype=dtype)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


class _Upcast(torch.autograd.Function):
    """``tensor.to(dtype)`` whose backward returns the gradient in the input's dtype, saturated at that dtype's
    largest finite value instead of overflowing to Inf (a float16 zero row's normalisation gradient, 1e12 times the
    upstream one, is finite in float32 but not in float16)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.input_dtype = tensor.dtype
        return tensor.to(dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        limit = torch.finfo(ctx.input_dtype).max
        return grad.clamp(-limit, limit).to(ctx.input_dtype), None


def upcast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` in ``dtype`` (a wider one, from :func:`compute_dtype`). Where the input's dtype has a smaller range
    (float16, bfloat16), the gradient flowing back is clamped to the input dtype's finite range before the cast:
    an exact gradient rounded to the input dtype where it fits, the largest finite value where it does not. Shapes
    and dtypes decide, no value is read."""
    if tensor.dtype == dtype:
        return tensor
    if not tensor.requires_grad or torch.finfo(tensor.dtype).max >= torch.finfo(dtype).max:
        return tensor.to(dtype)
    return _Upcast.apply(tensor, dtype)


def full_precision(*tensors: Any) -> AbstractContextManager:
    """Autocast off on the device of the first tensor among ``tensors``, for the body of a loss: its products and
    reductions then run in the dtype the loss chose (:func:`compute_dtype`: float32 for half-precision inputs), not
    in autocast's lower one. The model's forward, outside the loss, keeps the autocast it runs under."""
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            return torch.autocast(tensor.device.type, enabled=False)
    return nullcontext()


def check_score_shapes(
    scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None, targets: Tensor | None = None
) -> None:
    """The shapes and dtypes of a score matrix and its labels (free: no device value is read); the errors name the
    argument. ``positive_index`` may have any integer dtype, as the targets of torch's losses."""
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 2-D [anchors, candidates] matrix, got shape {shape}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating-point tensor, got {scores.dtype}")
    num_anchors, num_candidates = scores.shape
    if num_anchors == 0 or num_candidates == 0:
        raise ValueError(f"scores is empty (shape {tuple(scores.shape)})")
    if valid_mask is not None and (
        not isinstance(valid_mask, Tensor) or valid_mask.shape != scores.shape or valid_mask.dtype != torch.bool
    ):
        got = f"{valid_mask.dtype} {tuple(valid_mask.shape)}" if isinstance(valid_mask, Tensor) else repr(valid_mask)
        raise ValueError(f"valid_mask must be a bool tensor of the scores' shape {tuple(scores.shape)}, got {got}")
    if targets is not None and (not isinstance(targets, Tensor) or targets.shape != scores.shape):
        shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"targets must have the scores' shape {tuple(scores.shape)}, got {shape}")
    if positive_index is not None:
        check_positive_index(positive_index, num_anchors)


def check_positive_index(positive_index: Tensor, num_anchors: int | None = None) -> None:
    """``positive_index`` is an integer tensor [A] (of any integer dtype, as the targets of torch's losses), with one
    entry per anchor when ``num_anchors`` is given (free: no device value is read); the errors name the argument."""
    if not isinstance(positive_index, Tensor):
        raise TypeError(f"positive_index must be an integer tensor, got {type(positive_index).__name__}")
    if positive_index.dim() != 1 or (num_anchors is not None and positive_index.shape[0] != num_anchors):
        anchors = "" if num_anchors is None else f" with one entry per anchor ({num_anchors})"
        raise ValueError(f"positive_index must be 1-D [anchors]{anchors}, got shape {tuple(positive_index.shape)}")
    if positive_index.is_floating_point() or positive_index.is_complex() or positive_index.dtype == torch.bool:
        raise ValueError(f"positive_index must be an integer tensor, got {positive_index.dtype}")


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
        positive_index = positive_index.long()
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
    # Elementwise, not a sum: finite scores near the dtype's largest value (3e38 in float32) sum to Inf.
    checks.require(
        torch.isfinite(detached).all(),
        "scores contain NaN or Inf (check the embeddings: a NaN embedding gives NaN scores)",
    )


def check_scores(
    scores: Tensor, positive_index: Tensor | None = None, valid_mask: Tensor | None = None, **requirements: Any
) -> None:
    """Raise a ValueError naming the problem if the inputs of a function of :mod:`st_weince.functional` hold invalid
    values; ``requirements`` (``targets=``, ``every_row_has_positive=``) and the checks as in
    :func:`require_valid_scores`; one host-device sync. The loss classes make these checks themselves
    (``check_inputs=True``); call this when you use the math directly on data you do not trust."""
    check_score_shapes(scores, positive_index, valid_mask, requirements.get("targets"))
    checks = DeferredChecks()
    require_valid_scores(checks, scores, positive_index, valid_mask, **requirements)
    checks.raise_if_failed()
