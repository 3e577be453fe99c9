"""A documented benchmark command never overwrites committed results unless asked: every script of benchmarks/
writes by default outside ``benchmarks/results/`` (into runs/, which git ignores, or nowhere without an option), and
the committed files only when a command names them. ``python benchmarks/simcse_compare.py`` (docs/simcse.md) is run
for real, on a copy of the scripts, so that a regression cannot touch this checkout's committed files; the other
scripts' defaults are read from their parsers without a run."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results"
SCRIPTS = sorted((REPO / "benchmarks").glob("*.py"))
# the options that name where a script writes
OUTPUT_OPTIONS = ("output", "out", "output_dir", "results_dir", "runs_dir", "study_dir")
# options that default to None, and why nothing lands in benchmarks/results/ then
WRITES_NO_FILE_BY_DEFAULT = {
    ("gpu_study.py", "output"): "parse_args picks the file (test below)",
    ("operator_count.py", "output"): "prints only",
    ("simcse_compare.py", "results_dir"): "RUNS_DIR/tables",
    ("step_parity.py", "output"): "prints only",
}
# what the scripts with required arguments need to reach their parser's defaults (none of them is a default output)
REQUIRED_ARGUMENTS = {
    "kernel_parity.py": "--study-dir S --reference-fingerprint F --fingerprint F --reference-run R --rerun R "
    "--settings A=1",
    "loss_cost_before_after.py": "--before B",
    "loss_parity.py": "--output O",
    "step_parity.py": "0000000",
}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(script: Path, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``script`` builds when run as ``__main__``: it runs until its first ``parse_args`` and stops."""

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [str(script), *REQUIRED_ARGUMENTS.get(script.name, "").split()])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed as parsed:
        return parsed.parser
    raise AssertionError(f"{script.name} ended without parsing its arguments: {output.getvalue()[-500:]}")


def _inside_committed(path: str | Path) -> bool:
    return (REPO / path).resolve().is_relative_to(COMMITTED)


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_no_benchmark_writes_into_the_committed_results_by_default(script, monkeypatch):
    parser = _parser_of(script, monkeypatch)
    options = {action.dest: action for action in parser._actions if action.dest in OUTPUT_OPTIONS}
    assert options, f"{script.name} names no output: add its option to OUTPUT_OPTIONS"
    for dest, action in options.items():
        if action.required:
            continue  # the command names it
        if action.default is None:
            assert (script.name, dest) in WRITES_NO_FILE_BY_DEFAULT, f"{script.name} --{dest}: where does None write?"
            continue
        assert not _inside_committed(action.default), f"{script.name} --{dest} defaults to {action.default}"


def test_gpu_study_picks_a_file_outside_the_committed_results():
    gpu_study = load_script("benchmarks/gpu_study.py", "gpu_study_outputs")
    for pair in ("setup", "link"):
        output = gpu_study.parse_args(["--device", "cpu", "--pair", pair]).output
        assert not _inside_committed(output), output
    asked = COMMITTED / "gpu_study" / "gpu_study.json"
    assert gpu_study.parse_args(["--device", "cpu", "--output", str(asked)]).output == asked


def test_fix_schedules_writes_into_the_committed_runs_only_when_named(monkeypatch):
    study = load_script("benchmarks/simclr_link_or_temperature.py", "simclr_link_or_temperature_outputs")
    folders = []
    monkeypatch.setattr(study, "fix_schedules", folders.append)
    study.main(["--fix-schedules"])
    asked = COMMITTED / "simclr_link_or_temperature"
    study.main(["--fix-schedules", "--output-dir", str(asked)])
    assert not _inside_committed(folders[0]) and folders[1] == asked


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
