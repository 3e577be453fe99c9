"""How sharp a WEINCE term is (docs/weince.md, "How sharp is the loss?"): the secant slope of its logit over the whole
set its softmax runs over, ``(f(s_max) - f(s_min)) / (s_max - s_min)``, scores capped at ``1 - eps``; not a
softmax-weighted slope, which the one candidate nearest the cap dominates. Logged values: no gradient, no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor


def shortfall_secant_slope(scores: Tensor, valid_mask: Tensor | None, eps: float) -> Tensor:
    """Per row [A]: the secant slope of ``-log(1 - s)`` between the row's lowest and highest valid score, scores
    capped at ``1 - eps``; the tangent ``1 / (1 - s)`` where they are equal (no gradient)."""
    scores = scores.detach()
    if valid_mask is None:
        low, high = scores.amin(dim=1), scores.amax(dim=1)
    else:
        low = scores.masked_fill(~valid_mask, float("inf")).amin(dim=1)
        high = scores.masked_fill(~valid_mask, float("-inf")).amax(dim=1)
    low, high = low.clamp(max=1.0 - eps), high.clamp(max=1.0 - eps)
    width = high - low
    rise = torch.log1p(-low) - torch.log1p(-high)
    tangent = torch.rsub(high, 1.0).reciprocal_()
    spread = width > 0
    return torch.where(spread, rise / torch.where(spread, width, 1.0), tangent)


@torch.no_grad()
def blend_effective_scale(
    scores: Tensor, valid_mask: Tensor | None, lam: Tensor, beta: Tensor, *, scale: float, eps: float
) -> Tensor:
    """Per row [A]: the secant slope of the blended logit ``(1 - lam) s scale + lam (-beta log(1 - s))`` over the row's
    valid scores (the positive and every candidate of its softmax)."""
    if lam.dtype != scores.dtype:
        lam, beta = lam.to(scores.dtype), beta.to(scores.dtype)
    return (1.0 - lam) * scale + lam * beta * shortfall_secant_slope(scores, valid_mask, eps)


@torch.no_grad()
def selection_shortfall_scale(picked: Tensor, used: Tensor | None, beta: Tensor, eps: float) -> Tensor:
    """Per row [A]: the secant slope of the top-M shortfall logit ``-beta log(1 - s)`` over a row's used entries of a
    :func:`~st_weince.functional.top_m.top_m_selection` (its positive and used hardest negatives; None: all)."""
    # The positive is an entry of the set, so a row without used negatives (M' = 0) has the range of one score.
    return beta * shortfall_secant_slope(picked, used, eps)
