"""The SimCSE 7-task STS evaluation (STS12-16, STS-B, SICK-R) from local files: the data as SentEval and the SimCSE
authors ship it, and its scores (cosine Spearman) through sentence-transformers' ``EmbeddingSimilarityEvaluator``.
Not part of the installed package: eval/sts.py and eval/mteb_eval.py import it from their folder, recipes/simcse.py
(its STS-B dev and test scores, the very ones eval/sts.py gives on the saved model) adds this folder to its path.

A data folder is laid out like ``../shared/data``::

    DATA/stsb/stsb-en-{train,dev,test}.csv               STS Benchmark: CSV sentence1,sentence2,score (0-5), no header
    DATA/sts_senteval/STS1{2..6}-en-test/STS.input.*.txt  two tab-separated sentences a line
    DATA/sts_senteval/STS1{2..6}-en-test/STS.gs.*.txt     gold score a line; a blank line marks an unscored pair
    DATA/sts_senteval/SICK/SICK_{train,trial,test_annotated}.txt   SICK (TSV with a header)

Every reader whitespace-normalises sentences as SentEval's loaders do (``" ".join(s.split())``) and returns
:class:`STSSubset` objects.

What is this project's own in the scores is only what no library gives: SentEval's three aggregations of a year's
subsets (STS12-16), as SimCSE's evaluation reports them:

- ``all``: the Spearman correlation over the concatenation of all subsets of a year (the figure SimCSE's table prints);
- ``mean``: the plain mean of the per-subset correlations;
- ``wmean``: their mean weighted by subset size.

The similarity and the correlation are the evaluator's (``pairwise_cos_sim``, ``scipy.stats.spearmanr``).
:class:`STSEvaluator` encodes each distinct sentence of its pairs once (``EmbeddingSimilarityEvaluator`` encodes
both columns separately), so every caller - ``eval/sts.py``, the recipe's dev evaluation during training, its
before/after figures - gets the very same embeddings, hence the very same score, for the same model and pairs. The
plain evaluator batches the sentences differently, and its figure can differ in the last digits: all-MiniLM-L6-v2 on
STS-B test scores 0.8203246731 through this one and 0.8203247283 through the plain one (dev: equal).
"""

from __future__ import annotations

import csv
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

from st_weince.diagnostics.inputs import MissingDataError, normalise_whitespace, read_pair_csv
from st_weince.utils.cli import check_model_path

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

_REPO_ROOT = Path(__file__).resolve().parents[1]


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


# --------------------------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------------------------
AGGREGATIONS: tuple[str, ...] = ("all", "mean", "wmean")
SPEARMAN_KEY = "spearman_cosine"


class STSEvaluator(EmbeddingSimilarityEvaluator):
    """``EmbeddingSimilarityEvaluator`` (cosine) on one :class:`STSSubset`, each distinct
    sentence encoded once.

    Args:
        subset: the sentence pairs and gold scores.
        name: the evaluator's name; the trainer logs ``eval_{name}_spearman_cosine``.
        batch_size: encoding batch size.
        show_progress_bar: passed to ``model.encode``.
        embeddings: sentence -> embedding, encoded already (e.g. for all subsets of a table at once); ``None``
            encodes this subset's distinct sentences at every call.
        num_modules: score ``model[:num_modules]`` only, e.g. the encoder without a training-only head (SimCSE's
            MLP); ``None``: the whole model.

    A model in training mode is put back into it after encoding (``encode`` switches to eval mode), so the
    evaluator can run mid-training. Returns the evaluator's metrics dict; ``{name}_spearman_cosine`` is the score.
    """

    def __init__(
        self,
        subset: STSSubset,
        *,
        name: str,
        batch_size: int = 64,
        show_progress_bar: bool = False,
        embeddings: Mapping[str, np.ndarray] | None = None,
        num_modules: int | None = None,
    ) -> None:
        super().__init__(
            subset.sentences1,
            subset.sentences2,
            [float(score) for score in subset.scores],
            batch_size=batch_size,
            main_similarity="cosine",
            similarity_fn_names=["cosine"],
            name=name,
            show_progress_bar=show_progress_bar,
            write_csv=False,
        )
        self.embeddings = embeddings
        self.num_modules = num_modules
        self._call_embeddings: Mapping[str, np.ndarray] | None = None

    def encode_distinct(self, model: Any, sentences: Iterable[str]) -> dict[str, np.ndarray]:
        """sentence -> embedding for the distinct ``sentences``, in first-seen order, by the library's encode call."""
        distinct = list(dict.fromkeys(sentences))
        was_training = bool(getattr(model, "training", False))
        try:
            vectors = super().embed_inputs(model, distinct)
        finally:
            if was_training:
                model.train()
        return dict(zip(distinct, np.asarray(vectors), strict=True))

    def __call__(self, model: Any, output_path: str | None = None, epoch: int = -1, steps: int = -1) -> dict:
        if self.num_modules is not None and len(model) > self.num_modules:
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(modules=list(model)[: self.num_modules], device=str(model.device))
        table = self.embeddings
        if table is None:
            table = self.encode_distinct(model, [*self.sentences1, *self.sentences2])
        self._call_embeddings = table
        try:
            metrics = super().__call__(model, output_path=output_path, epoch=epoch, steps=steps)
        finally:
            self._call_embeddings = None
        score = metrics[f"{self.name}_{SPEARMAN_KEY}"]
        if not np.isfinite(score):
            raise ValueError(f"{self.name}: Spearman correlation is undefined (constant predictions or gold scores)")
        return metrics

    def embed_inputs(self, model: Any, sentences: Any, **kwargs: Any) -> np.ndarray:
        if self._call_embeddings is None:  # called outside __call__: plain encoding
            return super().embed_inputs(model, sentences, **kwargs)
        return np.stack([self._call_embeddings[sentence] for sentence in sentences])

    def store_metrics_in_model_card_data(self, model: Any, metrics: dict, epoch: int = 0, step: int = 0) -> None:
        if hasattr(model, "model_card_data"):  # anything with .encode can be evaluated
            super().store_metrics_in_model_card_data(model, metrics, epoch, step)

    def spearman(self, model: Any) -> float:
        """The cosine Spearman correlation (a fraction, not x100)."""
        return float(self(model)[f"{self.name}_{SPEARMAN_KEY}"])


def senteval_aggregation(
    per_subset: Sequence[float], sizes: Sequence[int], concatenated: float, names: Sequence[str]
) -> dict[str, Any]:
    """SentEval's ``all`` (the correlation of the concatenation), ``mean`` and ``wmean`` (size-weighted) of one
    year's per-subset correlations, plus the per-subset figures; fractions, not x100."""
    return {
        "all": float(concatenated),
        "mean": float(np.mean(per_subset)),
        "wmean": float(np.average(per_subset, weights=sizes)),
        "n": int(sum(sizes)),
        "subsets": {n: {"spearman": float(s), "n": int(k)} for n, s, k in zip(names, per_subset, sizes, strict=True)},
    }


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
    """:func:`senteval_aggregation` of similarity predictions already computed (one array per subset)."""
    if len(predictions) != len(golds) or not predictions:
        raise ValueError(f"need one prediction array per gold array, got {len(predictions)} and {len(golds)}")
    names = [f"subset{i}" for i in range(len(golds))] if names is None else list(names)
    arrays = [(np.asarray(p, dtype=np.float64), np.asarray(g, dtype=np.float64)) for p, g in zip(predictions, golds)]
    per_subset = [_spearman(p, g, n) for (p, g), n in zip(arrays, names, strict=True)]
    concatenated = _spearman(
        np.concatenate([p for p, _ in arrays]), np.concatenate([g for _, g in arrays]), "all subsets"
    )
    return senteval_aggregation(per_subset, [len(g) for _, g in arrays], concatenated, names)


def _concatenate(name: str, subsets: Sequence[STSSubset]) -> STSSubset:
    return STSSubset(
        name,
        [s for subset in subsets for s in subset.sentences1],
        [s for subset in subsets for s in subset.sentences2],
        np.concatenate([subset.scores for subset in subsets]),
    )


def load_model(model: Any, device: str | None = None, max_seq_length: int | None = None) -> Any:
    if isinstance(model, str | Path):
        from sentence_transformers import SentenceTransformer

        check_model_path(model)  # a missing path, or a run folder, named as such
        model = SentenceTransformer(str(model), device=device)
    if not hasattr(model, "encode"):
        raise ValueError(f"model must be a path, a name or an object with .encode(), got {type(model).__name__}")
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


def evaluate_subsets(
    model: Any,
    tasks: Mapping[str, Sequence[STSSubset]],
    *,
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> dict[str, dict[str, Any]]:
    """Per task (``{task: its subsets}``): SentEval's ``all`` / ``mean`` / ``wmean`` Spearman (fractions), pair count
    and per-subset figures. Every distinct sentence of all tasks is encoded once."""
    model = load_model(model)
    flat = [subset for subsets in tasks.values() for subset in subsets]
    if not flat:
        raise ValueError("no STS subset to evaluate")
    encoder = STSEvaluator(flat[0], name="encode", batch_size=batch_size, show_progress_bar=show_progress_bar)
    table = encoder.encode_distinct(model, (s for subset in flat for s in (*subset.sentences1, *subset.sentences2)))
    details: dict[str, dict[str, Any]] = {}
    for task, subsets in tasks.items():
        names = [f"{task}/{s.name}" if task in SENTEVAL_SUBSETS else s.name for s in subsets]
        per_subset = [
            STSEvaluator(subset, name=name, batch_size=batch_size, embeddings=table).spearman(model)
            for subset, name in zip(subsets, names, strict=True)
        ]
        if len(subsets) == 1:  # STS-B, SICK-R: the concatenation is the subset
            concatenated = per_subset[0]
        else:
            whole = _concatenate(task, subsets)
            concatenated = STSEvaluator(whole, name=task, batch_size=batch_size, embeddings=table).spearman(model)
        details[task] = senteval_aggregation(per_subset, [len(s.scores) for s in subsets], concatenated, names)
    return details


def sts_details(
    model: Any,
    tasks: str | Iterable[str] | None = None,
    data_dir: str | Path | None = None,
    *,
    split: str = "test",
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> dict[str, dict[str, Any]]:
    """:func:`evaluate_subsets` on tasks read from a data folder (all files are checked before encoding)."""
    names = resolve_task_names(tasks)
    loaded = {task: load_sts_task(task, data_dir, split) for task in names}
    return evaluate_subsets(model, loaded, batch_size=batch_size, show_progress_bar=show_progress_bar)


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
        tasks: any of :data:`TASKS` (aliases ``STS-B``, ``SICKRelatedness``); one name or several;
            ``None`` = all seven.
        data_dir: a folder laid out like ``../shared/data`` (``stsb/``, ``sts_senteval/``); ``None`` = that folder
            if it exists beside the repository, else ``eval/data`` (STS-B dev/test only).
        split: ``"test"`` (all tasks), ``"dev"`` / ``"train"`` (STS-B, SICK-R if its files are present).
        aggregation: for STS12-16: ``"all"`` (SimCSE's table), ``"mean"`` or ``"wmean"`` of the subsets.
        batch_size: encoding batch size.
        show_progress_bar: passed to ``model.encode``.

    Returns:
        ``{task: score, ..., "avg": mean}`` with scores in [-100, 100].

    Raises:
        ValueError: unknown task, split or aggregation, malformed files, an undefined correlation;
        ``MissingDataError`` (a ValueError and a FileNotFoundError) when a data file is missing.
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
