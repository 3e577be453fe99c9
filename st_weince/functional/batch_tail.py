"""The released composite's batch tail index ``beta_t`` (docs/algorithms.md 1.2b): a moving average, carried across
steps, of the slope of a Weibull line fitted to the smallest shortfalls of all the batch's negative scores, updated
with ``torch.where`` (no host sync) when the fit is trusted. Under data parallelism each process keeps enough of its
shortfalls (:func:`batch_negative_tail`'s ``global_entries``) for the fit of ``BatchTail.cat`` of all of them, which
equals the single-process fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from st_weince.functional.checks import check_score_shapes, compute_dtype, order_keys
from st_weince.functional.line_fit import burn_in, fit_design, fit_lines, shared_design
from st_weince.functional.options import TopM, require_options
from st_weince.functional.weince import HardestNegatives, count_negatives, negative_selection
from st_weince.utils.options import integer_option

# Fewer negatives than this in the whole batch: no fit, the moving average keeps its value.
MIN_BATCH_TAIL_POINTS = 10
_MIN_SUM_OF_SQUARES = 1e-12


def negative_mask(scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None) -> Tensor:
    """[A, C] bool: valid entries other than the row's positive (a row with positive -1 keeps all valid entries)."""
    columns = torch.arange(scores.shape[1], device=scores.device)
    negative = columns[None, :] != positive_index[:, None]
    return negative if valid_mask is None else negative & valid_mask


def batch_tail_size(num_negatives: Tensor | int, options: TopM) -> Tensor | int:
    """``k = min(K_all, max(beta_tail_min_points, floor(beta_tail_frac * K_all)))`` for an int or a long tensor."""
    require_options(options, TopM)
    if isinstance(num_negatives, Tensor):
        share = torch.floor(options.beta_tail_frac * num_negatives.double()).long()
        return torch.minimum(num_negatives, share.clamp_min(options.beta_tail_min_points))
    return min(num_negatives, max(options.beta_tail_min_points, int(options.beta_tail_frac * num_negatives)))


@dataclass(frozen=True)
class BatchTail:
    """The smallest shortfalls of a batch's negative scores (no gradient) and how many negatives there were."""

    shortfalls: Tensor  # [L] max(1 - s, eps); +inf beyond the last negative; ascending where ``ascending``
    # K_all: a scalar long tensor, or a Python int where the shapes alone give it (every row alike)
    num_negatives: Tensor | int
    ascending: bool = False  # known from how it was built (one part of batch_negative_tail), never from the values

    @staticmethod
    def cat(parts: list[BatchTail]) -> BatchTail:
        """Several processes' (or candidate groups') tails as one: the fit of the union of their rows."""
        if len(parts) == 1:
            return parts[0]
        counts = [p.num_negatives for p in parts]
        return BatchTail(
            shortfalls=torch.cat([p.shortfalls for p in parts]),
            num_negatives=sum(counts)
            if all(isinstance(c, int) for c in counts)
            else torch.stack([torch.as_tensor(c, device=parts[0].shortfalls.device) for c in counts]).sum(),
        )


@torch.no_grad()
def batch_negative_tail(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    options: TopM,
    *,
    eps: float,
    global_entries: int | None = None,
    hardest: HardestNegatives | None = None,
    has_positive: bool | None = None,
) -> BatchTail:
    """The smallest shortfalls ``max(1 - s, eps)`` over ALL negative scores of these rows (self-pairs, positives and
    masked entries excluded), as many as the tail of the global batch can need.

    ``global_entries``: the number of score entries of the global batch (default: this matrix's), so that under data
    parallelism each process keeps enough of its shortfalls for the global fit. A row with positive -1 contributes
    all its valid entries. ``hardest``: the rows' :func:`~st_weince.functional.weince.hardest_negatives` with its
    selection kept, whose selection (the positives and masked entries already out) this selects from, instead of
    making its own; ``has_positive`` as there.
    """
    require_options(options, TopM)
    check_score_shapes(scores, positive_index, valid_mask)
    if positive_index.dtype != torch.long:  # any integer dtype, as in torch's losses
        positive_index = positive_index.long()
    entries = scores.numel()
    global_entries = entries if global_entries is None else integer_option("global_entries", global_entries, entries)
    keep = min(entries, batch_tail_size(global_entries, options))
    if hardest is not None and hardest.selection is not None:
        selected = hardest.selection
    else:
        selected = negative_selection(scores, positive_index, valid_mask, has_positive)
    # The keep smallest shortfalls are the keep largest negative scores: one top-k of the flat selection.
    largest = selected.reshape(-1).topk(keep, sorted=True).values
    if not largest.is_floating_point():  # order keys (on CPU)
        largest = order_keys(largest).view(scores.dtype)
    dtype = compute_dtype(scores)
    shortfall = torch.rsub(largest if largest.dtype == dtype else largest.to(dtype), 1.0).clamp_min_(eps)
    if valid_mask is None and has_positive is not None:  # every row alike: a count from the shapes
        num_negatives = entries - scores.shape[0] * int(has_positive)
    else:
        num_negatives = count_negatives(positive_index, valid_mask, scores.shape, scores.device).sum()
    return BatchTail(shortfalls=shortfall, num_negatives=num_negatives, ascending=True)


@dataclass(frozen=True)
class BatchTailFit:
    """The batch's Weibull line fit (no gradient): slope (clamped at >= 0), R^2, points, and the verdict."""

    slope: Tensor  # scalar: least-squares slope of log F_r on log d_r, clamped at >= 0; 0 when there is no fit
    r_squared: Tensor  # scalar in [0, 1]; 0 when there is no fit
    tail_size: Tensor | int  # k (a Python int where the tail's count of negatives is one)
    fitted: Tensor | bool  # at least MIN_BATCH_TAIL_POINTS negatives
    trusted: Tensor  # scalar bool: fitted, R^2 >= beta_min_r_squared and slope > 0


@torch.no_grad()
def batch_tail_fit(tail: BatchTail, options: TopM) -> BatchTailFit:
    """Fit ``log F_r ~ a + slope * log d_r`` on the k smallest shortfalls (sorted ascending, ``F_r = r / (k + 1)``,
    the first ``max(1, floor(k / 20))`` dropped) and its R^2 (docs/algorithms.md 1.2b). Shortfalls whose log spreads by
    no more than rounding give slope 0 (no tail shape), hence an untrusted fit."""
    require_options(options, TopM)
    # the parts of a concatenated tail are each sorted only
    shortfalls = tail.shortfalls if tail.ascending else torch.sort(tail.shortfalls).values
    length = shortfalls.shape[0]
    if length == 0:
        zero = shortfalls.new_zeros(())
        no = torch.zeros((), dtype=torch.bool, device=shortfalls.device)
        return BatchTailFit(zero, zero, 0, False, no)
    dtype = shortfalls.dtype
    if isinstance(tail.num_negatives, int):  # the design from the shapes alone, made once
        k = min(batch_tail_size(tail.num_negatives, options), length)
        design = shared_design(k, length, dtype, shortfalls.device, gumbel=False)
        skipped = burn_in(k)
        n, first_used, fitted = float(max(k - skipped, 1)), min(skipped, length - 1), k >= MIN_BATCH_TAIL_POINTS
    else:
        k = batch_tail_size(tail.num_negatives, options).clamp_max(length)
        design = fit_design(k[None], length, dtype, gumbel=False)
        n = design.weight.sum(1, keepdim=True).clamp_min(1.0)
        first_used, fitted = design.burn_in.clamp_max(length - 1)[:, None], k >= MIN_BATCH_TAIL_POINTS
    x = torch.log(torch.where(design.weight[0] > 0, shortfalls, 1.0))[None]
    slope, sse, degenerate = fit_lines(x, design, n, first_used)
    log_cdf = design.centred[0, 0]
    total = (log_cdf * log_cdf).sum().clamp_min(_MIN_SUM_OF_SQUARES)
    if isinstance(fitted, bool):
        shaped = ~degenerate[0] if fitted else torch.zeros_like(degenerate[0])
    else:
        shaped = fitted & ~degenerate[0]
    slope = torch.where(shaped, slope[0, 0].clamp_min(0.0), 0.0)
    r_squared = torch.where(shaped, (1.0 - sse[0, 0] / total).clamp(0.0, 1.0), 0.0)
    trusted = shaped & (r_squared >= options.beta_min_r_squared) & (slope > 0)
    return BatchTailFit(slope=slope, r_squared=r_squared, tail_size=k, fitted=fitted, trusted=trusted)


@torch.no_grad()
def update_beta_ema(beta_ema: Tensor, fit: BatchTailFit, options: TopM) -> Tensor:
    """The new moving average (a tensor in ``beta_ema``'s dtype, no host sync):
    ``momentum * beta_ema + (1 - momentum) * clamp(slope, beta_min, beta_max)`` when the fit is trusted, else
    ``beta_ema`` unchanged. The batch's ``beta_t`` is the returned value."""
    require_options(options, TopM)
    if not isinstance(beta_ema, Tensor):
        raise TypeError(f"beta_ema must be a tensor (the state the caller keeps), got {type(beta_ema).__name__}")
    momentum = options.beta_ema_momentum
    clamped = fit.slope.to(beta_ema.dtype).clamp(options.beta_min, options.beta_max)
    updated = beta_ema * momentum + clamped * (1.0 - momentum)
    return torch.where(fit.trusted, updated, beta_ema)


def initial_beta_ema(options: TopM) -> Tensor:
    """The moving average's start value as a float32 scalar tensor (a buffer's initial value, moved with the loss)."""
    require_options(options, TopM)
    return torch.tensor(options.beta_ema_start, dtype=torch.float32)
