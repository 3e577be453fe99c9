"""WEINCE (Weibull-enhanced InfoNCE) as pure functions on score matrices.

Data flows one way: scores -> per-anchor tail fits -> batch pivot -> blend weights -> logits -> cross-entropy.
Every adapter (sentence-transformers losses, the vision recipe, the diagnostics) calls these functions, so each
formula of ``shared/docs/ALGORITHMS.md`` section 1 lives here exactly once.

Conventions
-----------
``scores``          [A, C] cosine similarities of A anchors (rows) against C candidates (columns).
``positive_index``  [A] long, the column of each anchor's positive, or -1 for a row without a positive in this block
                    (e.g. the ``query_to_query`` direction of MultipleNegativesRankingLoss).
``valid_mask``      [A, C] bool, False for entries that are no candidate at all (self-pairs, masked documents).
Negatives of a row are its valid entries other than its positive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

WeinceMode = Literal["both", "rho", "aic"]

# Defaults of the released reference implementation (ALGORITHMS.md 1.1).
DEFAULT_OPTIONS: dict[str, float | int | str] = {
    "q": 0.2,
    "kappa_rho": 10.0,
    "kappa_aic": 1.0,
    "aic_margin": 2.0,
    "tail_frac": 0.10,
    "min_tail_points": 32,
    "eps": 1e-6,
    "mode": "both",
    "beta": 1.0,
}
BETA_AUTO_RANGE = (0.5, 16.0)
# A wrong-signed slope disqualifies its line by this residual penalty (reference implementation).
_WRONG_SIGN_PENALTY = 1e6
_MIN_SSE = 1e-12
_MIN_FIT_POINTS = 3


@dataclass(frozen=True)
class TailFit:
    """Per-anchor results of the tail fits (no gradient)."""

    rho: Tensor  # [A] shortfall 1 - s of the hardest negative, at least eps; 1.0 where a row has no negative
    beta_hat: Tensor  # [A] slope of the Weibull line (estimated tail index); 0.0 where not fitted
    delta_aic: Tensor  # [A] AIC_Gumbel - AIC_Weibull; 0.0 where not fitted
    fitted: Tensor  # [A] bool: at least 3 tail points after the burn-in
    has_negatives: Tensor  # [A] bool: at least one negative


@dataclass(frozen=True)
class WeinceStatistics:
    """Everything the WEINCE logit needs, per anchor; computed without gradient."""

    lam: Tensor  # [A] blend weight in [0, 1); 0 gives InfoNCE
    beta: Tensor  # [A] tail index used in the shortfall logit
    rho: Tensor  # [A]
    delta_aic: Tensor  # [A]
    rho0: Tensor  # scalar batch pivot
    beta_hat: Tensor  # [A] raw estimate (before clamping)
    fitted: Tensor  # [A] bool


def _check_scores(scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None) -> None:
    """Validate shapes and values of a score matrix, its positives and its mask."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D [anchors, candidates] matrix, got shape {tuple(scores.shape)}")
    num_anchors, num_candidates = scores.shape
    if num_anchors == 0 or num_candidates == 0:
        raise ValueError(f"scores is empty (shape {tuple(scores.shape)})")
    if valid_mask is not None and (valid_mask.shape != scores.shape or valid_mask.dtype != torch.bool):
        raise ValueError(
            f"valid_mask must be a bool tensor of the scores' shape {tuple(scores.shape)}, "
            f"got {valid_mask.dtype} {tuple(valid_mask.shape)}"
        )
    if positive_index is not None:
        if positive_index.shape != (num_anchors,):
            raise ValueError(
                f"positive_index must have one entry per anchor ({num_anchors}), "
                f"got shape {tuple(positive_index.shape)}"
            )
        if positive_index.numel() and (positive_index.max() >= num_candidates or positive_index.min() < -1):
            raise ValueError(f"positive_index must lie in [-1, {num_candidates - 1}]")
    # One reduction pass: NaN or +-Inf in any valid entry makes the sum non-finite.
    valid_scores = scores.detach() if valid_mask is None else scores.detach().masked_fill(~valid_mask, 0.0)
    if not torch.isfinite(valid_scores.float().sum()):
        raise ValueError("scores contain NaN or Inf (check the embeddings: a NaN embedding gives NaN scores)")


def _count_negatives(positive_index: Tensor | None, valid_mask: Tensor | None, shape: torch.Size, device) -> Tensor:
    """K per row: valid entries other than the row's positive."""
    num_anchors, num_candidates = shape
    if valid_mask is None:
        count = torch.full((num_anchors,), num_candidates, dtype=torch.long, device=device)
    else:
        count = valid_mask.sum(1)
    if positive_index is not None:
        has_positive = positive_index >= 0
        positive_valid = has_positive
        if valid_mask is not None:
            positive_valid = has_positive & valid_mask.gather(1, positive_index.clamp_min(0)[:, None]).squeeze(1)
        count = count - positive_valid.long()
    return count


def _top_negative_scores(
    scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None, k_max: int
) -> Tensor:
    """The k_max largest negative scores of each row, descending, padded with -inf (float32, no gradient).

    Takes the top k_max + 1 of the row and drops the positive among them, instead of masking a full copy.
    """
    scores = scores.detach().float()
    if valid_mask is not None:
        scores = scores.masked_fill(~valid_mask, float("-inf"))
    if positive_index is None or not bool((positive_index >= 0).any()):
        return scores.topk(k_max, dim=1).values
    values, columns = scores.topk(min(k_max + 1, scores.shape[1]), dim=1, sorted=False)
    values = values.masked_fill(columns == positive_index[:, None], float("-inf"))
    return values.sort(dim=1, descending=True).values[:, :k_max]


def tail_sizes(num_negatives: Tensor, *, tail_frac: float, min_tail_points: int) -> Tensor:
    """Tail size k per anchor from its number of negatives K (ALGORITHMS.md 1.1 step 1)."""
    k = torch.clamp(torch.round(tail_frac * num_negatives.double()).long(), min=min_tail_points)
    k = torch.minimum(k, num_negatives)
    k = torch.clamp(k, min=10)
    return torch.minimum(k, num_negatives)


def _fit_lines(x: Tensor, ys: tuple[Tensor, ...], weight: Tensor, n: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Row-wise weighted least squares y ~ a + slope * x for several y on the same x (float64).

    ``x`` is [A, k]; ``weight`` (0/1), ``n`` (points per row, as a column) and each y are either per row ([A, k],
    [A, 1]) or one row shared by all anchors ([1, k], [1, 1]: the usual case of equal tail sizes, which saves
    most passes over [A, k]). Returns (slope, residual sum of squares) per y, the latter as syy - sxy^2 / sxx;
    a row whose x has no spread (duplicate scores) gets slope 0 and residual syy.
    """
    mean_x = (x * weight).sum(1, keepdim=True) / n
    xc = (x - mean_x).mul_(weight)
    sxx = (xc * xc).sum(1)
    degenerate = sxx <= 1e-300
    sxx_safe = torch.where(degenerate, torch.ones_like(sxx), sxx)
    fits = []
    for y in ys:
        yc = (y - (y * weight).sum(1, keepdim=True) / n) * weight
        sxy = (xc * yc).sum(1) if yc.shape[0] > 1 else (xc @ yc[0])
        syy = (yc * yc).sum(1)
        slope = torch.where(degenerate, torch.zeros_like(sxx), sxy / sxx_safe)
        fits.append((slope, (syy - slope * sxy).clamp_min(0.0)))
    return fits


@torch.no_grad()
def weince_tail_fit(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None = None,
    *,
    tail_frac: float = 0.10,
    min_tail_points: int = 32,
    eps: float = 1e-6,
) -> TailFit:
    """Per-anchor shortfall tail fits (ALGORITHMS.md 1.1 steps 1-4), vectorised over anchors; fits in float64."""
    _check_scores(scores, positive_index, valid_mask)
    num_negatives = _count_negatives(positive_index, valid_mask, scores.shape, scores.device)
    k = tail_sizes(num_negatives, tail_frac=tail_frac, min_tail_points=min_tail_points)
    k_max = int(k.max())
    has_negatives = num_negatives > 0
    num_anchors = scores.shape[0]
    if k_max == 0:
        zeros = torch.zeros(num_anchors, dtype=torch.float64, device=scores.device)
        no = torch.zeros(num_anchors, dtype=torch.bool, device=scores.device)
        return TailFit(rho=zeros + 1.0, beta_hat=zeros, delta_aic=zeros, fitted=no, has_negatives=has_negatives)

    top = _top_negative_scores(scores, positive_index, valid_mask, k_max).double()
    rank = torch.arange(1, k_max + 1, device=scores.device, dtype=torch.float64)[None, :]
    # When every anchor has the same tail size (the usual case) the tail positions, burn-in and CDF levels are
    # one row shared by all anchors.
    same_k = bool((k == k_max).all())
    tail_size = k[:1, None] if same_k else k[:, None]
    shortfall = torch.rsub(top, 1.0).clamp_min_(eps)
    if not same_k:
        shortfall = torch.where(rank <= tail_size, shortfall, 1.0)  # padding of short rows: log 1 = 0
    rho = torch.where(has_negatives, shortfall[:, 0], 1.0)

    burn_in = torch.clamp(torch.div(k, 20, rounding_mode="floor"), min=1)
    n = (k - burn_in).clamp_min(0)
    fitted = n >= _MIN_FIT_POINTS
    n_safe = n.clamp_min(1).double()
    used = (rank <= tail_size) & (rank > (burn_in[:1, None] if same_k else burn_in[:, None]))

    # Empirical CDF levels; positions outside the fit get a harmless 0.5 so no NaN enters the sums.
    log_cdf = torch.log(torch.where(used, rank / (tail_size.double() + 1.0), 0.5))
    (beta_hat, sse_weibull), (gumbel_slope, sse_gumbel) = _fit_lines(
        torch.log(shortfall),
        (log_cdf, torch.log(-log_cdf)),
        used.double(),
        n_safe[:1, None] if same_k else n_safe[:, None],
    )
    sse_weibull = (sse_weibull + _WRONG_SIGN_PENALTY * (beta_hat <= 0)).clamp_min(_MIN_SSE)
    sse_gumbel = (sse_gumbel + _WRONG_SIGN_PENALTY * (gumbel_slope >= 0)).clamp_min(_MIN_SSE)
    aic_weibull = n_safe * torch.log(sse_weibull / n_safe) + 4.0
    aic_gumbel = n_safe * torch.log(sse_gumbel / n_safe) + 4.0
    zero = torch.zeros_like(rho)
    return TailFit(
        rho=rho,
        beta_hat=torch.where(fitted, beta_hat, zero),
        delta_aic=torch.where(fitted, aic_gumbel - aic_weibull, zero),
        fitted=fitted,
        has_negatives=has_negatives,
    )


@torch.no_grad()
def batch_pivot(rho: Tensor, has_negatives: Tensor, q: float = 0.2) -> Tensor:
    """``rho0``: the q-quantile of rho over the anchors that have negatives (sort ascending, index round(q (A-1))).

    Pass the rho of the whole (global) batch: under data parallelism, gather first, so the pivot does not depend
    on how the batch is split over processes.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    pool = torch.sort(rho[has_negatives]).values
    if pool.numel() == 0:
        return torch.ones((), dtype=rho.dtype, device=rho.device)
    return pool[round(q * (pool.numel() - 1))]


@torch.no_grad()
def blend_weights(
    fit: TailFit,
    rho0: Tensor | float,
    *,
    kappa_rho: float = 10.0,
    kappa_aic: float = 1.0,
    aic_margin: float = 2.0,
    mode: WeinceMode = "both",
) -> Tensor:
    """lambda(a) = sigmoid(kappa_rho log(rho0 / rho)) * sigmoid(kappa_aic (dAIC - margin)); 0 where not fitted."""
    rho0 = torch.as_tensor(rho0, dtype=fit.rho.dtype, device=fit.rho.device)
    hardness = torch.sigmoid(kappa_rho * (torch.log(rho0) - torch.log(fit.rho)))
    geometry = torch.sigmoid(kappa_aic * (fit.delta_aic - aic_margin))
    if mode == "both":
        lam = hardness * geometry
    elif mode == "rho":
        lam = hardness
    elif mode == "aic":
        lam = geometry
    else:
        raise ValueError(f"mode must be 'both', 'rho' or 'aic', got {mode!r}")
    return torch.where(fit.fitted, lam, torch.zeros_like(lam))


def tail_index(fit: TailFit, beta: float | str = 1.0) -> Tensor:
    """beta(a) in the shortfall logit: a constant (reference implementation: 1.0) or "auto", the clamped estimate."""
    if beta == "auto":
        low, high = BETA_AUTO_RANGE
        return torch.where(fit.fitted, fit.beta_hat.clamp(low, high), torch.ones_like(fit.beta_hat))
    if isinstance(beta, str) or not float(beta) > 0:
        raise ValueError(f"beta must be a positive number or 'auto', got {beta!r}")
    return torch.full_like(fit.beta_hat, float(beta))


def _check_options(q: float, tail_frac: float, min_tail_points: int, eps: float) -> None:
    if not 0.0 < tail_frac <= 1.0:
        raise ValueError(f"tail_frac must lie in (0, 1], got {tail_frac}")
    if min_tail_points < 1:
        raise ValueError(f"min_tail_points must be at least 1, got {min_tail_points}")
    if not 0.0 < eps < 0.5:
        raise ValueError(f"eps must lie in (0, 0.5), got {eps}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")


@torch.no_grad()
def weince_statistics(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None = None,
    *,
    q: float = 0.2,
    kappa_rho: float = 10.0,
    kappa_aic: float = 1.0,
    aic_margin: float = 2.0,
    tail_frac: float = 0.10,
    min_tail_points: int = 32,
    eps: float = 1e-6,
    mode: WeinceMode = "both",
    beta: float | str = 1.0,
    rho0: Tensor | float | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> WeinceStatistics:
    """Per-anchor WEINCE statistics (no gradient).

    ``rho0`` overrides the batch pivot. ``gather`` maps a per-anchor tensor of this process to the one of the global
    batch (e.g. an all-gather under data parallelism), so that the pivot is taken over every process's anchors.
    """
    _check_options(q, tail_frac, min_tail_points, eps)
    fit = weince_tail_fit(
        scores, positive_index, valid_mask, tail_frac=tail_frac, min_tail_points=min_tail_points, eps=eps
    )
    if rho0 is None:
        gather = gather or (lambda local: local)
        rho0 = batch_pivot(gather(fit.rho), gather(fit.has_negatives), q)
    rho0 = torch.as_tensor(rho0, dtype=fit.rho.dtype, device=fit.rho.device)
    lam = blend_weights(fit, rho0, kappa_rho=kappa_rho, kappa_aic=kappa_aic, aic_margin=aic_margin, mode=mode)
    return WeinceStatistics(
        lam=lam.float(),
        beta=tail_index(fit, beta).float(),
        rho=fit.rho.float(),
        delta_aic=fit.delta_aic.float(),
        rho0=rho0.float(),
        beta_hat=fit.beta_hat.float(),
        fitted=fit.fitted,
    )


def check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


class _BlendedLogit(torch.autograd.Function):
    """l = (1 - lam) s / tau - lam beta log(max(1 - s, eps)) with a hand-written backward.

    ``max(1 - s, eps)`` is ``1 - min(s, 1 - eps)``. Fusing keeps one [A, C] tensor for backward (the shortfall)
    instead of the several intermediates autograd would store, and needs fewer passes over the matrix.
    """

    @staticmethod
    def forward(ctx, scores: Tensor, lam: Tensor, beta: Tensor, temperature: float, eps: float) -> Tensor:
        linear_weight = (1.0 - lam) / temperature
        shortfall_weight = lam * beta
        shortfall = torch.rsub(scores, 1.0)
        # Whether the clamp at 1 - eps is active anywhere decides if backward needs the mask (rarely).
        ctx.clamped = bool(shortfall.min() < eps)
        shortfall.clamp_min_(eps)
        logits = torch.log(shortfall).mul_(-shortfall_weight).addcmul_(scores, linear_weight)
        ctx.save_for_backward(shortfall, linear_weight, shortfall_weight)
        ctx.eps = eps
        return logits

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        shortfall, linear_weight, shortfall_weight = ctx.saved_tensors
        # d/ds [(1 - lam) s / tau - lam beta log(1 - s)] = (1 - lam) / tau + lam beta / (1 - s) below the cap,
        # and (1 - lam) / tau where the clamp at 1 - eps is active
        slope = torch.addcdiv(linear_weight, shortfall_weight, shortfall)
        if ctx.clamped:
            slope = torch.where(shortfall <= ctx.eps, linear_weight, slope)
        return slope.mul_(grad_output), None, None, None, None


def weince_logits(
    scores: Tensor,
    lam: Tensor,
    beta: Tensor,
    valid_mask: Tensor | None = None,
    *,
    temperature: float,
    eps: float = 1e-6,
) -> Tensor:
    """Blended logits (1 - lam) s / tau + lam (-beta log(1 - min(s, 1 - eps))), float32, -inf at invalid entries.

    Gradient flows through ``scores`` only; ``lam`` and ``beta`` are treated as constants.
    """
    check_temperature(temperature)
    s = scores.float()  # the shortfall log must be float32 even under fp16/bf16 autocast
    lam = lam.detach().float()[:, None]
    if bool((lam == 0).all()):
        logits = s / temperature  # plain InfoNCE: skip the shortfall term
    else:
        logits = _BlendedLogit.apply(s, lam, beta.detach().float()[:, None], float(temperature), float(eps))
    if valid_mask is not None:
        logits = logits.masked_fill(~valid_mask, float("-inf"))
    return logits


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
    *,
    temperature: float,
    reduction: str = "mean",
    q: float = 0.2,
    kappa_rho: float = 10.0,
    kappa_aic: float = 1.0,
    aic_margin: float = 2.0,
    tail_frac: float = 0.10,
    min_tail_points: int = 32,
    eps: float = 1e-6,
    mode: WeinceMode = "both",
    beta: float | str = 1.0,
    rho0: Tensor | float | None = None,
) -> Tensor:
    """WEINCE loss: cross-entropy of the blended logits of each row with its positive as the target."""
    check_temperature(temperature)
    if (positive_index < 0).any():
        raise ValueError("every row needs a positive for the cross-entropy (positive_index >= 0)")
    stats = weince_statistics(
        scores,
        positive_index,
        valid_mask,
        q=q,
        kappa_rho=kappa_rho,
        kappa_aic=kappa_aic,
        aic_margin=aic_margin,
        tail_frac=tail_frac,
        min_tail_points=min_tail_points,
        eps=eps,
        mode=mode,
        beta=beta,
        rho0=rho0,
    )
    if valid_mask is not None and not valid_mask.gather(1, positive_index[:, None]).all():
        raise ValueError("the positive of a row is masked out by valid_mask")
    logits = weince_logits(scores, stats.lam, stats.beta, valid_mask, temperature=temperature, eps=eps)
    return _reduce(F.cross_entropy(logits, positive_index, reduction="none"), reduction)
