"""Summaries of the benchmark studies: mean +- sample std over seeds, paired differences, Markdown tables, and the
generated blocks of docs/evidence.md. The one statistics helper of benchmarks/ (``mean_std``)."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def mean_std(values: list[float]) -> dict[str, float | int]:
    """``{"mean", "std", "n"}``: the mean and the sample standard deviation of ``values``. One value has no spread
    (std NaN, shown as no spread by ``format_stat``); no values have no mean either."""
    return {
        "mean": statistics.fmean(values) if values else float("nan"),
        "std": statistics.stdev(values) if len(values) > 1 else float("nan"),
        "n": len(values),
    }


def format_stat(stat: dict[str, float | int], digits: int = 2, sign: bool = False) -> str:
    """``mean +- std`` of a ``mean_std`` result; the mean alone for one value, ``-`` for none."""
    if not stat["n"]:
        return "-"
    mean = f"{stat['mean']:+.{digits}f}" if sign else f"{stat['mean']:.{digits}f}"
    return mean if stat["n"] < 2 else f"{mean} +- {stat['std']:.{digits}f}"


def paired_difference(
    mine: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], metrics: Iterable[str]
) -> dict[str, Any] | None:
    """``mine - base`` of the seeds both have (same seed: same initialisation, batches and augmentations):
    ``{"seeds", "per_seed": {seed: {metric: difference}}, metric: mean_std}``; None without a common seed."""
    metrics = tuple(metrics)
    seeds = sorted(set(mine) & set(base))
    if not seeds:
        return None
    per_seed = {str(s): {m: mine[s][m] - base[s][m] for m in metrics} for s in seeds}
    return {"seeds": seeds, "per_seed": per_seed, **seed_stats(per_seed, metrics)}


def seed_stats(per_seed: dict[str, dict[str, float]], metrics: Iterable[str]) -> dict[str, dict[str, float | int]]:
    """``{metric: mean_std over the seeds}`` of ``{seed: {metric: value}}``."""
    return {m: mean_std([row[m] for row in per_seed.values()]) for m in metrics}


def paired_table(paired: dict[str, Any]) -> list[str]:
    """Markdown table of paired differences (``{name: {"seeds", "per_seed", "linear_top1", "knn_top1"}}``): mean
    +- sample std over seeds and every seed's value, in points."""
    lines = [
        "| comparison | seeds | linear top-1 | k-NN top-1 | per seed (linear / k-NN) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, diff in paired.items():
        per_seed = "; ".join(
            f"seed {s}: {d['linear_top1']:+.2f} / {d['knn_top1']:+.2f}" for s, d in diff["per_seed"].items()
        )
        lines.append(
            f"| {name} | {len(diff['seeds'])} | {format_stat(diff['linear_top1'], sign=True)} "
            f"| {format_stat(diff['knn_top1'], sign=True)} | {per_seed} |"
        )
    return lines


def number(value: float | None, digits: int = 2, sign: bool = False) -> str:
    """A table cell: ``-`` for a missing value."""
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def block_markers(block: str) -> tuple[str, str]:
    """The two comment lines that enclose the generated ``block`` of a Markdown page."""
    return f"<!-- {block} summary: start -->", f"<!-- {block} summary: end -->"


def docs_blocks(path: Path) -> dict[str, str]:
    """Every generated block of the Markdown page ``path``, by name, as the text between its markers."""
    start, end = (re.escape(marker) for marker in block_markers("NAME"))
    pattern = start.replace("NAME", r"(?P<name>\w+)") + r"\n(?P<body>.*?)\n" + end.replace("NAME", "(?P=name)")
    text = path.read_text(encoding="utf-8")
    return {match["name"]: match["body"] for match in re.finditer(rf"^{pattern}$", text, flags=re.S | re.M)}


def update_docs(path: Path, markdown: str, block: str) -> None:
    """Replace the text between the two markers of ``block`` in ``path`` by ``markdown`` (generated, never edited
    by hand)."""
    start, end = block_markers(block)
    text = path.read_text()
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{path} needs exactly one {start!r} and one {end!r} line")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    path.write_text(f"{head}{start}\n{markdown}\n{end}{tail}")


def format_p(p: float) -> str:
    """A two-sided p as a table shows it: three decimals, and "< 0.001" below that (never "0.000")."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _without_nan(value: Any) -> Any:
    """``value`` with every float NaN (a statistic of no runs, or the spread of one) as None: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _without_nan(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nan(item) for item in value]
    return value


def write_summary(output_dir: Path, summary: dict[str, Any], markdown: str) -> None:
    """``summary.json`` and ``summary.md`` in ``output_dir``; the Markdown also to stdout."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "summary.json").write_text(json.dumps(_without_nan(summary), indent=2, allow_nan=False) + "\n")
    (output_dir / "summary.md").write_text(markdown + "\n")
    print(markdown, flush=True)
