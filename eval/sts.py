"""The SimCSE 7-task STS table (STS12-16, STS-B, SICK-R), offline, as cosine Spearman x100.

Usage (a folder laid out like ``../shared/data``: ``stsb/`` and ``sts_senteval/``):

    python eval/sts.py --model path/to/model --output sts.json
    python eval/sts.py --model path/to/model --tasks STSBenchmark --split dev

What is computed, matching SimCSE's ``evaluation.py --mode test --task_set sts``:

- STS12-16 (SentEval's copies of the test sets): the cosine similarity of each pair is compared with the gold score
  by Spearman's rank correlation over the concatenation of all subsets of a year (SentEval's ``all`` -> ``spearman``
  -> ``all``, the figure SimCSE prints in its table). Pairs whose gold score is blank are unscored and skipped, as
  SentEval does. ``--aggregation mean`` / ``wmean`` give SentEval's other two figures (plain / size-weighted mean of
  the per-subset correlations) instead.
- STS-B and SICK-R: Spearman on the test split.
- ``avg``: the mean of the task scores (SimCSE averages the scores after rounding them to two decimals; the
  difference is below 0.005).

Sentences are whitespace-normalised as SentEval's loaders do (``" ".join(s.split())``) and encoded with the model's
own ``max_seq_length`` unless ``--max-seq-length`` is given.

From Python (e.g. a training recipe selecting checkpoints on STS-B dev):

    from eval.sts import evaluate_sts
    scores = evaluate_sts(model, ["STSBenchmark"], data_dir, split="dev")  # {"STSBenchmark": 84.1, "avg": 84.1}
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr

TASKS: tuple[str, ...] = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICK-R")
TASK_ALIASES: dict[str, str] = {
    "STS-B": "STSBenchmark",
    "STSB": "STSBenchmark",
    "SICKRelatedness": "SICK-R",
    "SICK": "SICK-R",
}
# SentEval's subsets of each year (STS13 without the licensed SMT subset), as in SimCSE's SentEval/senteval/sts.py.
SENTEVAL_SUBSETS: dict[str, tuple[str, ...]] = {
    "STS12": ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews"),
    "STS13": ("FNWN", "headlines", "OnWN"),
    "STS14": ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news"),
    "STS15": ("answers-forums", "answers-students", "belief", "headlines", "images"),
    "STS16": ("answer-answer", "headlines", "plagiarism", "postediting", "question-question"),
}
SPLITS: tuple[str, ...] = ("train", "dev", "test")
AGGREGATIONS: tuple[str, ...] = ("all", "mean", "wmean")
SICK_FILES: dict[str, str] = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}
# Where the SimCSE authors host SentEval's data (their SentEval/data/downstream/download_dataset.sh).
SIMCSE_SENTEVAL_REPO = "princeton-nlp/datasets-for-simcse"
SIMCSE_SENTEVAL_FILE = "senteval.tar"

_REPO_ROOT = Path(__file__).resolve().parents[1]


class MissingDataError(FileNotFoundError, ValueError):
    """A data file an evaluation needs is not there (both a FileNotFoundError and a ValueError)."""


@dataclass(frozen=True)
class STSSubset:
    """Sentence pairs with gold similarity scores: one SentEval subset (e.g. STS12 MSRpar) or a whole split."""

    name: str
    sentences1: list[str]
    sentences2: list[str]
    scores: np.ndarray

    def __post_init__(self) -> None:
        if not (len(self.sentences1) == len(self.sentences2) == len(self.scores)):
            raise ValueError(
                f"{self.name}: {len(self.sentences1)} first sentences, {len(self.sentences2)} second sentences and "
                f"{len(self.scores)} gold scores; they must be equally many"
            )
        if len(self.scores) == 0:
            raise ValueError(f"{self.name}: no scored sentence pairs")


# --------------------------------------------------------------------------------------------------------------------
# Task names and data files
# --------------------------------------------------------------------------------------------------------------------
def resolve_task_names(tasks: str | Iterable[str] | None) -> list[str]:
    """Canonical task names, in the given order without duplicates; ``None`` means all seven."""
    if tasks is None:
        return list(TASKS)
    if isinstance(tasks, str):
        tasks = [tasks]
    resolved: list[str] = []
    for task in tasks:
        name = TASK_ALIASES.get(task, task)
        if name not in TASKS:
            raise ValueError(f"unknown STS task {task!r}; choose from {', '.join(TASKS)} (aliases: {TASK_ALIASES})")
        if name not in resolved:
            resolved.append(name)
    if not resolved:
        raise ValueError("no STS task given")
    return resolved


def default_data_dir() -> Path:
    """``../shared/data`` beside the repository if it is there, else the small copy in ``eval/data`` (STS-B only)."""
    shared = _REPO_ROOT.parent / "shared" / "data"
    return shared if shared.is_dir() else _REPO_ROOT / "eval" / "data"


def task_files(task: str, data_dir: str | Path, split: str = "test") -> list[Path]:
    """The files a task reads from a data folder laid out like ``../shared/data`` (they need not exist)."""
    (task,) = resolve_task_names([task])
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    data_dir = Path(data_dir)
    if task == "STSBenchmark":
        return [data_dir / "stsb" / f"stsb-en-{split}.csv"]
    if task == "SICK-R":
        return [data_dir / "sts_senteval" / "SICK" / SICK_FILES[split]]
    if split != "test":
        raise ValueError(f"{task} has only a test split (asked for {split!r})")
    folder = data_dir / "sts_senteval" / f"{task}-en-test"
    files = []
    for subset in SENTEVAL_SUBSETS[task]:
        files += [folder / f"STS.input.{subset}.txt", folder / f"STS.gs.{subset}.txt"]
    return files


def _check_files(task: str, files: Sequence[Path]) -> None:
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise MissingDataError(
            f"{task}: missing data file(s) {', '.join(missing)}. Point --data-dir (data_dir=) at a folder laid out "
            "like ../shared/data (stsb/ and sts_senteval/), or pass --download when online."
        )


def _normalise(sentence: str) -> str:
    return " ".join(sentence.split())


def read_senteval_subset(input_path: str | Path, gold_path: str | Path, name: str) -> STSSubset:
    """One SentEval STS subset: ``STS.input.*.txt`` (two tab-separated sentences a line) and ``STS.gs.*.txt`` (gold
    score a line). A blank gold line marks an unscored pair, which is skipped."""
    input_path, gold_path = Path(input_path), Path(gold_path)
    lines = input_path.read_text(encoding="utf-8").splitlines()
    golds = gold_path.read_text(encoding="utf-8").splitlines()
    if len(lines) != len(golds):
        raise ValueError(f"{input_path} has {len(lines)} lines but {gold_path} has {len(golds)}; they must match")
    s1, s2, scores = [], [], []
    for number, (line, gold) in enumerate(zip(lines, golds, strict=True), start=1):
        if gold.strip() == "":
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise ValueError(f"{input_path}:{number}: expected two tab-separated sentences, found {len(fields)} fields")
        try:
            score = float(gold)
        except ValueError:
            raise ValueError(f"{gold_path}:{number}: gold score {gold!r} is not a number") from None
        s1.append(_normalise(fields[0]))
        s2.append(_normalise(fields[1]))
        scores.append(score)
    return STSSubset(name, s1, s2, np.asarray(scores, dtype=np.float64))


def read_stsb_csv(path: str | Path, name: str = "STSBenchmark") -> STSSubset:
    """STS Benchmark as CSV ``sentence1,sentence2,score`` without a header (the layout of ``../shared/data/stsb``)."""
    path = Path(path)
    s1, s2, scores = [], [], []
    with path.open(encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.reader(handle), start=1):
            if len(row) != 3:
                raise ValueError(f"{path}:{number}: expected 3 CSV fields sentence1,sentence2,score, found {len(row)}")
            try:
                score = float(row[2])
            except ValueError:
                raise ValueError(f"{path}:{number}: score {row[2]!r} is not a number") from None
            s1.append(_normalise(row[0]))
            s2.append(_normalise(row[1]))
            scores.append(score)
    return STSSubset(name, s1, s2, np.asarray(scores, dtype=np.float64))


def read_sick(path: str | Path, name: str = "SICK-R") -> STSSubset:
    """SICK as distributed (TSV with a header; columns ``sentence_A``, ``sentence_B``, ``relatedness_score``)."""
    path = Path(path)
    with path.open(encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise ValueError(f"{path} is empty")
    header = rows[0]
    needed = ("sentence_A", "sentence_B", "relatedness_score")
    if any(column not in header for column in needed):
        raise ValueError(f"{path}: header {header} lacks one of the columns {needed}")
    ia, ib, ir = (header.index(column) for column in needed)
    s1, s2, scores = [], [], []
    for number, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        try:
            score = float(row[ir])
            a, b = row[ia], row[ib]
        except (IndexError, ValueError):
            raise ValueError(f"{path}:{number}: cannot read sentence_A, sentence_B and relatedness_score") from None
        s1.append(_normalise(a))
        s2.append(_normalise(b))
        scores.append(score)
    return STSSubset(name, s1, s2, np.asarray(scores, dtype=np.float64))


def load_sts_task(task: str, data_dir: str | Path | None = None, split: str = "test") -> list[STSSubset]:
    """The subsets of one task (one element for STS-B and SICK-R), read from ``data_dir``."""
    (task,) = resolve_task_names([task])
    data_dir = default_data_dir() if data_dir is None else Path(data_dir)
    files = task_files(task, data_dir, split)
    _check_files(task, files)
    if task == "STSBenchmark":
        return [read_stsb_csv(files[0], name=f"STSBenchmark/{split}")]
    if task == "SICK-R":
        return [read_sick(files[0], name=f"SICK-R/{split}")]
    return [
        read_senteval_subset(files[2 * i], files[2 * i + 1], name=subset)
        for i, subset in enumerate(SENTEVAL_SUBSETS[task])
    ]


# --------------------------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------------------------
def _spearman(predictions: np.ndarray, gold: np.ndarray, what: str) -> float:
    if len(predictions) != len(gold):
        raise ValueError(f"{what}: {len(predictions)} predictions for {len(gold)} gold scores")
    if len(gold) < 2:
        raise ValueError(f"{what}: a correlation needs at least two pairs, got {len(gold)}")
    constant = np.ptp(predictions) == 0 or np.ptp(gold) == 0
    value = float("nan") if constant else float(spearmanr(predictions, gold)[0])
    if not np.isfinite(value):
        raise ValueError(f"{what}: Spearman correlation is undefined (constant predictions or gold scores)")
    return value


def aggregate_spearman(
    predictions: Sequence[np.ndarray], golds: Sequence[np.ndarray], names: Sequence[str] | None = None
) -> dict[str, Any]:
    """SentEval's three aggregations of a year's subsets, as fractions (not x100).

    ``all``: Spearman over the concatenation of all subsets (what SimCSE reports); ``mean``: mean of the per-subset
    correlations; ``wmean``: their mean weighted by subset size. Also the per-subset correlations and sizes.
    """
    if len(predictions) != len(golds) or not predictions:
        raise ValueError(f"need one prediction array per gold array, got {len(predictions)} and {len(golds)}")
    names = [f"subset{i}" for i in range(len(golds))] if names is None else list(names)
    per_subset = [
        _spearman(np.asarray(p, dtype=np.float64), np.asarray(g, dtype=np.float64), n)
        for p, g, n in zip(predictions, golds, names, strict=True)
    ]
    sizes = [len(g) for g in golds]
    concatenated = _spearman(
        np.concatenate([np.asarray(p, dtype=np.float64) for p in predictions]),
        np.concatenate([np.asarray(g, dtype=np.float64) for g in golds]),
        "all subsets",
    )
    return {
        "all": concatenated,
        "mean": float(np.mean(per_subset)),
        "wmean": float(np.average(per_subset, weights=sizes)),
        "n": int(sum(sizes)),
        "subsets": {n: {"spearman": s, "n": k} for n, s, k in zip(names, per_subset, sizes, strict=True)},
    }


def paired_cosine(embeddings1: np.ndarray, embeddings2: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two equally shaped embedding matrices (a zero vector gives 0)."""
    a = np.asarray(embeddings1, dtype=np.float64)
    b = np.asarray(embeddings2, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"expected two (n, d) matrices of one shape, got {a.shape} and {b.shape}")
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return np.einsum("ij,ij->i", a, b)


def _load_model(model: Any, device: str | None = None, max_seq_length: int | None = None) -> Any:
    if isinstance(model, str | Path):
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(model), device=device)
    if not hasattr(model, "encode"):
        raise ValueError(f"model must be a path, a name or an object with .encode(), got {type(model).__name__}")
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


def cosine_predictions(
    model: Any, subsets: Sequence[STSSubset], *, batch_size: int = 64, show_progress_bar: bool = False
) -> list[np.ndarray]:
    """The cosine similarity of every pair of every subset; each distinct sentence is encoded once (in eval mode;
    a model in training mode is put back into it afterwards)."""
    index: dict[str, int] = {}
    for subset in subsets:
        for sentence in (*subset.sentences1, *subset.sentences2):
            index.setdefault(sentence, len(index))
    was_training = bool(getattr(model, "training", False))  # encode() switches to eval mode; restore after
    try:
        embeddings = model.encode(
            list(index), batch_size=batch_size, convert_to_numpy=True, show_progress_bar=show_progress_bar
        )
    finally:
        if was_training:
            model.train()
    embeddings = np.asarray(embeddings)
    return [
        paired_cosine(
            embeddings[[index[s] for s in subset.sentences1]], embeddings[[index[s] for s in subset.sentences2]]
        )
        for subset in subsets
    ]


def sts_details(
    model: Any,
    tasks: str | Iterable[str] | None = None,
    data_dir: str | Path | None = None,
    *,
    split: str = "test",
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> dict[str, dict[str, Any]]:
    """Per task: SentEval's ``all`` / ``mean`` / ``wmean`` Spearman (fractions), pair count and per-subset figures."""
    names = resolve_task_names(tasks)
    model = _load_model(model)
    loaded = {task: load_sts_task(task, data_dir, split) for task in names}  # all files checked before encoding
    flat = [subset for task in names for subset in loaded[task]]
    predictions = cosine_predictions(model, flat, batch_size=batch_size, show_progress_bar=show_progress_bar)
    details: dict[str, dict[str, Any]] = {}
    start = 0
    for task in names:
        subsets = loaded[task]
        preds = predictions[start : start + len(subsets)]
        start += len(subsets)
        labels = [f"{task}/{s.name}" if task in SENTEVAL_SUBSETS else s.name for s in subsets]
        details[task] = aggregate_spearman(preds, [s.scores for s in subsets], labels)
    return details


def scores_from_details(details: dict[str, dict[str, Any]], aggregation: str = "all") -> dict[str, float]:
    """Spearman x100 per task (STS12-16 aggregated by ``aggregation``) and their mean under ``avg``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose from {', '.join(AGGREGATIONS)}")
    scores = {task: 100.0 * d[aggregation if task in SENTEVAL_SUBSETS else "all"] for task, d in details.items()}
    scores["avg"] = float(np.mean(list(scores.values())))
    return scores


def evaluate_sts(
    model: Any,
    tasks: str | Iterable[str] | None = None,
    data_dir: str | Path | None = None,
    *,
    split: str = "test",
    aggregation: str = "all",
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> dict[str, float]:
    """Cosine Spearman x100 of ``model`` on STS tasks, from local files.

    Args:
        model: a SentenceTransformer (or any object with ``encode``), or a path / name to load one from.
        tasks: any of ``TASKS`` (aliases ``STS-B``, ``SICKRelatedness``); one name or several; ``None`` = all seven.
        data_dir: a folder laid out like ``../shared/data`` (``stsb/``, ``sts_senteval/``); ``None`` = that folder
            if it exists beside the repository, else ``eval/data`` (STS-B dev/test only).
        split: ``"test"`` (all tasks), ``"dev"`` / ``"train"`` (STS-B, SICK-R if its files are present).
        aggregation: for STS12-16: ``"all"`` (SimCSE's table), ``"mean"`` or ``"wmean"`` of the subsets.
        batch_size: encoding batch size.
        show_progress_bar: passed to ``model.encode``.

    Returns:
        ``{task: score, ..., "avg": mean}`` with scores in [-100, 100].

    Raises:
        ValueError: unknown task, split or aggregation, malformed files; ``MissingDataError`` (a ValueError and a
        FileNotFoundError) when a data file is missing.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose from {', '.join(AGGREGATIONS)}")
    details = sts_details(
        model, tasks, data_dir, split=split, batch_size=batch_size, show_progress_bar=show_progress_bar
    )
    return scores_from_details(details, aggregation)


def format_table(rows: dict[str, dict[str, float]], columns: Sequence[str] | None = None) -> str:
    """A markdown table, one row per model, two decimals."""
    if not rows:
        raise ValueError("nothing to tabulate")
    if columns is None:
        columns = list(dict.fromkeys(c for scores in rows.values() for c in scores))
    lines = ["| model | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for name, scores in rows.items():
        cells = [f"{scores[c]:.2f}" if c in scores else "-" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Download (online only)
# --------------------------------------------------------------------------------------------------------------------
def download_sts_data(data_dir: str | Path, archive: str | Path | None = None) -> Path:
    """Fill ``data_dir`` (``stsb/``, ``sts_senteval/``) from SentEval's data as the SimCSE authors host it.

    ``archive``: a local copy of ``senteval.tar``; ``None`` downloads it from the Hugging Face hub
    (``princeton-nlp/datasets-for-simcse``). Files already present are kept. STS-B's SentEval files
    (``sts-{train,dev,test}.csv``, tab-separated) are converted to ``stsb/stsb-en-{split}.csv``.
    """
    data_dir = Path(data_dir)
    if archive is None:
        from huggingface_hub import hf_hub_download

        archive = hf_hub_download(SIMCSE_SENTEVAL_REPO, SIMCSE_SENTEVAL_FILE, repo_type="dataset")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        root = Path(tmp)
        for task in SENTEVAL_SUBSETS:
            found = sorted(p for p in root.rglob(f"{task}-en-test") if p.is_dir())
            if not found:
                raise MissingDataError(f"{archive}: no {task}-en-test folder inside")
            target = data_dir / "sts_senteval" / f"{task}-en-test"
            target.mkdir(parents=True, exist_ok=True)
            for file in found[0].iterdir():
                if file.is_file() and not (target / file.name).exists():
                    shutil.copy2(file, target / file.name)
        for split, filename in SICK_FILES.items():
            found = sorted(root.rglob(filename))
            target = data_dir / "sts_senteval" / "SICK" / filename
            if found and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(found[0], target)
            elif not found and split == "test":
                raise MissingDataError(f"{archive}: no {filename} inside")
        for split in SPLITS:
            found = sorted(root.rglob(f"sts-{split}.csv"))
            if not found:
                raise MissingDataError(f"{archive}: no sts-{split}.csv (STS Benchmark) inside")
            target = data_dir / "stsb" / f"stsb-en-{split}.csv"
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with found[0].open(encoding="utf-8") as src, target.open("w", encoding="utf-8", newline="") as dst:
                writer = csv.writer(dst)
                for line in src:
                    fields = line.rstrip("\n").split("\t")
                    if len(fields) >= 7:  # genre, file, year, id, score, sentence1, sentence2[, sources]
                        writer.writerow([fields[5], fields[6], fields[4]])
    return data_dir


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="SentenceTransformer path or hub name")
    parser.add_argument("--tasks", nargs="+", default=None, help=f"any of {' '.join(TASKS)} (default: all)")
    parser.add_argument("--data-dir", default=None, help="folder with stsb/, sts_senteval/ (default: ../shared/data)")
    parser.add_argument("--split", default="test", choices=SPLITS)
    parser.add_argument("--aggregation", default="all", choices=AGGREGATIONS, help="STS12-16 aggregation")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=None, help="override the model's max_seq_length")
    parser.add_argument("--device", default=None)
    parser.add_argument("--name", default=None, help="model name in the output (default: --model)")
    parser.add_argument("--download", action="store_true", help="download missing data (online only)")
    parser.add_argument("--output", default=None, help="JSON file to write")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from st_weince.utils.provenance import provenance

    args = parse_args(argv)
    tasks = resolve_task_names(args.tasks)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if args.download and any(not f.is_file() for t in tasks for f in task_files(t, data_dir, args.split)):
        download_sts_data(data_dir)
    start = time.perf_counter()
    model = _load_model(args.model, device=args.device, max_seq_length=args.max_seq_length)
    details = sts_details(model, tasks, data_dir, split=args.split, batch_size=args.batch_size, show_progress_bar=True)
    scores = scores_from_details(details, args.aggregation)
    name = args.name or args.model
    result = {
        "model": name,
        "scores": scores,
        "metric": "cosine Spearman x100",
        "split": args.split,
        "aggregation": args.aggregation,
        "max_seq_length": getattr(model, "max_seq_length", None),
        "data_dir": str(data_dir),
        "details": details,
        "seconds": round(time.perf_counter() - start, 1),
        "provenance": provenance(["eval/sts.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    print(format_table({name: scores}))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
