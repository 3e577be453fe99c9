"""An independent, deliberately plain re-implementation of docs/algorithms.md section 1 (NumPy, a loop over anchors).

It shares no code with st_weince.functional, so tests comparing the two check the vectorised implementation
against the written specification.
"""

from __future__ import annotations

import math

import numpy as np

from st_weince.functional import Gate, WEINCEOptions


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coef
    return float(coef[1]), float(residual @ residual)


def reference_statistics(
    scores: np.ndarray,
    positive_index: np.ndarray,
    valid_mask: np.ndarray | None = None,
    *,
    # the pivot and the two gates
    q: float = 0.2,
    kappa_rho: float = 10.0,
    kappa_aic: float = 1.0,
    aic_margin: float = 2.0,
    mode: str = "both",
    # the tail fits and the logit
    tail_frac: float = 0.10,
    min_tail_points: int = 32,
    eps: float = 1e-6,
    beta: float | str = 1.0,
) -> dict[str, np.ndarray | float]:
    num_anchors, num_candidates = scores.shape
    if valid_mask is None:
        valid_mask = np.ones_like(scores, dtype=bool)
    rho = np.ones(num_anchors)
    delta_aic = np.zeros(num_anchors)
    beta_hat = np.zeros(num_anchors)
    fitted = np.zeros(num_anchors, dtype=bool)
    has_negatives = np.zeros(num_anchors, dtype=bool)
    for a in range(num_anchors):
        negatives = [float(scores[a, c]) for c in range(num_candidates) if valid_mask[a, c] and c != positive_index[a]]
        K = len(negatives)
        if K == 0:
            continue
        has_negatives[a] = True
        k = max(min_tail_points, round(tail_frac * K))
        k = min(k, K)
        k = max(10, k)
        k = min(k, K)
        top = sorted(negatives, reverse=True)[:k]
        d = np.array([max(1.0 - s, eps) for s in top])
        rho[a] = d[0]
        b = max(1, k // 20)
        if k - b < 3:
            continue
        fitted[a] = True
        r = np.arange(1, k + 1)
        F = r / (k + 1)
        x = np.log(d)[b:]
        slope_w, sse_w = _line_fit(x, np.log(F[b:]))
        slope_g, sse_g = _line_fit(x, np.log(-np.log(F[b:])))
        if slope_w <= 0:
            sse_w += 1e6
        if slope_g >= 0:
            sse_g += 1e6
        sse_w, sse_g = max(sse_w, 1e-12), max(sse_g, 1e-12)
        n = k - b
        delta_aic[a] = (n * math.log(sse_g / n) + 4) - (n * math.log(sse_w / n) + 4)
        beta_hat[a] = slope_w
    pool = np.sort(rho[has_negatives])
    rho0 = float(pool[round(q * (len(pool) - 1))]) if len(pool) else 1.0

    def sigmoid(z):
        return 1.0 / (1.0 + np.exp(-z))

    hardness = sigmoid(kappa_rho * (np.log(rho0) - np.log(rho)))
    geometry = sigmoid(kappa_aic * (delta_aic - aic_margin))
    lam = {"both": hardness * geometry, "rho": hardness, "aic": geometry}[mode]
    lam = np.where(fitted, lam, 0.0)
    if beta == "auto":
        beta_used = np.where(fitted, np.clip(beta_hat, 0.5, 16.0), 1.0)
    else:
        beta_used = np.full(num_anchors, float(beta))
    return {
        "lam": lam,
        "beta": beta_used,
        "rho": rho,
        "delta_aic": delta_aic,
        "rho0": rho0,
        "beta_hat": beta_hat,
        "fitted": fitted,
    }


def reference_loss(
    scores: np.ndarray,
    positive_index: np.ndarray,
    valid_mask: np.ndarray | None = None,
    *,
    temperature: float,
    **options,
) -> float:
    stats = reference_statistics(scores, positive_index, valid_mask, **options)
    eps = options.get("eps", 1e-6)
    if valid_mask is None:
        valid_mask = np.ones_like(scores, dtype=bool)
    losses = []
    for a in range(scores.shape[0]):
        lam, beta = stats["lam"][a], stats["beta"][a]
        logits = []
        for c in range(scores.shape[1]):
            if not valid_mask[a, c]:
                continue
            s = float(scores[a, c])
            logit = (1 - lam) * s / temperature + lam * (-beta * math.log(1 - min(s, 1 - eps)))
            logits.append((c, logit))
        values = np.array([v for _, v in logits])
        log_z = values.max() + math.log(np.exp(values - values.max()).sum())
        positive = dict(logits)[int(positive_index[a])]
        losses.append(log_z - positive)
    return float(np.mean(losses))


def options_of(scale: float = 20.0, **reference_options) -> WEINCEOptions:
    """The package's options for the reference's keyword arguments (the specification's flat names; the gate's four
    go into one Gate), with the reference's beta 1.0 unless given."""
    gate_names = ("q", "kappa_rho", "kappa_aic", "aic_margin")
    gate = {name: reference_options.pop(name) for name in gate_names if name in reference_options}
    return WEINCEOptions(scale=scale, gate=Gate(**gate), **{"beta": 1.0, **reference_options})
