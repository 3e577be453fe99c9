"""WEINCE (Weibull-enhanced InfoNCE) as pure functions on score matrices.

Data flows one way: scores -> per-anchor tail fits -> batch pivot -> blend weights -> logits -> cross-entropy.
Every adapter (sentence-transformers losses, the vision recipe, the diagnostics) calls these functions, so each
formula of ``docs/algorithms.md`` section 1 lives here exactly once, and the nine options live in one place,
:class:`WeinceOptions`.

Conventions
-----------
``scores``          [A, C] cosine similarities of A anchors (rows) against C candidates (columns).
``positive_index``  [A] long, the column of each anchor's positive, or -1 for a row without a positive in this block
                    (e.g. the ``query_to_query`` direction of MultipleNegativesRankingLoss).
``valid_mask``      [A, C] bool, False for entries that are no candidate at all (self-pairs, masked documents).
Negatives of a row are its valid entries other than its positive.

Hot path: no function here reads a device value on the host. Shapes decide every Python branch (the largest tail
size comes from the number of columns) and only shapes are checked, so the loss compiles with
``torch.compile(fullgraph=True)``; the values are checked once where a loss receives its inputs, or by
:func:`st_weince.functional.check_scores` for direct callers.

Dtypes: the statistics and the logits are computed in the scores' dtype, float16/bfloat16 in float32.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor

from st_weince.functional.checks import check_score_shapes, check_scores, compute_dtype
from st_weince.utils.options import check_representable, real_option

WeinceMode = Literal["both", "rho", "aic", "none"]
# "none": lambda = 0 for every anchor, i.e. exactly InfoNCE / MNRL through the same code path (the control arm of a
# comparison that keeps everything else, e.g. the false-negative guard, identical).
WEINCE_MODES = ("both", "rho", "aic", "none")
BETA_AUTO_RANGE = (0.5, 16.0)
# A wrong-signed slope disqualifies its line by this residual penalty (reference implementation).
_WRONG_SIGN_PENALTY = 1e6
_MIN_SSE = 1e-12
_MIN_FIT_POINTS = 3
# A tail whose log-shortfalls spread less than this many units of rounding (RMS, relative to their size) has no
# shape: its line fits are rounding noise (equal scores of 0.92 everywhere would otherwise give lambda 1.0).
_DEGENERATE_SPREAD_ULPS = 16.0



def _real(name: str, value: Any, positive: bool = False) -> float:
    """``value`` as a finite Python float, also finite in float32 (the dtype the statistics and logits are computed
    in for float32 and half-precision inputs); bools, strings, tensors and non-finite numbers are refused by name."""
    return real_option(name, value, positive=positive, dtype=torch.float32)


def check_scale(scale: Any, name: str = "scale") -> float:
    """``scale = 1 / temperature`` as a float: a number > 0, finite and nonzero in float32 (the error names
    ``name``)."""
    value = real_option(name, scale)
    if not value > 0:
        raise ValueError(f"{name} must be > 0 ({name} = 1 / temperature), got {value}")
    return _real(name, value, positive=True)


@dataclass(frozen=True)
class WeinceOptions:
    """The nine WEINCE options: the one source of their defaults (the released implementation's) and validation.

    Built once (by the loss classes in ``__init__``); every field is checked here, with an error naming the field.
    Numbers may be any real (Python or NumPy) number and are stored as Python ``float`` / ``int``; bools, strings
    (other than ``beta="auto"``) and non-finite values are refused.

    Args:
        q: quantile of the hardest-negative shortfalls that defines the batch pivot ``rho0``, in [0, 1].
        kappa_rho: slope of the hardness gate, >= 0.
        kappa_aic: slope of the geometry (AIC) gate, >= 0.
        aic_margin: AIC difference at which the geometry gate is one half (any finite number).
        tail_frac: share of an anchor's negatives used for the tail fit, in (0, 1].
        min_tail_points: minimum tail size, an integer >= 1.
        eps: floor of the shortfall ``1 - s``, in (0, 0.5).
        mode: "both" (hardness x geometry), "rho" (hardness only), "aic" (geometry only) or "none" (lambda = 0:
            exactly InfoNCE / MNRL through the same code path, the control arm of a comparison).
        beta: tail index of the shortfall logit, a finite number > 0, or "auto" (each anchor's estimate, clamped
            to [0.5, 16]). The reference implementation uses 1.0.
    """

    q: float = 0.2
    kappa_rho: float = 10.0
    kappa_aic: float = 1.0
    aic_margin: float = 2.0
    tail_frac: float = 0.10
    min_tail_points: int = 32
    eps: float = 1e-6
    mode: WeinceMode = "both"
    beta: float | str = 1.0

    def __post_init__(self) -> None:
        def store(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        store("q", _real("q", self.q))
        if not 0.0 <= self.q <= 1.0:
            raise ValueError(f"q must lie in [0, 1], got {self.q}")
        for name in ("kappa_rho", "kappa_aic"):
            store(name, _real(name, getattr(self, name)))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        store("aic_margin", _real("aic_margin", self.aic_margin))
        store("tail_frac", _real("tail_frac", self.tail_frac))
        if not 0.0 < self.tail_frac <= 1.0:
            raise ValueError(f"tail_frac must lie in (0, 1], got {self.tail_frac}")
        points = self.min_tail_points
        if isinstance(points, bool) or not isinstance(points, numbers.Integral):
            raise TypeError(f"min_tail_points must be an integer, got {type(points).__name__} {points!r}")
        store("min_tail_points", int(self.min_tail_points))
        if self.min_tail_points < 1:
            raise ValueError(f"min_tail_points must be at least 1, got {self.min_tail_points}")
        store("eps", _real("eps", self.eps))
        if not 0.0 < self.eps < 0.5:
            raise ValueError(f"eps must lie in (0, 0.5), got {self.eps}")
        check_representable("eps", self.eps, torch.float32, positive=True)  # log(eps) must stay finite
        if not isinstance(self.mode, str):
            raise TypeError(f"mode must be 'both', 'rho', 'aic' or 'none', got {type(self.mode).__name__}")
        if self.mode not in WEINCE_MODES:
            raise ValueError(f"mode must be 'both', 'rho', 'aic' or 'none', got {self.mode!r}")
        if isinstance(self.beta, str):
            if self.beta != "auto":
                raise ValueError(f"beta must be a positive number or 'auto', got {self.beta!r}")
        else:
            try:
                beta = _real("beta", self.beta)
            except (TypeError, ValueError) as error:
                raise type(error)(f"{error} (beta must be a finite number > 0 or 'auto')") from None
            if not beta > 0:
                raise ValueError(f"beta must be a positive number or 'auto', got {beta}")
            check_representable("beta", beta, torch.float32, positive=True)
            store("beta", beta)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> WeinceOptions:
        """A copy with ``changes`` applied (validated like the constructor)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown WEINCE option(s) {sorted(unknown)}; valid: {[f.name for f in fields(self)]}")
        return WeinceOptions(**{**self.as_dict(), **changes})


DEFAULTS = WeinceOptions()


def resolve_options(options: WeinceOptions | None, overrides: dict[str, Any]) -> WeinceOptions:
    """``options`` (default: the defaults) with keyword ``overrides`` applied."""
    if options is not None and not isinstance(options, WeinceOptions):
        raise TypeError(f"options must be a WeinceOptions, got {type(options).__name__}")
    options = options or DEFAULTS
    return options.replace(**overrides) if overrides else options


@dataclass(frozen=True)
class TailFit:
    """Per-anchor results of the tail fits (no gradient), in the statistics dtype."""

    rho: Tensor  # [A] shortfall 1 - s of the hardest negative, at least eps; 1.0 where a row has no negative
    beta_hat: Tensor  # [A] slope of the Weibull line (estimated tail index); 0.0 where not fitted or degenerate
    delta_aic: Tensor  # [A] AIC_Gumbel - AIC_Weibull; 0.0 where not fitted or degenerate (no tail shape)
    fitted: Tensor  # [A] bool: at least 3 tail points after the burn-in
    has_negatives: Tensor  # [A] bool: at least one negative

    @staticmethod
    def cat(parts: list[TailFit]) -> TailFit:
        """Row chunks' fits, concatenated in order."""
        return TailFit(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(TailFit)))


@dataclass(frozen=True)
class WeinceStatistics:
    """Everything the WEINCE logit needs, per anchor; computed without gradient, in the statistics dtype."""

    lam: Tensor  # [A] blend weight in [0, 1); 0 gives InfoNCE
    beta: Tensor  # [A] tail index used in the shortfall logit
    rho: Tensor  # [A]
    delta_aic: Tensor  # [A]
    rho0: Tensor  # scalar batch pivot
    beta_hat: Tensor  # [A] raw estimate (before clamping)
    fitted: Tensor  # [A] bool


def _count_negatives(positive_index: Tensor | None, valid_mask: Tensor | None, shape: torch.Size, device) -> Tensor:
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


def _top_negative_scores(
    scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None, k_max: int
) -> Tensor:
    """The k_max largest negative scores of each row, descending, padded with -inf (no gradient, scores' dtype).

    Takes the top k_max + 1 of the row and drops the positive among them (by column, so ties cannot confuse it),
    instead of masking a full copy of the matrix. A row without a positive (-1) keeps its top k_max.
    """
    scores = scores.detach()
    if valid_mask is not None:
        scores = scores.masked_fill(~valid_mask, float("-inf"))
    if positive_index is None:
        return scores.topk(k_max, dim=1).values
    values, columns = scores.topk(min(k_max + 1, scores.shape[1]), dim=1, sorted=True)
    # Drop the positive without re-sorting: position j takes the value at j, or at j + 1 once the positive has been
    # passed. A row whose positive is not among its top k_max + 1 (or that has none) keeps its first k_max values.
    width = values.shape[1]
    passed = (columns[:, :k_max] == positive_index[:, None]).cumsum(dim=1)
    positions = torch.arange(k_max, device=scores.device)[None, :] + passed
    beyond = positions >= width  # only when the row has no k_max-th negative (k_max = number of columns)
    return values.gather(1, positions.clamp_max_(width - 1)).masked_fill_(beyond, float("-inf"))


def tail_sizes(num_negatives: Tensor, *, tail_frac: float, min_tail_points: int) -> Tensor:
    """Tail size k per anchor from its number of negatives K (docs/algorithms.md 1.1 step 1)."""
    k = torch.clamp(torch.round(tail_frac * num_negatives.double()).long(), min=min_tail_points)
    k = torch.minimum(k, num_negatives)
    k = torch.clamp(k, min=10)
    return torch.minimum(k, num_negatives)


def max_tail_size(num_candidates: int, options: WeinceOptions) -> int:
    """The largest tail size any row of ``num_candidates`` columns can have (k is non-decreasing in K <= C)."""
    # the formula of tail_sizes in plain Python: shapes decide, no tensor is read
    k = min(max(options.min_tail_points, round(options.tail_frac * num_candidates)), num_candidates)
    return min(max(10, k), num_candidates)


def _fit_design(sizes: Tensor, k_max: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """For tail sizes ``sizes`` [R]: the burn-in b [R], the 0/1 weights [R, k_max] of the fitted ranks (b, k] and
    the centred responses of both lines at those ranks (zero elsewhere): log F_r (Weibull) and log(-log F_r)
    (Gumbel proxy), F_r = r / (k + 1)."""
    sizes = sizes[:, None]
    rank = torch.arange(1, k_max + 1, device=sizes.device, dtype=dtype)[None, :]
    burn_in = torch.clamp(torch.div(sizes, 20, rounding_mode="floor"), min=1)
    used = (rank <= sizes) & (rank > burn_in)
    weight = used.to(dtype)
    n = weight.sum(1, keepdim=True).clamp_min(1.0)
    # positions outside the fit get a harmless 0.5 so no NaN enters the sums
    log_cdf = torch.log(torch.where(used, rank / (sizes.to(dtype) + 1.0), 0.5))
    centred = tuple((y - (y * weight).sum(1, keepdim=True) / n) * weight for y in (log_cdf, torch.log(-log_cdf)))
    return burn_in.squeeze(1), weight, centred


def _row_design(k: Tensor, k_max: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """:func:`_fit_design` for each row's tail size. The design depends on k only, so when there are more rows
    than possible sizes it is computed once per size ([k_max + 1, k_max]) and each row picks its size's row, which
    saves about 15 passes over the [A, k_max] tails; otherwise (e.g. the small row chunks of a cached loss, where
    that table would grow quadratically with the batch) per row. Both give identical values."""
    if k_max + 1 > k.shape[0]:
        return _fit_design(k, k_max, dtype)
    burn_in, weight, centred = _fit_design(torch.arange(k_max + 1, device=k.device), k_max, dtype)
    return burn_in[k], weight.index_select(0, k), tuple(table.index_select(0, k) for table in centred)


def _fit_lines(
    x: Tensor, centred_ys: tuple[Tensor, ...], weight: Tensor, n: Tensor, first_used: Tensor
) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Row-wise least squares y ~ a + slope * x for several y on the same x, over the points with weight 1.

    ``x`` and ``weight`` are [A, k] (x finite everywhere), ``centred_ys`` the responses already centred over the
    used points and zero elsewhere, ``n`` [A, 1] the points per row, ``first_used`` [A, 1] the position of each
    row's first used point. Returns (slope, residual sum of squares) per y and the rows whose x has no spread
    (``degenerate``, slope 0).

    x is shifted by one of its own points before centring, so equal x give exactly zero deviations, and a row is
    degenerate when the RMS deviation is below a few units of rounding of x's magnitude (a relative threshold,
    valid in every dtype). Residuals are summed directly, not as syy - sxy^2 / sxx, which cancels in float32.
    """
    reference = x.gather(1, first_used)
    xs = (x - reference).mul_(weight)
    xc = (xs - xs.sum(1, keepdim=True) / n).mul_(weight)
    sxx = (xc * xc).sum(1)
    resolution = _DEGENERATE_SPREAD_ULPS * torch.finfo(x.dtype).eps * reference.squeeze(1).abs()
    degenerate = sxx <= n.squeeze(1) * resolution * resolution
    sxx_safe = torch.where(degenerate, torch.ones_like(sxx), sxx)
    fits = []
    for yc in centred_ys:
        slope = torch.where(degenerate, torch.zeros_like(sxx), (xc * yc).sum(1) / sxx_safe)
        residual = torch.addcmul(yc, xc, slope[:, None], value=-1.0)
        fits.append((slope, (residual * residual).sum(1)))
    return fits, degenerate


@torch.no_grad()
def weince_tail_fit(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None = None,
    options: WeinceOptions | None = None,
    **overrides: Any,
) -> TailFit:
    """Per-anchor shortfall tail fits (docs/algorithms.md 1.1 steps 1-4), vectorised over anchors, in the scores'
    dtype (float16/bfloat16: float32). Shapes are checked, values are not (:func:`check_scores`)."""
    if isinstance(valid_mask, WeinceOptions):
        raise TypeError("valid_mask got a WeinceOptions: pass the options as options=... (the fourth argument)")
    options = resolve_options(options, overrides)
    check_score_shapes(scores, positive_index, valid_mask)
    positive_index = None if positive_index is None else positive_index.long()
    dtype = compute_dtype(scores)
    device = scores.device
    num_negatives = _count_negatives(positive_index, valid_mask, scores.shape, device)
    k = tail_sizes(num_negatives, tail_frac=options.tail_frac, min_tail_points=options.min_tail_points)
    k_max = max(max_tail_size(scores.shape[1], options), 1)
    has_negatives = num_negatives > 0

    top = _top_negative_scores(scores, positive_index, valid_mask, k_max).to(dtype)
    # Shortfalls of the sorted tail; the -inf padding of rows with fewer than k_max negatives gives +inf, whose log
    # is set to 0 so that no inf or NaN enters the (weighted) sums.
    shortfall = torch.rsub(top, 1.0).clamp_min_(options.eps)
    rho = torch.where(has_negatives, shortfall[:, 0], 1.0)
    log_shortfall = torch.log(shortfall).nan_to_num_(posinf=0.0)

    burn_in, weight, centred = _row_design(k, k_max, dtype)
    n = (k - burn_in).clamp_min(0)
    fitted = n >= _MIN_FIT_POINTS
    n_safe = n.clamp_min(1).to(dtype)[:, None]
    ((beta_hat, sse_weibull), (gumbel_slope, sse_gumbel)), degenerate = _fit_lines(
        log_shortfall, centred, weight, n_safe, burn_in.clamp_max(k_max - 1)[:, None]
    )
    sse_weibull = (sse_weibull + _WRONG_SIGN_PENALTY * (beta_hat <= 0)).clamp_min(_MIN_SSE)
    sse_gumbel = (sse_gumbel + _WRONG_SIGN_PENALTY * (gumbel_slope >= 0)).clamp_min(_MIN_SSE)
    # AIC_G - AIC_W = n log(SSE_G / n) - n log(SSE_W / n); the +4 of both cancel.
    delta_aic = n_safe.squeeze(1) * (torch.log(sse_gumbel) - torch.log(sse_weibull))
    shaped = fitted & ~degenerate
    zero = torch.zeros_like(rho)
    return TailFit(
        rho=rho,
        beta_hat=torch.where(shaped, beta_hat, zero),
        delta_aic=torch.where(shaped, delta_aic, zero),
        fitted=fitted,
        has_negatives=has_negatives,
    )


@torch.no_grad()
def batch_pivot(rho: Tensor, has_negatives: Tensor, q: float = DEFAULTS.q) -> Tensor:
    """``rho0``: the q-quantile of rho over the anchors that have negatives (sort ascending, index round(q (A-1))).

    Sort plus gather, no boolean-mask indexing: rows without negatives sort last (+inf) and the index counts only
    the others. 1.0 when no anchor has a negative. Pass the rho of the whole (global) batch: under data
    parallelism, gather first, so the pivot does not depend on how the batch is split over processes.
    """
    q = WeinceOptions(q=q).q  # validated like the option
    pool = torch.sort(torch.where(has_negatives, rho, float("inf"))).values
    count = has_negatives.sum()
    # round half to even, like Python's round() in the reference implementation
    index = torch.round(q * (count - 1).clamp_min(0).double()).long().clamp(0, rho.numel() - 1)
    return torch.where(count > 0, pool.gather(0, index[None])[0], torch.ones((), dtype=rho.dtype, device=rho.device))


@torch.no_grad()
def blend_weights(fit: TailFit, rho0: Tensor | float, options: WeinceOptions | None = None, **overrides: Any) -> Tensor:
    """lambda(a) = sigmoid(kappa_rho log(rho0 / rho)) * sigmoid(kappa_aic (dAIC - margin)); 0 where not fitted."""
    options = resolve_options(options, overrides)
    rho0 = torch.as_tensor(rho0, dtype=fit.rho.dtype, device=fit.rho.device)
    hardness = torch.sigmoid(options.kappa_rho * (torch.log(rho0) - torch.log(fit.rho)))
    geometry = torch.sigmoid(options.kappa_aic * (fit.delta_aic - options.aic_margin))
    if options.mode == "both":
        lam = hardness * geometry
    elif options.mode == "rho":
        lam = hardness
    elif options.mode == "aic":
        lam = geometry
    else:  # "none": InfoNCE
        lam = torch.zeros_like(hardness)
    return torch.where(fit.fitted, lam, torch.zeros_like(lam))


def tail_index(fit: TailFit, beta: float | str = DEFAULTS.beta) -> Tensor:
    """beta(a) in the shortfall logit: a constant (reference implementation: 1.0) or "auto", the clamped estimate."""
    beta = WeinceOptions(beta=beta).beta
    if beta == "auto":
        low, high = BETA_AUTO_RANGE
        return torch.where(fit.fitted, fit.beta_hat.clamp(low, high), torch.ones_like(fit.beta_hat))
    return torch.full_like(fit.beta_hat, beta)


@torch.no_grad()
def statistics_from_fit(
    fit: TailFit,
    options: WeinceOptions | None = None,
    *,
    rho0: Tensor | float | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> WeinceStatistics:
    """Steps 5-7 of docs/algorithms.md 1.1 on given tail fits: the pivot (over ``gather``'s global batch unless ``rho0``
    is given), the blend weights and the tail index."""
    options = resolve_options(options, {})
    if rho0 is not None and not isinstance(rho0, Tensor):
        # a pivot is a shortfall 1 - s of a cosine score: in (0, 2]; log(rho0) enters lambda
        rho0 = real_option("rho0", rho0, positive=True, dtype=torch.float32)
    if rho0 is None:
        gather = gather or (lambda local: local)
        rho0 = batch_pivot(gather(fit.rho), gather(fit.has_negatives), options.q)
    rho0 = torch.as_tensor(rho0, dtype=fit.rho.dtype, device=fit.rho.device)
    return WeinceStatistics(
        lam=blend_weights(fit, rho0, options),
        beta=tail_index(fit, options.beta),
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
    options: WeinceOptions | None = None,
    *,
    rho0: Tensor | float | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
    **overrides: Any,
) -> WeinceStatistics:
    """Per-anchor WEINCE statistics (no gradient), in the scores' dtype (float16/bfloat16: float32).

    ``options`` (default :data:`DEFAULTS`), with keyword ``overrides`` (e.g. ``beta="auto"``) applied.
    ``rho0`` overrides the batch pivot. ``gather`` maps a per-anchor tensor of this process to the one of the global
    batch (e.g. an all-gather under data parallelism), so that the pivot is taken over every process's anchors.
    """
    options = resolve_options(options, overrides)
    fit = weince_tail_fit(scores, positive_index, valid_mask, options)
    return statistics_from_fit(fit, options, rho0=rho0, gather=gather)


class _BlendedLogit(torch.autograd.Function):
    """l = (1 - lam) s / tau - lam beta log(max(1 - s, eps)) with a hand-written backward.

    ``max(1 - s, eps)`` is ``1 - min(s, 1 - eps)``. Fusing keeps one [A, C] tensor for backward (the shortfall)
    instead of the several intermediates autograd would store, and needs fewer passes over the matrix. Where the
    clamp is active the saved shortfall is +inf, so the shortfall term's slope lam beta / shortfall is exactly 0
    there without a data-dependent branch.
    """

    @staticmethod
    def forward(ctx, scores: Tensor, lam: Tensor, beta: Tensor, scale: float, eps: float) -> Tensor:
        linear_weight = (1.0 - lam) * scale
        shortfall_weight = lam * beta
        shortfall = torch.rsub(scores, 1.0).clamp_min_(eps)
        logits = torch.log(shortfall).mul_(-shortfall_weight).addcmul_(scores, linear_weight)
        torch.threshold_(shortfall, eps, float("inf"))  # one pass: entries at the clamp (<= eps) become +inf
        ctx.save_for_backward(shortfall, linear_weight, shortfall_weight)
        return logits

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        shortfall, linear_weight, shortfall_weight = ctx.saved_tensors
        # d/ds [(1 - lam) s / tau - lam beta log(1 - s)] = (1 - lam) / tau + lam beta / (1 - s) below the cap,
        # and (1 - lam) / tau where the clamp at 1 - eps is active (saved shortfall +inf)
        slope = torch.addcdiv(linear_weight, shortfall_weight, shortfall)
        return slope.mul_(grad_output), None, None, None, None


def weince_logits(
    scores: Tensor,
    lam: Tensor,
    beta: Tensor,
    valid_mask: Tensor | None = None,
    *,
    scale: float,
    eps: float = DEFAULTS.eps,
) -> Tensor:
    """Blended logits (1 - lam) s / tau + lam (-beta log(1 - min(s, 1 - eps))), -inf at invalid entries, with
    ``scale = 1 / tau``.

    In the scores' dtype; float16/bfloat16 (autocast) scores are computed in float32, since the shortfall log
    needs it. Gradient flows through ``scores`` only; ``lam`` and ``beta`` are treated as constants.
    """
    scale = check_scale(scale)
    dtype = compute_dtype(scores)
    s = scores.to(dtype)
    lam = lam.detach().to(dtype)[:, None]
    logits = _BlendedLogit.apply(s, lam, beta.detach().to(dtype)[:, None], scale, float(eps))
    if valid_mask is not None:
        logits = logits.masked_fill(~valid_mask, float("-inf"))
    return logits


class _BlendedCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of the blended logits with the positive as the target, fused with the logit.

    The separate logit + log-sum-exp + gather chain makes autograd run about seven passes over [A, C] in backward;
    fused, the gradient (softmax - one-hot) * dl/ds takes four: dl/ds = (1 - lam) / tau + lam beta / (1 - s) with the
    row's upstream gradient folded into the two per-row weights.

    The loss is ``-log_softmax(l)[pos]``, whose kernel subtracts the row maximum first, not ``logsumexp(l) - l_pos``:
    at an extreme scale (logits of 1e8, whose float32 spacing is 8) the difference of two large numbers would lose
    the ``log K`` of a row of equal logits entirely; shifted, equal logits are exactly 0. It is also one fused kernel,
    and its output, saved for backward, gives the softmax with one ``exp``.
    """

    @staticmethod
    def forward(ctx, scores, lam, beta, positive_index, valid_mask, scale, eps):
        linear_weight = (1.0 - lam) * scale
        shortfall_weight = lam * beta
        shortfall = torch.rsub(scores, 1.0).clamp_min_(eps)
        logits = torch.log(shortfall).mul_(-shortfall_weight).addcmul_(scores, linear_weight)
        torch.threshold_(shortfall, eps, float("inf"))  # entries at the clamp: no shortfall gradient
        if valid_mask is not None:
            logits.masked_fill_(~valid_mask, float("-inf"))
        log_probabilities = torch.log_softmax(logits, dim=1)
        ctx.save_for_backward(log_probabilities, shortfall, linear_weight, shortfall_weight, positive_index)
        return log_probabilities.gather(1, positive_index[:, None]).squeeze(1).neg_()

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        log_probabilities, shortfall, linear_weight, shortfall_weight, positive_index = ctx.saved_tensors
        grad_rows = grad_rows[:, None]
        probabilities = log_probabilities.exp()
        probabilities.scatter_add_(1, positive_index[:, None], -torch.ones_like(grad_rows))
        slope = torch.addcdiv(linear_weight * grad_rows, shortfall_weight * grad_rows, shortfall)
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
    scale = check_scale(scale)
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


def _reduce(values: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    if reduction == "none":
        return values
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def weince_cross_entropy(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    options: WeinceOptions | None = None,
    *,
    scale: float,
    reduction: str = "mean",
    rho0: Tensor | float | None = None,
    statistics: WeinceStatistics | None = None,
    check_inputs: bool = True,
    **overrides: Any,
) -> Tensor:
    """WEINCE loss: cross-entropy of the blended logits of each row with its positive as the target.

    ``statistics`` reuses precomputed statistics of these rows (else they are computed here with ``options``).
    ``positive_index`` may have any integer dtype. Like torch's losses, the values are checked (every score finite,
    every row's positive in range and not masked out: :func:`check_scores` with ``every_row_has_positive=True``),
    with one host-device sync; ``check_inputs=False`` skips that (no sync, so ``torch.compile(fullgraph=True)``
    traces it whole), for inputs already checked, as the loss classes do.
    """
    options = resolve_options(options, overrides)
    scale = check_scale(scale)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    check_score_shapes(scores, positive_index, valid_mask)
    if check_inputs:
        check_scores(scores, positive_index, valid_mask, every_row_has_positive=True)
    positive_index = positive_index.long()
    if statistics is None:
        statistics = weince_statistics(scores, positive_index, valid_mask, options, rho0=rho0)
    rows = blended_cross_entropy(
        scores, statistics.lam, statistics.beta, positive_index, valid_mask, scale=scale, eps=options.eps
    )
    return _reduce(rows, reduction)
