"""Putting a loss's own statistics (WEINCE's lambda, RB-Sigmoid's t and b_rel ...) into the trainer's logs.

The sentence-transformers trainer sums every entry of a dict-valued loss into the training loss, so statistics
cannot travel that way. Instead a loss keeps running means (``RunningMeans``) and a trainer callback adds them
to each log record, before the printing and reporting callbacks see it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback


class RunningMeans:
    """Accumulates scalar statistics between two log events; no autograd graph is kept."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1

    def pop(self) -> dict[str, float]:
        means = {key: self._sums[key] / self._counts[key] for key in self._sums}
        self._sums.clear()
        self._counts.clear()
        return means


class LossStatisticsCallback(TrainerCallback):
    """Adds ``loss.pop_logged_statistics()`` to every training log record (console, log_history, reporters)."""

    def __init__(self, loss: Any) -> None:
        self.losses = list(loss.values()) if isinstance(loss, dict) else [loss]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        extra: dict[str, float] = {}
        for loss in self.losses:
            if hasattr(loss, "pop_logged_statistics"):
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
