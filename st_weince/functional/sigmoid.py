"""The sigmoid contrastive loss (SigLIP; RB-Sigmoid's relative-bias parametrization) as pure functions: each formula
of docs/algorithms.md section 2 once, for the loss classes, the vision recipe, the diagnostics and the benchmarks.

``scores`` [A, C] are cosine scores of A anchors against C candidates, ``targets`` [A, C] 1 at a matching pair and 0
elsewhere, ``valid_mask`` [A, C] False at entries that are no candidate. The logit is ``z = t (s - b_rel)`` (relative)
or ``z = t s - b`` (absolute, SigLIP), exactly one bias given; the loss is the mean over anchors of the sum over valid
candidates of ``softplus(-+z)``, each term with the sign of its own label, so it stays finite for any ``t`` and keeps
each term's float32 accuracy relative to its value. One block loss serves the dense functions and the block-by-block
computation on embeddings (:class:`_GatheredBlockSum`). Computed in the inputs' dtype, at least float32; scalars are
cast to it. Only shapes are checked here (free); values are checked where a loss receives its inputs, or by
:func:`st_weince.functional.check_scores`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from st_weince.functional.checks import check_positive_index, check_score_shapes, check_scores, compute_dtype
from st_weince.functional.false_negatives import (
    FalseNegativeFilter,
    FilterCounts,
    apply_false_negative_filter,
    pair_scores,
    positive_keys,
)
from st_weince.utils.hotpath import DeferredChecks
from st_weince.utils.options import real_option

ScalarLike = Tensor | float


def _scalar(value: ScalarLike, name: str, dtype: torch.dtype, positive: bool = False) -> ScalarLike:
    """A scalar argument in the computation dtype. Python numbers are checked on the host (no sync) and stay numbers;
    tensors (trained loss parameters) keep their autograd graph; their values are their owner's to check."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        value = value if value.dim() == 0 else value.reshape(())
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or a scalar tensor, got {type(value).__name__}")
    return real_option(name, value, positive=positive)


def _logit_parameters(
    scale: ScalarLike, relative_bias: ScalarLike | None, bias: ScalarLike | None, dtype: torch.dtype
) -> tuple[ScalarLike, ScalarLike, bool]:
    """``(t, bias value, relative?)`` in ``dtype`` from ``scale`` and exactly one of ``relative_bias`` and ``bias``."""
    t = _scalar(scale, "scale", dtype, positive=True)
    if (relative_bias is None) == (bias is None):
        raise ValueError("give exactly one of relative_bias (z = t (s - b_rel)) or bias (z = t s - b)")
    if relative_bias is not None:
        return t, _scalar(relative_bias, "relative_bias", dtype), True
    return t, _scalar(bias, "bias", dtype), False


def _logits(scores: Tensor, scale: ScalarLike, bias_value: ScalarLike, relative: bool) -> Tensor:
    # s + (-b), the same number as s - b: the bias's gradient is then a sum of the block's, not a sum of its negation
    # (one elementwise pass fewer in the backward)
    negated_bias = -bias_value
    return scale * (scores + negated_bias) if relative else scale * scores + negated_bias


def _flip_matching(values: Tensor, index: Tensor, in_block: Tensor) -> Tensor:
    """``values`` with the sign of each row's matching entry (column ``index``, where ``in_block``) flipped, in place:
    ``z -> v`` before the softplus, and ``sigmoid(v) -> -sigmoid(-z)`` after it, two [A, 1] operations."""
    matched = values.gather(1, index)
    return values.scatter_(1, index, torch.where(in_block[:, None], -matched, matched))


class _GatheredBlockSum(torch.autograd.Function):
    """The loss sum of :func:`sigmoid_contrastive_loss` and the :func:`score_extremes` of a block of embedding scores
    on three [A, C] buffers, one kept (autograd: seven, two kept; ``F.softplus``'s ``log1p`` is slow on CPU):
    ``softplus(v) = max(v, 0) + log(w) + (u - (w - 1)) / w``, ``u = exp(-|v|)``, ``w = 1 + u`` (``w - 1`` is exact;
    within 2 ulp of ``log1p``), with ``v = -z`` at the row's matching column and ``z`` elsewhere (each term accurate
    relative to itself); the gradient ``-sigmoid(-z)`` at the match and ``sigmoid(z)`` elsewhere, likewise. Entries
    outside ``valid_mask`` are zeroed before the logits (a NaN there gives no NaN) and left out of every sum, so a
    mask that excludes nothing gives the unmasked values bit for bit."""

    @staticmethod
    def forward(ctx, scores, column, in_block, valid_mask, scale, negated_bias, relative):
        index, buffer = column[:, None], scores.clone(memory_format=torch.contiguous_format)
        excluded = None if valid_mask is None else ~valid_mask

        def kept(values: Tensor) -> Tensor:
            return values if excluded is None else values.masked_fill_(excluded, 0.0)

        if excluded is not None:
            in_block = in_block & valid_mask.gather(1, index).squeeze(1)
        matching = buffer.gather(1, index)
        negatives = buffer.scatter_(1, index, matching.masked_fill(in_block[:, None], float("-inf")))
        max_negative = (negatives if excluded is None else negatives.masked_fill(excluded, float("-inf"))).amax()
        kept(buffer.scatter_(1, index, matching))
        if relative:
            buffer.add_(negated_bias)  # s - b_rel, kept for backward (s itself in the absolute parametrization)
        logits = _flip_matching(buffer * scale if relative else (buffer * scale).add_(negated_bias), index, in_block)
        exponential = logits.abs().neg_().exp_()
        positive_sum = kept(logits.clamp_min_(0)).sum()
        torch.add(exponential, 1.0, out=logits).sub_(1.0)  # w - 1
        correction_sum = kept(exponential.sub_(logits).div_(logits.add_(1.0))).sum()
        ctx.relative, ctx.numbers = relative, [None if isinstance(v, Tensor) else v for v in (scale, negated_bias)]
        ctx.save_for_backward(buffer, column, in_block, valid_mask, *filter(torch.is_tensor, (scale, negated_bias)))
        min_positive = matching.squeeze(1).masked_fill(~in_block, float("inf")).amin()
        ctx.mark_non_differentiable(min_positive, max_negative)
        return positive_sum + kept(logits.log_()).sum() + correction_sum, min_positive, max_negative

    @staticmethod
    def backward(ctx, grad_sum, _grad_min, _grad_max):
        buffer, column, in_block, valid_mask, *scalars = ctx.saved_tensors
        scale, negated_bias = (value if value is not None else scalars.pop(0) for value in ctx.numbers)
        index = column[:, None]
        logits = buffer * scale if ctx.relative else (buffer * scale).add_(negated_bias)
        residual = _flip_matching(_flip_matching(logits, index, in_block).sigmoid_(), index, in_block)  # sigmoid(z) - y
        if valid_mask is not None:
            residual.masked_fill_(~valid_mask, 0.0)
        grad_scale = grad_sum * (residual * buffer).sum() if ctx.needs_input_grad[4] else None  # torch.dot: 1e-5 off
        grad_bias = grad_sum * residual.sum() * (scale if ctx.relative else 1.0) if ctx.needs_input_grad[5] else None
        return residual.mul_(grad_sum * scale), None, None, None, grad_scale, grad_bias, None


def sigmoid_logits(
    scores: Tensor, *, scale: ScalarLike, relative_bias: ScalarLike | None = None, bias: ScalarLike | None = None
) -> Tensor:
    """Logits ``z = t (s - b_rel)`` (relative) or ``z = t s - b`` (absolute) with ``t = scale``, in the computation
    dtype (see the module docstring). Exactly one of ``relative_bias`` and ``bias`` must be given; ``scale`` must be
    finite and > 0."""
    dtype = compute_dtype(scores)
    return _logits(scores.to(dtype), *_logit_parameters(scale, relative_bias, bias, dtype))


def sigmoid_contrastive_loss(
    scores: Tensor,
    targets: Tensor,
    *,
    scale: ScalarLike,
    relative_bias: ScalarLike | None = None,
    bias: ScalarLike | None = None,
    valid_mask: Tensor | None = None,
    check_inputs: bool = True,
) -> Tensor:
    """Sigmoid contrastive loss: mean over anchors (rows) of the sum over valid candidates of
    ``-[y log sigmoid(z) + (1 - y) log sigmoid(-z)]``, with ``z`` from :func:`sigmoid_logits`.

    Args:
        scores: [A, C] similarities.
        targets: [A, C] in {0, 1}.
        scale: ``t > 0``, the inverse temperature (float or scalar tensor, may require grad).
        relative_bias: ``b_rel`` of the relative parametrization ``z = t (s - b_rel)``.
        bias: ``b`` of the absolute (SigLIP) parametrization ``z = t s - b``.
        valid_mask: [A, C] bool, False entries are left out of the sum; at least one entry must be True.
        check_inputs: refuse (ValueError naming the problem) targets other than 0 and 1 (soft targets are not
            supported), a ``valid_mask`` without any True entry, and NaN/Inf scores, with one host-device sync;
            False (the loss classes, which check their own inputs) checks the shapes only.
    """
    (check_scores if check_inputs else check_score_shapes)(scores, None, valid_mask, targets=targets)
    dtype = compute_dtype(scores)
    t, bias_value, relative = _logit_parameters(scale, relative_bias, bias, dtype)
    matching = targets == 1 if valid_mask is None else (targets == 1) & valid_mask
    block = scores.to(dtype)
    if valid_mask is not None:
        # Excluded entries are zeroed before the logits, so that even NaN there (a masked self-pair) gives neither a
        # NaN loss nor a NaN gradient.
        block = block.masked_fill(~valid_mask, 0.0)
    # softplus(v) with v = -z at the matching entries and z elsewhere, so each term keeps its float32 accuracy relative
    # to its own value (softplus(z) - z would cancel: a saturated match's 2e-8 rounds to 0, and at z = 3000 the ulp of
    # z makes the sum negative)
    logits = _logits(block, t, bias_value, relative)
    per_pair = F.softplus(torch.where(matching, -logits, logits))
    if valid_mask is not None:
        per_pair = per_pair.masked_fill(~valid_mask, 0.0)
    return per_pair.sum() / scores.shape[0]


def locked_adapter_scores(scores: Tensor, delta: ScalarLike) -> Tensor:
    """The implicit adapter for a locked encoder: ``delta^2 s - (1 - delta^2)``, the inner product of
    ``(delta U, sqrt(1 - delta^2))`` and ``(delta V, -sqrt(1 - delta^2))``; ``delta = sigmoid(x)`` in (0, 1).
    Computed in the scores' computation dtype."""
    dtype = compute_dtype(scores)
    squared = (delta.to(dtype) if isinstance(delta, Tensor) else float(delta)) ** 2
    return squared * scores.to(dtype) - (1.0 - squared)


def constellation_margin_from_extremes(min_positive: Tensor, max_negative: Tensor) -> tuple[Tensor, Tensor]:
    """Margin ``m = (min positive score - max negative score) / 2`` and the centre ``(min pos + max neg) / 2``,
    the relative bias at which an ``(m, b_rel)``-constellation with that margin sits. ``m > 0`` iff zero loss is
    reachable for this score matrix by scaling ``t`` up with ``b_rel`` at the centre."""
    return (min_positive - max_negative) / 2.0, (min_positive + max_negative) / 2.0


def score_extremes(scores: Tensor, targets: Tensor, valid_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Smallest matching and largest valid non-matching score, without gradient: ``+inf`` / ``-inf`` when there is
    none. Masked reductions, no boolean indexing, so no host-device sync."""
    check_score_shapes(scores, None, valid_mask, targets=targets)
    detached = scores.to(compute_dtype(scores)).detach()
    positive_mask = targets == 1
    negative_mask = ~positive_mask
    if valid_mask is not None:
        positive_mask, negative_mask = positive_mask & valid_mask, negative_mask & valid_mask
    min_positive = detached.masked_fill(~positive_mask, float("inf")).amin()
    return min_positive, detached.masked_fill(~negative_mask, float("-inf")).amax()


def constellation_margin(scores: Tensor, targets: Tensor, valid_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(margin, centre)`` of a score matrix: see :func:`constellation_margin_from_extremes`."""
    return constellation_margin_from_extremes(*score_extremes(scores, targets, valid_mask))


def targets_from_positive_index(
    positive_index: Tensor, num_candidates: int, *, dtype: torch.dtype | None = None
) -> Tensor:
    """0/1 targets [A, C] (float32 unless ``dtype``) with a 1 at ``positive_index[a]``; rows with index -1 have no
    positive. Built by comparison with the column numbers, without data-dependent shapes (no sync)."""
    check_positive_index(positive_index)
    columns = torch.arange(num_candidates, device=positive_index.device)
    return (columns[None, :] == positive_index[:, None]).to(dtype or torch.float32)


@dataclass(frozen=True)
class SigmoidLogits:
    """How :func:`chunked_sigmoid_contrastive_loss` turns cosine scores into logits: ``scale``, exactly one of
    ``relative_bias`` / ``bias`` (as in :func:`sigmoid_contrastive_loss`), and an optional elementwise
    ``score_transform`` applied to each score block first (e.g. the locked-encoder adapter)."""

    scale: ScalarLike
    relative_bias: ScalarLike | None = None
    bias: ScalarLike | None = None
    score_transform: Callable[[Tensor], Tensor] | None = None


@dataclass(frozen=True)
class CandidateGuard:
    """The false-negative guard of :func:`chunked_sigmoid_contrastive_loss`, applied to the cosine scores before the
    score transform; the masked candidates leave the loss and the extremes. ``positive_scores`` [A] and
    ``reference_keys`` [A, K] (the threshold scores and the positives' keys, as in
    :func:`~st_weince.functional.false_negatives.false_negative_mask`) are for a block of candidates that may not hold
    the rows' positives; None takes them from the block. ``candidate_keys`` [C, K]: the ``"identical"`` rule's
    :func:`~st_weince.functional.input_keys` of the candidates (required by it, unused otherwise)."""

    false_negative_filter: FalseNegativeFilter | tuple | list | str | None = None
    positive_scores: Tensor | None = None
    candidate_keys: Tensor | None = None
    reference_keys: Tensor | None = None


class SigmoidBlockLoss(NamedTuple):
    """:func:`chunked_sigmoid_contrastive_loss`'s result: the loss (mean over anchors), the smallest matching and the
    largest non-matching score (no gradient; ``+inf`` / ``-inf`` if none; the margin: see
    :func:`constellation_margin_from_extremes`), what the guard removed per anchor (None without a guard)."""

    loss: Tensor
    min_matching: Tensor
    max_non_matching: Tensor
    guard_counts: FilterCounts | None


def chunked_sigmoid_contrastive_loss(
    anchors: Tensor,
    candidates: Tensor,
    positive_index: Tensor,
    logits: SigmoidLogits,
    *,
    guard: CandidateGuard | None = None,
    chunk_size: int | None = None,
    check_inputs: bool = True,
) -> SigmoidBlockLoss:
    """:func:`sigmoid_contrastive_loss` of ``anchors @ candidates.T`` computed block by block over candidates.

    The sum of the losses of candidate blocks (the sigmoid loss has no normalization across candidates), each
    recomputed during backward (activation checkpointing), so memory grows with ``A x chunk_size``, not ``A x C``.

    Args:
        anchors, candidates: [A, D] and [C, D] (normalize both beforehand for cosine scores).
        positive_index: [A] column of each anchor's positive, -1 for none.
        logits: the scale, the bias and the score transform (:class:`SigmoidLogits`).
        guard: the false-negative guard and its inputs (:class:`CandidateGuard`); None: no guard.
        chunk_size: candidates per block; None computes the whole matrix as one block.
        check_inputs: refuse a ``positive_index`` outside ``[-1, C - 1]`` (ValueError), with one host-device sync;
            False (the loss classes, which check their own inputs) checks the shapes only.
    """
    guard = guard or CandidateGuard()
    false_negative_filter = FalseNegativeFilter.parse(guard.false_negative_filter)
    shapes = f"{tuple(anchors.shape)} and {tuple(candidates.shape)}"
    if anchors.dim() != 2 or candidates.dim() != 2 or anchors.shape[1] != candidates.shape[1]:
        raise ValueError(f"anchors and candidates must be [A, D] and [C, D] with the same D, got {shapes}")
    if anchors.shape[0] == 0 or candidates.shape[0] == 0:
        raise ValueError(f"anchors and candidates must not be empty, got {shapes}")
    check_positive_index(positive_index, anchors.shape[0])
    num_candidates = candidates.shape[0]
    if check_inputs:
        message = f"positive_index must lie in [-1, {num_candidates - 1}] (-1 = no positive in this row)"
        checks = DeferredChecks()
        checks.require((positive_index >= -1) & (positive_index < num_candidates), message)
        checks.raise_if_failed()
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    dtype = compute_dtype(anchors, candidates)
    t, bias_value, relative = _logit_parameters(logits.scale, logits.relative_bias, logits.bias, dtype)
    anchors = anchors if anchors.dtype == dtype else anchors.to(dtype)
    candidates = candidates if candidates.dtype == dtype else candidates.to(dtype)
    step = num_candidates if chunk_size is None else min(chunk_size, num_candidates)
    recompute = step < num_candidates and torch.is_grad_enabled()
    keyed = false_negative_filter is not None and false_negative_filter.needs_keys
    candidate_keys, reference_keys, positive_scores = guard.candidate_keys, None, None
    if keyed:
        reference_keys = guard.reference_keys
        if reference_keys is None or candidate_keys is None or candidate_keys.shape[0] != num_candidates:
            reference_keys = positive_keys(candidate_keys, positive_index, num_candidates)
    elif false_negative_filter is not None and guard.positive_scores is not None:
        if guard.positive_scores.shape != positive_index.shape:
            raise ValueError(
                f"positive_scores must be [A] = {tuple(positive_index.shape)}, got {tuple(guard.positive_scores.shape)}"
            )
        positive_scores = guard.positive_scores.detach().to(dtype)
    elif false_negative_filter is not None:
        positive_scores = pair_scores(anchors, candidates, positive_index)

    def block_loss(block: Tensor, start: int, block_keys: Tensor | None):
        """Loss sum of the candidates ``start ...`` (``block``), with its extremes and the guard's per-row counts."""
        scores = anchors @ block.T
        local = positive_index - start if start else positive_index  # each row's matching column in this block
        # On the cosine scores (before a score transform), against each row's matching-pair score.
        keys = {"candidate_keys": block_keys, "reference_keys": reference_keys}
        valid_mask, counts = apply_false_negative_filter(
            scores, local, None, false_negative_filter, positive_scores, **keys
        )
        if logits.score_transform is not None:
            scores = logits.score_transform(scores)
        width = block.shape[0]
        # (the guard never removes the matching column; a valid_mask given may)
        in_block = (local >= 0) & (local < width)
        column = local.clamp(0, width - 1)
        loss_sum, low, high = _GatheredBlockSum.apply(scores, column, in_block, valid_mask, t, -bias_value, relative)
        return loss_sum, low, high, None if counts is None else (counts.masked, counts.negatives)

    total = min_positive = max_negative = guard_counts = None
    for start in range(0, num_candidates, step):
        arguments = (candidates[start : start + step], start, candidate_keys[start : start + step] if keyed else None)
        if recompute:
            loss_sum, low, high, masked = checkpoint(block_loss, *arguments, use_reentrant=False)
        else:
            loss_sum, low, high, masked = block_loss(*arguments)
        if total is None:
            total, min_positive, max_negative = loss_sum, low, high
        else:
            total = total + loss_sum
            min_positive, max_negative = torch.minimum(min_positive, low), torch.maximum(max_negative, high)
        if masked is not None:
            block_counts = FilterCounts(*masked)
            guard_counts = block_counts if guard_counts is None else guard_counts.plus(block_counts)
    return SigmoidBlockLoss(total / anchors.shape[0], min_positive, max_negative, guard_counts)


def match_probabilities(
    scores: Tensor, *, scale: ScalarLike, relative_bias: ScalarLike, delta: ScalarLike | None = None
) -> Tensor:
    """RB-Sigmoid's match probability of each pair, ``sigmoid(t (s - b_rel))`` on cosine ``scores`` (after the locked
    adapter's ``delta^2 s - (1 - delta^2)`` when ``delta`` is given): the probability the loss was trained to
    predict for "this pair matches", with the decision threshold ``s = b_rel`` (probability 1/2). Same shape as
    ``scores``, in its computation dtype."""
    if delta is not None:
        scores = locked_adapter_scores(scores, delta)
    return torch.sigmoid(sigmoid_logits(scores, scale=scale, relative_bias=relative_bias))
