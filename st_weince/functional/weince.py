"""WEINCE (Weibull-enhanced InfoNCE) as pure functions on score matrices: scores -> per-anchor tail fits -> batch
pivot -> blend weights -> logits -> cross-entropy, each formula of docs/algorithms.md section 1 once, the options one
:class:`~st_weince.functional.options.WEINCEOptions` (checked when built).

``scores`` [A, C] cosines of A anchors against C candidates; ``positive_index`` [A] long, each row's positive column
or -1 (no positive in this block); ``valid_mask`` [A, C] bool, False for entries that are no candidate. Negatives:
valid entries other than the positive. No function reads a device value on the host (shapes decide every branch and
only shapes are checked; values: :func:`st_weince.functional.check_scores`), so the loss compiles with
``torch.compile(fullgraph=True)``. Computed in the scores' dtype, float16/bfloat16 in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from st_weince.functional.checks import (
    NEGATIVE_INFINITY_KEY,
    check_score_shapes,
    check_scores,
    compute_dtype,
    order_keys,
)
from st_weince.functional.line_fit import burn_in, fit_lines, row_design, shared_design
from st_weince.functional.options import BETA_AUTO_RANGE, DEFAULTS, Gate, WEINCEOptions, checked_field, require_options
from st_weince.utils.hotpath import DeferredChecks
from st_weince.utils.options import real_option

# A wrong-signed slope disqualifies its line by this residual penalty (reference implementation).
_WRONG_SIGN_PENALTY = 1e6
_MIN_SSE = 1e-12
_MIN_FIT_POINTS = 3


@dataclass(frozen=True)
class TailFit:
    """Per-anchor results of the tail fits (no gradient), in the statistics dtype."""

    rho: Tensor  # [A] shortfall 1 - s of the hardest negative, at least eps; 1.0 where a row has no negative
    beta_hat: Tensor  # [A] slope of the Weibull line (estimated tail index); 0.0 where not fitted or degenerate
    delta_aic: Tensor  # [A] AIC_Gumbel - AIC_Weibull; 0.0 where not fitted or degenerate (no tail shape)
    fitted: Tensor  # [A] bool: at least 3 tail points after the burn-in
    has_negatives: Tensor  # [A] bool: at least one negative
    # (fitted, has_negatives) of every row, when all rows have the same number of negatives (known from the shapes:
    # no valid_mask, and every row or no row with a positive); None where they may differ
    alike: tuple[bool, bool] | None = None

    @staticmethod
    def cat(parts: list[TailFit]) -> TailFit:
        """Row chunks' fits, concatenated in order."""
        alike = parts[0].alike if all(p.alike == parts[0].alike for p in parts) else None
        per_row = [f.name for f in fields(TailFit) if f.name != "alike"]
        return TailFit(*(torch.cat([getattr(p, name) for p in parts]) for name in per_row), alike=alike)


@dataclass(frozen=True)
class WEINCEStatistics:
    """Everything the WEINCE logit needs, per anchor; computed without gradient, in the statistics dtype."""

    lam: Tensor  # [A] blend weight in [0, 1); 0 gives InfoNCE
    beta: Tensor  # [A] tail index used in the shortfall logit
    rho: Tensor  # [A]
    delta_aic: Tensor  # [A]
    rho0: Tensor  # scalar batch pivot
    beta_hat: Tensor  # [A] raw estimate (before clamping)
    fitted: Tensor  # [A] bool


def count_negatives(positive_index: Tensor | None, valid_mask: Tensor | None, shape: torch.Size, device) -> Tensor:
    """K per row: valid entries other than the row's positive."""
    num_anchors, num_candidates = shape
    if valid_mask is None:
        count = torch.full((num_anchors,), num_candidates, dtype=torch.long, device=device)
    else:
        count = valid_mask.sum(1)
    if positive_index is not None:
        positive_valid = positive_index >= 0
        if valid_mask is not None:
            positive_valid = positive_valid & valid_mask.gather(1, positive_index.clamp_min(0)[:, None]).squeeze(1)
        count = count - positive_valid.long()
    return count


@dataclass(frozen=True)
class HardestNegatives:
    """Each row's hardest negatives, descending: the one partial sort per row that the tail fit and the top-M terms
    share (no gradient; :func:`hardest_negatives`)."""

    values: Tensor  # [A, W] the W largest negative scores of each row, descending, in the scores' dtype; -inf padding
    # [A, W] long: their columns (padding positions: some column, whose value is never used); None when not asked for
    columns: Tensor | None
    # [A, C] what the rows were selected from, when asked for: :func:`negative_selection` of the scores
    selection: Tensor | None = None

    def first(self, width: int) -> HardestNegatives:
        """The ``width`` hardest of each row (e.g. to keep only what the top-M terms need), without the selection."""
        columns = None if self.columns is None else self.columns[:, :width]
        return HardestNegatives(values=self.values[:, :width], columns=columns)


@torch.no_grad()
def negative_selection(
    scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None, has_positive: bool | None = None
) -> Tensor:
    """[A, C]: the scores with each row's positive (by its column, so ties cannot confuse it) and invalid entries at
    -inf, a new tensor to select negatives from by size: on CPU as :func:`~st_weince.functional.checks.order_keys`
    (whose top-k is faster there), elsewhere as floats. ``has_positive``: True when every row has a positive, False
    when none has, None to go by each row's (a fact of the caller's layout spares that per-row choice)."""
    selected = scores.detach()
    if valid_mask is not None:
        selected = selected.masked_fill(~valid_mask, float("-inf"))
    on_cpu = scores.device.type == "cpu"
    if on_cpu:
        selected = order_keys(selected)  # a new tensor
    elif valid_mask is None:
        selected = selected.clone()
    if positive_index is None or has_positive is False:
        return selected
    lowest = NEGATIVE_INFINITY_KEY[scores.dtype] if on_cpu else float("-inf")
    column = positive_index[:, None]
    if has_positive:
        return selected.scatter_(1, column, lowest)
    # rows with and without a positive: the latter's column 0 is written with its own value
    column = column.clamp_min(0)
    own = selected.gather(1, column)
    return selected.scatter_(1, column, torch.where(column == positive_index[:, None], lowest, own))


@torch.no_grad()
def hardest_negatives(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None,
    width: int,
    *,
    with_columns: bool = True,
    has_positive: bool | None = None,
    keep_selection: bool = False,
) -> HardestNegatives:
    """The ``width`` (at most the columns) largest negative scores of each row, descending, -inf beyond a row's last
    negative, and with ``with_columns`` their columns (no gradient), from one top-k of the :func:`negative_selection`
    (``has_positive`` as there), which ``keep_selection`` keeps with them (the batch tail selects from it too)."""
    if not 1 <= width <= scores.shape[1]:
        raise ValueError(f"width must be in [1, {scores.shape[1]}] (the number of columns), got {width}")
    selected = negative_selection(scores, positive_index, valid_mask, has_positive)
    values, columns = selected.topk(width, dim=1, sorted=True)
    return HardestNegatives(
        values=values if values.is_floating_point() else order_keys(values).view(scores.dtype),
        columns=columns if with_columns else None,
        selection=selected if keep_selection else None,
    )


def tail_sizes(num_negatives: Tensor, *, tail_frac: float, min_tail_points: int) -> Tensor:
    """Tail size k per anchor from its number of negatives K (docs/algorithms.md 1.1 step 1)."""
    k = torch.clamp(torch.round(tail_frac * num_negatives.double()).long(), min=min_tail_points)
    k = torch.minimum(k, num_negatives)
    k = torch.clamp(k, min=10)
    return torch.minimum(k, num_negatives)


def max_tail_size(num_candidates: int, options: WEINCEOptions) -> int:
    """The largest tail size any row of ``num_candidates`` columns can have (k is non-decreasing in K <= C)."""
    # the formula of tail_sizes in plain Python: shapes decide, no tensor is read
    k = min(max(options.min_tail_points, round(options.tail_frac * num_candidates)), num_candidates)
    return min(max(10, k), num_candidates)


def negatives_needed(options: WEINCEOptions = DEFAULTS) -> int:
    """The fewest negatives per anchor at which an anchor's tail is fitted (with the defaults: 4): its tail of
    :func:`max_tail_size` points keeps at least 3 after the burn-in of docs/algorithms.md 1.1 step 4."""
    require_options(options, WEINCEOptions)
    count = 1
    while (k := max_tail_size(count, options)) - burn_in(k) < _MIN_FIT_POINTS:
        count += 1
    return count


@torch.no_grad()
def weince_tail_fit(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None = None,
    options: WEINCEOptions = DEFAULTS,
    *,
    hardest: HardestNegatives | None = None,
    has_positive: bool | None = None,
) -> TailFit:
    """Per-anchor shortfall tail fits (docs/algorithms.md 1.1 steps 1-4), vectorised over anchors, in the scores'
    dtype (half precision: float32); shapes are checked, values are not (:func:`check_scores`). ``hardest``: the
    rows' :func:`hardest_negatives`, at least :func:`max_tail_size` wide, when the caller shares that sort with the
    top-M terms. With no ``valid_mask`` and a known ``has_positive`` every row has as many negatives, so the tail size
    and fit design follow from the shapes (the same values, fewer operators)."""
    require_options(options, WEINCEOptions)
    check_score_shapes(scores, positive_index, valid_mask)
    if positive_index is not None and positive_index.dtype != torch.long:
        positive_index = positive_index.long()
    dtype = compute_dtype(scores)
    num_rows, num_columns = scores.shape
    k_max = max(max_tail_size(num_columns, options), 1)
    if hardest is None:
        hardest = hardest_negatives(
            scores, positive_index, valid_mask, k_max, with_columns=False, has_positive=has_positive
        )
    elif hardest.values.shape[0] != num_rows or hardest.values.shape[1] < k_max:
        raise ValueError(
            f"hardest has shape {tuple(hardest.values.shape)}: the tail fit of {tuple(scores.shape)} scores needs "
            f"[{num_rows}, >= {k_max}]"
        )
    top = hardest.values if hardest.values.shape[1] == k_max else hardest.values[:, :k_max]
    # Shortfalls of the sorted tail; the -inf padding of rows with fewer than k_max negatives gives +inf, whose log
    # is set to 0 so that no inf or NaN enters the (weighted) sums.
    shortfall = torch.rsub(top if top.dtype == dtype else top.to(dtype), 1.0).clamp_min_(options.eps)
    log_shortfall = torch.log(shortfall).nan_to_num_(posinf=0.0)

    alike = valid_mask is None and (positive_index is None or has_positive is not None)
    if alike:  # every row: the same number of negatives, tail size and design, as Python numbers
        num_negatives = num_columns - int(positive_index is not None and bool(has_positive))
        k = max_tail_size(num_negatives, options)
        design = shared_design(k, k_max, dtype, scores.device)
        skipped = burn_in(k)
        points = max(k - skipped, 0)
        fitted, has_negatives = points >= _MIN_FIT_POINTS, num_negatives > 0
        n, first_used = float(max(points, 1)), min(skipped, k_max - 1)
        # a copy, not a view: a cached loss keeps every chunk's fit, and a view would keep its whole tail alive
        rho = shortfall[:, 0].clone() if has_negatives else torch.ones(num_rows, dtype=dtype, device=scores.device)
    else:
        num_negatives = count_negatives(positive_index, valid_mask, scores.shape, scores.device)
        k = tail_sizes(num_negatives, tail_frac=options.tail_frac, min_tail_points=options.min_tail_points)
        design = row_design(k, k_max, dtype)
        points = (k - design.burn_in).clamp_min(0)
        fitted, has_negatives = points >= _MIN_FIT_POINTS, num_negatives > 0
        n, first_used = points.clamp_min(1).to(dtype)[:, None], design.burn_in.clamp_max(k_max - 1)[:, None]
        rho = torch.where(has_negatives, shortfall[:, 0], 1.0)

    # Both lines at once (Weibull, and the Gumbel proxy's negative: a slope <= 0 has the wrong sign for either),
    # a wrong-signed one disqualified by a residual penalty (reference implementation).
    slope, sse, degenerate = fit_lines(log_shortfall, design, n, first_used)
    sse = (sse + _WRONG_SIGN_PENALTY * (slope <= 0)).clamp_min_(_MIN_SSE).log_()
    sse_weibull, sse_gumbel = sse.unbind()
    # AIC_G - AIC_W = n log(SSE_G / n) - n log(SSE_W / n); the +4 of both cancel.
    delta_aic = (sse_gumbel - sse_weibull) * n if alike else n.squeeze(1) * (sse_gumbel - sse_weibull)
    beta_hat = slope[0]
    if alike:
        facts = (fitted, has_negatives)
        if fitted:
            beta_hat, delta_aic = torch.where(degenerate, 0.0, beta_hat), torch.where(degenerate, 0.0, delta_aic)
        else:
            beta_hat, delta_aic = torch.zeros_like(beta_hat), torch.zeros_like(delta_aic)
        fitted = torch.full((num_rows,), fitted, device=scores.device)
        has_negatives = torch.full((num_rows,), has_negatives, device=scores.device)
    else:
        facts = None
        shaped = fitted & ~degenerate
        beta_hat, delta_aic = torch.where(shaped, beta_hat, 0.0), torch.where(shaped, delta_aic, 0.0)
    return TailFit(rho, beta_hat, delta_aic, fitted, has_negatives, alike=facts)


@torch.no_grad()
def batch_pivot(rho: Tensor, has_negatives: Tensor | bool, q: float = DEFAULTS.gate.q) -> Tensor:
    """``rho0``: the q-quantile of rho over the anchors that have negatives (sort ascending, index round(q (A-1))),
    1.0 when none has. Sort plus gather, no boolean-mask indexing: rows without negatives sort last (+inf).
    ``has_negatives``: per anchor, or one Python bool for all. Pass the rho of the whole (global) batch, so the pivot
    does not depend on how the batch is split over processes. ``q`` is checked as ``Gate.q``."""
    if not (isinstance(q, float) and 0.0 <= q <= 1.0):  # an options' q is such a float, checked when built
        q = checked_field(Gate, "q", q)
    if isinstance(has_negatives, bool):
        if not has_negatives:
            return torch.ones((), dtype=rho.dtype, device=rho.device)
        # round half to even, like Python's round() in the reference implementation
        return torch.kthvalue(rho, round(q * (rho.numel() - 1)) + 1).values
    pool = torch.sort(torch.where(has_negatives, rho, float("inf"))).values
    count = has_negatives.sum()
    index = torch.round(q * (count - 1).clamp_min(0).double()).long().clamp(0, rho.numel() - 1)
    return torch.where(count > 0, pool.gather(0, index[None])[0], torch.ones((), dtype=rho.dtype, device=rho.device))


def _where_fitted(fit: TailFit, value: Tensor, otherwise: float) -> Tensor:
    """``value`` where a row is fitted, else ``otherwise``; without a selection when every row is alike."""
    if fit.alike is None:
        return torch.where(fit.fitted, value, otherwise)
    return value if fit.alike[0] else torch.full_like(value, otherwise)


@torch.no_grad()
def blend_weights(fit: TailFit, rho0: Tensor | float, options: WEINCEOptions = DEFAULTS) -> Tensor:
    """lambda(a) = sigmoid(kappa_rho log(rho0 / rho)) * sigmoid(kappa_aic (dAIC - margin)); 0 where not fitted."""
    require_options(options, WEINCEOptions)
    gate = options.gate
    if options.mode == "none":  # InfoNCE
        return torch.zeros_like(fit.rho)
    if not isinstance(rho0, Tensor) or rho0.dtype != fit.rho.dtype:
        rho0 = torch.as_tensor(rho0, dtype=fit.rho.dtype, device=fit.rho.device)
    if options.mode in ("both", "rho"):
        hardness = torch.sigmoid(gate.kappa_rho * (torch.log(rho0) - torch.log(fit.rho)))
    if options.mode in ("both", "aic"):
        geometry = torch.sigmoid(gate.kappa_aic * (fit.delta_aic - gate.aic_margin))
    lam = hardness * geometry if options.mode == "both" else hardness if options.mode == "rho" else geometry
    return _where_fitted(fit, lam, 0.0)


@torch.no_grad()
def statistics_from_fit(
    fit: TailFit,
    options: WEINCEOptions = DEFAULTS,
    *,
    rho0: Tensor | float | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> WEINCEStatistics:
    """Steps 5-7 of docs/algorithms.md 1.1 on given tail fits: the pivot (over ``gather``'s global batch unless ``rho0``
    is given), the blend weights and the tail index."""
    require_options(options, WEINCEOptions)
    if rho0 is not None and not isinstance(rho0, Tensor):
        # a pivot is a shortfall 1 - s of a cosine score: in (0, 2]; log(rho0) enters lambda
        rho0 = real_option("rho0", rho0, positive=True, dtype=torch.float32)
    if rho0 is None:
        # every process's rows are alike when this one's are: the same layout of batches of one size
        has_negatives, rho = fit.has_negatives if fit.alike is None else fit.alike[1], fit.rho
        if gather is not None:
            has_negatives = gather(has_negatives) if fit.alike is None else has_negatives
            rho = gather(rho)
        rho0 = batch_pivot(rho, has_negatives, options.gate.q)
    if not isinstance(rho0, Tensor) or rho0.dtype != fit.rho.dtype or rho0.device != fit.rho.device:
        rho0 = torch.as_tensor(rho0, dtype=fit.rho.dtype, device=fit.rho.device)
    # beta(a) in the shortfall logit: a constant (reference implementation: 1.0) or "auto", the clamped estimate
    if options.beta == "auto":
        beta = _where_fitted(fit, fit.beta_hat.clamp(*BETA_AUTO_RANGE), 1.0)
    else:
        beta = torch.full_like(fit.beta_hat, options.beta)
    return WEINCEStatistics(
        lam=blend_weights(fit, rho0, options),
        beta=beta,
        rho=fit.rho,
        delta_aic=fit.delta_aic,
        rho0=rho0,
        beta_hat=fit.beta_hat,
        fitted=fit.fitted,
    )


@torch.no_grad()
def weince_statistics(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None = None,
    options: WEINCEOptions = DEFAULTS,
    *,
    rho0: Tensor | float | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> WEINCEStatistics:
    """Per-anchor WEINCE statistics (no gradient), in the scores' dtype (float16/bfloat16: float32).

    ``rho0`` overrides the batch pivot. ``gather`` maps a per-anchor tensor of this process to the one of the global
    batch (e.g. an all-gather under data parallelism), so that the pivot is taken over every process's anchors.
    """
    fit = weince_tail_fit(scores, positive_index, valid_mask, options)
    return statistics_from_fit(fit, options, rho0=rho0, gather=gather)


def _blended_logits(scores: Tensor, lam: Tensor, beta: Tensor, scale: float, eps: float) -> tuple[Tensor, ...]:
    """The blended logits and the per-row weights (1 - lam) / tau and lam beta; the shortfall's log is taken in place,
    so one [A, C] tensor is written (backward rebuilds the shortfall from the scores, :func:`_blended_slope`)."""
    linear_weight = (1.0 - lam) * scale
    shortfall_weight = lam * beta
    logits = torch.rsub(scores, 1.0).clamp_min_(eps).log_().mul_(-shortfall_weight).addcmul_(scores, linear_weight)
    return logits, linear_weight, shortfall_weight


def _blended_slope(scores: Tensor, linear_weight: Tensor, shortfall_weight: Tensor, eps: float) -> Tensor:
    """dl/ds = (1 - lam) / tau + lam beta / (1 - s) below the cap, and (1 - lam) / tau where the clamp at 1 - eps is
    active: there the shortfall is set to +inf, so the second term is exactly 0 without a data-dependent branch."""
    shortfall = torch.threshold_(torch.rsub(scores, 1.0), eps, float("inf"))
    return torch.div(shortfall_weight, shortfall, out=shortfall).add_(linear_weight)


class _BlendedLogit(torch.autograd.Function):
    """l = (1 - lam) s / tau - lam beta log(max(1 - s, eps)) (``max(1 - s, eps) = 1 - min(s, 1 - eps)``), fused: only
    the scores are kept for backward, not the intermediates autograd would store, in fewer passes over the matrix."""

    @staticmethod
    def forward(ctx, scores: Tensor, lam: Tensor, beta: Tensor, scale: float, eps: float) -> Tensor:
        logits, linear_weight, shortfall_weight = _blended_logits(scores, lam, beta, scale, eps)
        ctx.save_for_backward(scores, linear_weight, shortfall_weight)
        ctx.eps = eps
        return logits

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        scores, linear_weight, shortfall_weight = ctx.saved_tensors
        slope = _blended_slope(scores, linear_weight, shortfall_weight, ctx.eps)
        return slope.mul_(grad_output), None, None, None, None


def weince_logits(
    scores: Tensor,
    lam: Tensor,
    beta: Tensor,
    valid_mask: Tensor | None = None,
    *,
    scale: float,
    eps: float = DEFAULTS.eps,
    check_inputs: bool = True,
) -> Tensor:
    """Blended logits (1 - lam) s / tau + lam (-beta log(1 - min(s, 1 - eps))), ``scale = 1 / tau``, -inf at invalid
    entries, in the scores' dtype (half precision: float32, which the shortfall log needs). The gradient flows through
    ``scores`` only. ``check_inputs`` refuses a ``lam`` outside [0, 1] and a ``beta`` not finite and > 0, with one
    host sync; the loss classes pass False (they compute both themselves)."""
    if check_inputs:
        checks = DeferredChecks()
        checks.require((lam >= 0) & (lam <= 1), "lam must lie in [0, 1] (it is a blend weight), got NaN or outside")
        checks.require(torch.isfinite(beta) & (beta > 0), "beta must be finite and > 0 (the shortfall tail index)")
        checks.raise_if_failed()
    dtype = compute_dtype(scores)
    s = scores.to(dtype)
    lam = lam.detach().to(dtype)[:, None]
    logits = _BlendedLogit.apply(s, lam, beta.detach().to(dtype)[:, None], scale, float(eps))
    if valid_mask is not None:
        logits = logits.masked_fill(~valid_mask, float("-inf"))
    return logits


class _BlendedCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of the blended logits with the positive as the target, fused with the logit: the
    gradient (softmax - one-hot) * dl/ds, dl/ds = (1 - lam) / tau + lam beta / (1 - s) with the row's upstream gradient
    folded into the two per-row weights, takes four passes over [A, C] where autograd's chain takes about seven.

    The loss is ``-log_softmax(l)[pos]``, not ``logsumexp(l) - l_pos``: at an extreme scale (logits of 1e8, float32
    spacing 8) that difference would lose the ``log K`` of a row of equal logits; shifted by the row maximum, equal
    logits are exactly 0. Its output, saved for backward, gives the softmax with one ``exp``."""

    @staticmethod
    def forward(ctx, scores, lam, beta, positive_index, valid_mask, scale, eps):
        logits, linear_weight, shortfall_weight = _blended_logits(scores, lam, beta, scale, eps)
        if valid_mask is not None:
            logits.masked_fill_(~valid_mask, float("-inf"))
        log_probabilities = torch.log_softmax(logits, dim=1)
        ctx.save_for_backward(log_probabilities, scores, linear_weight, shortfall_weight, positive_index)
        ctx.eps = eps
        return log_probabilities.gather(1, positive_index[:, None]).squeeze(1).neg_()

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        log_probabilities, scores, linear_weight, shortfall_weight, positive_index = ctx.saved_tensors
        grad_rows = grad_rows[:, None]
        probabilities = log_probabilities.exp()
        probabilities.scatter_add_(1, positive_index[:, None], -torch.ones_like(grad_rows))
        # the row's upstream gradient folded into the two per-row weights
        slope = _blended_slope(scores, linear_weight * grad_rows, shortfall_weight * grad_rows, ctx.eps)
        return probabilities.mul_(slope), None, None, None, None, None, None


def blended_cross_entropy(
    scores: Tensor,
    lam: Tensor,
    beta: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    *,
    scale: float,
    eps: float = DEFAULTS.eps,
) -> Tensor:
    """Per-row cross-entropy [A] of :func:`weince_logits` with ``positive_index`` as the target, fused (fewer passes
    over the matrix in backward). Same dtypes and gradient as the unfused logits + ``F.cross_entropy``."""
    check_score_shapes(scores, positive_index, valid_mask)
    dtype = compute_dtype(scores)
    return _BlendedCrossEntropy.apply(
        scores.to(dtype),
        lam.detach().to(dtype)[:, None],
        beta.detach().to(dtype)[:, None],
        positive_index.long(),
        valid_mask,
        scale,
        float(eps),
    )


def weince_cross_entropy(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    options: WEINCEOptions = DEFAULTS,
    *,
    reduction: str = "mean",
    rho0: Tensor | float | None = None,
    statistics: WEINCEStatistics | None = None,
) -> Tensor:
    """WEINCE loss (the blend, docs/algorithms.md 1.2, at ``options.scale``): the cross-entropy of each row's
    blended logits with its positive as the target. ``statistics``: precomputed statistics of these rows. The values
    are checked as torch's losses do (:func:`check_scores` with ``every_row_has_positive=True``, one host sync) unless
    ``options.check_inputs`` is False (no sync: ``torch.compile(fullgraph=True)`` traces it whole)."""
    require_options(options, WEINCEOptions)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if options.check_inputs:
        check_scores(scores, positive_index, valid_mask, every_row_has_positive=True)
    else:
        check_score_shapes(scores, positive_index, valid_mask)
    positive_index = positive_index.long()
    if statistics is None:
        statistics = weince_statistics(scores, positive_index, valid_mask, options, rho0=rho0)
    rows = blended_cross_entropy(
        scores, statistics.lam, statistics.beta, positive_index, valid_mask, scale=options.scale, eps=options.eps
    )
    return rows if reduction == "none" else getattr(rows, reduction)()
