"""benchmarks/gpu_study.py in its CPU smoke mode (``--device cpu --quick``) on the shared CIFAR-10 zip."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_script


def load_gpu_study():
    return load_script("benchmarks/gpu_study.py", "gpu_study")


@pytest.fixture(scope="module")
def gpu_study():
    return load_gpu_study()


@pytest.mark.parametrize("setup, arm", [("batchnorm-head", "blend"), ("released", "composite")])
def test_quick_cpu_run_writes_one_json_with_both_arms(gpu_study, shared_data, tmp_path, one_torch_thread, setup, arm):
    output = tmp_path / "gpu.json"
    zip_path = shared_data / "cifar10" / "cifar10-jpg.zip"
    result = gpu_study.main(
        ["--device", "cpu", "--quick", "--epochs", "2", "--data-dir", str(zip_path), "--output", str(output)]
        + ["--setup", setup, "--probe-epochs", "3"]
    )
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))
    infonce, weince = result["results"]["infonce"], result["results"][arm]
    steps = 256 // 32
    for record in (infonce, weince):
        assert record["epochs"] == 2 and record["steps"] == 2 * steps and record["images_seen"] == 2 * steps * 32
        assert 0.0 <= record["knn_top1"] <= 100.0 and record["knn_k"] == 20
        assert len(record["train_loss_per_epoch"]) == 2
    assert weince["loss_statistics_last_epoch"]["weince_lambda_mean"] >= 0.0
    assert infonce["loss_statistics_last_epoch"] == {}
    assert result["weince_minus_infonce_knn_top1"] == pytest.approx(weince["knn_top1"] - infonce["knn_top1"])
    assert result["config"]["bf16"] and result["config"]["channels_last"] and result["config"]["width"] == 4
    assert result["config"]["train_images"] == 256 and result["config"]["test_images"] == 128
    assert "versions" in result and "git_commit" in result
    lr, decay = (3e-4, 0.0) if setup == "released" else (1e-3, 1e-6)
    assert (result["config"]["lr"], result["config"]["weight_decay"]) == (lr, decay)
    if setup == "released":
        # The composite's options reached the loss; its batch tail index is logged; the released probe protocol ran.
        objective = weince["objective"]
        assert (objective["top_m"]["shortfall_weight"], objective["top_m"]["infonce_weight"]) == (0.5, 0.5)
        assert (objective["scale"], objective["beta"]) == (2.0, 1.0)
        assert weince["loss_statistics_last_epoch"]["weince_batch_beta"] > 0.0
        for record in (infonce, weince):
            assert record["probe_protocol"]["protocol"] == "released"
            assert record["probe_protocol"]["linear_val_top1"] is not None
    else:
        assert "probe_protocol" not in infonce  # the blend alone: no top-M term
        assert weince["objective"]["top_m"] is None


def test_budget_decides_epochs_and_the_second_loss_follows(gpu_study, shared_data, tmp_path, one_torch_thread):
    zip_path = shared_data / "cifar10" / "cifar10-jpg.zip"
    argv = ["--device", "cpu", "--quick", "--budget-seconds", "0.01", "--data-dir", str(zip_path)]
    result = gpu_study.main([*argv, "--setup", "batchnorm-head", "--output", str(tmp_path / "gpu.json")])
    # A budget smaller than one epoch still trains one whole epoch; WEINCE then trains exactly as many.
    assert result["results"]["infonce"]["epochs"] == 1 == result["results"]["blend"]["epochs"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(gpu_study, capsys):
    with pytest.raises(SystemExit):
        gpu_study.parse_args(["--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_the_link_pair_trains_the_shortfall_arm_the_matched_and_the_scheduled_linear_arm(
    gpu_study, shared_data, tmp_path, one_torch_thread
):
    """--pair link: arm 3, the linear top-M term at the fixed scale 30.87, and the linear term whose scale follows
    arm 3's per-step effective scale of this run, step for step (the scheduled arm of
    benchmarks/simclr_link_or_temperature.py)."""
    zip_path = shared_data / "cifar10" / "cifar10-jpg.zip"
    result = gpu_study.main(
        ["--device", "cpu", "--quick", "--epochs", "2", "--data-dir", str(zip_path), "--output", str(tmp_path / "g")]
        + ["--pair", "link", "--probe-epochs", "2"]
    )
    assert gpu_study.LINK_ARMS == ("infonce-topm-shortfall", "infonce-topm-infonce-matched",
                                   "infonce-topm-infonce-scheduled")  # fmt: skip
    shortfall, linear, scheduled = (result["results"][name] for name in gpu_study.LINK_ARMS)
    assert shortfall["objective"]["top_m"]["shortfall_weight"] == 0.5 and shortfall["objective"]["mode"] == "none"
    assert linear["objective"]["top_m"]["infonce_scale"] == pytest.approx(30.87)
    assert linear["loss_statistics_last_epoch"]["weince_effective_scale_top_m_infonce"] == pytest.approx(30.87)
    # the schedule: arm 3's logged per-step effective scale, every step of both epochs, followed step for step
    steps = 2 * (256 // 32)
    source = shortfall["per_step"]["loss_statistics"]["weince_effective_scale_top_m_shortfall"]
    followed = scheduled["per_step"]["loss_statistics"]["weince_effective_scale_top_m_infonce"]
    assert len(source) == steps == len(followed) == len(scheduled["per_step"]["loss"])
    assert followed == pytest.approx(source, rel=1e-6)  # logged in float32
    assert scheduled["objective"]["top_m"]["infonce_scale"] == "scheduled"
    assert scheduled["objective"]["infonce_scale_schedule"]["steps"] == steps
    assert scheduled["epochs"] == shortfall["epochs"] == 2
    assert result["weince_minus_infonce_knn_top1"] == pytest.approx(linear["knn_top1"] - shortfall["knn_top1"])
    assert result["minus_first_arm_knn_top1"]["infonce-topm-infonce-scheduled"] == pytest.approx(
        scheduled["knn_top1"] - shortfall["knn_top1"]
    )
    assert set(result["config"]["arms"]) == set(gpu_study.LINK_ARMS)
    with pytest.raises(ValueError, match="train infonce-topm-shortfall first"):
        gpu_study.link_schedule({}, "infonce-topm-infonce-scheduled", 0)
    assert gpu_study.parse_args(["--device", "cpu", "--pair", "link"]).output == gpu_study.DEFAULT_OUTPUT_LINK
    with pytest.raises(SystemExit):
        gpu_study.parse_args(["--device", "cpu", "--pair", "link", "--setup", "batchnorm-head"])


def test_setup_unknown_name_lists_the_setups(gpu_study, capsys):
    with pytest.raises(SystemExit):
        gpu_study.parse_args(["--device", "cpu", "--setup", "nosuch"])
    assert "batchnorm-head" in capsys.readouterr().err
