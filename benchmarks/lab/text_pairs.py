"""Labelled texts (BANKING77's ``text,category`` CSV) and the same-class pairs the text benchmarks use."""

from __future__ import annotations

import csv
import random
from collections import defaultdict
from pathlib import Path


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
