"""The WEINCE settings grids of benchmarks/simclr_grid.py (trained) and weince_grid_statistics.py (measured before
training): two 9-point Latin squares of 3x3x3 grids."""

from __future__ import annotations

from st_weince.functional.weince import DEFAULTS

# Two 3x3x3 grids, each with the defaults at the middle level of every factor. "released": the factors the released
# code tuned. "blend": the factors that set which anchors are blended (q: rho0 is the q-quantile of the shortfalls,
# kappa_rho: the sharpness of that gate) and how strongly (beta: the slope of the shortfall logit).
SQUARES: dict[str, dict[str, tuple[float, float, float]]] = {
    "released": {"aic_margin": (0.0, 2.0, 6.0), "kappa_rho": (5.0, 10.0, 20.0), "kappa_aic": (0.5, 1.0, 2.0)},
    "blend": {"q": (0.1, 0.2, 0.4), "kappa_rho": (5.0, 10.0, 20.0), "beta": (0.5, 1.0, 2.0)},
}
TRAINED_SQUARE = "blend"  # why: benchmarks/results/simclr_grid/lambda_statistics.json (docs/evidence.md, study 3)
SHORT_NAMES = {"aic_margin": "margin", "kappa_rho": "krho", "kappa_aic": "kaic", "q": "q", "beta": "beta"}


def latin_square(square: str = TRAINED_SQUARE) -> list[dict[str, float]]:
    """9 of the 27 points of ``SQUARES[square]``: the third factor's level is (i + j + 2) mod 3 for levels i and j
    of the first two, so each level of each factor appears three times, every pair of factors meets each
    combination of levels once, and (i, j) = (1, 1) gives the defaults."""
    (first, a), (second, b), (third, c) = SQUARES[square].items()
    return [{first: x, second: y, third: c[(i + j + 2) % 3]} for i, x in enumerate(a) for j, y in enumerate(b)]


def point_name(options: dict[str, float]) -> str:
    return "-".join(f"{SHORT_NAMES[key]}{value:g}" for key, value in options.items())


def is_default(options: dict[str, float]) -> bool:
    """The vision defaults (WeinceOptions(), beta 1 as in the reference code)."""
    return all(getattr(DEFAULTS, key) == value for key, value in options.items())
