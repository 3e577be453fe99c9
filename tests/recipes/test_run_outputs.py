"""recipes/recipe_tools.py's write_run_outputs: the one writer of a recipe's results.json and training-curve figure."""

from __future__ import annotations

import argparse
import json

from recipe_tools import write_run_outputs


def test_results_json_carries_config_command_and_provenance(tmp_path):
    args = argparse.Namespace(loss="weince", seed=3, output_dir=tmp_path / "run")
    history = [
        {"step": 1, "loss": 2.0, "weince_lambda_mean": 0.1, "learning_rate": 1e-5},
        {"step": 2, "loss": 1.5, "weince_lambda_mean": 0.2},
        {"step": 2, "eval_dev": 0.5},
    ]
    record = write_run_outputs(tmp_path / "run", {"steps": 2, "score": 71.5}, args, log_history=history,
                               title="demo", dev_metric="eval_dev")  # fmt: skip
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved == json.loads(json.dumps(record, default=str))
    assert saved["steps"] == 2 and saved["score"] == 71.5
    assert saved["config"] == {"loss": "weince", "seed": 3, "output_dir": str(tmp_path / "run")}
    assert saved["command"].startswith("python")
    assert saved["environment"]["versions"]["torch"] and "git_commit" in saved["environment"]
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 10_000


def test_no_dev_metric_and_no_history(tmp_path):
    """A run without a dev metric (SimCLR) still gets its curves; a run without training logs gets no figure."""
    write_run_outputs(tmp_path / "a", {}, {"loss": "infonce"}, log_history=[{"step": 1, "loss": 1.0}])
    assert (tmp_path / "a" / "training_curves.png").stat().st_size > 5_000
    write_run_outputs(tmp_path / "b", {"x": 1}, {}, log_history=[])
    assert json.loads((tmp_path / "b" / "results.json").read_text())["x"] == 1
    assert not (tmp_path / "b" / "training_curves.png").exists()


def test_other_processes_get_the_record_and_write_nothing(tmp_path):
    record = write_run_outputs(
        tmp_path / "c", {"x": 1}, {"seed": 0}, log_history=[{"step": 1, "loss": 1.0}], write=False
    )
    assert record["x"] == 1 and record["config"] == {"seed": 0} and "environment" in record
    assert not (tmp_path / "c").exists()
