"""Row-wise least-squares line fits on sorted tails, shared by WEINCE's per-anchor tail fits
(:func:`st_weince.functional.weince.weince_tail_fit`) and the composite's batch tail fit
(:func:`st_weince.functional.batch_tail.batch_tail_fit`). Shapes decide every branch; no device value is read."""

from __future__ import annotations

import torch
from torch import Tensor

# A tail whose log-shortfalls spread less than this many units of rounding (RMS, relative to their size) has no
# shape: its line fits are rounding noise (equal scores of 0.92 everywhere would otherwise give lambda 1.0).
_DEGENERATE_SPREAD_ULPS = 16.0


def fit_design(sizes: Tensor, k_max: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
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


def row_design(k: Tensor, k_max: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """:func:`fit_design` for each row's tail size. The design depends on k only, so when there are more rows
    than possible sizes it is computed once per size ([k_max + 1, k_max]) and each row picks its size's row, which
    saves about 15 passes over the [A, k_max] tails; otherwise (e.g. the small row chunks of a cached loss, where
    that table would grow quadratically with the batch) per row. Both give identical values."""
    if k_max + 1 > k.shape[0]:
        return fit_design(k, k_max, dtype)
    burn_in, weight, centred = fit_design(torch.arange(k_max + 1, device=k.device), k_max, dtype)
    return burn_in[k], weight.index_select(0, k), tuple(table.index_select(0, k) for table in centred)


def fit_lines(
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
