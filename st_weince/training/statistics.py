"""Putting a loss's own statistics (WEINCE's lambda, RB-Sigmoid's t and b_rel ...) into the trainer's logs.

The sentence-transformers trainer sums every entry of a dict-valued loss into the training loss, so statistics
cannot travel that way. Instead a loss keeps running means (``RunningMeans``) and a trainer callback adds them
to each log record, before the printing and reporting callbacks see it.

The running sums stay where the statistics are (on the accelerator): adding a tensor is a device operation, and the
values are read back to the host only when the trainer logs, in one transfer per device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerCallback


class RunningMeans:
    """Accumulates scalar statistics between two log events; no autograd graph is kept and, for tensors, no
    host-device synchronisation happens before :meth:`pop`. Non-finite tensor values (e.g. the margin of a block
    without negatives) are left out of their mean instead of turning it into NaN."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor | float] = {}
        self._counts: dict[str, Tensor | int] = {}

    def add(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, Tensor):
                # A copy: the value may be a view of a parameter that the optimizer changes before the log.
                value = value.detach().reshape(()).to(torch.float32, copy=True)
                finite = torch.isfinite(value)
                value, count = torch.where(finite, value, torch.zeros_like(value)), finite.float()
            else:
                value, count = float(value), 1
            previous = self._sums.get(key)
            self._sums[key] = value if previous is None else previous + value
            self._counts[key] = count if previous is None else self._counts[key] + count

    def pop(self) -> dict[str, float]:
        """Means since the last call, as Python floats (one device-to-host transfer per device)."""
        sums: dict[str, float] = {key: value for key, value in self._sums.items() if not isinstance(value, Tensor)}
        counts: dict[str, float] = {key: float(self._counts[key]) for key in sums}
        by_device: dict[torch.device, list[str]] = {}
        for key, value in self._sums.items():
            if isinstance(value, Tensor):
                by_device.setdefault(value.device, []).append(key)
        for keys in by_device.values():
            flat = torch.stack([self._sums[key] for key in keys] + [self._counts[key] for key in keys]).tolist()
            sums.update(zip(keys, flat[: len(keys)]))
            counts.update(zip(keys, flat[len(keys) :]))
        means = {key: sums[key] / counts[key] for key in self._sums if counts[key] > 0}
        self._sums.clear()
        self._counts.clear()
        return means


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
