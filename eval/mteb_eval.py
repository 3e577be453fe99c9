"""An MTEB subset on one or several models, offline where the task data is local, as a models x tasks table.

Usage:

    python eval/mteb_eval.py --models path/to/a path/to/b --output-dir results/mteb
    python eval/mteb_eval.py --models path/to/a --tasks STSBenchmark Banking77Classification
    python eval/mteb_eval.py --models path/to/a --task-sets sts clustering retrieval   # clustering/retrieval: online

Default tasks: the seven STS tasks of the SimCSE table (STS12-16, STSBenchmark, SICK-R) and
``Banking77Classification``. Their data is read from ``--data-dir`` (laid out like ``../shared/data``: ``stsb/``,
``sts_senteval/``, ``banking77/``) and put into the MTEB task object (``task.dataset = DatasetDict(...)``,
``task.data_loaded = True``), so nothing is downloaded. Any other MTEB task name is loaded by MTEB itself, which
needs the Hugging Face hub (an error says so up front when ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set).

MTEB's result cache is never used (``cache=None``): models without a name share the cache key
``no_model_name/available`` and a fine-tuned model falls back to its base model's name, so a cache can silently
return ANOTHER model's scores. Every model is also given its own name (``model_card_data.model_name``) and fresh task
objects.

The STS tasks here score the same local pairs as ``eval/sts.py`` (both read by ``eval/sts_tasks.py``): STS12-16 as
one concatenated test set each (which is SentEval's ``all`` aggregation), STS-B and SICK-R test, so both scripts give
the same STS numbers. Scores are the
tasks' MTEB main scores x100 (``cosine_spearman`` for STS, ``accuracy`` for classification).

Outputs in ``--output-dir``: ``mteb_scores.json`` (scores, per-task metrics, machine, versions, command),
``mteb_scores.csv`` and ``mteb_scores.md``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sts_tasks import TASKS as STS_TASKS
from sts_tasks import MissingDataError, default_data_dir, format_table, load_sts_task

DEFAULT_TASKS: tuple[str, ...] = (*STS_TASKS, "Banking77Classification")
# Presets; everything beyond the local tasks needs the Hugging Face hub.
TASK_SETS: dict[str, tuple[str, ...]] = {
    "sts": STS_TASKS,
    "classification": ("Banking77Classification", "EmotionClassification"),
    "clustering": ("TwentyNewsgroupsClustering.v2", "BiorxivClusteringS2S.v2"),
    "retrieval": ("SciFact", "NFCorpus", "ArguAna"),
}


# --------------------------------------------------------------------------------------------------------------------
# Local data for MTEB tasks
# --------------------------------------------------------------------------------------------------------------------
def _sts_dataset(task: str) -> Callable[[Path], Any]:
    def load(data_dir: Path) -> Any:
        from datasets import Dataset, DatasetDict

        subsets = load_sts_task(task, data_dir, "test")
        return DatasetDict(
            test=Dataset.from_dict(
                {
                    "sentence1": [s for subset in subsets for s in subset.sentences1],
                    "sentence2": [s for subset in subsets for s in subset.sentences2],
                    "score": [float(x) for subset in subsets for x in subset.scores],
                }
            )
        )

    return load


def load_banking77(data_dir: Path) -> Any:
    """BANKING77 from ``banking77/{train,test}.csv`` (``text,category``); labels are indices into
    ``categories.json`` (the order of the original dataset's label names)."""
    from datasets import Dataset, DatasetDict

    folder = Path(data_dir) / "banking77"
    files = [folder / "train.csv", folder / "test.csv", folder / "categories.json"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise MissingDataError(f"Banking77Classification: missing data file(s) {', '.join(missing)}")
    categories = json.loads(files[2].read_text(encoding="utf-8"))
    label_of = {name: i for i, name in enumerate(categories)}
    splits = {}
    for split, path in (("train", files[0]), ("test", files[1])):
        texts, labels = [], []
        with path.open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or not {"text", "category"} <= set(reader.fieldnames):
                raise ValueError(f"{path}: expected a CSV header with columns text,category, got {reader.fieldnames}")
            for number, row in enumerate(reader, start=2):
                if row["category"] not in label_of:
                    raise ValueError(f"{path}:{number}: category {row['category']!r} is not in {files[2]}")
                texts.append(row["text"])
                labels.append(label_of[row["category"]])
        splits[split] = Dataset.from_dict({"text": texts, "label": labels})
    return DatasetDict(splits)


LOCAL_TASKS: dict[str, Callable[[Path], Any]] = {task: _sts_dataset(task) for task in STS_TASKS}
LOCAL_TASKS["Banking77Classification"] = load_banking77


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def resolve_tasks(tasks: Sequence[str] | None = None, task_sets: Sequence[str] | None = None) -> list[str]:
    """Task names from explicit names and presets (default: ``DEFAULT_TASKS``), checked against MTEB's registry."""
    import mteb

    names: list[str] = list(tasks or [])
    for task_set in task_sets or []:
        if task_set not in TASK_SETS:
            raise ValueError(f"unknown task set {task_set!r}; choose from {', '.join(TASK_SETS)}")
        names += TASK_SETS[task_set]
    names = list(dict.fromkeys(names or DEFAULT_TASKS))
    for name in names:
        try:
            mteb.get_task(name)
        except Exception as error:  # mteb raises KeyError / ValueError depending on the version
            raise ValueError(f"unknown MTEB task {name!r}: {error}") from None
    return names


def build_tasks(names: Sequence[str], data_dir: str | Path | None = None) -> list[Any]:
    """Fresh MTEB task objects; tasks with local data get it in place, so MTEB downloads nothing for them."""
    import mteb

    data_dir = default_data_dir() if data_dir is None else Path(data_dir)
    remote = [n for n in names if n not in LOCAL_TASKS]
    if remote and _offline():
        raise ValueError(
            f"task(s) {', '.join(remote)} have no local data here and the hub is offline (HF_HUB_OFFLINE / "
            f"HF_DATASETS_OFFLINE); local tasks: {', '.join(LOCAL_TASKS)}"
        )
    tasks = []
    for name in names:
        task = mteb.get_task(name)
        if name in LOCAL_TASKS:
            task.dataset = LOCAL_TASKS[name](data_dir)
            task.data_loaded = True
        tasks.append(task)
    return tasks


# --------------------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------------------
def unique_model_names(models: Sequence[str], names: Sequence[str] | None = None) -> list[str]:
    """Display names: the given ones (must be unique), else the model paths as given."""
    if names:
        if len(names) != len(models):
            raise ValueError(f"{len(names)} names for {len(models)} models; give one name per model")
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {list(names)}")
        return list(names)
    if len(set(models)) != len(models):
        raise ValueError(f"the same model is listed twice: {list(models)}")
    return [str(m) for m in models]


def evaluate_model(
    model: Any,
    name: str,
    task_names: Sequence[str],
    data_dir: str | Path | None = None,
    *,
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> dict[str, Any]:
    """One model on MTEB tasks, without any result cache.

    Returns ``{"scores": {task: main score x100}, "main_scores": {task: metric name}, "metrics": {task: all test
    metrics of the default subset}}``.
    """
    import mteb
    from sentence_transformers import SentenceTransformer

    from st_weince.utils.cli import check_model_path

    if isinstance(model, str | Path):
        check_model_path(model)  # a missing path, or a run folder, named as such
        model = SentenceTransformer(str(model), device="cpu" if not _cuda() else None)
    model.model_card_data.model_name = name  # a name of its own; the cache is off anyway
    tasks = build_tasks(task_names, data_dir)
    result = mteb.evaluate(
        model,
        tasks,
        cache=None,
        overwrite_strategy="always",
        encode_kwargs={"batch_size": batch_size},
        show_progress_bar=show_progress_bar,
    )
    scores, main_scores, metrics = {}, {}, {}
    for task_result in result.task_results:
        task = task_result.task_name
        value = task_result.get_score()
        if value is None or not math.isfinite(value):
            raise ValueError(f"{name}: MTEB returned no main score for {task}")
        scores[task] = 100.0 * float(value)
        main_scores[task] = mteb.get_task(task).metadata.main_score
        split_scores = next(iter(task_result.scores.values()))
        metrics[task] = {  # finite numbers only (e.g. Banking77's "ap" is NaN for a multi-class task)
            k: float(v)
            for k, v in split_scores[0].items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
    missing = [t for t in task_names if t not in scores]
    if missing:
        raise ValueError(f"{name}: MTEB returned no result for {', '.join(missing)}")
    return {"scores": {t: scores[t] for t in task_names}, "main_scores": main_scores, "metrics": metrics}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def evaluate_models(
    models: Sequence[Any],
    names: Sequence[str],
    task_names: Sequence[str],
    data_dir: str | Path | None = None,
    *,
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> dict[str, dict[str, Any]]:
    """Several models, each named, each on fresh task objects: ``{name: evaluate_model(...)}``."""
    if len(models) != len(names) or len(set(names)) != len(names):
        raise ValueError(f"need one unique name per model, got {list(names)} for {len(models)} models")
    return {
        name: evaluate_model(
            model, name, task_names, data_dir, batch_size=batch_size, show_progress_bar=show_progress_bar
        )
        for model, name in zip(models, names, strict=True)
    }


def table_csv(results: dict[str, dict[str, Any]], task_names: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["model", *task_names, "avg"])
    for name, result in results.items():
        values = [result["scores"][t] for t in task_names]
        writer.writerow([name, *(f"{v:.4f}" for v in values), f"{sum(values) / len(values):.4f}"])
    return buffer.getvalue()


def table_markdown(results: dict[str, dict[str, Any]], task_names: Sequence[str]) -> str:
    rows = {}
    for name, result in results.items():
        row = {t: result["scores"][t] for t in task_names}
        row["avg"] = sum(row.values()) / len(row)
        rows[name] = row
    return format_table(rows, [*task_names, "avg"])


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="SentenceTransformer paths or hub names")
    parser.add_argument("--names", nargs="+", default=None, help="one unique display name per model")
    parser.add_argument("--tasks", nargs="+", default=None, help="MTEB task names (default: 7 STS + Banking77)")
    parser.add_argument("--task-sets", nargs="+", default=None, choices=sorted(TASK_SETS), help="task presets")
    parser.add_argument("--data-dir", default=None, help="stsb/, sts_senteval/, banking77/ (default: ../shared/data)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output-dir", default=None, help="write mteb_scores.{json,csv,md} here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from st_weince.utils.cli import quiet_known_warnings, user_errors_exit

    quiet_known_warnings()
    args = parse_args(argv)
    with user_errors_exit("mteb_eval.py"):  # a missing file, model or task: one line, exit status 2
        return run(args, argv)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    from st_weince.utils.provenance import provenance

    names = unique_model_names(args.models, args.names)
    task_names = resolve_tasks(args.tasks, args.task_sets)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    build_tasks(task_names, data_dir)  # fail on missing data before loading any model
    start = time.perf_counter()
    results = evaluate_models(
        args.models, names, task_names, data_dir, batch_size=args.batch_size, show_progress_bar=True
    )
    for name, model in zip(names, args.models, strict=True):
        results[name]["model"] = str(model)
    output = {
        "tasks": task_names,
        "metric": "MTEB main score x100 on the test split",
        "data_dir": str(data_dir),
        "local_tasks": [t for t in task_names if t in LOCAL_TASKS],
        "cache": None,
        "results": results,
        "seconds": round(time.perf_counter() - start, 1),
        "provenance": provenance(["eval/mteb_eval.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    markdown = table_markdown(results, task_names)
    print(markdown)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mteb_scores.json").write_text(json.dumps(output, indent=2) + "\n", encoding="utf-8")
        (out / "mteb_scores.csv").write_text(table_csv(results, task_names), encoding="utf-8")
        (out / "mteb_scores.md").write_text(markdown + "\n", encoding="utf-8")
        print(f"wrote {out}/mteb_scores.{{json,csv,md}}")
    return output


if __name__ == "__main__":
    main()
