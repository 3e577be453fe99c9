"""STS data as SentEval and the SimCSE authors ship it: folder layout, readers, download.

A data folder is laid out like ``../shared/data``::

    DATA/stsb/stsb-en-{train,dev,test}.csv               STS Benchmark: CSV sentence1,sentence2,score (0-5), no header
    DATA/sts_senteval/STS1{2..6}-en-test/STS.input.*.txt  two tab-separated sentences a line
    DATA/sts_senteval/STS1{2..6}-en-test/STS.gs.*.txt     gold score a line; a blank line marks an unscored pair
    DATA/sts_senteval/SICK/SICK_{train,trial,test_annotated}.txt   SICK (TSV with a header)

Every reader whitespace-normalises sentences as SentEval's loaders do (``" ".join(s.split())``) and returns
:class:`STSSubset` objects; the scores are computed by :mod:`st_weince.evaluation.sts`.
"""

from __future__ import annotations

import csv
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
SICK_FILES: dict[str, str] = {"train": "SICK_train.txt", "dev": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}
# Where the SimCSE authors host SentEval's data (their SentEval/data/downstream/download_dataset.sh).
SIMCSE_SENTEVAL_REPO = "princeton-nlp/datasets-for-simcse"
SIMCSE_SENTEVAL_FILE = "senteval.tar"

_REPO_ROOT = Path(__file__).resolve().parents[2]


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
    """In a checkout of the repository: ``../shared/data`` beside it if it is there, else the small copy in
    ``eval/data`` (STS-B dev/test only, with its licence)."""
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


def normalise_whitespace(sentence: str) -> str:
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
        s1.append(normalise_whitespace(fields[0]))
        s2.append(normalise_whitespace(fields[1]))
        scores.append(score)
    return STSSubset(name, s1, s2, np.asarray(scores, dtype=np.float64))


def read_pair_csv(path: str | Path, *, scored: bool = True) -> tuple[list[str], list[str], list[float]]:
    """Sentence pairs from a CSV without a header: ``sentence1,sentence2,score`` (STS-B's layout), or
    ``sentence1,sentence2[,...]`` with ``scored=False`` (then the scores list is empty).

    Raises a ValueError naming the file and line for a row with the wrong number of fields or a non-numeric score,
    and a :class:`MissingDataError` for a missing file.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"sentence-pair file {path} not found (CSV sentence1,sentence2,score without header)")
    s1, s2, scores = [], [], []
    with path.open(encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.reader(handle), start=1):
            if scored and len(row) != 3:
                raise ValueError(f"{path}:{number}: expected 3 CSV fields sentence1,sentence2,score, found {len(row)}")
            if len(row) < 2:
                raise ValueError(
                    f"{path}:{number}: expected 2 or more CSV fields sentence1,sentence2, found {len(row)}"
                )
            if scored:
                try:
                    scores.append(float(row[2]))
                except ValueError:
                    raise ValueError(f"{path}:{number}: score {row[2]!r} is not a number") from None
            s1.append(normalise_whitespace(row[0]))
            s2.append(normalise_whitespace(row[1]))
    return s1, s2, scores


def read_stsb_csv(path: str | Path, name: str = "STSBenchmark") -> STSSubset:
    """STS Benchmark as CSV ``sentence1,sentence2,score`` without a header (the layout of ``../shared/data/stsb``)."""
    s1, s2, scores = read_pair_csv(path)
    return STSSubset(name, s1, s2, np.asarray(scores, dtype=np.float64))


def read_stsb_splits(folder: str | Path, dev_pairs: int | None = None) -> dict[str, STSSubset]:
    """``{"dev": ..., "test": ...}`` from a folder holding ``stsb-en-dev.csv`` and ``stsb-en-test.csv`` (the recipes'
    ``--stsb-dir``); ``dev_pairs`` keeps the first N dev pairs only."""
    splits = {}
    for split in ("dev", "test"):
        path = Path(folder) / f"stsb-en-{split}.csv"
        if not path.is_file():
            raise MissingDataError(
                f"STS-B {split} file {str(path)!r} not found. Pass --stsb-dir with a folder holding stsb-en-dev.csv "
                "and stsb-en-test.csv (CSV sentence1,sentence2,score without header), e.g. eval/data/stsb."
            )
        splits[split] = read_stsb_csv(path, name=f"STSBenchmark/{split}")
    if dev_pairs:
        dev = splits["dev"]
        splits["dev"] = STSSubset(
            dev.name, dev.sentences1[:dev_pairs], dev.sentences2[:dev_pairs], dev.scores[:dev_pairs]
        )
    return splits


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
        s1.append(normalise_whitespace(a))
        s2.append(normalise_whitespace(b))
        scores.append(score)
    return STSSubset(name, s1, s2, np.asarray(scores, dtype=np.float64))


def load_sts_task(task: str, data_dir: str | Path | None = None, split: str = "test") -> list[STSSubset]:
    """The subsets of one task (one element for STS-B and SICK-R), read from ``data_dir``
    (``None``: :func:`default_data_dir`)."""
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
