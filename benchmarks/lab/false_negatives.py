"""BANKING77 for the false-negative comparison: the splits and planned batches, the blending diagnostic of a batch,
and the test-split evaluation (cosine k-NN, linear probe)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.lab.text_pairs import texts_by_class
from st_weince.functional.false_negatives import FalseNegativeFilter, false_negative_mask
from st_weince.functional.weince import DEFAULTS, weince_statistics


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


@torch.no_grad()
def blending_diagnostic(
    queries: torch.Tensor, docs: torch.Tensor, labels: list[str], spec: FalseNegativeFilter
) -> dict[str, float]:
    """On one batch of normalised (query, doc) embeddings with their classes: false negatives per anchor, and for
    WEINCE's default statistics the strongly blended anchors (lambda > 0.5) and how many of them have a false
    negative (same class) as their hardest candidate, without and with the guard ``spec``.

    Counts, not shares, so that they add up over steps."""
    scores = queries @ docs.T
    size = scores.shape[0]
    positive_index = torch.arange(size)
    codes = {label: i for i, label in enumerate(sorted(set(labels)))}
    label_ids = torch.tensor([codes[label] for label in labels])
    same = (label_ids[:, None] == label_ids[None, :]) & ~torch.eye(size, dtype=torch.bool)
    out = {"anchors": float(size), "false_negatives": float(same.sum())}
    masks = {"before": None, "after": ~false_negative_mask(scores, positive_index, None, spec)}
    for name, valid_mask in masks.items():
        stats = weince_statistics(scores, positive_index, valid_mask, DEFAULTS.replace(beta="auto"))
        candidates = scores.masked_fill(torch.eye(size, dtype=torch.bool), float("-inf"))
        if valid_mask is not None:
            candidates = candidates.masked_fill(~valid_mask, float("-inf"))
        hardest = candidates.argmax(1)
        has_candidate = torch.isfinite(candidates.max(1).values)
        hardest_is_false_negative = same.gather(1, hardest[:, None]).squeeze(1) & has_candidate
        blended = stats.lam > 0.5
        out[f"blended_{name}"] = float(blended.sum())
        out[f"blended_fn_hardest_{name}"] = float((blended & hardest_is_false_negative).sum())
        out[f"lambda_sum_{name}"] = float(stats.lam.sum())
        if valid_mask is not None:
            out["masked"] = float((~valid_mask).sum())
            out["masked_false_negatives"] = float((~valid_mask & same).sum())
    return out


def shares(totals: dict[str, float]) -> dict[str, float | None]:
    """Summed counts of :func:`blending_diagnostic` as rates per anchor and shares."""
    anchors = max(totals["anchors"], 1.0)
    out = {
        "false_negatives_per_anchor": totals["false_negatives"] / anchors,
        "masked_per_anchor": totals["masked"] / anchors,
        "masked_that_are_false_negatives": totals["masked_false_negatives"] / max(totals["masked"], 1.0),
    }
    for name in ("before", "after"):
        blended = totals[f"blended_{name}"]
        out[f"blended_share_{name}"] = blended / anchors
        out[f"blended_fn_hardest_share_{name}"] = totals[f"blended_fn_hardest_{name}"] / blended if blended else None
        out[f"lambda_mean_{name}"] = totals[f"lambda_sum_{name}"] / anchors
    return out


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
