"""Figures of the benchmark studies (matplotlib, no display)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOSS_COLORS = {"infonce": "tab:blue", "weince": "tab:red", "rb-sigmoid": "tab:green"}


@contextmanager
def figure(path: Path, panels: int, size: tuple[float, float], **subplots: Any) -> Iterator[Any]:
    """Axes of a one-row figure, saved to ``path`` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size, **subplots)
    try:
        yield axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


CURVE_PANELS: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
    ("linear top-1 (%, subset probe)", lambda c: c["linear_top1"]),
    ("k-NN top-1 (%, k=20, subset)", lambda c: c["knn_top1"]),
    ("POT shape xi (projections)", lambda c: c["pot_projection"]["xi"]),
    ("WEINCE mean lambda (encoder, fixed batch)", lambda c: c["encoder_weince_statistics"]["lambda_mean"]),
]


def plot_curves(runs: dict[str, dict[str, Any]], path: Path) -> None:
    """Per run, the checkpoints' probes, POT shape and WEINCE lambda along training (colour: the loss)."""
    with figure(path, len(CURVE_PANELS), (4.2 * len(CURVE_PANELS), 3.4)) as axes:
        for ax, (title, value) in zip(axes, CURVE_PANELS):
            for name, run in sorted(runs.items()):
                points = [(c["epoch"], value(c)) for c in run["checkpoints"] if value(c) is not None]
                if points:
                    ax.plot(*zip(*points), color=LOSS_COLORS[run["loss"]], marker=".", alpha=0.8, label=name)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)


PAIRED_PANELS = [("linear_top1", "linear top-1"), ("knn_top1", "k-NN top-1")]


def plot_paired(paired: dict[str, Any], path: Path, title: str) -> None:
    """Paired differences (``paired_difference`` results by name), one panel a metric: every seed's value as a dot,
    the mean as a bar with the sample std as its error bar (none for one seed); zero is "no difference"."""
    names = list(paired)
    with figure(path, len(PAIRED_PANELS), (5.2 * len(PAIRED_PANELS), 0.5 * len(names) + 1.6), sharey=True) as axes:
        for ax, (metric, label) in zip(axes, PAIRED_PANELS):
            for row, name in enumerate(names):
                stat = paired[name][metric]
                spread = stat["std"] if stat["n"] > 1 else None
                ax.barh(row, stat["mean"], xerr=spread, color="tab:gray", alpha=0.45, capsize=3)
                values = [seed_values[metric] for seed_values in paired[name]["per_seed"].values()]
                ax.plot(values, [row] * len(values), "o", color="tab:red", markersize=4)
            ax.axvline(0.0, color="black", linewidth=0.8)
            ax.set_title(f"{title}: {label}, points", fontsize=9)
            ax.set_yticks(range(len(names)), names, fontsize=8)
            ax.grid(axis="x", alpha=0.3)
        axes[0].invert_yaxis()  # the first name on top (the y axis is shared: once inverts both)
