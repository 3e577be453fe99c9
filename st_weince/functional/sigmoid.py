"""The sigmoid contrastive loss (SigLIP; RB-Sigmoid's relative-bias parametrization) as pure functions.

Every formula of ``shared/docs/ALGORITHMS.md`` section 2 lives here exactly once; the sentence-transformers adapter
(:class:`st_weince.losses.RBSigmoidLoss`), the vision recipe, the diagnostics and the synthetic experiments call these.

Conventions
-----------
``scores``      [A, C] cosine similarities of A anchors (rows) against C candidates (columns).
``targets``     [A, C] 1 for a matching pair, 0 for a non-matching one.
``valid_mask``  [A, C] bool, False for entries that are no candidate at all (self-pairs, masked entries).

Parametrizations of the logit (exactly one bias is given):

- relative (RB-Sigmoid): ``z = t * (s - b_rel)``;
- absolute (SigLIP):     ``z = t * s - b``, so ``b = t * b_rel``.

Loss (SigLIP's normalization): ``-(1/A) sum_a sum_c [y log sigmoid(z) + (1 - y) log sigmoid(-z)]``, i.e. the mean over
anchors of the sum over valid candidates. Computed as ``-log sigmoid((2y - 1) z)`` in float32, which is finite for any
temperature (``t = 1e4`` with scores of exactly +-1 gives a finite loss and finite gradients).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

ScalarLike = Tensor | float


def _as_scalar(value: ScalarLike, name: str, device: torch.device) -> Tensor:
    tensor = value if isinstance(value, Tensor) else torch.tensor(float(value), device=device)
    if tensor.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(tensor.shape)}")
    if not torch.isfinite(tensor.detach()).all():
        raise ValueError(f"{name} must be finite, got {float(tensor.detach())}")
    return tensor.reshape(()).float()


def _logits(scores: Tensor, t: Tensor, bias_value: Tensor, relative: bool) -> Tensor:
    scores = scores.float()
    return t * (scores - bias_value) if relative else t * scores - bias_value


def _pair_losses(logits: Tensor, positive_mask: Tensor) -> Tensor:
    """``-log sigmoid(z)`` at matching pairs, ``-log sigmoid(-z)`` elsewhere, as ``softplus(-+z)`` (stable: linear
    above 20, ``log1p(exp(.))`` below)."""
    return F.softplus(torch.where(positive_mask, -logits, logits))


def sigmoid_logits(
    scores: Tensor,
    *,
    inverse_temperature: ScalarLike,
    relative_bias: ScalarLike | None = None,
    bias: ScalarLike | None = None,
) -> Tensor:
    """Logits ``z = t (s - b_rel)`` (relative) or ``z = t s - b`` (absolute), in float32.

    Exactly one of ``relative_bias`` and ``bias`` must be given; ``inverse_temperature`` must be finite and > 0.
    """
    if (relative_bias is None) == (bias is None):
        raise ValueError("give exactly one of relative_bias (z = t (s - b_rel)) or bias (z = t s - b)")
    t = _check_temperature(inverse_temperature, scores.device)
    if relative_bias is not None:
        return _logits(scores, t, _as_scalar(relative_bias, "relative_bias", scores.device), True)
    return _logits(scores, t, _as_scalar(bias, "bias", scores.device), False)


def _check_temperature(inverse_temperature: ScalarLike, device: torch.device) -> Tensor:
    t = _as_scalar(inverse_temperature, "inverse_temperature", device)
    if not bool(t.detach() > 0):
        raise ValueError(f"inverse_temperature must be > 0, got {float(t.detach())}")
    return t


def targets_from_positive_index(positive_index: Tensor, num_candidates: int) -> Tensor:
    """0/1 float targets [A, C] with a 1 at ``positive_index[a]``; rows with index -1 have no positive."""
    if positive_index.dim() != 1:
        raise ValueError(f"positive_index must be 1-D [anchors], got shape {tuple(positive_index.shape)}")
    if positive_index.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"positive_index must be an integer tensor, got {positive_index.dtype}")
    if positive_index.numel() and (int(positive_index.max()) >= num_candidates or int(positive_index.min()) < -1):
        raise ValueError(f"positive_index must lie in [-1, {num_candidates - 1}] (-1 = no positive in this row)")
    targets = torch.zeros(positive_index.shape[0], num_candidates, device=positive_index.device)
    rows = torch.nonzero(positive_index >= 0).squeeze(1)
    targets[rows, positive_index[rows]] = 1.0
    return targets


def _check_inputs(scores: Tensor, targets: Tensor, valid_mask: Tensor | None) -> Tensor:
    if scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D [anchors, candidates] matrix, got shape {tuple(scores.shape)}")
    if scores.numel() == 0:
        raise ValueError(f"scores is empty (shape {tuple(scores.shape)})")
    if targets.shape != scores.shape:
        raise ValueError(f"targets must have the scores' shape {tuple(scores.shape)}, got {tuple(targets.shape)}")
    if not ((targets == 0) | (targets == 1)).all():
        raise ValueError("targets must contain only 0 (non-matching) and 1 (matching)")
    if valid_mask is None:
        valid_mask = torch.ones_like(scores, dtype=torch.bool)
    elif valid_mask.shape != scores.shape or valid_mask.dtype != torch.bool:
        raise ValueError(
            f"valid_mask must be a bool tensor of the scores' shape {tuple(scores.shape)}, "
            f"got {valid_mask.dtype} {tuple(valid_mask.shape)}"
        )
    if not valid_mask.any():
        raise ValueError("valid_mask excludes every entry: there is nothing to compute a loss on")
    if not torch.isfinite(scores.detach().masked_fill(~valid_mask, 0.0)).all():
        raise ValueError("scores contain NaN or Inf (check the embeddings: a NaN embedding gives NaN scores)")
    return valid_mask


def sigmoid_contrastive_loss(
    scores: Tensor,
    targets: Tensor,
    *,
    inverse_temperature: ScalarLike,
    relative_bias: ScalarLike | None = None,
    bias: ScalarLike | None = None,
    valid_mask: Tensor | None = None,
) -> Tensor:
    """Sigmoid contrastive loss: mean over anchors (rows) of the sum over valid candidates of
    ``-[y log sigmoid(z) + (1 - y) log sigmoid(-z)]``, with ``z`` from :func:`sigmoid_logits`.

    Args:
        scores: [A, C] similarities.
        targets: [A, C] in {0, 1}.
        inverse_temperature: ``t > 0`` (float or scalar tensor, may require grad).
        relative_bias: ``b_rel`` of the relative parametrization ``z = t (s - b_rel)``.
        bias: ``b`` of the absolute (SigLIP) parametrization ``z = t s - b``.
        valid_mask: [A, C] bool, False entries are left out of the sum.
    """
    valid_mask = _check_inputs(scores, targets, valid_mask)
    logits = sigmoid_logits(scores, inverse_temperature=inverse_temperature, relative_bias=relative_bias, bias=bias)
    per_pair = _pair_losses(logits, targets == 1)
    return per_pair.masked_fill(~valid_mask, 0.0).sum() / scores.shape[0]


def locked_adapter_scores(scores: Tensor, delta: Tensor) -> Tensor:
    """The implicit adapter for a locked encoder: ``delta^2 s - (1 - delta^2)``, the inner product of
    ``(delta U, sqrt(1 - delta^2))`` and ``(delta V, -sqrt(1 - delta^2))``; ``delta = sigmoid(x)`` in (0, 1)."""
    squared = delta.float() ** 2
    return squared * scores.float() - (1.0 - squared)


def constellation_margin_from_extremes(min_positive: Tensor, max_negative: Tensor) -> tuple[Tensor, Tensor]:
    """Margin ``m = (min positive score - max negative score) / 2`` and the centre ``(min pos + max neg) / 2``,
    the relative bias at which an ``(m, b_rel)``-constellation with that margin sits. ``m > 0`` iff zero loss is
    reachable for this score matrix by scaling ``t`` up with ``b_rel`` at the centre."""
    return (min_positive - max_negative) / 2.0, (min_positive + max_negative) / 2.0


def score_extremes(scores: Tensor, targets: Tensor, valid_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Smallest matching (positive) and largest valid non-matching score; raises if either set is empty."""
    valid_mask = _check_inputs(scores, targets, valid_mask)
    positive = valid_mask & (targets == 1)
    negative = valid_mask & (targets == 0)
    if not positive.any() or not negative.any():
        raise ValueError("the margin needs at least one matching and one non-matching valid pair")
    scores = scores.detach().float()
    return scores[positive].min(), scores[negative].max()


def constellation_margin(scores: Tensor, targets: Tensor, valid_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(margin, centre)`` of a score matrix: see :func:`constellation_margin_from_extremes`."""
    return constellation_margin_from_extremes(*score_extremes(scores, targets, valid_mask))


def _chunk_loss(
    anchors: Tensor,
    candidates: Tensor,
    positive_index: Tensor,
    t: Tensor,
    bias_value: Tensor,
    relative: bool,
    score_transform: Callable[[Tensor], Tensor] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Loss of one candidate block (inputs already checked) with the block's smallest matching and largest
    non-matching score (+inf / -inf when the block has none)."""
    scores = anchors @ candidates.T
    if score_transform is not None:
        scores = score_transform(scores)
    rows = torch.arange(anchors.shape[0], device=anchors.device)
    in_block = (positive_index >= 0) & (positive_index < candidates.shape[0])
    rows, columns = rows[in_block], positive_index[in_block]
    positive_mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    positive_mask[rows, columns] = True
    loss = _pair_losses(_logits(scores, t, bias_value, relative), positive_mask).sum() / anchors.shape[0]
    with torch.no_grad():
        detached = scores.detach().float()
        positives = detached[rows, columns]
        min_positive = positives.min() if positives.numel() else detached.new_tensor(float("inf"))
        max_negative = detached.masked_fill(positive_mask, float("-inf")).max()
    return loss, min_positive, max_negative


def chunked_sigmoid_contrastive_loss(
    anchors: Tensor,
    candidates: Tensor,
    positive_index: Tensor,
    *,
    inverse_temperature: ScalarLike,
    relative_bias: ScalarLike | None = None,
    bias: ScalarLike | None = None,
    score_transform: Callable[[Tensor], Tensor] | None = None,
    chunk_size: int | None = None,
    return_extremes: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """:func:`sigmoid_contrastive_loss` of ``anchors @ candidates.T`` computed block by block over candidates.

    The sigmoid loss has no normalization across candidates, so it is the sum of the losses of candidate blocks.
    Each block is recomputed during backward (activation checkpointing), so the autograd graph holds one
    [A, chunk_size] block at a time: memory grows with ``A x chunk_size`` instead of ``A x C``.

    Args:
        anchors: [A, D] (normalize beforehand for cosine scores).
        candidates: [C, D].
        positive_index: [A] column of each anchor's positive, -1 for none.
        score_transform: elementwise map applied to each score block (e.g. the locked-encoder adapter).
        chunk_size: candidates per block; None computes the whole matrix at once.
        return_extremes: also return the smallest matching and the largest non-matching score (no gradient; for
            the margin, see :func:`constellation_margin_from_extremes`), from the same score blocks.
    """
    if anchors.dim() != 2 or candidates.dim() != 2 or anchors.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"anchors and candidates must be [A, D] and [C, D] with the same D, "
            f"got {tuple(anchors.shape)} and {tuple(candidates.shape)}"
        )
    if positive_index.shape != (anchors.shape[0],):
        raise ValueError(f"positive_index must be [A] = [{anchors.shape[0]}], got {tuple(positive_index.shape)}")
    if (relative_bias is None) == (bias is None):
        raise ValueError("give exactly one of relative_bias (z = t (s - b_rel)) or bias (z = t s - b)")
    if not (torch.isfinite(anchors.detach()).all() and torch.isfinite(candidates.detach()).all()):
        raise ValueError("anchors and candidates must be finite (NaN or Inf embeddings)")
    num_candidates = candidates.shape[0]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")
    if positive_index.numel() and (int(positive_index.max()) >= num_candidates or int(positive_index.min()) < -1):
        raise ValueError(f"positive_index must lie in [-1, {num_candidates - 1}] (-1 = no positive in this row)")
    relative = relative_bias is not None
    t = _check_temperature(inverse_temperature, anchors.device)
    bias_value = _as_scalar(
        relative_bias if relative else bias, "relative_bias" if relative else "bias", anchors.device
    )
    step = num_candidates if chunk_size is None else chunk_size
    total = anchors.new_zeros((), dtype=torch.float32)
    min_positive = anchors.new_tensor(float("inf"), dtype=torch.float32)
    max_negative = anchors.new_tensor(float("-inf"), dtype=torch.float32)
    for start in range(0, num_candidates, step):
        block = candidates[start : start + step]
        shifted = torch.where(positive_index >= 0, positive_index - start, -1)
        arguments = (anchors, block, shifted, t, bias_value, relative, score_transform)
        if step < num_candidates and torch.is_grad_enabled():
            loss, low, high = checkpoint(_chunk_loss, *arguments, use_reentrant=False)
        else:
            loss, low, high = _chunk_loss(*arguments)
        total = total + loss
        min_positive, max_negative = torch.minimum(min_positive, low), torch.maximum(max_negative, high)
    if return_extremes:
        return total, min_positive, max_negative
    return total
