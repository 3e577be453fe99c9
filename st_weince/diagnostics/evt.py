"""Peaks-over-threshold (POT) fits of a generalized Pareto distribution (GPD) to the upper tail of scores
(docs/algorithms.md 1.4; docs/diagnostics.md, "What is measured"): a shape ``xi < 0`` signals a finite right endpoint
(Weibull domain), ``xi = 0`` the Gumbel domain that softmax assumes. Maximum likelihood through the profile of ``xi``,
with its profile-likelihood interval. The search is restricted to ``xi > -1``, where the likelihood is bounded (Smith,
1985), and a fit that ends on that bound is flagged; the usual asymptotics hold for ``xi > -0.5`` only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize, stats

XI_LOWER = -0.999
XI_UPPER = 2.0
_SIGMA_GRID = 48
_XI_GRID = 40


@dataclass(frozen=True)
class PotFit:
    """Result of :func:`pot_fit`. ``xi_ci`` is a profile-likelihood interval; ``endpoint`` is None unless xi < 0."""

    xi: float
    sigma: float
    threshold: float
    threshold_quantile: float | None
    num_exceedances: int
    num_values: int
    xi_ci: tuple[float, float]
    ci_level: float
    ci_method: str
    loglik: float
    sigma_exponential: float  # scale of the xi = 0 (Gumbel-domain) fit: the mean exceedance
    loglik_exponential: float
    lr_statistic_xi0: float  # 2 (l_GPD - l_xi=0)
    p_value_xi0: float  # chi2_1 tail probability of the LR statistic (H0: xi = 0)
    endpoint: float | None
    at_lower_bound: bool  # the MLE hit the xi > -1 restriction

    def to_dict(self) -> dict:
        out = asdict(self)
        out["xi_ci"] = list(self.xi_ci)
        return out


def gpd_loglik(exceedances: np.ndarray, xi: float, sigma: float | np.ndarray) -> np.ndarray:
    """Log-likelihood of exceedances (``y >= 0``) under GPD(xi, sigma), i.e. ``scipy.stats.genpareto.logpdf`` (shape
    ``c = xi``) summed, written out: ``-n log sigma - (1 + 1/xi) sum log(1 + xi y / sigma)`` (``xi = 0``:
    ``-n log sigma - sum y / sigma``), ``-inf`` outside the support. About 20 times faster than scipy's generic
    ``logpdf`` on the profile grids (a test checks the two agree).

    ``sigma`` may be an array of scales (shape [G]); the result then has shape [G].
    """
    y = np.asarray(exceedances, dtype=np.float64)
    sig = np.atleast_1d(np.asarray(sigma, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        if xi == 0.0:
            out = -y.size * np.log(sig) - y.sum() / sig
        else:
            z = xi * y[None, :] / sig[:, None]
            out = -y.size * np.log(sig) - (1.0 + 1.0 / xi) * np.log1p(z).sum(1)
            out = np.where((z >= -1.0).all(1), out, -np.inf)
    out = np.where((y >= 0).all() & (sig > 0), out, -np.inf)
    out = np.where(np.isnan(out), -np.inf, out)
    return out if np.ndim(sigma) else float(out[0])


def gpd_quantile(probabilities: np.ndarray, xi: float, sigma: float) -> np.ndarray:
    """Quantiles of GPD(xi, sigma) at the given probabilities (for QQ plots)."""
    return stats.genpareto.ppf(np.asarray(probabilities, dtype=np.float64), xi, scale=sigma)


def gpd_density(y: np.ndarray, xi: float, sigma: float) -> np.ndarray:
    """Density of GPD(xi, sigma) at ``y`` (0 outside the support)."""
    return stats.genpareto.pdf(np.asarray(y, dtype=np.float64), xi, scale=sigma)


def _profile_sigma(y: np.ndarray, xi: float) -> tuple[float, float]:
    """max over sigma of the GPD log-likelihood at fixed xi: (loglik, sigma)."""
    y_max = float(y.max())
    mean = float(y.mean())
    if abs(xi) < 1e-10:
        return float(-y.size * math.log(mean) - y.size), mean
    low = max(-xi * y_max * (1.0 + 1e-9), 1e-6 * mean) if xi < 0 else 1e-4 * mean
    high = max(100.0 * y_max, 100.0 * mean)
    grid = np.exp(np.linspace(math.log(low), math.log(high), _SIGMA_GRID))
    values = gpd_loglik(y, xi, grid)
    best = int(np.argmax(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, _SIGMA_GRID - 1)]
    res = optimize.minimize_scalar(
        lambda log_s: -float(gpd_loglik(y, xi, math.exp(log_s))),
        bounds=(math.log(lo), math.log(hi)),
        method="bounded",
        options={"xatol": 1e-10},
    )
    if -res.fun >= values[best]:
        return float(-res.fun), float(math.exp(res.x))
    return float(values[best]), float(grid[best])


def profile_loglik(exceedances: np.ndarray, xi: float) -> float:
    """Profile log-likelihood l_p(xi) = max over sigma of the GPD log-likelihood."""
    return _profile_sigma(np.asarray(exceedances, dtype=np.float64), xi)[0]


def _check_values(values: np.ndarray | Sequence[float], name: str = "values") -> np.ndarray:
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contain NaN or Inf ({int((~np.isfinite(x)).sum())} entries)")
    return x


def fit_gpd(exceedances: np.ndarray, ci_level: float = 0.95) -> dict:
    """Maximum-likelihood GPD fit of exceedances ``y > 0`` with a profile-likelihood interval for xi."""
    y = _check_values(exceedances, "exceedances")
    if (y <= 0).any():
        raise ValueError("exceedances must be > 0 (subtract the threshold and keep values strictly above it)")
    if y.size < 10:
        raise ValueError(f"a GPD fit needs at least 10 exceedances, got {y.size}")
    if not 0.0 < ci_level < 1.0:
        raise ValueError(f"ci_level must lie in (0, 1), got {ci_level}")
    grid = np.linspace(XI_LOWER, XI_UPPER, _XI_GRID)
    prof = np.array([profile_loglik(y, xi) for xi in grid])
    best = int(np.argmax(prof))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, _XI_GRID - 1)]
    res = optimize.minimize_scalar(
        lambda xi: -profile_loglik(y, xi), bounds=(lo, hi), method="bounded", options={"xatol": 1e-7}
    )
    xi_hat, ll_hat = (float(res.x), float(-res.fun)) if -res.fun >= prof[best] else (float(grid[best]), prof[best])
    ll_hat, sigma_hat = _profile_sigma(y, xi_hat)
    crit = float(stats.chi2.ppf(ci_level, df=1))

    def gap(xi: float) -> float:
        return 2.0 * (ll_hat - profile_loglik(y, xi)) - crit

    ci_low = XI_LOWER if gap(XI_LOWER) <= 0 else optimize.brentq(gap, XI_LOWER, xi_hat, xtol=1e-6)
    upper = XI_UPPER
    while gap(upper) <= 0 and upper < 50:
        upper *= 2
    ci_high = optimize.brentq(gap, xi_hat, upper, xtol=1e-6) if gap(upper) > 0 else upper
    return {
        "xi": xi_hat,
        "sigma": sigma_hat,
        "loglik": ll_hat,
        "xi_ci": (float(ci_low), float(ci_high)),
        "at_lower_bound": bool(xi_hat <= XI_LOWER + 1e-3),
    }


def pot_fit(
    values: np.ndarray | Sequence[float],
    threshold_quantile: float = 0.95,
    *,
    threshold: float | None = None,
    ci_level: float = 0.95,
    min_exceedances: int = 30,
) -> PotFit:
    """Peaks-over-threshold GPD fit of the upper tail of ``values``.

    Args:
        values: the scores (e.g. all negative cosine similarities of an encoder), any shape.
        threshold_quantile: the threshold ``u`` is this empirical quantile of ``values``.
        threshold: an explicit threshold instead (then ``threshold_quantile`` is ignored and reported as None).
        ci_level: level of the profile-likelihood confidence interval for ``xi``.
        min_exceedances: fewer values strictly above ``u`` raise a ValueError.

    Returns:
        A :class:`PotFit` with ``xi``, ``sigma``, ``threshold``, ``num_exceedances``, ``xi_ci``, the ``xi = 0``
        (exponential) fit and the likelihood-ratio test of ``xi = 0``, and the implied endpoint when ``xi < 0``.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> fit = pot_fit(1.0 - rng.beta(3.0, 4.0, 100_000), threshold_quantile=0.98)
        >>> round(fit.xi, 1)  # theory: -1/3
        -0.3
    """
    x = _check_values(values)
    if threshold is None:
        if not 0.0 < threshold_quantile < 1.0:
            raise ValueError(f"threshold_quantile must lie in (0, 1), got {threshold_quantile}")
        u = float(np.quantile(x, threshold_quantile))
        quantile: float | None = float(threshold_quantile)
    else:
        u, quantile = float(threshold), None
    y = x[x > u] - u
    if y.size < min_exceedances:
        raise ValueError(
            f"only {y.size} values lie above the threshold {u:.6g} (need at least {min_exceedances}); "
            "lower threshold_quantile or pass more values"
        )
    gpd = fit_gpd(y, ci_level=ci_level)
    sigma0 = float(y.mean())
    ll0 = float(-y.size * math.log(sigma0) - y.size)
    lr = max(2.0 * (gpd["loglik"] - ll0), 0.0)
    xi = gpd["xi"]
    return PotFit(
        xi=xi,
        sigma=gpd["sigma"],
        threshold=u,
        threshold_quantile=quantile,
        num_exceedances=int(y.size),
        num_values=int(x.size),
        xi_ci=gpd["xi_ci"],
        ci_level=ci_level,
        ci_method="profile likelihood",
        loglik=gpd["loglik"],
        sigma_exponential=sigma0,
        loglik_exponential=ll0,
        lr_statistic_xi0=lr,
        p_value_xi0=float(stats.chi2.sf(lr, df=1)),
        endpoint=float(u - gpd["sigma"] / xi) if xi < 0 else None,
        at_lower_bound=gpd["at_lower_bound"],
    )


def exceedances(values: np.ndarray | Sequence[float], threshold: float) -> np.ndarray:
    """The values strictly above ``threshold``, minus the threshold."""
    x = _check_values(values)
    return x[x > threshold] - threshold


def threshold_stability(
    values: np.ndarray | Sequence[float],
    quantiles: Sequence[float] = (0.80, 0.85, 0.90, 0.95, 0.975, 0.99, 0.995, 0.999),
    *,
    ci_level: float = 0.95,
    min_exceedances: int = 30,
) -> list[PotFit]:
    """POT fits over a range of threshold quantiles (the shape should be stable above a good threshold).

    Quantiles that leave fewer than ``min_exceedances`` exceedances are skipped; if none is left, ValueError.
    """
    x = _check_values(values)
    fits = []
    for q in quantiles:
        if not 0.0 < q < 1.0:
            raise ValueError(f"threshold quantiles must lie in (0, 1), got {q}")
        if (x > np.quantile(x, q)).sum() < min_exceedances:
            continue
        fits.append(pot_fit(x, q, ci_level=ci_level, min_exceedances=min_exceedances))
    if not fits:
        raise ValueError(f"no threshold quantile leaves {min_exceedances} exceedances in {x.size} values")
    return fits


def pot_fit_rows(
    rows: Sequence[np.ndarray] | np.ndarray,
    threshold_quantile: float = 0.95,
    *,
    ci_level: float = 0.95,
    min_exceedances: int = 30,
) -> list[PotFit | None]:
    """One POT fit per row (e.g. each anchor's negative scores against a large pool): the per-anchor tail that
    WEINCE's statistics look at, instead of the tail of all pairs pooled. Rows with too few exceedances give None."""
    fits: list[PotFit | None] = []
    for row in rows:
        x = _check_values(row, "row")
        if (x > np.quantile(x, threshold_quantile)).sum() < min_exceedances:
            fits.append(None)
            continue
        fits.append(pot_fit(x, threshold_quantile, ci_level=ci_level, min_exceedances=min_exceedances))
    return fits


def summarize_shapes(fits: Sequence[PotFit | None]) -> dict:
    """Distribution of per-row shapes: quantiles of xi and the shares whose interval lies below / above 0."""
    done = [f for f in fits if f is not None]
    if not done:
        raise ValueError("no row had enough exceedances for a fit")
    xi = np.array([f.xi for f in done])
    return {
        "rows_fitted": len(done),
        "rows_skipped": len(fits) - len(done),
        "exceedances_per_row_median": float(np.median([f.num_exceedances for f in done])),
        "xi_quantiles": {str(q): float(np.quantile(xi, q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9)},
        "xi_mean": float(xi.mean()),
        "share_xi_negative": float((xi < 0).mean()),
        "share_ci_below_zero": float(np.mean([f.xi_ci[1] < 0 for f in done])),
        "share_ci_above_zero": float(np.mean([f.xi_ci[0] > 0 for f in done])),
        "share_at_lower_bound": float(np.mean([f.at_lower_bound for f in done])),
    }
