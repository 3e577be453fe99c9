"""The released WEINCE composite (docs/algorithms.md 1.2b) as pure functions on score matrices.

``L = L_blend + w_shortfall * L_shortfall_topM + w_infonce * L_infonce_topM``, where per anchor the two top-M terms
are cross-entropies over the positive and the M hardest negatives only:

- shortfall ("Weibit") term: logits ``-beta_t * log(1 - min(x, 1 - eps))``, no temperature;
- InfoNCE term: logits ``scale * x`` (``scale = 1 / tau``).

``beta_t`` is one scalar per batch: an exponential moving average of the slope of a Weibull line fitted to the
smallest shortfalls of ALL the batch's negative scores, updated only when the fit is trusted. It is state carried
across steps (a tensor the caller keeps, e.g. a buffer, and saves with its checkpoints).

Conventions as in :mod:`st_weince.functional.weince`: ``scores`` [A, C], ``positive_index`` [A] long (every row needs
a positive for the top-M terms), ``valid_mask`` [A, C] bool or None. Negatives of a row: its valid entries other than
its positive. Every default lives in :class:`TopMOptions`.

Hot path: shapes decide every Python branch, nothing here reads a device value on the host (the functions check
shapes only; the values are checked where a loss receives its inputs, and a direct caller checks them with
:func:`st_weince.functional.check_scores` and ``every_row_has_positive=True``), the moving average is updated with
``torch.where``, so a step compiles with ``torch.compile(fullgraph=True)``. Computed in the scores' dtype,
float16/bfloat16 in float32.

Under data parallelism the batch tail index is taken over the global batch: each process computes
:func:`batch_negative_tail` on its rows (``global_entries`` = the score entries of all processes), the processes
exchange the results, and :func:`batch_tail_fit` fits ``BatchTail.cat`` of them, which equals the single-process fit.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from st_weince.functional.checks import check_score_shapes, compute_dtype
from st_weince.functional.weince import (
    BETA_AUTO_RANGE,
    WeinceOptions,
    WeinceStatistics,
    _fit_design,
    _fit_lines,
    check_scale,
    weince_cross_entropy,
)
from st_weince.utils.options import real_option

# Fewer negatives than this in the whole batch: no fit, the moving average keeps its value.
MIN_BATCH_TAIL_POINTS = 10
_MIN_SUM_OF_SQUARES = 1e-12


def _integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True)
class TopMOptions:
    """The options of the two top-M terms and of the batch tail index: the one source of their defaults (the
    released implementation's, docs/algorithms.md 1.2b) and of their validation, with errors naming the option.

    Args:
        top_m: M, the number of hardest negatives per anchor (an integer >= 1); a row with K negatives uses
            ``min(M, K - 1)`` of them.
        top_m_shortfall_weight: weight of the top-M shortfall term (>= 0; 0 = off; released: 0.5).
        top_m_infonce_weight: weight of the top-M InfoNCE term (>= 0; 0 = off; released: 0.5).
        beta_ema_start: start value of the moving average of the batch tail index (> 0).
        beta_ema_momentum: weight of the previous value in the moving average, in [0, 1).
        beta_min_r_squared: a fit is trusted only when its R^2 reaches this, in [0, 1].
        beta_min, beta_max: a trusted slope is clamped to [beta_min, beta_max] before it enters the average.
        beta_tail_min_points, beta_tail_frac: the tail size ``k = min(K_all, max(beta_tail_min_points,
            floor(beta_tail_frac * K_all)))`` over the batch's K_all negative scores.
        eps: floor of the shortfall ``1 - s``, in (0, 0.5) (the same default as WEINCE's).
    """

    top_m: int = 50
    top_m_shortfall_weight: float = 0.0
    top_m_infonce_weight: float = 0.0
    beta_ema_start: float = 4.0
    beta_ema_momentum: float = 0.9
    beta_min_r_squared: float = 0.85
    beta_min: float = BETA_AUTO_RANGE[0]
    beta_max: float = BETA_AUTO_RANGE[1]
    beta_tail_min_points: int = 1024
    beta_tail_frac: float = 0.05
    eps: float = WeinceOptions.eps

    def __post_init__(self) -> None:
        def store(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        store("top_m", _integer("top_m", self.top_m, 1))
        for name in ("top_m_shortfall_weight", "top_m_infonce_weight"):
            store(name, real_option(name, getattr(self, name)))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns the term off), got {getattr(self, name)}")
        store("beta_ema_start", real_option("beta_ema_start", self.beta_ema_start, positive=True))
        store("beta_ema_momentum", real_option("beta_ema_momentum", self.beta_ema_momentum))
        if not 0.0 <= self.beta_ema_momentum < 1.0:
            raise ValueError(f"beta_ema_momentum must lie in [0, 1), got {self.beta_ema_momentum}")
        store("beta_min_r_squared", real_option("beta_min_r_squared", self.beta_min_r_squared))
        if not 0.0 <= self.beta_min_r_squared <= 1.0:
            raise ValueError(f"beta_min_r_squared must lie in [0, 1], got {self.beta_min_r_squared}")
        store("beta_min", real_option("beta_min", self.beta_min, positive=True))
        store("beta_max", real_option("beta_max", self.beta_max, positive=True))
        if self.beta_min > self.beta_max:
            raise ValueError(f"beta_min ({self.beta_min}) must not exceed beta_max ({self.beta_max})")
        store("beta_tail_min_points", _integer("beta_tail_min_points", self.beta_tail_min_points, 1))
        store("beta_tail_frac", real_option("beta_tail_frac", self.beta_tail_frac))
        if not 0.0 < self.beta_tail_frac <= 1.0:
            raise ValueError(f"beta_tail_frac must lie in (0, 1], got {self.beta_tail_frac}")
        store("eps", real_option("eps", self.eps))
        if not 0.0 < self.eps < 0.5:
            raise ValueError(f"eps must lie in (0, 0.5), got {self.eps}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> TopMOptions:
        """A copy with ``changes`` applied (validated like the constructor)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown top-M option(s) {sorted(unknown)}; valid: {[f.name for f in fields(self)]}")
        return TopMOptions(**{**self.as_dict(), **changes})


TOP_M_DEFAULTS = TopMOptions()


def _resolve(options: TopMOptions | None, overrides: dict[str, Any]) -> TopMOptions:
    if options is not None and not isinstance(options, TopMOptions):
        raise TypeError(f"options must be a TopMOptions, got {type(options).__name__}")
    options = options or TOP_M_DEFAULTS
    return options.replace(**overrides) if overrides else options


def _negative_mask(scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None) -> Tensor:
    """[A, C] bool: valid entries other than the row's positive (a row with positive -1 keeps all valid entries)."""
    columns = torch.arange(scores.shape[1], device=scores.device)
    negative = columns[None, :] != positive_index[:, None]
    return negative if valid_mask is None else negative & valid_mask


# --------------------------------------------------------------------------------------------- top-M terms


def top_m_negatives(
    scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None, *, top_m: int = TOP_M_DEFAULTS.top_m
) -> tuple[Tensor, Tensor, Tensor]:
    """The positive score [A] and the M hardest negative scores [A, M'] of each row (descending) with a mask
    [A, M'] of the ones used: ``min(M, K - 1)`` per row with K negatives. ``M' = min(M, C - 2)`` comes from the
    shape; unused positions hold 0. Gradient flows to the selected scores. In the scores' dtype (half: float32).
    """
    top_m = _integer("top_m", top_m, 1)
    s = scores.to(compute_dtype(scores))
    positive = s.gather(1, positive_index.clamp_min(0)[:, None]).squeeze(1)
    width = max(min(top_m, s.shape[1] - 2), 0)
    if width == 0:  # at most one negative per row: K - 1 = 0 hard negatives
        empty = s.new_zeros((s.shape[0], 0))
        return positive, empty, empty.bool()
    negative = _negative_mask(s, positive_index, valid_mask)
    values = s.masked_fill(~negative, float("-inf")).topk(width, dim=1, sorted=True).values
    per_row = (negative.sum(1) - 1).clamp(0, top_m)
    used = torch.arange(width, device=s.device)[None, :] < per_row[:, None]
    return positive, torch.where(used, values, torch.zeros_like(values)), used


def _cross_entropy_first(positive_logit: Tensor, negative_logits: Tensor, used: Tensor) -> Tensor:
    """Per-row cross-entropy with the first logit (the positive) as the target; unused negatives excluded."""
    negative_logits = negative_logits.masked_fill(~used, float("-inf"))
    logits = torch.cat([positive_logit[:, None], negative_logits], dim=1)
    return torch.logsumexp(logits, dim=1) - positive_logit


def shortfall_logits(scores: Tensor, beta: Tensor | float, eps: float = TOP_M_DEFAULTS.eps) -> Tensor:
    """``-beta * log(1 - min(s, 1 - eps))``: the pure shortfall ("Weibit") logit, no temperature."""
    return torch.log(torch.rsub(scores.clamp(max=1.0 - eps), 1.0)) * -beta


def top_m_cross_entropies(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    options: TopMOptions | None = None,
    *,
    beta: Tensor | float,
    scale: float,
    **overrides: Any,
) -> tuple[Tensor, Tensor]:
    """Both top-M terms per row, ``(shortfall [A], infonce [A])``, from one selection of the hardest negatives.

    ``beta``: the batch tail index ``beta_t`` (a scalar tensor, no gradient, or a number); ``scale`` = 1 / tau.
    """
    options = _resolve(options, overrides)
    scale = check_scale(scale)
    check_score_shapes(scores, positive_index, valid_mask)
    positive_index = positive_index.long()  # any integer dtype, as in torch's losses
    positive, negatives, used = top_m_negatives(scores, positive_index, valid_mask, top_m=options.top_m)
    beta = torch.as_tensor(beta, device=positive.device).detach().to(positive.dtype)
    shortfall = _cross_entropy_first(
        shortfall_logits(positive, beta, options.eps), shortfall_logits(negatives, beta, options.eps), used
    )
    infonce = _cross_entropy_first(positive * scale, negatives * scale, used)
    return shortfall, infonce


def top_m_shortfall_cross_entropy(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    options: TopMOptions | None = None,
    *,
    beta: Tensor | float,
    **overrides: Any,
) -> Tensor:
    """Per-row [A] cross-entropy of the shortfall logits over [positive] + the M hardest negatives, target the
    positive (``L_weibit_topM`` of docs/algorithms.md 1.2b)."""
    options = _resolve(options, overrides)
    check_score_shapes(scores, positive_index, valid_mask)
    positive_index = positive_index.long()  # any integer dtype, as in torch's losses
    positive, negatives, used = top_m_negatives(scores, positive_index, valid_mask, top_m=options.top_m)
    beta = torch.as_tensor(beta, device=positive.device).detach().to(positive.dtype)
    return _cross_entropy_first(
        shortfall_logits(positive, beta, options.eps), shortfall_logits(negatives, beta, options.eps), used
    )


def top_m_infonce_cross_entropy(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    options: TopMOptions | None = None,
    *,
    scale: float,
    **overrides: Any,
) -> Tensor:
    """Per-row [A] InfoNCE over [positive] + the M hardest negatives, logits ``scale * s``, target the positive
    (``L_infonce_topM`` of docs/algorithms.md 1.2b)."""
    options = _resolve(options, overrides)
    scale = check_scale(scale)
    check_score_shapes(scores, positive_index, valid_mask)
    positive_index = positive_index.long()  # any integer dtype, as in torch's losses
    positive, negatives, used = top_m_negatives(scores, positive_index, valid_mask, top_m=options.top_m)
    return _cross_entropy_first(positive * scale, negatives * scale, used)


# --------------------------------------------------------------------------------------------- batch tail index


def batch_tail_size(num_negatives: Tensor | int, options: TopMOptions | None = None) -> Tensor | int:
    """``k = min(K_all, max(beta_tail_min_points, floor(beta_tail_frac * K_all)))`` for an int or a long tensor."""
    options = _resolve(options, {})
    if isinstance(num_negatives, Tensor):
        share = torch.floor(options.beta_tail_frac * num_negatives.double()).long()
        return torch.minimum(num_negatives, share.clamp_min(options.beta_tail_min_points))
    return min(num_negatives, max(options.beta_tail_min_points, int(options.beta_tail_frac * num_negatives)))


@dataclass(frozen=True)
class BatchTail:
    """The smallest shortfalls of a batch's negative scores (no gradient) and how many negatives there were."""

    shortfalls: Tensor  # [L] ascending, max(1 - s, eps); +inf beyond the last negative
    num_negatives: Tensor  # scalar long: K_all

    @staticmethod
    def cat(parts: list[BatchTail]) -> BatchTail:
        """Several processes' (or candidate groups') tails as one: the fit of the union of their rows."""
        return BatchTail(
            shortfalls=torch.cat([p.shortfalls for p in parts]),
            num_negatives=torch.stack([p.num_negatives for p in parts]).sum(),
        )


@torch.no_grad()
def batch_negative_tail(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    options: TopMOptions | None = None,
    *,
    global_entries: int | None = None,
    **overrides: Any,
) -> BatchTail:
    """The smallest shortfalls ``max(1 - s, eps)`` over ALL negative scores of these rows (self-pairs, positives and
    masked entries excluded), as many as the tail of the global batch can need.

    ``global_entries``: the number of score entries of the global batch (default: this matrix's), so that under data
    parallelism each process keeps enough of its shortfalls for the global fit. A row with positive -1 contributes
    all its valid entries.
    """
    options = _resolve(options, overrides)
    check_score_shapes(scores, positive_index, valid_mask)
    positive_index = positive_index.long()  # any integer dtype, as in torch's losses
    entries = scores.numel()
    global_entries = entries if global_entries is None else _integer("global_entries", global_entries, entries)
    keep = min(entries, batch_tail_size(global_entries, options))
    s = scores.detach().to(compute_dtype(scores))
    negative = _negative_mask(s, positive_index, valid_mask)
    shortfall = torch.rsub(s, 1.0).clamp_min_(options.eps).masked_fill_(~negative, float("inf"))
    smallest = shortfall.reshape(-1).topk(keep, largest=False, sorted=True).values
    return BatchTail(shortfalls=smallest, num_negatives=negative.sum())


@dataclass(frozen=True)
class BatchTailFit:
    """The batch's Weibull line fit (no gradient): slope (clamped at >= 0), R^2, points, and the verdict."""

    slope: Tensor  # scalar: least-squares slope of log F_r on log d_r, clamped at >= 0; 0 when there is no fit
    r_squared: Tensor  # scalar in [0, 1]; 0 when there is no fit
    tail_size: Tensor  # scalar long: k
    fitted: Tensor  # scalar bool: at least MIN_BATCH_TAIL_POINTS negatives
    trusted: Tensor  # scalar bool: fitted, R^2 >= beta_min_r_squared and slope > 0


@torch.no_grad()
def batch_tail_fit(tail: BatchTail, options: TopMOptions | None = None, **overrides: Any) -> BatchTailFit:
    """Fit ``log F_r ~ a + slope * log d_r`` on the k smallest shortfalls (sorted ascending, ``F_r = r / (k + 1)``,
    the first ``max(1, floor(k / 20))`` dropped) and its R^2 (docs/algorithms.md 1.2b). Shortfalls whose log spreads by
    no more than rounding give slope 0 (no tail shape), hence an untrusted fit."""
    options = _resolve(options, overrides)
    shortfalls = torch.sort(tail.shortfalls).values  # the parts of a concatenated tail are each sorted only
    length = shortfalls.shape[0]
    if length == 0:
        zero = shortfalls.new_zeros(())
        no = torch.zeros((), dtype=torch.bool, device=shortfalls.device)
        return BatchTailFit(zero, zero, tail.num_negatives.clamp_max(0), no, no)
    dtype = shortfalls.dtype
    k = batch_tail_size(tail.num_negatives, options).clamp_max(length)
    burn_in, weight, (log_cdf, _) = _fit_design(k[None], length, dtype)
    n = weight.sum(1, keepdim=True).clamp_min(1.0)
    x = torch.log(torch.where(weight[0] > 0, shortfalls, torch.ones_like(shortfalls)))[None]
    ((slope, sse),), degenerate = _fit_lines(x, (log_cdf,), weight, n, burn_in.clamp_max(length - 1)[:, None])
    total = (log_cdf * log_cdf).sum(1).clamp_min(_MIN_SUM_OF_SQUARES)
    fitted = k >= MIN_BATCH_TAIL_POINTS
    shaped = fitted & ~degenerate[0]
    slope = torch.where(shaped, slope[0].clamp_min(0.0), torch.zeros_like(slope[0]))
    r_squared = torch.where(shaped, (1.0 - sse[0] / total[0]).clamp(0.0, 1.0), torch.zeros_like(slope))
    trusted = shaped & (r_squared >= options.beta_min_r_squared) & (slope > 0)
    return BatchTailFit(slope=slope, r_squared=r_squared, tail_size=k, fitted=fitted, trusted=trusted)


@torch.no_grad()
def update_beta_ema(
    beta_ema: Tensor, fit: BatchTailFit, options: TopMOptions | None = None, **overrides: Any
) -> Tensor:
    """The new moving average (a tensor in ``beta_ema``'s dtype, no host sync):
    ``momentum * beta_ema + (1 - momentum) * clamp(slope, beta_min, beta_max)`` when the fit is trusted, else
    ``beta_ema`` unchanged. The batch's ``beta_t`` is the returned value."""
    options = _resolve(options, overrides)
    if not isinstance(beta_ema, Tensor):
        raise TypeError(f"beta_ema must be a tensor (the state the caller keeps), got {type(beta_ema).__name__}")
    momentum = options.beta_ema_momentum
    clamped = fit.slope.to(beta_ema.dtype).clamp(options.beta_min, options.beta_max)
    updated = beta_ema * momentum + clamped * (1.0 - momentum)
    return torch.where(fit.trusted, updated, beta_ema)


def initial_beta_ema(
    options: TopMOptions | None = None, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The moving average's start value as a scalar tensor (a buffer's initial value)."""
    return torch.tensor(_resolve(options, {}).beta_ema_start, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------- the composite


@dataclass(frozen=True)
class CompositeLoss:
    """The composite's total and its terms (each a mean over anchors; None where its weight is 0)."""

    total: Tensor
    blend: Tensor
    top_m_shortfall: Tensor | None
    top_m_infonce: Tensor | None
    top_m_shortfall_weight: float
    top_m_infonce_weight: float

    def shares(self) -> dict[str, Tensor]:
        """Each weighted term's share of the total (detached device tensors: no host sync)."""
        total = self.total.detach()
        shares = {"blend": self.blend.detach() / total}
        if self.top_m_shortfall is not None:
            shares["top_m_shortfall"] = self.top_m_shortfall_weight * self.top_m_shortfall.detach() / total
        if self.top_m_infonce is not None:
            shares["top_m_infonce"] = self.top_m_infonce_weight * self.top_m_infonce.detach() / total
        return shares


def composite_loss(
    blend: Tensor,
    top_m_shortfall: Tensor | None = None,
    top_m_infonce: Tensor | None = None,
    options: TopMOptions | None = None,
    **overrides: Any,
) -> CompositeLoss:
    """``blend + top_m_shortfall_weight * top_m_shortfall + top_m_infonce_weight * top_m_infonce``.

    A term whose weight is 0 is left out (not multiplied by 0), so with both weights 0 the total IS ``blend``.
    A term with a positive weight must be given.
    """
    options = _resolve(options, overrides)
    total = blend
    terms = {}
    for name, term, weight in (
        ("top_m_shortfall", top_m_shortfall, options.top_m_shortfall_weight),
        ("top_m_infonce", top_m_infonce, options.top_m_infonce_weight),
    ):
        if weight == 0.0:
            terms[name] = None
            continue
        if term is None:
            raise ValueError(f"{name}_weight is {weight}, but no {name} term was given")
        terms[name] = term
        total = total + weight * term
    return CompositeLoss(
        total=total,
        blend=blend,
        top_m_shortfall=terms["top_m_shortfall"],
        top_m_infonce=terms["top_m_infonce"],
        top_m_shortfall_weight=options.top_m_shortfall_weight,
        top_m_infonce_weight=options.top_m_infonce_weight,
    )


@dataclass(frozen=True)
class CompositeStep:
    """One step of the composite: the loss and its terms, the new moving average (= this batch's beta_t), the fit."""

    loss: CompositeLoss
    beta_ema: Tensor
    fit: BatchTailFit


def composite_cross_entropy(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    beta_ema: Tensor,
    *,
    scale: float,
    weince_options: WeinceOptions | None = None,
    top_m_options: TopMOptions | None = None,
    statistics: WeinceStatistics | None = None,
) -> CompositeStep:
    """The released composite on one (scores, positive_index, valid_mask) triple: the blended cross-entropy
    (section 1.2 with ``weince_options`` and ``scale``), the batch tail index updated from these scores,
    and the top-M terms with that ``beta_t``. Terms with weight 0 are not computed; the tail index is updated
    only when the shortfall term is on (it is its only user).

    For one process and one candidate group; a loss class that gathers across processes or has several candidate
    groups calls the pieces (:func:`batch_negative_tail`, ``BatchTail.cat``, :func:`batch_tail_fit`,
    :func:`update_beta_ema`, :func:`top_m_cross_entropies`, :func:`composite_loss`) itself.
    """
    options = _resolve(top_m_options, {})
    scale = check_scale(scale)
    blend = weince_cross_entropy(
        scores,
        positive_index,
        valid_mask,
        weince_options,
        scale=scale,
        statistics=statistics,
        check_inputs=False,  # shapes only, like every piece here; values: check_scores (module docstring)
    )
    if options.top_m_shortfall_weight > 0:
        fit = batch_tail_fit(batch_negative_tail(scores, positive_index, valid_mask, options), options)
        beta_ema = update_beta_ema(beta_ema, fit, options)
    else:
        zero = torch.zeros((), device=scores.device)
        fit = BatchTailFit(zero, zero, zero.long(), zero.bool(), zero.bool())
    shortfall = infonce = None
    if options.top_m_shortfall_weight > 0 or options.top_m_infonce_weight > 0:
        shortfall_rows, infonce_rows = top_m_cross_entropies(
            scores, positive_index, valid_mask, options, beta=beta_ema, scale=scale
        )
        shortfall, infonce = shortfall_rows.mean(), infonce_rows.mean()
    return CompositeStep(loss=composite_loss(blend, shortfall, infonce, options), beta_ema=beta_ema, fit=fit)
