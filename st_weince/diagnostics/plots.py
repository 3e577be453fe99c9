"""Plots of the tail diagnostics (matplotlib, written to PNG files; no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from st_weince.diagnostics.evt import PotFit, exceedances, gpd_density, gpd_quantile  # noqa: E402
from st_weince.diagnostics.link import LinkFit  # noqa: E402

PAPER_XI = -0.39
PAPER_LAMBDA = (0.33, 0.50)


def _label(ax: plt.Axes, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)


def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_exceedance_density(values: np.ndarray, fit: PotFit, path: str | Path, title: str = "") -> Path:
    """Histogram density of the scores above the threshold with the fitted GPD and the xi = 0 fit, on linear and
    log axes; the score cap 1 and (for xi < 0) the fitted endpoint are marked."""
    y = exceedances(values, fit.threshold)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    edges = np.linspace(0.0, y.max(), 60)
    dens, _ = np.histogram(y, bins=edges, density=True)
    centers = 0.5 * (edges[1:] + edges[:-1])
    grid = np.linspace(0.0, max(y.max(), (fit.endpoint or 0.0) - fit.threshold) * 1.02, 400)
    for ax, log in zip(axes, (False, True)):
        keep = dens > 0
        ax.plot(fit.threshold + centers[keep], dens[keep], "o", ms=3, color="black", label="empirical")
        ax.plot(fit.threshold + grid, gpd_density(grid, fit.xi, fit.sigma), label=f"GPD fit, xi = {fit.xi:.3f}")
        exponential = gpd_density(grid, 0.0, fit.sigma_exponential)
        ax.plot(fit.threshold + grid, exponential, "--", label="xi = 0 fit (Gumbel domain)")
        if fit.endpoint is not None:
            ax.axvline(fit.endpoint, color="C0", lw=0.8, ls=":", label=f"fitted endpoint {fit.endpoint:.3f}")
        if fit.threshold + grid[-1] >= 1.0:
            ax.axvline(1.0, color="grey", lw=0.8, label="cap s = 1")
        if log:
            ax.set_yscale("log")
            positive = dens[dens > 0]
            ax.set_ylim(positive.min() / 5, dens.max() * 3)
        axis = ("log" if log else "linear") + " axis"
        _label(ax, "score s (above the threshold)", "density of exceedances", axis, legend_size=7)
    fig.suptitle(f"{title} POT: u = {fit.threshold:.4f} (q = {fit.threshold_quantile}), n = {fit.num_exceedances}")
    return _save(fig, path)


def plot_qq(values: np.ndarray, fit: PotFit, path: str | Path, title: str = "") -> Path:
    """QQ plot of the exceedances against the fitted GPD and against the xi = 0 (exponential) fit."""
    y = np.sort(exceedances(values, fit.threshold))
    p = (np.arange(1, y.size + 1) - 0.5) / y.size
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot(gpd_quantile(p, fit.xi, fit.sigma), y, ".", ms=2, label=f"GPD, xi = {fit.xi:.3f}")
    ax.plot(gpd_quantile(p, 0.0, fit.sigma_exponential), y, ".", ms=2, label="xi = 0 (exponential)")
    top = max(y.max(), gpd_quantile(p[-1:], 0.0, fit.sigma_exponential)[0])
    ax.plot([0, top], [0, top], color="grey", lw=0.8)
    _label(ax, "model quantile of the exceedance", "empirical exceedance", f"{title} QQ plot (u = {fit.threshold:.4f})")
    return _save(fig, path)


def plot_shape_stability(fits: Sequence[PotFit], path: str | Path, title: str = "") -> Path:
    """xi with its confidence interval against the threshold quantile; the paper's -0.39 and xi = 0 marked."""
    q = np.array([f.threshold_quantile for f in fits], dtype=float)
    xi = np.array([f.xi for f in fits])
    low = np.array([f.xi_ci[0] for f in fits])
    high = np.array([f.xi_ci[1] for f in fits])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = -np.log10(1.0 - q)
    ax.errorbar(x, xi, yerr=[xi - low, high - xi], fmt="o-", capsize=3, label="xi (profile-likelihood CI)")
    ax.axhline(0.0, color="grey", lw=0.8, label="xi = 0 (Gumbel domain)")
    ax.axhline(PAPER_XI, color="C3", lw=0.8, ls="--", label=f"paper: {PAPER_XI}")
    ax.set_xticks(x, [f"{v:g}\n(n={f.num_exceedances})" for v, f in zip(q, fits)], fontsize=7)
    _label(ax, "threshold quantile (number of exceedances)", "GPD shape xi", f"{title} shape vs threshold")
    return _save(fig, path)


def plot_link_profile(fits: dict[str, LinkFit], path: str | Path, title: str = "") -> Path:
    """Profile log-likelihood over lambda (relative to its maximum) of one or more link fits; the chi2 cut-off of
    the confidence interval and the paper's range 0.33-0.50 marked."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lowest = 0.0
    for name, fit in fits.items():
        if fit.separated:
            ax.plot([], [], " ", label=f"{name}: separated data, no finite MLE")
            continue
        rel = np.array(fit.profile_loglik) - fit.loglik
        lowest = min(lowest, float(rel.min()))
        ax.plot(fit.profile_lam, rel, "o-", ms=3, label=f"{name}: lambda = {fit.lam:.3f}")
    level = next(iter(fits.values())).ci_level
    ax.axhline(-0.5 * stats.chi2.ppf(level, df=1), color="grey", lw=0.8, ls=":", label=f"{level:.0%} CI cut-off")
    ax.axvspan(*PAPER_LAMBDA, color="C3", alpha=0.12, label="paper: 0.33-0.50")
    ax.set_ylim(max(lowest, -200.0) * 1.05 - 1.0, 5.0)
    ylabel = "profile log-likelihood - maximum"
    _label(ax, "lambda (weight of the shortfall logit)", ylabel, f"{title} link selection", legend_size=7)
    return _save(fig, path)


def plot_row_shapes(xi: Sequence[float], path: str | Path, title: str = "", pooled_xi: float | None = None) -> Path:
    """Histogram of per-anchor GPD shapes, with xi = 0, the paper's -0.39 and the pooled fit marked."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.hist(np.asarray(xi), bins=40, color="C0", alpha=0.8)
    ax.axvline(0.0, color="grey", lw=0.8, label="xi = 0 (Gumbel domain)")
    ax.axvline(PAPER_XI, color="C3", lw=0.8, ls="--", label=f"paper: {PAPER_XI}")
    if pooled_xi is not None:
        ax.axvline(pooled_xi, color="C1", lw=1.0, label=f"pooled fit: {pooled_xi:.3f}")
    _label(ax, "per-anchor GPD shape xi", "anchors", f"{title} per-anchor tails (n = {len(xi)})")
    return _save(fig, path)
