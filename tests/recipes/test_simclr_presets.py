"""recipes/simclr.py's presets: the released WEINCE setup (docs/algorithms.md 1.2b) point by point, the batchnorm-head
setup unchanged, and the released evaluation protocol (stratified split, raw-feature probe, k-NN over split seeds)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from tests.recipes.test_vision_recipe import recipe, tiny_zip  # noqa: F401 (fixtures)

from simclr_tools.augment import RELEASED_AUGMENT, SimCLRAugmentConfig, eval_transform
from simclr_tools.evaluation import (
    RELEASED_PROTOCOL,
    STANDARDIZED_PROTOCOL,
    evaluate_frozen_features,
    knn_evaluate,
    knn_evaluate_splits,
    linear_probe,
    stratified_split,
)
from simclr_tools.models import SimCLRModel, load_encoder, save_encoder
from simclr_tools.setups import SETUPS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_released_preset_settings(recipe):  # noqa: F811
    args = recipe.parse_args(["--preset", "released", "--loss", "weince"])
    assert (args.lr, args.weight_decay, args.hidden_dim) == (3e-4, 0.0, "features")
    assert (args.batch_size, args.scale, args.epochs, args.projection_dim, args.probe_epochs) == (
        256,
        2.0,
        100,
        64,
        100,
    )
    assert args.loss_kwargs == {"top_m": {"shortfall_weight": 0.5, "infonce_weight": 0.5}}  # M: the default 50
    preset = recipe.SETUPS["released"]
    assert preset.augment is RELEASED_AUGMENT and preset.probe is RELEASED_PROTOCOL
    assert not preset.head_batch_norm and not preset.head_output_bias
    # the baseline arm gets no loss options; explicit values override the preset's, one by one
    assert recipe.parse_args(["--preset", "released", "--loss", "infonce"]).loss_kwargs == {}
    overridden = recipe.parse_args(
        ["--preset", "released", "--loss", "weince", "--loss-option", "top_m.m=10", "--lr", "1e-3"]
    )
    assert overridden.loss_kwargs["top_m"] == {"shortfall_weight": 0.5, "infonce_weight": 0.5, "m": 10}
    assert overridden.lr == 1e-3
    blend_only = recipe.parse_args(["--preset", "released", "--loss", "weince", "--no-preset-loss-options"])
    assert blend_only.loss_kwargs == {}


def test_batchnorm_head_preset_is_the_default(recipe):  # noqa: F811
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name and the default warn about nothing
        args = recipe.parse_args([])
        assert recipe.parse_args(["--preset", "batchnorm-head"]).preset == "batchnorm-head"
        preset = recipe.SETUPS["batchnorm-head"]
    assert args.preset == "batchnorm-head"
    assert (args.lr, args.weight_decay, args.hidden_dim, args.loss_kwargs) == (1e-3, 1e-6, 512, {})
    assert preset.augment == SimCLRAugmentConfig() and preset.probe is STANDARDIZED_PROTOCOL
    assert preset.head_batch_norm and preset.head_output_bias
    assert STANDARDIZED_PROTOCOL.name == "standardized"
    with pytest.raises(SystemExit):
        recipe.parse_args(["--hidden-dim", "wide"])


def test_an_unknown_setup_name_lists_the_choices(recipe, capsys):  # noqa: F811
    assert sorted(SETUPS) == ["batchnorm-head", "released"]
    with pytest.raises(SystemExit):
        recipe.parse_args(["--preset", "nosuch"])
    err = capsys.readouterr().err
    assert "invalid choice: 'nosuch'" in err and "batchnorm-head" in err and "released" in err


def test_released_augmentation_and_eval_transform():
    config = RELEASED_AUGMENT
    assert (config.brightness, config.contrast, config.saturation, config.hue) == (0.8, 0.8, 0.8, 0.2)
    assert (config.jitter_p, config.grayscale_p, config.flip_p) == (0.8, 0.2, 0.5)
    assert (config.crop_scale, config.crop_ratio) == ((0.08, 1.0), (3 / 4, 4 / 3))  # RandomResizedCrop defaults
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    # ToTensor only: no normalisation, exactly
    assert torch.equal(eval_transform(images, config.mean, config.std), images.float() / 255.0)


def test_released_projection_head_and_its_round_trip(tmp_path):
    model = SimCLRModel("resnet18", width=4, hidden_dim=None, projection_dim=64, head_batch_norm=False,
                        head_output_bias=False)  # fmt: skip
    layers = list(model.head.net)
    assert [type(layer) for layer in layers] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (layers[0].in_features, layers[0].out_features, layers[2].out_features) == (32, 32, 64)
    assert layers[0].bias is None and layers[2].bias is None
    save_encoder(model, tmp_path / "released")
    loaded = load_encoder(tmp_path / "released")
    assert [type(layer) for layer in loaded.head.net] == [nn.Linear, nn.ReLU, nn.Linear]
    # a model saved before the head options existed loads with the BatchNorm head
    previous = SimCLRModel("resnet18", width=4, hidden_dim=16, projection_dim=8)
    save_encoder(previous, tmp_path / "previous")
    config_path = tmp_path / "previous" / "model_config.json"
    config = json.loads(config_path.read_text())
    del config["head_batch_norm"], config["head_output_bias"]
    config_path.write_text(json.dumps(config))
    assert isinstance(load_encoder(tmp_path / "previous").head.net[1], nn.BatchNorm1d)


def test_stratified_split_matches_a_direct_computation():
    labels = torch.tensor([0] * 10 + [1] * 7 + [2] * 5)[torch.randperm(22, generator=torch.Generator().manual_seed(0))]
    train, val = stratified_split(labels, 0.2, seed=3)
    rng = np.random.default_rng(3)
    expected_val = []
    for label in (0, 1, 2):
        members = np.flatnonzero(labels.numpy() == label)
        rng.shuffle(members)
        expected_val += members[: int(0.2 * len(members))].tolist()
    assert val.tolist() == sorted(expected_val)
    assert sorted(train.tolist() + val.tolist()) == list(range(22))
    assert torch.bincount(labels[val]).tolist() == [2, 1, 1]
    assert not torch.equal(val, stratified_split(labels, 0.2, seed=4)[1])
    with pytest.raises(ValueError, match="empty train or validation part"):
        stratified_split(torch.tensor([0, 1, 2]), 0.2)


def _clustered(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 4
    centres = 3.0 * torch.randn(4, 8, generator=torch.Generator().manual_seed(99))
    return centres[labels] + torch.randn(count, 8, generator=generator), labels


def test_released_protocol_splits_and_reports_validation():
    train, train_labels = _clustered(200, 0)
    test, test_labels = _clustered(60, 1)
    result = evaluate_frozen_features(train, train_labels, test, test_labels, RELEASED_PROTOCOL, epochs=400)
    assert result["protocol"] == "released" and result["knn_headline_k"] == 50
    assert len(result["knn_splits"]) == 5 and [s["seed"] for s in result["knn_splits"]] == [1, 2, 3, 4, 5]
    # the means are the means over the split seeds
    per_seed = [s["test"]["top1"]["50"] for s in result["knn_splits"]]
    assert result["knn_top1"] == pytest.approx(np.mean(per_seed))
    assert result["knn_val"]["recall"]["1"] == pytest.approx(np.mean([s["val"]["recall"]["1"] for s in
                                                                      result["knn_splits"]]))  # fmt: skip
    # the probe: raw features of the 80 % part, Adam lr 3e-4 without weight decay, split seed 1
    train_index, val_index = stratified_split(train_labels, 0.2, seed=1)
    probe = linear_probe(train[train_index], train_labels[train_index], test, test_labels, epochs=400, lr=3e-4,
                         weight_decay=0.0, seed=1, standardize=False, val_features=train[val_index],
                         val_labels=train_labels[val_index])  # fmt: skip
    assert result["linear_top1"] == probe["top1"] and result["linear_val_top1"] == probe["val_top1"]
    assert result["linear_top1"] > 80.0  # separable clusters: the raw-feature probe learns them
    # each split's k-NN uses only the train part as the bank
    bank_index, _ = stratified_split(train_labels, 0.2, seed=2)
    direct = knn_evaluate(train[bank_index], train_labels[bank_index], test, test_labels, [5], 0.1, 4)
    assert result["knn_splits"][1]["test"]["top1"]["5"] == direct.top1[5]


def test_standardized_protocol_equals_the_plain_probe_and_knn():
    train, train_labels = _clustered(80, 2)
    test, test_labels = _clustered(40, 3)
    result = evaluate_frozen_features(train, train_labels, test, test_labels, STANDARDIZED_PROTOCOL, epochs=5, seed=7)
    probe = linear_probe(train, train_labels, test, test_labels, epochs=5, num_classes=4, seed=7)
    knn = knn_evaluate(train, train_labels, test, test_labels, [1, 2, 5, 10, 20, 50], 0.1, 4)
    assert result["linear_top1"] == probe["top1"] and result["linear_train_top1"] == probe["train_top1"]
    assert result["knn_top1"] == knn.top1[20] and result["knn"] == knn.as_dict()
    assert "linear_val_top1" not in result and "knn_splits" not in result


def test_knn_splits_reject_no_seeds():
    train, labels = _clustered(40, 4)
    with pytest.raises(ValueError, match="at least one seed"):
        knn_evaluate_splits(train, labels, train, labels, split_seeds=())


@pytest.mark.parametrize("loss", ["infonce", "weince", "weince-blend"])
def test_released_preset_end_to_end(recipe, tiny_zip, tmp_path, loss):  # noqa: F811
    output = tmp_path / loss
    argv = ["--preset", "released", "--dataset", "imagefolder", "--data-dir", str(tiny_zip)]
    argv += ["--loss", loss.removesuffix("-blend")]
    argv += ["--width", "2", "--batch-size", "6", "--max-steps", "2", "--limit-train", "24", "--limit-eval", "9"]
    argv += ["--probe-epochs", "2", "--seed", "1", "--output-dir", str(output), "--log-every", "1"]
    if loss == "weince-blend":  # the blend alone
        argv.append("--no-preset-loss-options")
    returned = recipe.main(argv)
    results = json.loads((output / "results.json").read_text())
    assert results["preset"] == "released" and results["protocol"] == "released"
    assert results["config"]["lr"] == 3e-4 and results["config"]["weight_decay"] == 0.0
    assert 0.0 <= results["linear_val_top1"] <= 100.0 and len(results["knn_splits"]) == 5
    assert results["linear_top1"] == pytest.approx(returned["linear_top1"])
    config = json.loads((output / "model_config.json").read_text())
    assert config["hidden_dim"] == 16 and not config["head_batch_norm"] and not config["head_output_bias"]
    objective = results["objective"]
    if loss == "weince":  # the released composite: both top-M terms, the batch tail index logged every step
        assert (objective["scale"], objective["beta"], objective["top_m"]["m"]) == (2.0, 1.0, 50)
        assert (objective["top_m"]["shortfall_weight"], objective["top_m"]["infonce_weight"]) == (0.5, 0.5)
        assert all(record["weince_batch_beta"] > 0 for record in results["history"])
        shares = ("blend", "top_m_shortfall", "top_m_infonce")
        assert all(sum(record[f"weince_share_{name}"] for name in shares) == pytest.approx(1.0)
                   for record in results["history"])  # fmt: skip
    elif loss == "weince-blend":
        assert objective["top_m"] is None  # both top-M terms off
        assert not any("weince_batch_beta" in record for record in results["history"])
