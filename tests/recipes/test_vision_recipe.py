"""recipes/simclr.py end to end on a tiny offline zip: a few training steps, both evaluations, the saved encoder."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import load_script

from simclr_tools.models import load_encoder

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def recipe():
    return load_script("recipes/simclr.py", "simclr_recipe")


@pytest.fixture(scope="module")
def tiny_zip(tmp_path_factory) -> Path:
    """3 classes of 16x16 JPEGs (a colour each, plus noise) in train/ and test/, zipped; built in tmp."""
    rng = np.random.default_rng(0)
    target = tmp_path_factory.mktemp("tiny-images") / "tiny.zip"
    colours = {"red": (200, 40, 40), "green": (40, 200, 40), "blue": (40, 40, 200)}
    with zipfile.ZipFile(target, "w") as archive:
        for split, count in (("train", 8), ("test", 4)):
            for name, colour in colours.items():
                for index in range(count):
                    noise = rng.integers(-30, 30, size=(16, 16, 3))
                    array = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
                    buffer = Path(target.parent / "image.jpg")
                    Image.fromarray(array).save(buffer)
                    archive.write(buffer, f"{split}/{name}/{index:04d}.jpg")
    return target


@pytest.mark.parametrize("loss", ["infonce", "weince", "rb-sigmoid"])
def test_few_steps_end_to_end_writes_results_and_encoder(recipe, tiny_zip, tmp_path, loss):
    if loss == "rb-sigmoid":
        pytest.importorskip("st_weince.losses.rb_sigmoid")
    output = tmp_path / loss
    argv = ["--dataset", "imagefolder", "--data-dir", str(tiny_zip), "--loss", loss, "--backbone", "resnet18"]
    argv += ["--width", "2", "--hidden-dim", "8", "--projection-dim", "8", "--batch-size", "6", "--max-steps", "3"]
    argv += ["--limit-train", "18", "--limit-eval", "9", "--probe-epochs", "3", "--log-every", "1"]
    argv += ["--seed", "1", "--output-dir", str(output), "--lr", "1e-2"]
    returned = recipe.main(argv)

    results = json.loads((output / "results.json").read_text())
    assert results["linear_top1"] == pytest.approx(returned["linear_top1"])
    for key in ("linear_top1", "knn_top1"):
        assert 0.0 <= results[key] <= 100.0
    assert results["pretrain_images"] == 18 and results["eval_images"] == 9 and results["steps"] == 3
    assert sorted(results["knn"]["top1"], key=int) == ["1", "2", "5", "10"]  # k <= 18 train images
    assert results["knn_headline_k"] == 10
    assert len(results["history"]) == 3 and all(np.isfinite(h["loss"]) for h in results["history"])
    assert results["throughput"]["source_images_per_second_data_pipeline"] > 0
    assert (
        results["objective"]["loss_class"]
        == {
            "infonce": "MultipleNegativesRankingLoss",
            "weince": "WEINCELoss",
            "rb-sigmoid": "RBSigmoidLoss",
        }[loss]
    )
    if loss == "rb-sigmoid":
        # t and b_rel are trained (they start at 10 and 0.8 and move under lr 1e-2).
        assert results["loss_parameters"]["loss.log_t"] != pytest.approx(float(np.log(10.0)), abs=1e-4)
        assert results["loss_parameters"]["loss.b_rel"] != pytest.approx(0.8, abs=1e-4)
    if loss == "weince":
        assert "weince_lambda_mean" in results["history"][-1]

    # The saved encoder is the trained one: reloading reproduces the features the evaluation used.
    model = load_encoder(output)
    initial = recipe.SimCLRModel("resnet18", width=2, hidden_dim=8, projection_dim=8)
    trained_weight, initial_weight = model.encoder.conv1.weight, initial.encoder.conv1.weight
    assert trained_weight.shape == initial_weight.shape and not torch.equal(trained_weight, initial_weight)


def test_same_seed_gives_the_same_run(recipe, tiny_zip, tmp_path):
    argv = ["--dataset", "imagefolder", "--data-dir", str(tiny_zip), "--loss", "weince", "--width", "2"]
    argv += ["--hidden-dim", "8", "--projection-dim", "8", "--batch-size", "6", "--max-steps", "2", "--skip-eval"]
    argv += ["--limit-train", "12", "--log-every", "1", "--no-save-model"]
    first = recipe.main([*argv, "--output-dir", str(tmp_path / "a")])
    second = recipe.main([*argv, "--output-dir", str(tmp_path / "b")])
    assert [h["loss"] for h in first["history"]] == [h["loss"] for h in second["history"]]
    assert "linear_top1" not in first and not (tmp_path / "a" / "model.pt").exists()


def test_recipe_rejects_bad_flags(recipe, tiny_zip, tmp_path):
    with pytest.raises(SystemExit):
        recipe.parse_args(["--limit-train", "0"])
    with pytest.raises(SystemExit):
        recipe.parse_args(["--loss", "triplet"])
    with pytest.raises(ValueError, match="batch-size 64 needs at least"):
        recipe.run(recipe.parse_args(["--dataset", "imagefolder", "--data-dir", str(tiny_zip), "--batch-size", "64"]))
    with pytest.raises(ValueError, match="needs --data-dir"):
        recipe.run(recipe.parse_args(["--dataset", "imagefolder", "--data-dir", str(tmp_path / "missing")]))
    with pytest.raises(SystemExit) as exit_info:  # the command line: one line and exit status 2 (test_cli_errors.py)
        recipe.main(["--dataset", "imagefolder", "--data-dir", str(tmp_path / "missing")])
    assert exit_info.value.code == 2


def test_scale_is_rb_sigmoids_starting_t(recipe, tiny_zip, tmp_path):
    assert recipe.parse_args(["--loss", "rb-sigmoid"]).scale is None  # its own default, not InfoNCE's 2
    argv = ["--dataset", "imagefolder", "--data-dir", str(tiny_zip), "--loss", "rb-sigmoid", "--scale", "3"]
    argv += ["--width", "2", "--hidden-dim", "8", "--projection-dim", "8", "--batch-size", "6", "--max-steps", "1"]
    argv += ["--limit-train", "6", "--skip-eval", "--no-save-model", "--lr", "0", "--output-dir", str(tmp_path)]
    results = recipe.main(argv)
    assert results["objective"]["scale"] == pytest.approx(3.0)  # lr 0: t is where --scale started it


def test_loss_flags_are_spelled_as_in_the_simcse_recipe(recipe):
    args = recipe.parse_args(["--loss-option", "beta=auto", "--loss-option", "gate.kappa_rho=3", "--scale", "4"])
    assert args.scale == 4.0 and args.loss_kwargs == {"beta": "auto", "gate": {"kappa_rho": 3}}
    assert recipe.parse_args([]).scale == pytest.approx(2.0)  # SimCLR's temperature 0.5
    for removed in (["--temperature", "0.25"], ["--beta", "auto"], ["--loss-kwargs", '{"kappa_rho": 3}']):
        with pytest.raises(SystemExit):
            recipe.parse_args(removed)
    with pytest.raises(SystemExit):
        recipe.parse_args(["--loss-option", "beta"])  # KEY=VALUE


def test_prints_and_records_the_processes(recipe, tiny_zip, tmp_path, monkeypatch, capsys):
    """Under ``accelerate launch --cpu --num_processes 2`` (its environment and command line, as observed; the one
    process it starts) the recipe says it trains on 1, names the torchrun command for 2, and records both."""
    from st_weince.training import processes

    argv = ["--dataset", "imagefolder", "--data-dir", str(tiny_zip), "--width", "2", "--hidden-dim", "8"]
    argv += ["--projection-dim", "8", "--batch-size", "6", "--max-steps", "1", "--limit-train", "6", "--skip-eval"]
    argv += ["--no-save-model", "--output-dir", str(tmp_path)]
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *processes.MPI_SIZE_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("ACCELERATE_USE_CPU", "True"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("sys.argv", ["recipes/simclr.py", *argv])
    launcher = ["python3", "/usr/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "recipes/simclr.py", *argv]
    monkeypatch.setattr(processes, "_parent_command_line", lambda: launcher)
    results = recipe.main(argv)
    out, err = capsys.readouterr()
    assert out.startswith("training on 1 process (world size 1)\n")
    assert err.startswith("warning: accelerate launch asked for 2 processes, but this run trains on 1")
    assert "\n    torchrun --nproc_per_node 2 recipes/simclr.py --dataset imagefolder " in err
    assert results["environment"]["processes"] == {"launcher": "accelerate launch", "requested": 2, "actual": 1}
    assert json.loads((tmp_path / "results.json").read_text())["environment"]["world_size"] == 1
