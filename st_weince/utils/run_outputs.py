"""What a recipe leaves in its output folder: ``results.json`` (its figures, configuration, command and provenance)
and ``training_curves.png``. Both recipes write them through :func:`write_run_outputs`, so the two files have one
layout."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from st_weince.utils.provenance import provenance

STANDARD_LOG_KEYS = frozenset({"loss", "grad_norm", "learning_rate", "epoch", "step"})


def write_run_outputs(
    output_dir: str | Path,
    results: dict[str, Any],
    args: argparse.Namespace | dict[str, Any],
    *,
    log_history: list[dict[str, Any]] | None = None,
    title: str = "",
    dev_metric: str | None = None,
    write: bool = True,
    processes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``results`` plus ``config`` (the parsed arguments), ``command`` and ``environment`` (machine, versions, git
    commit): the record that is returned and, when ``write`` (the main process), written to ``results.json``, with
    ``training_curves.png`` when ``log_history`` has training entries. ``processes`` (``ProcessCount.record()``):
    the processes the launcher asked for and those the run had, recorded in ``environment`` beside ``world_size``."""
    record = {
        **results,
        "config": dict(vars(args) if isinstance(args, argparse.Namespace) else args),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "environment": provenance(processes=processes),
    }
    if not write:
        return record
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    if log_history and any("loss" in e and "step" in e for e in log_history):
        plot_training_curves(log_history, output_dir / "training_curves.png", title, dev_metric)
    return record


def plot_training_curves(
    log_history: list[dict[str, Any]], path: str | Path, title: str, dev_metric: str | None = None
) -> None:
    """Training loss (and ``dev_metric`` x100 when given) on the top row; every other numeric key of the training
    logs (the loss's statistics, e.g. ``weince_lambda_mean``) in its own panel below. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log_history if "loss" in e and "step" in e]
    evals = [e for e in log_history if dev_metric is not None and dev_metric in e]
    stat_keys = sorted(
        {k for e in train for k, v in e.items() if k not in STANDARD_LOG_KEYS and isinstance(v, int | float)}
    )
    columns = max(2, min(len(stat_keys), 4))
    rows = 1 + math.ceil(len(stat_keys) / columns)
    fig = plt.figure(figsize=(4 * columns, 3.2 * rows))
    grid = fig.add_gridspec(rows, columns)
    top_left = fig.add_subplot(grid[0, : columns // 2] if dev_metric else grid[0, :])
    top_left.plot([e["step"] for e in train], [e["loss"] for e in train], marker=".")
    top_left.set(title="training loss", xlabel="step")
    if dev_metric:
        top_right = fig.add_subplot(grid[0, columns // 2 :])
        top_right.plot([e["step"] for e in evals], [100 * e[dev_metric] for e in evals], marker="o")
        top_right.set(title=f"{dev_metric} x100", xlabel="step")
    for index, key in enumerate(stat_keys):
        axis = fig.add_subplot(grid[1 + index // columns, index % columns])
        points = [(e["step"], e[key]) for e in train if key in e]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        axis.set(title=key, xlabel="step")
    if not stat_keys:
        top_left.text(0.5, 0.9, "this loss logs no statistics", ha="center", transform=top_left.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
