"""The data and the checkpoint evaluation of the SimCLR studies (benchmarks/lab/simclr_runner.py).

Every checkpoint of every run evaluates on the same images and fixed subsets: probes (the setup's protocol) on a
class-balanced subset of the training images, or all of them for a full evaluation; the POT shape of the negative
scores of a class-balanced set of evaluation images; WEINCE's statistics of the encoder on one fixed augmented batch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from st_weince.diagnostics import pot_fit
from st_weince.diagnostics.collect import negative_pool
from st_weince.functional import nt_xent_layout
from st_weince.losses import WEINCELoss

from simclr_tools.augment import SimCLRAugment, eval_transform
from simclr_tools.data import ImageTensorDataset, balanced_subset, load_dataset
from simclr_tools.evaluation import (
    KNN_KS,
    KNN_TEMPERATURE,
    STANDARDIZED_PROTOCOL,
    evaluate_frozen_features,
    extract_features,
    knn_evaluate,
    linear_probe,
)
from simclr_tools.models import SimCLRModel
from simclr_tools.setups import SETUPS
from simclr_tools.training import to_memory_format

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "cifar10" / "cifar10-jpg.zip"
KNN_HEADLINE_K = 20
STATS_AUGMENT_SEED = 12345  # the fixed augmented batch for WEINCE's statistics of the encoder


class EvalData:
    """The images and fixed subsets every checkpoint of every run evaluates on."""

    def __init__(self, train: Any, test: Any, config: dict[str, Any]) -> None:
        self.train, self.test = train, test
        seed = config["subset_seed"]
        self.probe_index = torch.tensor(balanced_subset(train.labels, config["probe_subset"], seed))
        self.pot_index = torch.tensor(balanced_subset(test.labels, config["pot_images"], seed))
        stats_index = torch.tensor(balanced_subset(train.labels, config["batch_size"], seed))
        self.setup = SETUPS[config["setup"]]
        augment = SimCLRAugment(self.setup.augment, generator=torch.Generator().manual_seed(STATS_AUGMENT_SEED))
        self.stats_views = augment(train.images[stats_index])
        self.num_classes = len(train.classes)


def load_data(config: dict[str, Any], data_dir: Path) -> EvalData:
    """The training images and the evaluation images: the test split, or with ``config["holdout"]`` a
    class-balanced part of the training split that is then not trained on (for choosing settings)."""
    tick = time.perf_counter()
    train = load_dataset(config["dataset"], "train", data_dir, limit=config["limit_train"], download=False)
    if config["holdout"] is None:
        evaluation = load_dataset(config["dataset"], "test", data_dir, limit=config["limit_test"], download=False)
    else:
        holdout = config["holdout"]
        if isinstance(holdout, bool) or not (isinstance(holdout, int) and 0 < holdout < len(train)):
            raise ValueError(f"holdout must be a number of images in 1..{len(train) - 1}, got {config['holdout']!r}")
        held = torch.zeros(len(train), dtype=torch.bool)
        held[balanced_subset(train.labels, config["holdout"], config["subset_seed"])] = True
        evaluation = ImageTensorDataset(train.images[held], train.labels[held], train.classes)
        train = ImageTensorDataset(train.images[~held], train.labels[~held], train.classes)
    split = "test" if config["holdout"] is None else "held-out training"
    print(
        f"data: {len(train)} train, {len(evaluation)} {split} images ({time.perf_counter() - tick:.0f} s)", flush=True
    )
    return EvalData(train, evaluation, config)


def pot_shape(embeddings: Tensor, quantile: float) -> dict[str, Any]:
    """xi of the pooled negative scores (all pairs); a failed fit is recorded with its reason, not hidden."""
    try:
        fit = pot_fit(negative_pool(embeddings), quantile)
    except ValueError as error:
        return {"xi": None, "error": str(error)}
    return {
        "xi": fit.xi,
        "xi_ci": list(fit.xi_ci),
        "threshold": fit.threshold,
        "num_exceedances": fit.num_exceedances,
        "p_value_xi0": fit.p_value_xi0,
        "endpoint": fit.endpoint,
    }


@torch.no_grad()
def encoder_weince_statistics(model: SimCLRModel, data: EvalData, config: dict[str, Any]) -> dict[str, float]:
    """WEINCE's per-anchor statistics on the fixed augmented batch, for any loss's encoder (eval mode)."""
    was_training = model.training
    model.eval()
    view_a, view_b = (to_memory_format(v, config["channels_last"]) for v in data.stats_views)
    z1, z2 = model(torch.cat([view_a, view_b])).float().chunk(2)
    model.train(was_training)
    probe_loss = WEINCELoss(None, scale=1.0 / config["temperature"], beta=config["beta"])
    stats = probe_loss.statistics(*nt_xent_layout(z1, z2))
    return {
        "lambda_mean": float(stats.lam.mean()),
        "lambda_gt_half": float((stats.lam > 0.5).float().mean()),
        "rho0": float(stats.rho0),
        "beta_mean": float(stats.beta.mean()),
    }


def protocol_evaluation(
    features: Tensor, labels: Tensor, test_features: Tensor, data: EvalData, config: dict[str, Any], seed: int
) -> dict[str, Any]:
    """The setup's probe protocol (evaluate_frozen_features) in the study's record keys, plus the
    protocol's own figures (validation accuracies, every k-NN split seed)."""
    result = evaluate_frozen_features(
        features,
        labels,
        test_features,
        data.test.labels,
        data.setup.probe,
        epochs=config["probe_epochs"],
        num_classes=data.num_classes,
        seed=seed,
    )
    return {
        "probe_train_images": len(labels),
        "probe_protocol": result["protocol"],
        "linear_top1": result["linear_top1"],
        "linear_top5": result["linear_top5"],
        "linear_train_top1": result["linear_train_top1"],
        "linear_val_top1": result.get("linear_val_top1"),
        "knn_top1": result["knn_top1"],
        "knn_k": result["knn_headline_k"],
        "knn_top1_by_k": {str(k): v for k, v in result["knn"]["top1"].items()},
        "knn_val_top1_by_k": {str(k): v for k, v in result["knn_val"]["top1"].items()} if "knn_val" in result else None,
        "knn_splits": result.get("knn_splits"),
    }


def standardized_evaluation(
    features: Tensor, labels: Tensor, test_features: Tensor, data: EvalData, config: dict[str, Any], seed: int
) -> dict[str, Any]:
    """The standardized protocol's probes: weighted k-NN at every k (headline k = 20) and the linear probe."""
    ks = [k for k in KNN_KS if k <= len(labels)]
    knn = knn_evaluate(features, labels, test_features, data.test.labels, ks, KNN_TEMPERATURE, data.num_classes)
    linear = linear_probe(
        features,
        labels,
        test_features,
        data.test.labels,
        epochs=config["probe_epochs"],
        num_classes=data.num_classes,
        seed=seed,
    )
    headline = KNN_HEADLINE_K if KNN_HEADLINE_K in knn.top1 else max(knn.top1)
    return {
        "probe_train_images": len(labels),
        "linear_top1": linear["top1"],
        "linear_top5": linear["top5"],
        "linear_train_top1": linear["train_top1"],
        "knn_top1": knn.top1[headline],
        "knn_k": headline,
        "knn_top1_by_k": {str(k): v for k, v in knn.top1.items()},
    }


def evaluate(model: SimCLRModel, data: EvalData, config: dict[str, Any], seed: int, full: bool) -> dict[str, Any]:
    """Probes on the subset (and, when ``full``, on all training images), POT shapes, WEINCE statistics."""
    tick = time.perf_counter()
    channels_last = config["channels_last"]
    augment_config = data.setup.augment

    def transform(images: Tensor) -> Tensor:
        return to_memory_format(eval_transform(images, augment_config.mean, augment_config.std), channels_last)

    test_features = extract_features(model.encoder, data.test.images, transform, 500)
    subset_labels = data.train.labels[data.probe_index]
    if full:  # one pass over all training images serves both the subset probes and the full ones
        train_features = extract_features(model.encoder, data.train.images, transform, 500)
        subsets = {
            "subset": (train_features[data.probe_index], subset_labels),
            "full": (train_features, data.train.labels),
        }
    else:
        train_images = data.train.images[data.probe_index]
        subsets = {"subset": (extract_features(model.encoder, train_images, transform, 500), subset_labels)}
    probes = standardized_evaluation if data.setup.probe is STANDARDIZED_PROTOCOL else protocol_evaluation
    out: dict[str, Any] = {
        name: probes(features, labels, test_features, data, config, seed)
        for name, (features, labels) in subsets.items()
    }
    pot_images = transform(data.test.images[data.pot_index])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        backbone = model.encoder(pot_images).float()
        projection = model.head(backbone).float()
    model.train(was_training)
    out["pot_projection"] = pot_shape(projection, config["pot_quantile"])
    out["pot_backbone"] = pot_shape(backbone, config["pot_quantile"])
    out["encoder_weince_statistics"] = encoder_weince_statistics(model, data, config)
    out["test_images"] = len(data.test)
    out["eval_seconds"] = time.perf_counter() - tick
    return out
