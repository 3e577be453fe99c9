"""Several results / score files side by side: mean +- std over seeds.

Usage:

    python eval/compare.py runs/weince/seed*/sts.json runs/mnrl/seed*/sts.json
    python eval/compare.py weince=runs/weince_s*/results.json mnrl=runs/mnrl_s*/results.json --metrics 'STS*' avg
    python eval/compare.py eval/reference/*.json --output-dir results/compare

Arguments are files or glob patterns, optionally prefixed ``LABEL=``. Understood files:

- ``eval/sts.py`` output (``{"model": ..., "scores": {...}}``): one run named by its model;
- ``eval/mteb_eval.py`` output (``mteb_scores.json``: ``{"results": {model: {"scores": {...}}}}``) or its
  ``mteb_scores.csv``: one run per model;
- any other JSON object (e.g. a recipe's ``results.json``): one run named by the file path, whose metrics are all
  numeric leaves as dotted keys (``{"final": {"stsb_test": 80.1}}`` -> ``final.stsb_test``; ``provenance`` and
  ``details`` sub-trees are left out).

Runs are grouped by their ``LABEL`` when given, else by their name with the seed removed (``--seed-pattern``, default
matches ``seed1``, ``_seed-2``, ``/seed=3``...), so ``runs/weince/seed1/sts.json`` and ``runs/weince/seed2/sts.json``
form one group. Each cell is the mean +- sample standard deviation (n - 1 in the denominator) over the runs of a
group that have that metric; a cell over fewer runs than its row shows its own ``n``.

Outputs: a markdown table on stdout; with ``--output-dir`` also ``compare.md``, ``compare.csv`` (long form:
group, metric, n, mean, std, values) and ``compare.json``.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import glob
import io
import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SEED_PATTERN = r"[-_/.]?seed[-_=]?\d+"
_SKIPPED_SUBTREES = ("provenance", "details")


@dataclass
class Run:
    """One evaluated model (one seed): its name, the file it came from and its metrics."""

    name: str
    source: str
    metrics: dict[str, float]
    label: str | None = None


@dataclass
class GroupStats:
    """Mean and sample standard deviation of one metric over the runs of a group."""

    values: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float | None:
        """The sample standard deviation (``statistics.stdev``, as the benchmarks' summaries); None for one run."""
        return statistics.stdev(self.values) if len(self.values) > 1 else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _flatten(obj: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not prefix and key in _SKIPPED_SUBTREES:
                continue
            out.update(_flatten(value, f"{prefix}{key}."))
    else:
        number = _number(obj)
        if number is not None:
            out[prefix[:-1]] = number
    return out


def _numeric_scores(scores: dict[str, Any], where: str) -> dict[str, float]:
    metrics = {k: _number(v) for k, v in scores.items()}
    bad = [k for k, v in metrics.items() if v is None]
    if bad:
        raise ValueError(f"{where}: scores {bad} are not finite numbers")
    return metrics  # type: ignore[return-value]


def load_runs(path: str | Path) -> list[Run]:
    """The runs in one score file (see the module docstring for the formats)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"score file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".csv":
        rows = list(csv.reader(io.StringIO(text)))
        if len(rows) < 2 or len(rows[0]) < 2:
            raise ValueError(f"{path}: expected a header (model,metric...) and at least one row")
        header, runs = rows[0], []
        for number, row in enumerate(rows[1:], start=2):
            if len(row) != len(header):
                raise ValueError(f"{path}:{number}: {len(row)} fields for a header of {len(header)}")
            try:
                metrics = {h: float(v) for h, v in zip(header[1:], row[1:], strict=True) if v != ""}
            except ValueError:
                raise ValueError(f"{path}:{number}: non-numeric score in {row[1:]}") from None
            runs.append(Run(row[0], str(path), metrics))
        return runs
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if isinstance(data.get("results"), dict) and all(
        isinstance(r, dict) and isinstance(r.get("scores"), dict) for r in data["results"].values()
    ):
        return [
            Run(str(name), str(path), _numeric_scores(r["scores"], f"{path} [{name}]"))
            for name, r in data["results"].items()
        ]
    if isinstance(data.get("scores"), dict):
        name = str(data.get("model", path))
        return [Run(name, str(path), _numeric_scores(data["scores"], str(path)))]
    metrics = _flatten(data)
    if not metrics:
        raise ValueError(f"{path}: no numeric metric found")
    return [Run(str(path), str(path), metrics)]


def expand_arguments(arguments: Sequence[str]) -> list[Run]:
    """``[LABEL=]PATH_OR_GLOB`` arguments -> runs, each labelled when a label was given."""
    runs: list[Run] = []
    for argument in arguments:
        label, sep, pattern = argument.partition("=")
        if not sep or Path(argument).exists():
            label, pattern = None, argument
        elif not label:
            raise ValueError(f"empty label in {argument!r}; write LABEL=PATH")
        paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not paths:
            raise ValueError(f"no file matches {pattern!r}")
        for path in paths:
            for run in load_runs(path):
                run.label = label
                runs.append(run)
    if not runs:
        raise ValueError("no score file given")
    return runs


def group_key(run: Run, seed_pattern: str = DEFAULT_SEED_PATTERN, several_models: bool = False) -> str:
    """The group of a run: its label (plus its model name when a labelled file holds several models), else its
    name with the seed part removed."""
    if run.label is not None:
        return f"{run.label}:{run.name}" if several_models else run.label
    stripped = re.sub(seed_pattern, "", run.name, flags=re.IGNORECASE)
    return stripped or run.name


def aggregate(
    runs: Sequence[Run], metrics: Sequence[str] | None = None, seed_pattern: str = DEFAULT_SEED_PATTERN
) -> tuple[dict[str, dict[str, GroupStats]], list[str]]:
    """``({group: {metric: GroupStats}}, metric order)``; ``metrics`` are fnmatch patterns (default: all)."""
    if not runs:
        raise ValueError("no runs to compare")
    labelled_sources: dict[str, set[str]] = {}
    for run in runs:
        if run.label is not None:
            labelled_sources.setdefault(f"{run.label}\0{run.source}", set()).add(run.name)
    several = {key.split("\0")[0] for key, names in labelled_sources.items() if len(names) > 1}
    all_metrics = list(dict.fromkeys(m for run in runs for m in run.metrics))
    if metrics:
        selected = [m for pattern in metrics for m in all_metrics if fnmatch.fnmatchcase(m, pattern)]
        selected = list(dict.fromkeys(selected))
        if not selected:
            raise ValueError(f"no metric matches {list(metrics)}; available: {all_metrics}")
    else:
        selected = all_metrics
    groups: dict[str, dict[str, GroupStats]] = {}
    for run in runs:
        key = group_key(run, seed_pattern, run.label in several)
        cells = groups.setdefault(key, {})
        for metric in selected:
            if metric in run.metrics:
                cells.setdefault(metric, GroupStats()).values.append(run.metrics[metric])
    return groups, selected


def _cell(stats: GroupStats | None, decimals: int, show_n: bool) -> str:
    if stats is None:
        return "-"
    text = f"{stats.mean:.{decimals}f}"
    if stats.std is not None:
        text += f" ± {stats.std:.{decimals}f}"
    return text + (f" (n={stats.n})" if show_n else "")


def to_markdown(groups: dict[str, dict[str, GroupStats]], metrics: Sequence[str], decimals: int = 2) -> str:
    """One row per group: ``n`` (its number of runs) and ``mean ± std`` per metric; a cell over fewer runs than its
    row shows its own ``(n=k)``."""
    lines = ["| run | n | " + " | ".join(metrics) + " |", "| --- | ---: |" + " ---: |" * len(metrics)]
    for name, cells in groups.items():
        n = max((s.n for s in cells.values()), default=0)
        row = [_cell(cells.get(m), decimals, m in cells and cells[m].n != n) for m in metrics]
        lines.append(f"| {name} | {n} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def to_csv(groups: dict[str, dict[str, GroupStats]], metrics: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["group", "metric", "n", "mean", "std", "values"])
    for name, cells in groups.items():
        for metric in metrics:
            if metric in cells:
                s = cells[metric]
                std = "" if s.std is None else repr(s.std)
                writer.writerow([name, metric, s.n, repr(s.mean), std, " ".join(repr(v) for v in s.values)])
    return buffer.getvalue()


def to_json(groups: dict[str, dict[str, GroupStats]], metrics: Sequence[str], runs: Sequence[Run]) -> dict:
    return {
        "metrics": list(metrics),
        "std": "sample standard deviation (n - 1); null when n = 1",
        "groups": {
            name: {m: {"n": s.n, "mean": s.mean, "std": s.std, "values": s.values} for m, s in cells.items()}
            for name, cells in groups.items()
        },
        "runs": [{"name": r.name, "source": r.source, "label": r.label} for r in runs],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="[LABEL=]FILE or glob (sts.json, mteb_scores.json/csv, results.json)")
    parser.add_argument("--metrics", nargs="+", default=None, help="metric names or fnmatch patterns (default: all)")
    parser.add_argument("--seed-pattern", default=DEFAULT_SEED_PATTERN, help="regex removed from names to group seeds")
    parser.add_argument("--decimals", type=int, default=2)
    parser.add_argument("--output-dir", default=None, help="write compare.{md,csv,json} here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    from st_weince.utils.cli import user_errors_exit

    args = parse_args(argv)
    with user_errors_exit("compare.py"):  # a missing or unreadable file: one line, exit status 2
        return run(args)


def run(args: argparse.Namespace) -> dict:
    try:
        re.compile(args.seed_pattern)
    except re.error as error:
        raise ValueError(f"--seed-pattern {args.seed_pattern!r} is not a regular expression: {error}") from None
    runs = expand_arguments(args.files)
    groups, metrics = aggregate(runs, args.metrics, args.seed_pattern)
    markdown = to_markdown(groups, metrics, args.decimals)
    print(markdown)
    result = to_json(groups, metrics, runs)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(markdown + "\n", encoding="utf-8")
        (out / "compare.csv").write_text(to_csv(groups, metrics), encoding="utf-8")
        (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
