"""Evaluation on frozen features: weighted k-NN (top-1 and recall@k) and a linear probe.

k-NN follows the protocol of the released SimCLR code the WEINCE paper builds on (Wu et al. 2018's weighted vote):
cosine similarities between L2-normalised test and train features, the k most similar train images vote for their
class with weight ``exp(similarity / temperature)``, temperature 0.1, k in {1, 2, 5, 10, 20, 50}.
``recall@k`` is the share of test images with at least one same-class image among their k nearest train images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

KNN_KS = (1, 2, 5, 10, 20, 50)
KNN_TEMPERATURE = 0.1


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
) -> dict[str, float]:
    """Train a linear classifier on frozen, standardised features (Adam, cross-entropy); test accuracy in percent.

    Features are standardised with the train split's mean and std (a fixed affine map, so the probe is still
    linear in the frozen features). Returns ``{"top1": ..., "top5": ..., "train_top1": ...}``.
    """
    _check_features(train_features, train_labels, test_features, test_labels)
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
    mean = train_features.mean(0, keepdim=True)
    std = train_features.std(0, keepdim=True).clamp_min(1e-6)
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
        return {
            "top1": 100.0 * float((logits.argmax(1) == test_labels).float().mean()),
            "top5": 100.0 * float((top5 == test_labels[:, None]).any(1).float().mean()),
            "train_top1": 100.0 * float((classifier(train).argmax(1) == train_labels).float().mean()),
        }
