"""A user's mistake on a command line gets one line naming the problem and exit status 2 (as argparse), no traceback:
a model path that does not exist, a recipe's run folder passed as a model, a missing checkpoint, a missing file."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from st_weince.utils.cli import KNOWN_HARMLESS_WARNINGS, check_model_path, quiet_known_warnings, user_errors_exit
from tests.conftest import load_script


def run_folder(tmp_path: Path) -> Path:
    """What recipes/simcse.py leaves: checkpoints, results.json, and the model in final/."""
    run = tmp_path / "runs" / "simcse" / "cpu-demo-weince-seed0"
    (run / "final").mkdir(parents=True)
    (run / "final" / "modules.json").write_text("[]\n")
    (run / "final" / "config.json").write_text("{}\n")
    (run / "results.json").write_text("{}\n")
    return run


def one_error_line(capsys, main, argv: list[str], prog: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_check_model_path_names_a_missing_path_and_a_run_folder(tmp_path):
    with pytest.raises(ValueError, match=r"model path '.*no-such-model' does not exist"):
        check_model_path(str(tmp_path / "no-such-model"))
    run = run_folder(tmp_path)
    with pytest.raises(ValueError, match=rf"^{run} is a run folder; the model is in {run / 'final'}$"):
        check_model_path(str(run))
    check_model_path(str(run / "final"))  # the model itself
    check_model_path("sentence-transformers/all-MiniLM-L6-v2")  # a hub name is not a local path


def test_eval_sts_cli(tmp_path, capsys, shared_data):
    sts = load_script("eval/sts.py", "eval_sts_cli_errors")
    argv = ["--tasks", "STSBenchmark", "--data-dir", str(shared_data)]
    line = one_error_line(capsys, sts.main, ["--model", str(tmp_path / "missing"), *argv], "sts.py")
    assert "does not exist" in line
    run = run_folder(tmp_path)
    line = one_error_line(capsys, sts.main, ["--model", str(run), *argv], "sts.py")
    assert line == f"sts.py: error: {run} is a run folder; the model is in {run / 'final'}"
    line = one_error_line(capsys, sts.main, ["--model", str(run / "final"), "--data-dir", str(tmp_path)], "sts.py")
    assert "missing data file" in line


def test_mteb_eval_cli(tmp_path, capsys, shared_data):
    mteb_eval = load_script("eval/mteb_eval.py", "eval_mteb_cli_errors")
    run = run_folder(tmp_path)
    argv = ["--models", str(run), "--tasks", "STSBenchmark", "--data-dir", str(shared_data)]
    line = one_error_line(capsys, mteb_eval.main, argv, "mteb_eval.py")
    assert line.endswith(f"{run} is a run folder; the model is in {run / 'final'}")


def test_compare_cli(tmp_path, capsys):
    compare = load_script("eval/compare.py", "eval_compare_cli_errors")
    line = one_error_line(capsys, compare.main, [str(tmp_path / "missing.json")], "compare.py")
    assert "does not exist" in line


def test_diagnostics_cli(tmp_path, capsys):
    from st_weince.diagnostics.__main__ import main

    sentences = tmp_path / "sentences.txt"
    sentences.write_text("a sentence\nanother one\n")
    argv = ["--model", str(run_folder(tmp_path)), "--sentences", str(sentences), "--output-dir", str(tmp_path / "o")]
    line = one_error_line(capsys, main, argv, "st-weince-diagnostics")
    assert "is a run folder; the model is in" in line


def test_simcse_recipe_cli(tmp_path, capsys):
    recipe = load_script("recipes/simcse.py", "simcse_cli_errors")
    missing = tmp_path / "runs" / "checkpoint-40"
    argv = ["--model", "tiny", "--output-dir", str(tmp_path / "out"), "--resume-from-checkpoint", str(missing)]
    line = one_error_line(capsys, recipe.main, argv, "simcse.py")
    assert line == f"simcse.py: error: --resume-from-checkpoint {str(missing)!r} does not exist"
    run = run_folder(tmp_path)
    with pytest.raises(ValueError, match="is a run folder; the model is in"):
        recipe.load_simcse_model(recipe.parse_args(["--model", str(run), "--output-dir", str(tmp_path / "out")]))


def test_simclr_recipe_cli(tmp_path, capsys):
    recipe = load_script("recipes/simclr.py", "simclr_cli_errors")
    argv = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "missing"), "--no-download", "--output-dir",
            str(tmp_path / "out")]  # fmt: skip
    one_error_line(capsys, recipe.main, argv, "simclr.py")


def test_an_unexpected_error_keeps_its_traceback():
    with pytest.raises(KeyError), user_errors_exit("tool.py"):
        raise KeyError("a bug")


def test_known_harmless_warnings_are_filtered_and_ours_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_known_warnings()
        warnings.warn_explicit(
            "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be "
            "used.", UserWarning, "dataloader.py", 1, module="torch.utils.data.dataloader",
        )  # fmt: skip
        warnings.warn_explicit("The task 'STSBenchmark' is superseded by 'STSBenchmark.v2'.", UserWarning,
                               "evaluate.py", 1, module="mteb.evaluate")  # fmt: skip
        warnings.warn_explicit("renamed", FutureWarning, "model_meta.py", 1, module="mteb.models.model_meta")
        warnings.warn_explicit("a FutureWarning of our own", FutureWarning, "cli.py", 1, module="st_weince.utils.cli")
    assert [str(w.message) for w in caught] == ["a FutureWarning of our own"]
    assert len(KNOWN_HARMLESS_WARNINGS) == 3
