"""Diagnostics of the hard-negative tail (docs/algorithms.md 1.4): POT/GPD fits and likelihood link selection.

Command line: ``python -m st_weince.diagnostics --help`` (or ``st-weince-diagnostics``).
"""

from st_weince.diagnostics.evt import PotFit, fit_gpd, gpd_loglik, gpd_quantile, pot_fit, threshold_stability
from st_weince.diagnostics.link import LinkFit, fit_link, link_loglik

__all__ = [
    "LinkFit",
    "PotFit",
    "fit_gpd",
    "fit_link",
    "gpd_loglik",
    "gpd_quantile",
    "link_loglik",
    "pot_fit",
    "threshold_stability",
]
