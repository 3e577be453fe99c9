"""STS scores (cosine Spearman) through sentence-transformers' ``EmbeddingSimilarityEvaluator``.

What is this project's own here is only what no library gives: SentEval's three aggregations of a year's subsets
(STS12-16), as SimCSE's evaluation reports them:

- ``all``: the Spearman correlation over the concatenation of all subsets of a year (the figure SimCSE's table prints);
- ``mean``: the plain mean of the per-subset correlations;
- ``wmean``: their mean weighted by subset size.

The similarity and the correlation are the evaluator's (``pairwise_cos_sim``, ``scipy.stats.spearmanr``).
:class:`STSEvaluator` encodes each distinct sentence of its pairs once (``EmbeddingSimilarityEvaluator`` encodes
both columns separately), so every caller - ``eval/sts.py``, the recipes' dev evaluation during training, their
before/after figures - gets the very same embeddings, hence the very same score, for the same model and pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

from st_weince.data.sts import SENTEVAL_SUBSETS, STSSubset, load_sts_task, resolve_task_names

AGGREGATIONS: tuple[str, ...] = ("all", "mean", "wmean")
SPEARMAN_KEY = "spearman_cosine"


class STSEvaluator(EmbeddingSimilarityEvaluator):
    """``EmbeddingSimilarityEvaluator`` (cosine) on one :class:`~st_weince.data.sts.STSSubset`, each distinct
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

        from st_weince.utils.pretrained import check_model_path

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
    split: str = "test", aggregation: str = "all", batch_size: int = 64, show_progress_bar: bool = False,
) -> dict[str, float]:
    """Cosine Spearman x100 of ``model`` on STS tasks, from local files.

    Args:
        model: a SentenceTransformer (or any object with ``encode``), or a path / name to load one from.
        tasks: any of ``st_weince.data.sts.TASKS`` (aliases ``STS-B``, ``SICKRelatedness``); one name or several;
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
