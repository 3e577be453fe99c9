"""BANKING77 for the false-negative comparison (benchmarks/false_negative_compare.py): the labelled texts, their
split, the same-class pairs and the planned batches of a seed, and the test-split evaluation (cosine k-NN, linear
probe). Resurrected from 82267c0 (``lab/false_negatives.py`` and ``lab/text_pairs.py``), the same splits, pairs and
batches; the blending diagnostic of the threshold guards is left out."""

from __future__ import annotations

import csv
import hashlib
import json
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def read_split(path: Path) -> list[tuple[str, str]]:
    """(text, category) rows of a CSV with the columns text,category; ValueError naming the columns found."""
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {"text", "category"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected columns text,category, got {reader.fieldnames}")
        return [(row["text"], row["category"]) for row in reader]


def texts_by_class(rows: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The texts of each class, in the order of ``rows``."""
    by_class: dict[str, list[str]] = defaultdict(list)
    for text, label in rows:
        by_class[label].append(text)
    return by_class


def shuffled_classes(rows: list[tuple[str, str]], seed: int) -> Iterator[tuple[str, list[str]]]:
    """(class, its texts sorted, then shuffled), classes in sorted order, all shuffled by one seeded generator."""
    by_class = texts_by_class(rows)
    rng = random.Random(seed)
    for label in sorted(by_class):
        texts = sorted(by_class[label])
        rng.shuffle(texts)
        yield label, texts


def stratified_split(
    rows: list[tuple[str, str]], fraction: float, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, validation): ``fraction`` of every class (at least one text, and at least two left for pairs)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {fraction}")
    train, validation = [], []
    for label, texts in shuffled_classes(rows, seed):
        count = min(max(1, round(fraction * len(texts))), len(texts) - 2)
        validation += [(text, label) for text in texts[:count]]
        train += [(text, label) for text in texts[count:]]
    return train, validation


def reference_set(rows: list[tuple[str, str]], per_class: int, seed: int = 0) -> list[tuple[str, str]]:
    """``per_class`` texts of every class: the reference set of the k-NN and the linear probe."""
    return [(text, label) for label, texts in shuffled_classes(rows, seed) for text in texts[:per_class]]


def same_class_pairs(rows: list[tuple[str, str]], seed: int) -> list[tuple[str, str, str]]:
    """(anchor, positive, class): each class's texts shuffled and paired consecutively (each text once)."""
    by_class = texts_by_class(rows)
    rng = random.Random(seed)
    pairs = []
    for label in sorted(by_class):
        texts = list(by_class[label])
        rng.shuffle(texts)
        pairs += [(texts[i], texts[i + 1], label) for i in range(0, len(texts) - 1, 2)]
    return pairs


def batches(pairs: list[tuple[str, str, str]], batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` random batches of pair indices (epochs of a seeded permutation; incomplete tails dropped)."""
    if len(pairs) < batch_size:
        raise ValueError(f"{len(pairs)} pairs cannot fill a batch of {batch_size}")
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < steps:
        order = list(range(len(pairs)))
        rng.shuffle(order)
        out += [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return out[:steps]


def label_ids(labels: list[str]) -> dict[str, int]:
    """The intent id of every class name: its index in sorted order."""
    return {label: i for i, label in enumerate(sorted(set(labels)))}


def same_label_share(plan: list[list[int]], labels: list[int]) -> float:
    """What ``false_negative_filter="same_label"`` removes on these batches of (anchor, positive) pairs, averaged
    over the batches: per batch, the other rows with the anchor's label over all ``B (B - 1)`` negatives."""
    shares = []
    for batch in plan:
        codes = torch.tensor([labels[i] for i in batch])
        same = int((codes[:, None] == codes[None, :]).sum()) - len(batch)
        shares.append(same / (len(batch) * (len(batch) - 1)))
    return float(np.mean(shares))


def digest(value) -> str:
    """sha256 of a JSON-able value or a tensor (its bytes): equal digests, equal batches."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().numpy().tobytes()
    else:
        data = json.dumps(value).encode()
    return hashlib.sha256(data).hexdigest()


def encode(model, texts: list[str]) -> torch.Tensor:
    return model.encode(texts, batch_size=128, convert_to_tensor=True, normalize_embeddings=True).float().cpu()


def knn_accuracy(
    reference: torch.Tensor, reference_labels: list[str], queries: torch.Tensor, labels: list[str], k: int
) -> float:
    """Cosine k-NN accuracy: majority vote of the k nearest, a tie going to the label of the nearer neighbour."""
    classes = sorted(set(reference_labels))
    codes = torch.tensor([classes.index(label) for label in reference_labels])
    neighbours = codes[(queries @ reference.T).topk(min(k, reference.shape[0]), dim=1).indices]
    votes = F.one_hot(neighbours, len(classes)).sum(1).gather(1, neighbours)
    predictions = neighbours.gather(1, (votes == votes.max(1, keepdim=True).values).int().argmax(1, keepdim=True))
    return sum(classes[p] == label for p, label in zip(predictions.squeeze(1).tolist(), labels)) / len(labels)


def linear_probe_accuracy(
    reference: torch.Tensor, reference_labels: list[str], queries: torch.Tensor, labels: list[str]
) -> float:
    from sklearn.linear_model import LogisticRegression

    probe = LogisticRegression(max_iter=1000)
    probe.fit(reference.numpy(), reference_labels)
    return float((probe.predict(queries.numpy()) == np.asarray(labels)).mean())
