"""A documented benchmark command never overwrites committed results unless asked: ``python
benchmarks/simcse_compare.py`` (docs/simcse.md) writes its tables next to its runs, and the committed ones in
``benchmarks/results/simcse/`` only with ``--results-dir`` naming them. Run on a copy of the scripts, so that a
regression cannot touch this checkout's committed files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _copy_of_the_benchmark(root: Path) -> Path:
    """The script with what it imports (benchmarks/lab, eval/, recipes/) and the committed tables, under ``root``."""
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "simcse_compare.py", root / "benchmarks")
    shutil.copytree(REPO / "benchmarks" / "lab", root / "benchmarks" / "lab")
    shutil.copytree(REPO / "benchmarks" / "results" / "simcse", root / "benchmarks" / "results" / "simcse")
    for folder in ("eval", "recipes"):
        (root / folder).mkdir()
        for script in (REPO / folder).glob("*.py"):
            shutil.copy(script, root / folder)
    return root / "benchmarks" / "results" / "simcse"


@pytest.mark.slow  # two runs of the script (it imports sentence-transformers)
def test_simcse_compare_keeps_the_committed_tables_unless_asked(tmp_path):
    committed = _copy_of_the_benchmark(tmp_path / "repo")
    before = {path.name: path.read_bytes() for path in committed.iterdir()}
    runs = tmp_path / "runs"
    runs.mkdir()
    # the starting model's scores, as a finished baseline leaves them (nothing is evaluated)
    (runs / "baseline.json").write_text(json.dumps({"stsb_dev": 80.0, "stsb_test": 82.0, "dev_pairs": 500}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    script = tmp_path / "repo" / "benchmarks" / "simcse_compare.py"
    command = [sys.executable, str(script), "--summarize-only", "--runs-dir", str(runs)]
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=300)
    assert {path.name: path.read_bytes() for path in committed.iterdir()} == before
    assert (runs / "tables" / "summary.md").is_file() and (runs / "tables" / "runs.csv").is_file()

    asked = [*command, "--results-dir", str(committed)]  # asked: the committed tables are rewritten
    subprocess.run(asked, check=True, capture_output=True, env=env, timeout=300)
    assert (committed / "summary.md").read_bytes() != before["summary.md"]
