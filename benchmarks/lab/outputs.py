"""Where a benchmark writes unless told otherwise: ``runs/benchmarks/<script>/``, which git ignores. The committed
results in ``benchmarks/results/`` change only when a command names them (``--output benchmarks/results/...``), so
that trying a documented command never rewrites the figures the docs cite."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def scratch(script: str, name: str = "") -> Path:
    """``runs/benchmarks/<stem of script>/<name>``: the default output of ``script`` (pass its ``__file__``)."""
    return REPO / "runs" / "benchmarks" / Path(script).stem / name
