"""benchmarks/false_negative_compare.py without training: every arm of a seed gets the same planned batches and labels,
the same-label share of a batch is counted right, and the summary pairs runs by seed only where they saw the same
batches (with the paired t of the differences)."""

from __future__ import annotations

import argparse
import math

import pytest
import scipy.stats

from tests.conftest import load_script


@pytest.fixture(scope="module")
def compare():
    return load_script("benchmarks/false_negative_compare.py", "false_negative_compare")


def labelled_rows(classes: int = 5, per_class: int = 9) -> list[tuple[str, str]]:
    return [(f"text {label} {i}", f"intent_{label}") for label in range(classes) for i in range(per_class)]


def test_every_arm_of_a_seed_gets_the_same_batches_and_labels(compare):
    data = {"train": labelled_rows()}
    plan = compare.training_plan(data, batch_size=6, steps=5, seed=3)
    assert plan == compare.training_plan(data, batch_size=6, steps=5, seed=3)  # what every arm of seed 3 trains on
    assert plan["plan"] != compare.training_plan(data, batch_size=6, steps=5, seed=4)["plan"]
    assert len(plan["plan"]) == 5 and all(len(batch) == 6 == len(set(batch)) for batch in plan["plan"])
    # 9 texts per intent: 4 same-intent pairs each; the label column is the pair's intent id (sorted order)
    assert len(plan["pairs"]) == 20
    for (anchor, positive, intent), label in zip(plan["pairs"], plan["labels"]):
        assert anchor.split()[1] == positive.split()[1] == intent[-1] and label == int(intent[-1])


def test_same_label_share_counts_the_other_rows_of_the_anchors_label(compare):
    from benchmarks.lab.false_negatives import same_label_share

    labels = [0, 0, 1, 0, 2, 2]
    # batch 1: labels 0, 0, 0, 1 -> 3 x 2 ordered same-label pairs of 4 x 3 negatives; batch 2: 2, 2, 1 -> 2 of 6
    assert same_label_share([[0, 1, 3, 2], [4, 5, 2]], labels) == pytest.approx((6 / 12 + 2 / 6) / 2)
    assert same_label_share([[0, 2, 4]], labels) == 0.0


def record(compare, arm: str, seed: int, knn: float, batches: str = "b") -> dict:
    versions = dict.fromkeys(("torch", "sentence-transformers", "transformers", "mteb"), "1.0")
    provenance = {"git_commit": "abc1234", "machine": {"cpu": {"family": "cpu X"}}, "versions": versions}
    return {
        "name": f"{arm}-seed{seed}", "arm": arm, "seed": seed, "test_knn": knn, "test_linear_probe": 80.0,
        "logged": {}, "plan_same_label_share": 0.01, "train_loss_last": 1.0, "seconds": {"total": 1.0},
        "scale": {}, "provenance": provenance,
        "pairing": {"batches_sha256": batches + str(seed), "labels_seen_sha256": "l", "labels_seen_are_the_plan": True,
                    "first_step_embeddings_sha256": "e"},
    }  # fmt: skip


def test_the_summary_pairs_by_seed_and_refuses_runs_on_other_batches(compare, monkeypatch):
    monkeypatch.setattr(compare, "provenance_now", lambda args: {})
    knn = {"mnrl": [88.0, 88.5, 87.9], "weince": [88.2, 88.4, 88.6]}
    records = [record(compare, arm, seed, knn[arm][seed]) for arm in knn for seed in range(3)]
    summary = compare.summarize(records, argparse.Namespace())
    entry = summary["paired"]["weince_minus_mnrl"]
    differences = [0.2, -0.1, 0.7]
    assert [entry["per_seed"][str(s)]["test_knn"] for s in range(3)] == pytest.approx(differences)
    assert entry["test_knn"]["mean"] == pytest.approx(sum(differences) / 3)
    t = scipy.stats.ttest_rel(knn["weince"], knn["mnrl"])
    assert entry["tests"]["test_knn"]["t"] == pytest.approx(t.statistic)
    assert entry["tests"]["test_knn"]["p_two_sided"] == pytest.approx(t.pvalue)
    assert entry["tests"]["test_knn"]["n"] == 3 and entry["tests"]["test_knn"]["df"] == 2
    assert summary["paired_batches_per_seed"]["1"]["batches_sha256"]
    # a run of seed 1 that trained on other batches pairs with nothing
    records[4] = record(compare, "weince", 1, 88.4, batches="other")
    summary = compare.summarize(records, argparse.Namespace())
    entry = summary["paired"]["weince_minus_mnrl"]
    assert entry["seeds"] == [0, 2] and "not see the same batches" in entry["refused"]["1"]
    assert not summary["paired_batches_per_seed"]["1"]["batches_sha256"]
    assert math.isclose(entry["test_knn"]["mean"], (0.2 + 0.7) / 2)
