"""st-weince: WEINCE and RB-Sigmoid contrastive losses for sentence-transformers."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["MatchProbability", "match_probability"]


def __getattr__(name: str) -> Any:
    # lazily, so that ``import st_weince`` stays light (no sentence-transformers import)
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("st_weince.calibration"), name)
    raise AttributeError(f"module 'st_weince' has no attribute {name!r}")
