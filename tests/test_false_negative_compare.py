"""benchmarks/false_negative_compare.py: its data handling, its diagnostic, and a whole (tiny) comparison that
writes JSON lines and resumes by skipping finished runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from st_weince.functional.false_negatives import FalseNegativeFilter
from tests.conftest import TINY_SENTENCES, load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    return load_script("benchmarks/false_negative_compare.py", "false_negative_compare")


def labelled_rows(classes: int = 6, per_class: int = 12, seed: int = 0) -> list[tuple[str, str]]:
    words = " ".join(TINY_SENTENCES).split()
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for label in range(classes):
        # each class draws its words from its own slice of the vocabulary, so the classes are learnable
        vocabulary = words[label * 5 : label * 5 + 8]
        for _ in range(per_class):
            picks = torch.randint(len(vocabulary), (6,), generator=generator).tolist()
            rows.append((" ".join(vocabulary[i] for i in picks), f"class_{label}"))
    return rows


def test_stratified_split_pairs_and_batches(compare):
    rows = labelled_rows()
    train, validation = compare.stratified_split(rows, 0.25)
    assert sorted(train + validation) == sorted(rows)
    for label in {label for _, label in rows}:
        assert sum(v == label for _, v in validation) == 3 and sum(v == label for _, v in train) == 9
    pairs = compare.same_class_pairs(train, seed=1)
    texts_of = {}
    for text, label in train:
        texts_of.setdefault(label, []).append(text)
    assert len(pairs) == 6 * 4  # 9 texts per class: 4 pairs, one text left over
    assert all(a in texts_of[label] and b in texts_of[label] for a, b, label in pairs)
    assert compare.same_class_pairs(train, seed=1) == pairs and compare.same_class_pairs(train, seed=2) != pairs
    plan = compare.batches(pairs, 8, 7, seed=3)
    assert len(plan) == 7 and all(len(b) == 8 and len(set(b)) == 8 for b in plan)
    assert plan == compare.batches(pairs, 8, 7, seed=3)  # identical batches for every arm of a seed
    with pytest.raises(ValueError, match="cannot fill a batch"):
        compare.batches(pairs[:3], 8, 1, seed=0)


def test_blending_diagnostic_counts(compare):
    generator = torch.Generator().manual_seed(0)
    size, dim = 64, 32
    queries = torch.randn(size, dim, generator=generator)
    docs = queries + 0.3 * torch.randn(size, dim, generator=generator)
    labels = [f"c{i}" for i in range(size)]
    # rows 0, 1 and 2 are one class, with duplicate documents: 6 false negatives, all of them masked by the guard
    docs[1] = docs[0]
    docs[2] = docs[0]
    queries[1] = queries[0] + 0.01 * torch.randn(dim, generator=generator)
    queries[2] = queries[0] + 0.01 * torch.randn(dim, generator=generator)
    labels[1] = labels[2] = labels[0]
    queries, docs = F.normalize(queries, dim=-1), F.normalize(docs, dim=-1)
    counts = compare.blending_diagnostic(queries, docs, labels, FalseNegativeFilter.parse(("absolute", 0.05)))
    assert counts["anchors"] == 64 and counts["false_negatives"] == 6
    assert counts["masked"] == 6 and counts["masked_false_negatives"] == 6
    # the planted rows' hardest candidate is a false negative before the guard, never after
    assert counts["blended_fn_hardest_before"] <= 3 and counts["blended_fn_hardest_after"] == 0
    assert 0 <= counts["blended_before"] <= 64


def test_knn_accuracy_majority_vote_and_ties(compare):
    """k = 3: a 2-1 vote wins; with k = 2 a 1-1 tie goes to the nearer neighbour's class."""
    reference = F.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.3], [0.0, 1.0]]), dim=-1)
    labels = ["a", "b", "b", "c"]
    query = F.normalize(torch.tensor([[1.0, 0.02]]), dim=-1)  # nearest: a, then b, b, then c
    assert compare.knn_accuracy(reference, labels, query, ["b"], k=3) == 1.0
    assert compare.knn_accuracy(reference, labels, query, ["a"], k=2) == 1.0
    assert compare.knn_accuracy(reference, labels, query, ["a"], k=1) == 1.0
    assert compare.knn_accuracy(reference, labels, torch.cat([query, query]), ["b", "c"], k=3) == 0.5


def write_split(path: Path, rows: list[tuple[str, str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "category"])
        writer.writerows(rows)


def test_tiny_comparison_writes_lines_and_resumes(compare, tiny_model_dir, tmp_path, one_torch_thread):
    data = tmp_path / "data" / "banking77"
    data.mkdir(parents=True)
    write_split(data / "train.csv", labelled_rows(per_class=20))
    write_split(data / "test.csv", labelled_rows(per_class=4, seed=1))
    out = tmp_path / "out"
    argv = [
        "--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"), "--out", str(out),
        "--losses", "mnrl", "rb_sigmoid", "--seeds", "0", "1", "--grid", "absolute:0.1", "relative:0.9",
        "--steps", "2", "--warmup-steps", "1", "--batch-size", "8", "--reference-per-class", "3", "--no-mteb",
    ]  # fmt: skip
    summary = compare.main(argv)
    lines = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    # per loss: 2 thresholds at seed 0, no guard at seeds 0 and 1, the chosen threshold at seed 1
    assert len(lines) == 10 and len({line["name"] for line in lines}) == 10
    for loss_name in ("mnrl", "rb_sigmoid"):
        result = summary["losses"][loss_name]
        by_name = {line["name"]: line for line in lines if line["loss"] == loss_name}
        chosen = result["chosen_filter"]
        # the chosen threshold is the validation argmax (first on ties)
        grid_scores = [
            by_name[f"{loss_name}-{rule}{value}-seed0"]["val_knn"]
            for rule, value in (("absolute", 0.1), ("relative", 0.9))
        ]
        assert chosen == [["absolute", 0.1], ["relative", 0.9]][grid_scores.index(max(grid_scores))]
        tag = f"{chosen[0]}{chosen[1]}"
        expected = [
            by_name[f"{loss_name}-{tag}-seed{s}"]["test_knn"] - by_name[f"{loss_name}-off-seed{s}"]["test_knn"]
            for s in (0, 1)
        ]
        assert [result["paired"]["per_seed"][str(s)]["test_knn"] for s in (0, 1)] == pytest.approx(expected)
        assert result["paired"]["test_knn"]["mean"] == pytest.approx(sum(expected) / 2)
        assert 0.0 <= result["arms"]["guard"]["test_linear_probe"]["mean"] <= 1.0
        assert "mteb_banking77" not in result["paired"]
    # Between losses, paired by seed: RB-Sigmoid - MNRL without the guard, from the run lines.
    runs = {line["name"]: line for line in lines}
    between_losses = summary["between_losses"]["rb_sigmoid_minus_mnrl_off"]
    between = [between_losses["per_seed"][str(s)]["test_linear_probe"] for s in (0, 1)]
    expected = [
        runs[f"rb_sigmoid-off-seed{s}"]["test_linear_probe"] - runs[f"mnrl-off-seed{s}"]["test_linear_probe"]
        for s in (0, 1)
    ]
    assert between == pytest.approx(expected)
    assert "mteb_banking77" not in summary["between_losses"]["rb_sigmoid_minus_mnrl_guard"]
    assert all(line["logged"] for line in lines)
    # Trained through the trainer on the planned batches: every step logged, and every arm of a seed saw the same
    # batches (the false negatives per anchor depend on the batches' classes only).
    assert all(len(line["train_losses"]) == 2 for line in lines)
    for seed in (0, 1):
        assert len({line["diagnostic"]["false_negatives_per_anchor"] for line in lines if line["seed"] == seed}) == 1
    guarded = [line for line in lines if line["filter"] is not None]
    key = "weince_fn_masked_share" if guarded[0]["loss"] == "mnrl" else "rb_sigmoid_fn_masked_share"
    assert key in guarded[0]["logged"]
    assert summary["provenance"]["command"].startswith("python ")
    assert (out / "summary.md").read_text().count("paired diff") == 2
    # A restart trains nothing again and writes the same summary.
    before = (out / "runs.jsonl").read_text()
    again = compare.main(argv)
    assert (out / "runs.jsonl").read_text() == before
    assert again["losses"] == summary["losses"]


def test_diagnostic_only_on_the_starting_model(compare, tiny_model_dir, tmp_path, one_torch_thread):
    data = tmp_path / "data" / "banking77"
    data.mkdir(parents=True)
    write_split(data / "train.csv", labelled_rows(per_class=20))
    write_split(data / "test.csv", labelled_rows(per_class=4, seed=1))
    argv = [
        "--model", str(tiny_model_dir), "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
        "--seeds", "0", "1", "--grid", "absolute:0.0", "absolute:0.5", "--batch-size", "8", "--diagnostic-only", "3",
    ]  # fmt: skip
    record = compare.main(argv)
    assert json.loads((tmp_path / "out" / "diagnostic_start.json").read_text()) == record
    tight, loose = record["diagnostic"]
    assert tight["anchors"] == loose["anchors"] == 2 * 3 * 8
    # the same batches: the same false negatives and the same "before"; a looser threshold removes more
    assert tight["false_negatives_per_anchor"] == loose["false_negatives_per_anchor"] > 0
    assert tight["blended_share_before"] == loose["blended_share_before"]
    assert loose["masked_per_anchor"] >= tight["masked_per_anchor"]
    assert not (tmp_path / "out" / "runs.jsonl").exists()
