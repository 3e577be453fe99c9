"""benchmarks/lab/simclr_runner.py, the runner of the SimCLR studies, driven by its one study left on the tree
(benchmarks/simclr_ablation.py) at a tiny configuration on a synthetic ImageFolder: resume, skipping, restart,
lockstep pairing, a refused configuration, the held-out split, and the summaries' helpers. (The tests of the retired
study scripts, simclr_study/grid/negatives, run from commit 82267c0: docs/evidence.md.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.lab.simclr_eval import load_data
from benchmarks.lab.simclr_runner import STUDY, run_groups
from benchmarks.lab.summaries import docs_blocks, format_stat, mean_std, paired_difference, update_docs
from tests.conftest import load_script

TINY = {
    "width": 2,
    "hidden_dim": 8,
    "projection_dim": 4,
    "batch_size": 8,
    "epochs": 3,
    "probe_subset": 8,
    "probe_epochs": 2,
    "pot_images": 16,  # 120 pairs
    "pot_quantile": 0.7,  # 36 exceedances (pot_fit needs 30)
    "full_eval_epochs": [2],
}
# The runner at the BatchNorm-head setup (what study 1 trained): full evaluations, POT fits, WEINCE's statistics.
BATCHNORM_HEAD = {**TINY, "setup": "batchnorm-head", "lr": 1e-3, "weight_decay": 1e-6, "temperature": 0.5}
FULL_RUN = ["header", "checkpoint", "checkpoint", "checkpoint", "full", "checkpoint", "final"]
TIMING_KEYS = {"train_seconds", "eval_seconds", "elapsed_seconds", "load_average"}


@pytest.fixture(scope="module")
def study():
    return load_script("benchmarks/simclr_ablation.py", "simclr_ablation")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """Two classes of 16x16 images (reddish / bluish noise): 12 train and 10 test images per class."""
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 10)):
        for label, channel in (("red", 0), ("blue", 2)):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 120, size=(16, 16, 3), dtype=np.uint8)
                pixels[..., channel] += 120
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")
    return root


def run_study(study, image_folder: Path, out: Path, *extra: str, override: dict | None = None) -> None:
    """``study.main`` (a script on the runner) on the tiny folder, results and states under ``out``."""
    study.main(
        [
            "--data-dir",
            str(image_folder),
            "--output-dir",
            str(out / "results"),
            "--state-dir",
            str(out / "state"),
            "--override",
            json.dumps(BATCHNORM_HEAD if override is None else override),
            *extra,
        ]
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING_KEYS}


def test_resume_after_a_stop_gives_the_uninterrupted_result(study, image_folder, tmp_path, one_torch_thread):
    run_study(study, image_folder, tmp_path / "straight", "--runs", "blend-seed0")
    run_study(study, image_folder, tmp_path / "resumed", "--runs", "blend-seed0", "--stop-after-epoch", "1")
    stopped = lines(tmp_path / "resumed" / "results" / "blend-seed0.jsonl")
    assert [r["type"] for r in stopped] == ["header", "checkpoint", "checkpoint"]  # epochs 0 and 1, no final line
    run_study(study, image_folder, tmp_path / "resumed", "--runs", "blend-seed0")

    straight = lines(tmp_path / "straight" / "results" / "blend-seed0.jsonl")
    resumed = lines(tmp_path / "resumed" / "results" / "blend-seed0.jsonl")
    assert [r["type"] for r in straight] == FULL_RUN
    assert [r["type"] for r in resumed] == [*FULL_RUN[:3], "resume", *FULL_RUN[3:]]
    assert resumed[3]["from_epoch"] == 1
    evaluated_straight = [without_timing(r) for r in straight if r["type"] in ("checkpoint", "full", "final")]
    evaluated_resumed = [without_timing(r) for r in resumed if r["type"] in ("checkpoint", "full", "final")]
    assert evaluated_resumed == evaluated_straight  # bit-identical metrics, statistics and POT fits
    final = straight[-1]
    assert final["epoch"] == 3 and final["step"] == 3 * 3 and final["images_seen"] == 3 * 3 * 8
    assert final["probe_train_images"] == 24  # the final probes use all training images, the curve the subset
    assert straight[-2]["probe_train_images"] == 8
    assert straight[4]["epoch"] == 2 and straight[4]["probe_train_images"] == 24  # the milestone's full probes
    assert final["loss_statistics"]["weince_lambda_mean"] >= 0.0
    assert final["pot_projection"]["num_exceedances"] == 36

    state_a = torch.load(tmp_path / "straight" / "state" / "blend-seed0" / "state.pt", weights_only=False)
    state_b = torch.load(tmp_path / "resumed" / "state" / "blend-seed0" / "state.pt", weights_only=False)
    for key, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][key]), key
    assert torch.equal(state_a["augment_rng"], state_b["augment_rng"])

    # A finished run is skipped: its file stays as it is.
    before = (tmp_path / "straight" / "results" / "blend-seed0.jsonl").read_text()
    run_study(study, image_folder, tmp_path / "straight", "--runs", "blend-seed0")
    assert (tmp_path / "straight" / "results" / "blend-seed0.jsonl").read_text() == before


def test_unfinished_run_without_state_restarts_from_scratch(study, image_folder, tmp_path, one_torch_thread):
    run_study(study, image_folder, tmp_path, "--runs", "infonce-seed0", "--stop-after-epoch", "1")
    (tmp_path / "state" / "infonce-seed0" / "state.pt").unlink()
    run_study(study, image_folder, tmp_path, "--runs", "infonce-seed0")
    records = lines(tmp_path / "results" / "infonce-seed0.jsonl")
    assert [r["type"] for r in records] == FULL_RUN


def test_losses_share_initialisation_and_advance_in_lockstep(study, image_folder, tmp_path, one_torch_thread):
    run_study(study, image_folder, tmp_path, "--runs", "infonce-seed0", "blend-seed0", "infonce-seed1")
    infonce = lines(tmp_path / "results" / "infonce-seed0.jsonl")
    weince = lines(tmp_path / "results" / "blend-seed0.jsonl")
    other_seed = lines(tmp_path / "results" / "infonce-seed1.jsonl")
    # Epoch 0 is evaluated before any step: the same seed gives the same network whatever the loss.
    assert infonce[1]["encoder_weince_statistics"] == weince[1]["encoder_weince_statistics"]
    assert infonce[1]["encoder_weince_statistics"] != other_seed[1]["encoder_weince_statistics"]
    assert infonce[1]["loss_statistics"] == {} and "weince_lambda_mean" in weince[2]["loss_statistics"]

    # The two runs of seed 0 advanced epoch by epoch in turn: the same lines as a run on its own, no resume line.
    run_study(study, image_folder, tmp_path / "alone", "--runs", "blend-seed0")
    alone = lines(tmp_path / "alone" / "results" / "blend-seed0.jsonl")
    assert [r["type"] for r in weince] == FULL_RUN
    assert [without_timing(r) for r in weince[1:]] == [without_timing(r) for r in alone[1:]]
    assert run_groups([("infonce", 0), ("blend", 0), ("infonce", 1), ("blend", 1), ("rb-sigmoid", 1)]) == [
        [("infonce", 0), ("blend", 0)],
        [("infonce", 1), ("blend", 1), ("rb-sigmoid", 1)],
    ]


def test_resume_refuses_a_changed_configuration(study, image_folder, tmp_path, one_torch_thread):
    run_study(study, image_folder, tmp_path, "--runs", "blend-seed0", "--stop-after-epoch", "1")
    with pytest.raises(ValueError, match="different configuration.*probe_epochs"):
        study.main(
            [
                "--data-dir",
                str(image_folder),
                "--output-dir",
                str(tmp_path / "results"),
                "--state-dir",
                str(tmp_path / "state"),
                "--override",
                json.dumps({**BATCHNORM_HEAD, "probe_epochs": 3}),
                "--runs",
                "blend-seed0",
            ]
        )


def test_update_docs_replaces_only_the_marked_block(tmp_path):
    start, end = "<!-- simclr_study summary: start -->", "<!-- simclr_study summary: end -->"
    other = "<!-- simclr_grid summary: start -->\ngrid\n<!-- simclr_grid summary: end -->"
    doc = tmp_path / "evidence.md"
    doc.write_text(f"intro\n{start}\nold table\n{end}\n{other}\noutro\n")
    update_docs(doc, "| new | table |", block="simclr_study")
    assert doc.read_text() == f"intro\n{start}\n| new | table |\n{end}\n{other}\noutro\n"
    update_docs(doc, "new grid", block="simclr_grid")
    assert doc.read_text().endswith(
        "<!-- simclr_grid summary: start -->\nnew grid\n<!-- simclr_grid summary: end -->\noutro\n"
    )
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="needs exactly one"):
        update_docs(doc, "x", block="simclr_study")


def test_docs_blocks_reads_back_what_update_docs_wrote(tmp_path):
    doc = tmp_path / "evidence.md"
    doc.write_text(
        "intro\n<!-- simclr_study summary: start -->\nold\n<!-- simclr_study summary: end -->\n"
        "<!-- simclr_grid summary: start -->\ngrid\n<!-- simclr_grid summary: end -->\n"
        "<!-- orphan summary: start -->\nno end of its own\n<!-- other summary: end -->\noutro\n"
    )
    update_docs(doc, "| a | b |\n| - | - |\n| 1 | 2 |", block="simclr_study")
    # A start without its own end is not a block: the names of the two markers must agree.
    assert docs_blocks(doc) == {"simclr_study": "| a | b |\n| - | - |\n| 1 | 2 |", "simclr_grid": "grid"}


def test_mean_std_and_paired_differences_of_the_summaries():
    """One value has a mean and no spread (NaN, shown as the mean alone); a paired difference covers the seeds both
    sides have."""
    single = mean_std([2.5])
    assert single["mean"] == 2.5 and single["n"] == 1 and np.isnan(single["std"])
    assert format_stat(single) == "2.50" and format_stat(single, sign=True) == "+2.50"
    pair = mean_std([1.0, 4.0])
    assert pair["std"] == pytest.approx(np.std([1.0, 4.0], ddof=1))
    assert format_stat(pair, digits=1) == "2.5 +- 2.1"
    assert format_stat(mean_std([])) == "-"
    mine = {0: {"linear_top1": 50.0}, 1: {"linear_top1": 53.0}, 2: {"linear_top1": 40.0}}
    base = {0: {"linear_top1": 49.0}, 1: {"linear_top1": 50.0}}
    difference = paired_difference(mine, base, ["linear_top1"])
    assert difference["seeds"] == [0, 1]
    assert difference["per_seed"] == {"0": {"linear_top1": 1.0}, "1": {"linear_top1": 3.0}}
    assert difference["linear_top1"]["mean"] == 2.0 and difference["linear_top1"]["n"] == 2
    assert paired_difference(mine, {3: {"linear_top1": 1.0}}, ["linear_top1"]) is None


def test_holdout_is_class_balanced_and_never_trained_on(image_folder):
    config = {**STUDY, **TINY, "holdout": 4}
    data = load_data(config, image_folder)
    assert len(data.train) == 20 and len(data.test) == 4
    assert Counter(data.test.labels.tolist()) == {0: 2, 1: 2}
    train_images = {bytes(image.numpy()) for image in data.train.images}
    assert not any(bytes(image.numpy()) in train_images for image in data.test.images)
    # The held-out images come from the training split, not from the test split.
    everything = load_data({**config, "holdout": None}, image_folder)
    assert {bytes(i.numpy()) for i in data.test.images} <= {bytes(i.numpy()) for i in everything.train.images}
    for bad in (0, 24, 2.5, True):
        with pytest.raises(ValueError, match="holdout must be a number of images"):
            load_data({**config, "holdout": bad}, image_folder)


@pytest.mark.parametrize(
    ("override", "expected"),
    [('{"width": 8', "--override must be JSON"), ('{"no_such_key": 1}', "--override has unknown keys ['no_such_key']")],
)
def test_a_bad_override_is_refused_by_name(study, override, expected, capsys):
    with pytest.raises(SystemExit):
        study.main(["--override", override])
    assert expected in capsys.readouterr().err
