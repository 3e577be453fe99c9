"""eval/mteb_eval.py: MTEB on local data, no result-cache collision between models, agreement with eval/sts.py."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mteb")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `eval/` is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from eval import mteb_eval  # noqa: E402
from tests.conftest import copy_head_lines  # noqa: E402

from sts_tasks import MissingDataError, evaluate_sts, load_sts_task  # noqa: E402

CATEGORIES = ["card_arrival", "card_linking", "exchange_rate"]


def build_tiny_model(path: Path, sentences: list[str], seed: int = 0):
    from recipe_tools import build_tiny_bert

    return build_tiny_bert(path, sentences=sentences, seed=seed)


@pytest.fixture(scope="module")
def tiny_data(shared_data: Path, tmp_path_factory) -> Path:
    """STS-B test (50 pairs), STS12 (15 pairs a subset) and BANKING77 with 3 intents (12 train / 6 test each)."""
    root = tmp_path_factory.mktemp("mteb-data")
    copy_head_lines(shared_data / "stsb/stsb-en-test.csv", root / "stsb/stsb-en-test.csv", 50)
    for subset in ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"):
        for kind in ("input", "gs"):
            name = f"sts_senteval/STS12-en-test/STS.{kind}.{subset}.txt"
            copy_head_lines(shared_data / name, root / name, 15)
    (root / "banking77").mkdir()
    for split, per_class in (("train", 12), ("test", 6)):
        with (shared_data / "banking77" / f"{split}.csv").open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
        with (root / "banking77" / f"{split}.csv").open("w", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["text", "category"])
            for category in CATEGORIES:
                for row in [r for r in rows if r["category"] == category][:per_class]:
                    writer.writerow([row["text"], category])
    (root / "banking77/categories.json").write_text(json.dumps(CATEGORIES), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def model_dirs(tiny_data: Path, tmp_path_factory) -> list[Path]:
    """Two tiny models that differ only by their random initialisation."""
    sentences = []
    for task in ("STSBenchmark", "STS12"):
        for subset in load_sts_task(task, tiny_data):
            sentences += subset.sentences1 + subset.sentences2
    with (tiny_data / "banking77/train.csv").open(encoding="utf-8", newline="") as handle:
        sentences += [row["text"] for row in csv.DictReader(handle)]
    dirs = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"tiny-mteb-bert-{seed}")
        build_tiny_model(path, sentences, seed=seed)
        dirs.append(path)
    return dirs


@pytest.fixture(scope="module")
def cli_run(model_dirs: list[Path], tiny_data: Path, tmp_path_factory) -> tuple[dict, Path]:
    """One CLI run: two models, STS-B + STS12 + Banking77, tables written."""
    out = tmp_path_factory.mktemp("mteb-out")
    argv = ["--models", *map(str, model_dirs), "--names", "tiny-a", "tiny-b", "--data-dir", str(tiny_data)]
    argv += ["--tasks", "STSBenchmark", "STS12", "Banking77Classification", "--output-dir", str(out)]
    return mteb_eval.main(argv), out


def test_two_models_in_one_run_get_their_own_scores(cli_run, model_dirs: list[Path], tiny_data: Path):
    output, _ = cli_run
    a, b = output["results"]["tiny-a"]["scores"], output["results"]["tiny-b"]["scores"]
    assert a["STSBenchmark"] != pytest.approx(b["STSBenchmark"], abs=1e-3)
    assert a["STS12"] != pytest.approx(b["STS12"], abs=1e-3)
    # each model's MTEB STS score is the one eval/sts.py computes for that very model (no cross-talk)
    for name, path in zip(("tiny-a", "tiny-b"), model_dirs, strict=True):
        expected = evaluate_sts(str(path), ["STSBenchmark", "STS12"], tiny_data)
        got = output["results"][name]["scores"]
        assert got["STSBenchmark"] == pytest.approx(expected["STSBenchmark"], abs=1e-3)
        assert got["STS12"] == pytest.approx(expected["STS12"], abs=1e-3)  # MTEB's STS12 = SentEval's "all"
    assert output["cache"] is None


def test_banking77_runs_offline_on_local_data(cli_run):
    output, _ = cli_run
    for name in ("tiny-a", "tiny-b"):
        result = output["results"][name]
        assert result["main_scores"]["Banking77Classification"] == "accuracy"
        accuracy = result["metrics"]["Banking77Classification"]["accuracy"]
        assert result["scores"]["Banking77Classification"] == pytest.approx(100 * accuracy)
        assert 0.0 <= accuracy <= 1.0
        assert round(accuracy * 18 * 10) == pytest.approx(accuracy * 18 * 10, abs=1e-6)  # 18 test queries, 10 runs


def test_tables_are_written(cli_run):
    output, out = cli_run
    with (out / "mteb_scores.csv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["model"] for r in rows] == ["tiny-a", "tiny-b"]
    for row in rows:
        scores = output["results"][row["model"]]["scores"]
        assert float(row["STS12"]) == pytest.approx(scores["STS12"], abs=1e-4)
        assert float(row["avg"]) == pytest.approx(sum(scores.values()) / 3, abs=1e-4)
    markdown = (out / "mteb_scores.md").read_text(encoding="utf-8")
    assert markdown.startswith("| model | STSBenchmark | STS12 | Banking77Classification | avg |")
    saved = json.loads((out / "mteb_scores.json").read_text(encoding="utf-8"))
    assert saved["tasks"] == ["STSBenchmark", "STS12", "Banking77Classification"]
    assert saved["provenance"]["versions"]["mteb"]


def test_local_banking77_loader(tiny_data: Path):
    dataset = mteb_eval.load_banking77(tiny_data)
    assert dataset["train"].num_rows == 36 and dataset["test"].num_rows == 18
    with (tiny_data / "banking77/test.csv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert dataset["test"]["text"] == [r["text"] for r in rows]
    assert dataset["test"]["label"] == [CATEGORIES.index(r["category"]) for r in rows]


def test_default_tasks_and_presets():
    assert mteb_eval.resolve_tasks() == [
        "STS12",
        "STS13",
        "STS14",
        "STS15",
        "STS16",
        "STSBenchmark",
        "SICK-R",
        "Banking77Classification",
    ]
    assert mteb_eval.resolve_tasks(["SICK-R"], ["retrieval"]) == ["SICK-R", "SciFact", "NFCorpus", "ArguAna"]


def test_errors(tiny_data: Path, tmp_path: Path, monkeypatch):
    with pytest.raises(ValueError, match="unknown MTEB task 'NoSuchTask'"):
        mteb_eval.resolve_tasks(["NoSuchTask"])
    with pytest.raises(ValueError, match="unknown task set 'vision'"):
        mteb_eval.resolve_tasks(task_sets=["vision"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="SciFact have no local data here and the hub is offline"):
        mteb_eval.build_tasks(["STSBenchmark", "SciFact"], tiny_data)
    with pytest.raises(MissingDataError, match="banking77/train.csv"):
        mteb_eval.build_tasks(["Banking77Classification"], tmp_path)
    with pytest.raises(MissingDataError, match="STS13: missing data file"):
        mteb_eval.build_tasks(["STS13"], tiny_data)
    with pytest.raises(ValueError, match="model names must be unique"):
        mteb_eval.unique_model_names(["a", "b"], ["x", "x"])
    with pytest.raises(ValueError, match="the same model is listed twice"):
        mteb_eval.unique_model_names(["a", "a"])
    with pytest.raises(ValueError, match="1 names for 2 models"):
        mteb_eval.unique_model_names(["a", "b"], ["x"])


def test_committed_minilm_mteb_reference():
    path = REPO_ROOT / "eval/reference/all-MiniLM-L6-v2.mteb/mteb_scores.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    (result,) = saved["results"].values()
    assert result["scores"]["STSBenchmark"] == pytest.approx(82.03, abs=0.05)
    sts_row = json.loads((REPO_ROOT / "eval/reference/all-MiniLM-L6-v2.sts.json").read_text(encoding="utf-8"))
    for task in ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICK-R"):
        assert result["scores"][task] == pytest.approx(sts_row["scores"][task], abs=0.01)  # the two paths agree
    assert saved["cache"] is None and "Banking77Classification" in result["scores"]
