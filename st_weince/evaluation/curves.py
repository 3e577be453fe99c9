"""The recipes' training-curve figure: loss and the dev metric on top, each of the loss's own statistics below."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

STANDARD_LOG_KEYS = frozenset({"loss", "grad_norm", "learning_rate", "epoch", "step"})


def plot_training_curves(log_history: list[dict[str, Any]], path: str | Path, title: str, dev_metric: str) -> None:
    """Training loss and ``dev_metric`` (x100) on the top row; every other numeric key of the training logs (the
    loss's statistics, e.g. ``weince_lambda_mean``) in its own panel below. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log_history if "loss" in e and "step" in e]
    evals = [e for e in log_history if dev_metric in e]
    stat_keys = sorted(
        {k for e in train for k, v in e.items() if k not in STANDARD_LOG_KEYS and isinstance(v, int | float)}
    )
    columns = max(2, min(len(stat_keys), 4))
    rows = 1 + math.ceil(len(stat_keys) / columns)
    fig = plt.figure(figsize=(4 * columns, 3.2 * rows))
    grid = fig.add_gridspec(rows, columns)
    top_left, top_right = fig.add_subplot(grid[0, : columns // 2]), fig.add_subplot(grid[0, columns // 2 :])
    top_left.plot([e["step"] for e in train], [e["loss"] for e in train], marker=".")
    top_left.set(title="training loss", xlabel="step")
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
