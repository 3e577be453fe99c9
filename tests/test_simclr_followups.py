"""benchmarks/simclr_grid.py and simclr_negatives.py on the tiny synthetic ImageFolder:
the held-out split, the grid design, the options reaching the loss, the pairing of the summaries."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch

from benchmarks.lab.simclr_eval import load_data
from benchmarks.lab.simclr_runner import STUDY
from tests.conftest import load_script
from tests.test_simclr_study import TINY, image_folder, lines  # noqa: F401  (image_folder is a fixture)


@pytest.fixture(scope="module")
def grid():
    return load_script("benchmarks/simclr_grid.py", "simclr_grid")


@pytest.fixture(scope="module")
def negatives():
    return load_script("benchmarks/simclr_negatives.py", "simclr_negatives")


@pytest.mark.parametrize("square", ["released", "blend"])
def test_latin_square_covers_every_level_three_times_and_holds_the_defaults(grid, square):
    factors = grid.SQUARES[square]
    points = grid.latin_square(square)
    keys = [tuple(p[name] for name in factors) for p in points]
    assert len(set(keys)) == 9
    assert set(keys) <= set(itertools.product(*factors.values()))
    for position, levels in enumerate(factors.values()):
        assert Counter(k[position] for k in keys) == {level: 3 for level in levels}
    # Every pair of factors meets each combination of levels once (a Latin square, not just balanced margins).
    for a, b in itertools.combinations(range(3), 2):
        assert len({(k[a], k[b]) for k in keys}) == 9
    defaults = [p for p in points if grid.is_default(p)]
    assert len(defaults) == 1 and all(
        value == levels[1] for value, levels in zip(defaults[0].values(), factors.values())
    )
    assert len({grid.point_name(p) for p in points}) == 9


def test_lambda_statistics_by_point_follow_q_and_ignore_a_saturated_geometry_gate(grid):
    statistics = load_script("benchmarks/weince_grid_statistics.py", "weince_grid_statistics")
    generator = torch.Generator().manual_seed(0)
    # Well-separated positives and a long Weibull-like tail of negatives: dAIC far above every margin of the grid.
    embeddings = torch.nn.functional.normalize(torch.randn(256, 16, generator=generator), dim=1)
    scores = [
        embeddings
        @ torch.nn.functional.normalize(embeddings + 0.3 * torch.randn(256, 16, generator=generator), dim=1).T
    ]
    base = statistics.WeinceOptions()
    released = {row["point"]: row for row in statistics.statistics_by_point(scores, "released", base)}
    blend = statistics.statistics_by_point(scores, "blend", base)
    assert released["margin2-krho10-kaic1"]["mean_abs_change_vs_default"] == 0.0
    assert min(row["delta_aic_median"] for row in released.values()) > 6.0
    # Points that differ only in the saturated AIC gate give the same lambda to 1e-3.
    assert released["margin0-krho10-kaic0.5"]["lambda_mean"] == pytest.approx(
        released["margin2-krho10-kaic1"]["lambda_mean"], abs=1e-3
    )
    # rho0 is the q-quantile of the shortfalls, so about a share q of the anchors has lambda > 1/2.
    for row in blend:
        assert row["lambda_gt_half"] == pytest.approx(row["options"]["q"], abs=2 / 256)


def test_holdout_is_class_balanced_and_never_trained_on(image_folder):  # noqa: F811
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


def test_grid_runs_every_point_with_its_options_and_reruns_the_best(grid, image_folder, tmp_path, one_torch_thread):  # noqa: F811
    tiny_short = {**TINY, "epochs": 1, "holdout": 4}
    common = ["--data-dir", str(image_folder), "--output-dir", str(tmp_path / "grid"), "--state-dir"]
    common += [str(tmp_path / "state"), "--study-output", str(tmp_path / "study")]
    grid.main([*common, "--override", json.dumps(tiny_short)])
    summary = json.loads((tmp_path / "grid" / "summary.json").read_text())
    assert len(summary["points"]) == 9 and summary["points_missing"] == []
    reference = lines(tmp_path / "grid" / "infonce" / "infonce-seed0.jsonl")[-1]
    for row in summary["points"]:
        records = lines(tmp_path / "grid" / row["point"] / "weince-seed0.jsonl")
        assert [r["type"] for r in records] == ["header", "checkpoint", "final"]  # no epoch-0 evaluation
        header, final = records[0], records[-1]
        assert header["config"]["weince_options"] == row["options"]
        for key, value in row["options"].items():  # the options reached the loss object
            assert header["objective"][key] == value
        assert final["probe_train_images"] == 20  # the 24 training images less the 4 held out
        assert row["linear_minus_infonce"] == pytest.approx(final["linear_top1"] - reference["linear_top1"])
    best = max(summary["points"], key=lambda r: (r["linear_top1"], r["knn_top1"]))
    assert summary["best"]["point"] == best["point"]

    # study 1's reference finals (only InfoNCE seed 1 and default WEINCE seed 0 exist, as after an interrupted study)
    reference_finals = {"infonce-seed1": (50.0, 40.0), "weince-seed0": (10.0, 20.0)}
    (tmp_path / "study").mkdir()
    for name, (linear, knn) in reference_finals.items():
        reference = [
            {"type": "header"},
            {"type": "checkpoint", "epoch": 1, "linear_top1": linear + 1, "knn_top1": knn + 1},
            {"type": "final", "epoch": TINY["epochs"], "linear_top1": linear, "knn_top1": knn},
        ]
        (tmp_path / "study" / f"{name}.jsonl").write_text("\n".join(map(json.dumps, reference)))

    grid.main([*common, "--override", json.dumps(TINY), "--rerun-best", "--rerun-seeds", "0", "1"])
    finals = {}
    for seed in (0, 1):
        rerun = lines(tmp_path / "grid" / "rerun-best" / f"weince-seed{seed}.jsonl")
        assert rerun[0]["config"]["weince_options"] == best["options"]  # the point chosen at seed 0, at every seed
        assert rerun[0]["seed"] == seed
        assert rerun[0]["config"]["holdout"] is None and rerun[-1]["probe_train_images"] == 24  # nothing held out
        assert rerun[-1]["epoch"] == TINY["epochs"]
        finals[seed] = rerun[-1]
    assert finals[0]["linear_top1"] != finals[1]["linear_top1"] or finals[0]["knn_top1"] != finals[1]["knn_top1"]

    grid.main([*common, "--summarize"])
    comparison = json.loads((tmp_path / "grid" / "summary.json").read_text())["rerun_best"]
    assert comparison["seeds"] == [0, 1] and comparison["options"] == best["options"]
    assert comparison["linear_top1"]["mean"] == pytest.approx((finals[0]["linear_top1"] + finals[1]["linear_top1"]) / 2)
    per_seed = comparison["per_seed"]
    assert per_seed["1"]["minus_study_infonce"]["linear_top1"] == pytest.approx(finals[1]["linear_top1"] - 50.0)
    assert per_seed["0"]["minus_study_weince"]["knn_top1"] == pytest.approx(finals[0]["knn_top1"] - 20.0)
    assert "minus_study_infonce" not in per_seed["0"] and "minus_study_weince" not in per_seed["1"]
    # one paired seed each: its difference is the mean, and no spread is claimed
    infonce = comparison["minus_study_infonce"]["knn_top1"]
    assert infonce["n"] == 1 and infonce["mean"] == pytest.approx(finals[1]["knn_top1"] - 40.0)
    # along training, paired on the checkpoint lines of the same epoch; a reference that lacks an epoch is left out
    seed1_epoch1 = lines(tmp_path / "grid" / "rerun-best" / "weince-seed1.jsonl")[2]
    assert seed1_epoch1["type"] == "checkpoint" and seed1_epoch1["epoch"] == 1
    curve = next(row for row in comparison["along_training"] if row["epoch"] == 1)
    assert curve["seeds"] == [0, 1]
    assert curve["minus_study_infonce"]["linear_top1"]["mean"] == pytest.approx(seed1_epoch1["linear_top1"] - 51.0)
    assert all(row["epoch"] == 1 or "minus_study_infonce" not in row for row in comparison["along_training"])
    assert sorted(comparison["full_evaluations"]) == sorted(str(e) for e in {*TINY["full_eval_epochs"], TINY["epochs"]})
    assert (tmp_path / "grid" / "rerun-best" / "difference.png").stat().st_size > 0
    table = (tmp_path / "grid" / "summary.md").read_text()
    assert "| mean +- std (2 seeds) |" in table and f"{finals[1]['linear_top1'] - 50.0:+.2f}" in table


def test_negatives_pairs_the_losses_per_batch_size_with_the_same_images_seen(
    negatives,
    image_folder,  # noqa: F811
    tmp_path,
    one_torch_thread,
):
    out = tmp_path / "negatives"
    negatives.main(
        [
            "--data-dir",
            str(image_folder),
            "--output-dir",
            str(out),
            "--state-dir",
            str(tmp_path / "state"),
            "--override",
            json.dumps({**TINY, "epochs": 1}),
            "--batch-sizes",
            "4",
            "8",
            "--seeds",
            "0",
        ]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert [row["batch_pairs"] for row in summary["rows"]] == [4, 8]
    for row in summary["rows"]:
        batch = row["batch_pairs"]
        infonce = lines(out / f"batch{batch}" / "infonce-seed0.jsonl")[-1]
        weince = lines(out / f"batch{batch}" / "weince-seed0.jsonl")[-1]
        assert infonce["images_seen"] == weince["images_seen"] == 24  # one epoch whatever the batch size
        assert weince["step"] == 24 // batch
        assert row["per_seed"]["0"]["knn_top1_difference"] == pytest.approx(weince["knn_top1"] - infonce["knn_top1"])
        assert row["linear_top1_difference"]["mean"] == pytest.approx(weince["linear_top1"] - infonce["linear_top1"])
    assert (out / "difference.png").stat().st_size > 0
    assert "| 4 | 6 | 1 |" in (out / "summary.md").read_text()


@pytest.mark.parametrize(
    ("override", "expected"),
    [('{"width": 8', "--override must be JSON"), ('{"no_such_key": 1}', "--override has unknown keys ['no_such_key']")],
)
def test_followup_scripts_refuse_a_bad_override_by_name(grid, negatives, override, expected, capsys):
    for script in (grid, negatives):
        with pytest.raises(SystemExit):
            script.main(["--override", override])
        assert expected in capsys.readouterr().err
