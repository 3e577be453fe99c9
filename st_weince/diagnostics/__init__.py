"""Diagnostics of the hard-negative tail (docs/algorithms.md 1.4): POT/GPD fits and likelihood link selection.

Command line: ``python -m st_weince.diagnostics --help`` (or ``st-weince-diagnostics``). The fits need scipy and the
plots matplotlib, the extra ``[diagnostics]``; the losses need neither.
"""

import importlib.util

_MISSING = [name for name in ("scipy", "matplotlib") if importlib.util.find_spec(name) is None]
if _MISSING:  # checked here, before any submodule: the command line and the package fail with the same line
    raise ImportError(
        f"st_weince.diagnostics needs {' and '.join(_MISSING)}, which the losses do not: "
        'pip install "st-weince[diagnostics]"'
    )

# ruff: noqa: E402
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
