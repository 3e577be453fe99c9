"""Evaluation on frozen features: weighted k-NN (top-1 and recall@k) and a linear probe.

Two protocols (docs/vision.md):

- ``standardized`` (:data:`STANDARDIZED_PROTOCOL`): the probe on standardised features of the whole train split,
  Adam lr 1e-3, weight decay 1e-6; k-NN against the whole train split;
- the released WEINCE protocol (docs/algorithms.md 1.2b): a stratified 80/20 train/validation split of the train split
  (:func:`stratified_split`), the probe (logistic regression) on the raw features of the 80 %, Adam lr 3e-4 without
  weight decay, batch 256, 100 epochs, test and validation accuracy after the last epoch; k-NN with the 80 % as the
  bank, for each of 5 split seeds (:func:`knn_evaluate_splits`).

k-NN follows the protocol of the released SimCLR code the WEINCE paper builds on (Wu et al. 2018's weighted vote):
cosine similarities between L2-normalised test and train features, the k most similar train images vote for their
class with weight ``exp(similarity / temperature)``, temperature 0.1, k in {1, 2, 5, 10, 20, 50}.
``recall@k`` is the share of test images with at least one same-class image among their k nearest train images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

KNN_KS = (1, 2, 5, 10, 20, 50)
KNN_TEMPERATURE = 0.1
# The released protocol: validation share of the stratified split, the probe's split seed, the k-NN split seeds.
RELEASED_VAL_FRACTION = 0.2
RELEASED_PROBE_SPLIT_SEED = 1
RELEASED_KNN_SPLIT_SEEDS = (1, 2, 3, 4, 5)


def stratified_split(
    labels: Tensor, val_fraction: float = RELEASED_VAL_FRACTION, seed: int = 1
) -> tuple[Tensor, Tensor]:
    """Indices ``(train, val)`` of a stratified split: for each class (in ascending order) its indices are shuffled by
    ``numpy.random.default_rng(seed)`` and the first ``floor(val_fraction * n_class)`` go to validation. Both index
    lists are returned in ascending order."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    labels_np = torch.as_tensor(labels).cpu().numpy()
    rng = np.random.default_rng(seed)
    train, val = [], []
    for label in np.unique(labels_np):
        members = np.flatnonzero(labels_np == label)
        rng.shuffle(members)
        count = int(val_fraction * len(members))
        val.extend(members[:count].tolist())
        train.extend(members[count:].tolist())
    if not train or not val:
        raise ValueError(
            f"a {val_fraction:.0%} stratified split of {len(labels_np)} labelled images leaves an empty train or "
            "validation part; use more probe images"
        )
    return torch.tensor(sorted(train), dtype=torch.long), torch.tensor(sorted(val), dtype=torch.long)


@torch.no_grad()
def extract_features(
    encoder: nn.Module,
    images: Tensor,
    transform: Callable[[Tensor], Tensor],
    batch_size: int = 512,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> Tensor:
    """Features of ``images`` (uint8 [N, 3, H, W]) from ``encoder`` in eval mode, float32 on the CPU."""
    was_training = encoder.training
    encoder.eval()
    chunks = []
    starts = range(0, images.shape[0], batch_size)
    for start in tqdm(starts, desc="features", disable=not progress, leave=False):
        batch = transform(images[start : start + batch_size].to(device))
        chunks.append(encoder(batch).float().cpu())
    encoder.train(was_training)
    return torch.cat(chunks)


@dataclass(frozen=True)
class KnnResult:
    top1: dict[int, float]  # k -> accuracy in percent
    recall: dict[int, float]  # k -> recall@k in percent

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            "top1": {str(k): v for k, v in self.top1.items()},
            "recall": {str(k): v for k, v in self.recall.items()},
        }


def _check_features(train_features: Tensor, train_labels: Tensor, test_features: Tensor, test_labels: Tensor) -> None:
    if train_features.dim() != 2 or test_features.dim() != 2 or train_features.shape[1] != test_features.shape[1]:
        raise ValueError(
            "features must be [N, D] with the same D, "
            f"got {tuple(train_features.shape)} and {tuple(test_features.shape)}"
        )
    if train_labels.shape != (train_features.shape[0],) or test_labels.shape != (test_features.shape[0],):
        raise ValueError("labels must have one entry per feature row")
    if (train_labels < 0).any() or (test_labels < 0).any():
        raise ValueError("evaluation needs labelled images (labels >= 0)")
    if not (torch.isfinite(train_features).all() and torch.isfinite(test_features).all()):
        raise ValueError("features contain NaN or Inf (the encoder diverged)")


@torch.no_grad()
def knn_evaluate(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    ks: Sequence[int] = KNN_KS,
    temperature: float = KNN_TEMPERATURE,
    num_classes: int | None = None,
    chunk_size: int = 1024,
) -> KnnResult:
    """Weighted k-NN top-1 accuracy and recall@k (percent) for every k in ``ks``."""
    _check_features(train_features, train_labels, test_features, test_labels)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    ks = sorted(set(int(k) for k in ks))
    if ks[0] < 1 or ks[-1] > train_features.shape[0]:
        raise ValueError(f"every k must lie in [1, number of train images = {train_features.shape[0]}], got {ks}")
    num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
    train = F.normalize(train_features.float(), dim=1)
    test = F.normalize(test_features.float(), dim=1)
    correct = dict.fromkeys(ks, 0)
    hit = dict.fromkeys(ks, 0)
    for start in range(0, test.shape[0], chunk_size):
        queries, labels = test[start : start + chunk_size], test_labels[start : start + chunk_size]
        similarity, index = (queries @ train.T).topk(ks[-1], dim=1)
        neighbour_labels = train_labels[index]  # [Q, kmax], most similar first
        weights = torch.exp(similarity / temperature)
        same = neighbour_labels == labels[:, None]
        for k in ks:
            votes = torch.zeros(queries.shape[0], num_classes)
            votes.scatter_add_(1, neighbour_labels[:, :k], weights[:, :k])
            correct[k] += int((votes.argmax(1) == labels).sum())
            hit[k] += int(same[:, :k].any(1).sum())
    total = test.shape[0]
    return KnnResult(top1={k: 100.0 * correct[k] / total for k in ks}, recall={k: 100.0 * hit[k] / total for k in ks})


def linear_probe(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 1e-3,
    weight_decay: float = 1e-6,
    num_classes: int | None = None,
    seed: int = 0,
    *,
    standardize: bool = True,
    val_features: Tensor | None = None,
    val_labels: Tensor | None = None,
) -> dict[str, float]:
    """Train a linear classifier on frozen features (Adam, cross-entropy); accuracies in percent after the last epoch.

    ``standardize``: features standardised with the train split's mean and std (a fixed affine map, so the probe is
    still linear in the frozen features; the standardized protocol), or raw (the released protocol: lr 3e-4,
    weight_decay 0). Returns ``{"top1": ..., "top5": ..., "train_top1": ...}`` on the test features, plus
    ``val_top1`` when validation features are given.
    """
    _check_features(train_features, train_labels, test_features, test_labels)
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if (val_features is None) != (val_labels is None):
        raise ValueError("pass val_features and val_labels together")
    if val_features is not None:
        _check_features(train_features, train_labels, val_features, val_labels)
    num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
    if standardize:
        mean = train_features.mean(0, keepdim=True)
        std = train_features.std(0, keepdim=True).clamp_min(1e-6)
    else:
        mean, std = torch.zeros(1, train_features.shape[1]), torch.ones(1, train_features.shape[1])
    train = (train_features.float() - mean) / std
    test = (test_features.float() - mean) / std
    generator = torch.Generator().manual_seed(seed)
    classifier = nn.Linear(train.shape[1], num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        classifier.reset_parameters()
    optimizer = torch.optim.Adam(classifier.parameters(), lr=lr, weight_decay=weight_decay)
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(train.shape[0], generator=generator)
            for start in range(0, train.shape[0], batch_size):
                batch = order[start : start + batch_size]
                loss = F.cross_entropy(classifier(train[batch]), train_labels[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    with torch.no_grad():
        logits = classifier(test)
        top5 = logits.topk(min(5, num_classes), dim=1).indices
        result = {
            "top1": 100.0 * float((logits.argmax(1) == test_labels).float().mean()),
            "top5": 100.0 * float((top5 == test_labels[:, None]).any(1).float().mean()),
            "train_top1": 100.0 * float((classifier(train).argmax(1) == train_labels).float().mean()),
        }
        if val_features is not None:
            val = (val_features.float() - mean) / std
            result["val_top1"] = 100.0 * float((classifier(val).argmax(1) == val_labels).float().mean())
        return result


def knn_evaluate_splits(
    train_features: Tensor, train_labels: Tensor, test_features: Tensor, test_labels: Tensor, *,
    split_seeds: Sequence[int] = RELEASED_KNN_SPLIT_SEEDS, val_fraction: float = RELEASED_VAL_FRACTION,
    ks: Sequence[int] = KNN_KS, temperature: float = KNN_TEMPERATURE, num_classes: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The released k-NN protocol: for each split seed, a stratified split of the train features; the train part is
    the bank for the validation part and for the test features. Returns the mean over seeds of top-1 and recall@k
    (``"test"``, ``"val"``, each ``{"top1": {k: %}, "recall": {k: %}}``) and every seed's results (``"splits"``)."""
    if not split_seeds:
        raise ValueError("split_seeds must name at least one seed")
    splits = []
    for seed in split_seeds:
        train_index, val_index = stratified_split(train_labels, val_fraction, seed)
        bank, bank_labels = train_features[train_index], train_labels[train_index]
        usable = [k for k in ks if k <= len(train_index)]
        test = knn_evaluate(bank, bank_labels, test_features, test_labels, usable, temperature, num_classes)
        val = knn_evaluate(
            bank, bank_labels, train_features[val_index], train_labels[val_index], usable, temperature, num_classes
        )
        splits.append({"seed": seed, "test": test.as_dict(), "val": val.as_dict()})

    def mean_of(part: str) -> dict[str, dict[str, float]]:
        return {
            metric: {k: float(np.mean([split[part][metric][k] for split in splits])) for k in splits[0][part][metric]}
            for metric in ("top1", "recall")
        }

    return {"test": mean_of("test"), "val": mean_of("val"), "splits": splits, "val_fraction": val_fraction}


@dataclass(frozen=True)
class ProbeProtocol:
    """How frozen features are evaluated: the linear probe's settings and the k-NN bank.

    ``val_fraction`` None: the whole train split trains the probe and is the k-NN bank (standardized protocol); a
    fraction: a stratified train/validation split (seed ``probe_split_seed``) for the probe, and k-NN over the
    splits of ``knn_split_seeds`` (released protocol). ``probe_seed`` None: the run's seed initialises the probe and
    orders its batches.
    """

    name: str
    standardize: bool
    lr: float
    weight_decay: float
    batch_size: int = 256
    val_fraction: float | None = None
    probe_split_seed: int = RELEASED_PROBE_SPLIT_SEED
    probe_seed: int | None = None
    knn_split_seeds: tuple[int, ...] = ()
    knn_headline_k: int = 20


STANDARDIZED_PROTOCOL = ProbeProtocol("standardized", standardize=True, lr=1e-3, weight_decay=1e-6)
RELEASED_PROTOCOL = ProbeProtocol(
    "released",
    standardize=False,
    lr=3e-4,
    weight_decay=0.0,
    val_fraction=RELEASED_VAL_FRACTION,
    probe_seed=RELEASED_PROBE_SPLIT_SEED,
    knn_split_seeds=RELEASED_KNN_SPLIT_SEEDS,
    knn_headline_k=max(KNN_KS),
)


def evaluate_frozen_features(
    train_features: Tensor,
    train_labels: Tensor,
    test_features: Tensor,
    test_labels: Tensor,
    protocol: ProbeProtocol = STANDARDIZED_PROTOCOL,
    *,
    epochs: int = 100,
    num_classes: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Linear probe and weighted k-NN under ``protocol``; accuracies in percent.

    Returns ``linear_top1`` / ``linear_top5`` / ``linear_train_top1`` (test accuracy after the last epoch),
    ``knn_top1`` (at ``knn_headline_k``, or the largest usable k), ``knn`` (all k on the test features) and, under a
    split protocol, ``linear_val_top1``, ``knn_val`` and ``knn_splits`` (every split seed's results; ``knn`` and
    ``knn_val`` are their means).
    """
    num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
    results: dict[str, Any] = {"protocol": protocol.name, "knn_temperature": KNN_TEMPERATURE}
    probe_index, validation = torch.arange(len(train_labels)), {}
    if protocol.val_fraction is not None:  # the probe trains on a stratified part, validated on the rest
        probe_index, val_index = stratified_split(train_labels, protocol.val_fraction, protocol.probe_split_seed)
        validation = {"val_features": train_features[val_index], "val_labels": train_labels[val_index]}
    linear = linear_probe(
        train_features[probe_index],
        train_labels[probe_index],
        test_features,
        test_labels,
        epochs=epochs,
        batch_size=protocol.batch_size,
        lr=protocol.lr,
        weight_decay=protocol.weight_decay,
        num_classes=num_classes,
        seed=seed if protocol.probe_seed is None else protocol.probe_seed,
        standardize=protocol.standardize,
        **validation,
    )
    if protocol.val_fraction is None:
        ks = [k for k in KNN_KS if k <= train_features.shape[0]]
        knn_test = knn_evaluate(
            train_features, train_labels, test_features, test_labels, ks, KNN_TEMPERATURE, num_classes
        ).as_dict()
    else:
        knn = knn_evaluate_splits(
            train_features,
            train_labels,
            test_features,
            test_labels,
            split_seeds=protocol.knn_split_seeds,
            val_fraction=protocol.val_fraction,
            num_classes=num_classes,
        )
        knn_test = knn["test"]
        results.update({"linear_val_top1": linear["val_top1"], "knn_val": knn["val"], "knn_splits": knn["splits"]})
    top1 = knn_test["top1"]
    headline = str(protocol.knn_headline_k) if str(protocol.knn_headline_k) in top1 else max(top1, key=int)
    results.update(
        {
            "linear_top1": linear["top1"],
            "linear_top5": linear["top5"],
            "linear_train_top1": linear["train_top1"],
            "knn_top1": top1[headline],
            "knn_headline_k": int(headline),
            "knn": knn_test,
        }
    )
    return results


def evaluate_encoder(
    encoder: nn.Module,
    probe_train: Any,
    test: Any,
    protocol: ProbeProtocol,
    transform: Callable[[Tensor], Tensor],
    *,
    epochs: int = 100,
    batch_size: int = 512,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """:func:`evaluate_frozen_features` of ``encoder``'s features of two labelled image sets (``images``, ``labels``,
    ``classes``: :class:`~simclr_tools.data.ImageTensorDataset`), un-augmented (``transform``: the evaluation's
    normalisation), plus the set sizes."""
    train_features, test_features = (
        extract_features(encoder, split.images, transform, batch_size, device) for split in (probe_train, test)
    )
    result = evaluate_frozen_features(train_features, probe_train.labels, test_features, test.labels, protocol,
                                      epochs=epochs, num_classes=len(probe_train.classes), seed=seed)  # fmt: skip
    return {**result, "probe_train_images": len(probe_train), "eval_images": len(test)}
