"""Row-wise least-squares line fits on sorted tails, shared by WEINCE's per-anchor tail fits
(:func:`st_weince.functional.weince.weince_tail_fit`) and the composite's batch tail fit
(:func:`st_weince.functional.batch_tail.batch_tail_fit`). Shapes decide every branch; no device value is read."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# A tail whose log-shortfalls spread less than this many units of rounding (RMS, relative to their size) has no
# shape: its line fits are rounding noise (equal scores of 0.92 everywhere would otherwise give lambda 1.0).
_DEGENERATE_SPREAD_ULPS = 16.0


class Design(NamedTuple):
    """The fixed part of the fits of tails of sizes k [R] over ``k_max`` ranks: the burn-in b [R], the 0/1 weights
    [R, k_max] of the fitted ranks (b, k], and the responses' centred values at those ranks (zero elsewhere)
    [Y, R, k_max]: log F_r (Weibull) and, with ``gumbel``, -log(-log F_r) (the Gumbel proxy's negative, so that for
    both lines a slope <= 0 has the wrong sign), F_r = r / (k + 1)."""

    burn_in: Tensor
    weight: Tensor
    centred: Tensor


def burn_in(size: Tensor | int) -> Tensor | int:
    """The ranks a tail fit of ``size`` points leaves out first, ``max(1, floor(size / 20))`` (docs/algorithms.md
    1.1 step 4), for a Python int (a size the shapes give) or an integer tensor of sizes."""
    if isinstance(size, Tensor):
        return torch.clamp(torch.div(size, 20, rounding_mode="floor"), min=1)
    return max(1, size // 20)


def fit_design(sizes: Tensor, k_max: int, dtype: torch.dtype, *, gumbel: bool = True) -> Design:
    """The :class:`Design` of tails of sizes ``sizes`` [R]."""
    sizes = sizes[:, None]
    rank = torch.arange(1, k_max + 1, device=sizes.device, dtype=dtype)[None, :]
    skipped = burn_in(sizes)
    used = (rank <= sizes) & (rank > skipped)
    weight = used.to(dtype)
    n = weight.sum(1, keepdim=True).clamp_min(1.0)
    # positions outside the fit get a harmless 0.5 so no NaN enters the sums
    log_cdf = torch.log(torch.where(used, rank / (sizes.to(dtype) + 1.0), 0.5))
    responses = (log_cdf, torch.log(-log_cdf).neg_()) if gumbel else (log_cdf,)
    centred = torch.stack([(y - (y * weight).sum(1, keepdim=True) / n) * weight for y in responses])
    return Design(skipped.squeeze(1), weight, centred)


# The designs of the tails that every row of a batch shares (their size follows from the shapes alone), made once per
# size: they are the same at every step.
_SHARED_DESIGNS: dict[tuple, Design] = {}


def shared_design(size: int, k_max: int, dtype: torch.dtype, device: torch.device, *, gumbel: bool = True) -> Design:
    """:func:`fit_design` of one tail size (a Python int: every row's), [1, k_max], kept for the next call."""
    key = (size, k_max, dtype, device, gumbel)
    design = _SHARED_DESIGNS.get(key)
    if design is None:
        if len(_SHARED_DESIGNS) >= 64:  # a bounded cache: few sizes recur within a training run
            _SHARED_DESIGNS.clear()
        with torch.no_grad():
            design = fit_design(torch.tensor([size], device=device), k_max, dtype, gumbel=gumbel)
        _SHARED_DESIGNS[key] = design
    return design


def row_design(k: Tensor, k_max: int, dtype: torch.dtype) -> Design:
    """:func:`fit_design` for each row's tail size. The design depends on k only, so when there are more rows
    than possible sizes it is computed once per size ([k_max + 1, k_max]) and each row picks its size's row, which
    saves about 15 passes over the [A, k_max] tails; otherwise (e.g. the small row chunks of a cached loss, where
    that table would grow quadratically with the batch) per row. Both give identical values."""
    if k_max + 1 > k.shape[0]:
        return fit_design(k, k_max, dtype)
    table = fit_design(torch.arange(k_max + 1, device=k.device), k_max, dtype)
    return Design(table.burn_in[k], table.weight.index_select(0, k), table.centred.index_select(1, k))


def fit_lines(x: Tensor, design: Design, n: Tensor | float, first_used: Tensor | int) -> tuple[Tensor, Tensor, Tensor]:
    """Row-wise least squares y ~ a + slope * x for the design's responses on the same x, over the points with weight
    1: ``(slope [Y, A], residual sum of squares [Y, A], degenerate [A])``, where the rows whose x has no spread
    (``degenerate``) get slope 0.

    ``x`` is [A, k] (finite everywhere), ``n`` [A, 1] the points per row (or one number for every row),
    ``first_used`` [A, 1] the position of each row's first used point (or one position for every row). The design's
    rows are the rows of x, or one row for all.

    x is shifted by one of its own points before centring, so equal x give exactly zero deviations, and a row is
    degenerate when the RMS deviation is below a few units of rounding of x's magnitude (a relative threshold,
    valid in every dtype). Residuals are summed directly, not as syy - sxy^2 / sxx, which cancels in float32.
    """
    weight, centred = design.weight, design.centred
    reference = x[:, first_used : first_used + 1] if isinstance(first_used, int) else x.gather(1, first_used)
    xs = (x - reference).mul_(weight)
    xc = (xs - xs.sum(1, keepdim=True) / n).mul_(weight)
    sxx = (xc * xc).sum(1, keepdim=True)
    resolution = reference.abs().mul_(_DEGENERATE_SPREAD_ULPS * torch.finfo(x.dtype).eps)
    degenerate = sxx <= resolution * n * resolution
    sxx_safe = torch.where(degenerate, 1.0, sxx)
    slope = torch.where(degenerate, 0.0, (xc * centred).sum(2, keepdim=True) / sxx_safe)
    residual = torch.addcmul(centred, xc, slope, value=-1.0)
    return slope.squeeze(2), (residual * residual).sum(2), degenerate.squeeze(1)
