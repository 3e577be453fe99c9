"""The SimCSE 7-task STS table (STS12-16, STS-B, SICK-R), offline, as cosine Spearman x100.

Usage (a folder laid out like ``../shared/data``: ``stsb/`` and ``sts_senteval/``):

    python eval/sts.py --model path/to/model --output sts.json
    python eval/sts.py --model path/to/model --tasks STSBenchmark --split dev

What is computed, matching SimCSE's ``evaluation.py --mode test --task_set sts``: sentence-transformers'
``EmbeddingSimilarityEvaluator`` (cosine, Spearman) on each subset, STS12-16 aggregated as SentEval does (``all``:
the correlation of the concatenation of a year's subsets, SimCSE's figure; ``--aggregation mean`` / ``wmean``: the
plain / size-weighted mean of the per-subset correlations), STS-B and SICK-R on the test split, and ``avg`` = the
mean of the task scores. Sentences are encoded at the model's own ``max_seq_length`` unless ``--max-seq-length`` is
given. The readers and the evaluation are in ``eval/sts_tasks.py``; from Python, with ``eval/`` on ``sys.path``:

    from sts_tasks import evaluate_sts
    scores = evaluate_sts(model, ["STSBenchmark"], data_dir, split="dev")  # {"STSBenchmark": 84.1, "avg": 84.1}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sts_tasks import (
    AGGREGATIONS,
    SPLITS,
    TASKS,
    default_data_dir,
    download_sts_data,
    format_table,
    load_model,
    load_sts_task,
    resolve_task_names,
    scores_from_details,
    sts_details,
    task_files,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="SentenceTransformer path or hub name (required unless --download alone)"
    )
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
    args = parser.parse_args(argv)
    if args.model is None and not args.download:
        parser.error("--model is required (or --download alone, to fetch the STS data without evaluating)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from st_weince.utils.cli import quiet_known_warnings, user_errors_exit

    quiet_known_warnings()
    args = parse_args(argv)
    with user_errors_exit("sts.py"):  # a missing file or model: one line, exit status 2
        return run(args, argv)


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    from st_weince.utils.provenance import provenance

    tasks = resolve_task_names(args.tasks)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if args.download and any(not f.is_file() for t in tasks for f in task_files(t, data_dir, args.split)):
        download_sts_data(data_dir)
    for task in tasks:  # missing data fails before the model is loaded
        load_sts_task(task, data_dir, args.split)
    if args.model is None:  # --download alone: the data is in place, nothing to evaluate
        print(f"STS data for {' '.join(tasks)} ({args.split}) is in {data_dir}")
        return {"data_dir": str(data_dir), "tasks": tasks}
    start = time.perf_counter()
    model = load_model(args.model, device=args.device, max_seq_length=args.max_seq_length)
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
