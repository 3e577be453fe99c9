"""benchmarks/simclr_link_or_temperature.py on the tiny synthetic ImageFolder: every step's loss and statistics are
logged, a schedule is fixed from a finished run only, the scheduled arm follows it step for step (also across a
resume), and the headers record the CPU."""

from __future__ import annotations

import json
import math

import pytest

from tests.benchmarks.test_simclr_ablation import TINY_RELEASED
from tests.benchmarks.test_simclr_runner import image_folder, lines, run_study  # noqa: F401
from tests.conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("benchmarks/simclr_link_or_temperature.py", "simclr_link_or_temperature")


def run(study, image_folder, out, *extra):  # noqa: F811
    run_study(study, image_folder, out, *extra, override=TINY_RELEASED)


def test_the_scheduled_arm_follows_the_shortfall_terms_logged_scale_step_for_step(
    study,
    image_folder,  # noqa: F811
    tmp_path,
    one_torch_thread,
):
    results = tmp_path / "results"
    run(study, image_folder, tmp_path, "--runs", "infonce-topm-shortfall-seed0", "--stop-after-epoch", "1")
    with pytest.raises(ValueError, match="no final line"):  # a schedule comes from a whole run
        study.schedules.fix_schedule(results, study.SHORTFALL, 0)
    with pytest.raises(FileNotFoundError, match="--fix-schedules"):
        run(study, image_folder, tmp_path, "--runs", "infonce-topm-infonce-scheduled-seed0")
    run(study, image_folder, tmp_path, "--runs", "infonce-topm-shortfall-seed0")
    source = lines(results / "infonce-topm-shortfall-seed0.jsonl")
    header = source[0]
    assert header["machine"]["cpu"]["family"] and header["machine"]["cpu"]["aten_capability"]
    steps = [r for r in source if r["type"] == "steps"]
    assert [r["epoch"] for r in steps] == [1, 2]  # the resume kept epoch 1's line and added epoch 2's
    per_epoch = 24 // TINY_RELEASED["batch_size"]
    scales = [v for r in steps for v in r["loss_statistics"]["weince_effective_scale_top_m_shortfall"]]
    assert len(scales) == 2 * per_epoch and all(math.isfinite(v) and v > 0 for v in scales)
    # The epoch's mean statistics are the means of its steps.
    checkpoint = next(r for r in source if r["type"] == "checkpoint" and r["epoch"] == 2)
    assert checkpoint["loss_statistics"]["weince_effective_scale_top_m_shortfall"] == pytest.approx(
        sum(scales[per_epoch:]) / per_epoch
    )
    assert checkpoint["train_loss"] == pytest.approx(sum(steps[1]["loss"]) / per_epoch, rel=1e-6)

    study.main(["--fix-schedules", "--output-dir", str(results)])
    schedule = json.loads((results / "schedules" / "infonce-topm-shortfall-seed0.json").read_text())
    assert schedule["values"] == scales and schedule["steps"] == len(scales)
    assert schedule["source_git_commit"] == header["git_commit"]

    # Stopped after epoch 1 and resumed: the scale still follows the schedule at every step.
    run(study, image_folder, tmp_path, "--runs", "infonce-topm-infonce-scheduled-seed0", "--stop-after-epoch", "1")
    run(study, image_folder, tmp_path, "--runs", "infonce-topm-infonce-scheduled-seed0")
    scheduled = lines(results / "infonce-topm-infonce-scheduled-seed0.jsonl")
    followed = [
        v
        for r in scheduled
        if r["type"] == "steps"
        for v in r["loss_statistics"]["weince_effective_scale_top_m_infonce"]
    ]
    assert followed == pytest.approx(scales, rel=1e-6)  # logged in float32
    assert scheduled[0]["objective"]["infonce_scale_schedule"]["source_sha256"] == schedule["source_sha256"]
    assert "resume" in [r["type"] for r in scheduled] and scheduled[-1]["type"] == "final"

    # The warm-start arm: arm 2's first epoch bit for bit (steps, probes, POT), then the scheduled linear term at
    # arm 2's scale from the handover step on, across a stop and resume at the handover.
    run(study, image_folder, tmp_path, "--runs", f"{study.WARM}-seed0", "--stop-after-epoch", "1")
    run(study, image_folder, tmp_path, "--runs", f"{study.WARM}-seed0")
    warm = lines(results / f"{study.WARM}-seed0.jsonl")
    timings = ("train_seconds", "eval_seconds", "elapsed_seconds", "load_average")

    def epoch_one(records):
        return [
            {k: v for k, v in r.items() if k not in timings}
            for r in records
            if r["type"] in ("checkpoint", "steps") and r["epoch"] <= 1
        ]

    assert epoch_one(warm) == epoch_one(source)
    warm_steps = [r for r in warm if r["type"] == "steps"]
    assert [r["epoch"] for r in warm_steps] == [1, 2]
    assert "weince_effective_scale_top_m_infonce" not in warm_steps[0]["loss_statistics"]
    assert warm_steps[1]["loss_statistics"]["weince_effective_scale_top_m_infonce"] == pytest.approx(
        scales[per_epoch:], rel=1e-6
    )
    assert warm[0]["objective"]["handover_step"] == per_epoch and warm[-1]["type"] == "final"
