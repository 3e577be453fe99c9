"""An independent, deliberately plain re-implementation of the released WEINCE composite (docs/algorithms.md 1.2b):
policy ``tlambda_select`` (the blend of section 1.2 with beta = 1) plus the top-M shortfall and top-M InfoNCE terms,
with the batch tail index as a moving average carried across steps.

Python floats and loops over anchors and candidates; the blend comes from tests/weince_reference.py. It shares no
code with st_weince.functional, so tests comparing the two check the vectorised implementation against the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tests.weince_reference import reference_loss


def _log_sum_exp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _negatives(scores: np.ndarray, positive_index: np.ndarray, valid_mask: np.ndarray, row: int) -> list[float]:
    return [
        float(scores[row, c]) for c in range(scores.shape[1]) if valid_mask[row, c] and c != int(positive_index[row])
    ]


def reference_batch_fit(
    scores: np.ndarray,
    positive_index: np.ndarray,
    valid_mask: np.ndarray,
    *,
    tail_min_points: int = 1024,
    tail_frac: float = 0.05,
    eps: float = 1e-6,
) -> dict[str, float] | None:
    """Slope (clamped at >= 0) and R^2 of log F_r on log d_r over the batch's smallest shortfalls, or None (fewer
    than 10 negatives)."""
    pooled = []
    for row in range(scores.shape[0]):
        pooled += [max(1.0 - s, eps) for s in _negatives(scores, positive_index, valid_mask, row)]
    total = len(pooled)
    k = min(total, max(tail_min_points, math.floor(tail_frac * total)))
    if k < 10:
        return None
    tail = sorted(pooled)[:k]
    burn = max(1, k // 20)
    xs = [math.log(d) for d in tail[burn:]]
    ys = [math.log(r / (k + 1)) for r in range(burn + 1, k + 1)]
    n = len(xs)
    x_mean, y_mean = sum(xs) / n, sum(ys) / n
    sxx = sum((x - x_mean) ** 2 for x in xs)
    sxy = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys))
    syy = sum((y - y_mean) ** 2 for y in ys)
    if max(xs) == min(xs):  # every fitted shortfall equal: no line, no slope
        return {"slope": 0.0, "r_squared": 0.0}
    slope = sxy / sxx
    residual = sum((y - y_mean - slope * (x - x_mean)) ** 2 for x, y in zip(xs, ys))
    r_squared = min(max(1.0 - residual / syy, 0.0), 1.0)
    return {"slope": max(slope, 0.0), "r_squared": r_squared}


def _top_m_terms(
    scores: np.ndarray,
    positive_index: np.ndarray,
    valid_mask: np.ndarray,
    *,
    top_m: int,
    beta_t: float,
    temperature: float,
    eps: float,
) -> tuple[float, float]:
    shortfall_losses, infonce_losses = [], []
    for row in range(scores.shape[0]):
        negatives = _negatives(scores, positive_index, valid_mask, row)
        m = max(min(top_m, len(negatives) - 1), 0)
        chosen = [float(scores[row, int(positive_index[row])])] + sorted(negatives, reverse=True)[:m]
        shortfall = [-beta_t * math.log(1.0 - min(x, 1.0 - eps)) for x in chosen]
        plain = [x / temperature for x in chosen]
        shortfall_losses.append(_log_sum_exp(shortfall) - shortfall[0])
        infonce_losses.append(_log_sum_exp(plain) - plain[0])
    return sum(shortfall_losses) / len(shortfall_losses), sum(infonce_losses) / len(infonce_losses)


@dataclass(kw_only=True)
class ReleasedCompositeReference:
    """The released composite with its state: ``step(...)`` per batch, ``beta_ema`` carried across steps."""

    top_m: int = 50
    shortfall_weight: float = 0.5
    infonce_weight: float = 0.5
    # the batch tail index: its moving average (start, momentum, clamp of a slope), the trust in a fit, the tail
    beta_ema: float = 4.0
    momentum: float = 0.9
    beta_range: tuple[float, float] = (0.5, 16.0)
    min_r_squared: float = 0.85
    tail_min_points: int = 1024
    tail_frac: float = 0.05
    eps: float = 1e-6

    def step(
        self,
        scores: np.ndarray,
        positive_index: np.ndarray,
        valid_mask: np.ndarray | None = None,
        *,
        temperature: float,
        **blend_options,
    ) -> dict[str, float | bool | None]:
        scores = np.asarray(scores, dtype=np.float64)
        positive_index = np.asarray(positive_index)
        if valid_mask is None:
            valid_mask = np.ones(scores.shape, dtype=bool)
        fit = reference_batch_fit(
            scores,
            positive_index,
            valid_mask,
            tail_min_points=self.tail_min_points,
            tail_frac=self.tail_frac,
            eps=self.eps,
        )
        trusted = fit is not None and fit["r_squared"] >= self.min_r_squared and fit["slope"] > 0.0
        if trusted:
            low, high = self.beta_range
            clamped = min(max(fit["slope"], low), high)
            self.beta_ema = self.momentum * self.beta_ema + (1.0 - self.momentum) * clamped
        beta_t = self.beta_ema
        blend = reference_loss(
            scores, positive_index, valid_mask, temperature=temperature, eps=self.eps, beta=1.0, **blend_options
        )
        shortfall, infonce = _top_m_terms(
            scores, positive_index, valid_mask, top_m=self.top_m, beta_t=beta_t, temperature=temperature, eps=self.eps
        )
        return {
            "total": blend + self.shortfall_weight * shortfall + self.infonce_weight * infonce,
            "blend": blend,
            "top_m_shortfall": shortfall,
            "top_m_infonce": infonce,
            "beta_t": beta_t,
            "slope": None if fit is None else fit["slope"],
            "r_squared": None if fit is None else fit["r_squared"],
            "trusted": trusted,
        }
