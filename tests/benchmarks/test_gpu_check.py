"""benchmarks/gpu_check.py in its CPU smoke mode: every section runs, and what it measures holds on CPU too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_gpu_check_quick_on_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    output = tmp_path / "gpu_check.json"
    gpu_check.main(["--device", "cpu", "--quick", "--output", str(output)])
    report = json.loads(output.read_text())
    for section in ("syncs", "loss_level", "low_precision", "whole_step"):
        assert "error" not in report[section], report[section].get("traceback")
    for row in report["low_precision"]["accuracy"]:  # half-precision embeddings are computed in float32
        assert row["relative_loss_error_vs_float64"] < 1e-5
        assert max(row["gradient_error_over_rounding_error"]) <= 2.0
    assert {row["input_dtype"] for row in report["low_precision"]["cost"]} == {"float32", "bfloat16", "float16"}
    syncs = report["syncs"]
    assert syncs["mnrl/check_inputs=True"]["dispatch_count"] == 0
    for name in ("weince", "rb_sigmoid"):
        assert syncs[f"{name}/check_inputs=False"]["dispatch_count"] == 0
        assert syncs[f"{name}/check_inputs=True"]["dispatch_count"] <= 1
        # the cached variants add at most the one check read to what the mixin itself costs (CMNRL)
        baseline = syncs["cmnrl/check_inputs=True"]["dispatch_count"]
        assert syncs[f"cached_{name}/check_inputs=False"]["dispatch_count"] == baseline
        assert syncs[f"cached_{name}/check_inputs=True"]["dispatch_count"] <= baseline + 1
    rows = [row for row in report["loss_level"]["rows"] if "skipped" not in row]
    assert rows, "no loss-level row ran"
    for row in rows:
        assert set(row["ratio"]) >= {"weince/eager", "rb_sigmoid/eager", "cached_weince/eager", "weince/compiled"}
        assert all(value > 0 for value in row["ratio"].values())
        assert max(row["compiled_minus_eager"].values()) < 1e-4
    for kind, baseline in (("uncached", "mnrl"), ("cached", "cmnrl")):
        step = report["whole_step"][kind]
        assert baseline in step["seconds"] and len(step["ratio"]) == 2
    assert report["provenance"]["command"].startswith("python")
    sys.modules.pop("gpu_check", None)
    sys.modules.pop("low_precision", None)
