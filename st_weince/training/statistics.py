"""Putting a loss's own statistics (WEINCE's lambda, RB-Sigmoid's t and b_rel ...) into the trainer's logs.

The sentence-transformers trainer sums every entry of a dict-valued loss into the training loss, so statistics
cannot travel that way. Instead a loss keeps running means by name
(:class:`st_weince.utils.logged_statistics.RunningMeans`) and a trainer callback adds them to each log record,
before the printing and reporting callbacks see it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerCallback

from st_weince.utils.logged_statistics import RunningMeans

__all__ = ["LossStatisticsCallback", "RunningMeans", "log_loss_statistics", "statistics_sources"]


def statistics_sources(loss: nn.Module | dict[str, nn.Module]) -> list[nn.Module]:
    """The modules of the loss tree(s) that log statistics (``pop_logged_statistics``), each once: the loss itself,
    or the loss inside a wrapper such as ``MatryoshkaLoss``."""
    roots = list(loss.values()) if isinstance(loss, dict) else [loss]
    found: dict[int, nn.Module] = {}
    for root in roots:
        for module in root.modules():
            if hasattr(module, "pop_logged_statistics"):
                found.setdefault(id(module), module)
    return list(found.values())


class LossStatisticsCallback(TrainerCallback):
    """Adds ``pop_logged_statistics()`` of every statistics-logging module of the loss to every training log
    record (console, log_history, reporters)."""

    def __init__(self, loss: Any) -> None:
        self.losses = statistics_sources(loss)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        extra: dict[str, float] = {}
        for loss in self.losses:
            extra.update({key: round(value, 6) for key, value in loss.pop_logged_statistics().items()})
        logs.update(extra)
        # The trainer appended a copy of ``logs`` to the history before calling the callbacks.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


def log_loss_statistics(trainer: Any) -> LossStatisticsCallback:
    """Make the trainer log the statistics of its loss(es); call once after building the trainer.

    The callback is put first, so the progress bar, the printer and reporters (TensorBoard, W&B ...) see the values.
    """
    callback = LossStatisticsCallback(trainer.loss)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
