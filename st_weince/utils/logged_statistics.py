"""The one way a loss logs its own statistics (WEINCE's lambda, RB-Sigmoid's t and b_rel ...): running means keyed
by name, kept on the device.

A loss adds a dict of scalar tensors every step (device operations only, no host-device sync, so the hot path stays
free of them and compiles); the trainer integration (:mod:`st_weince.training.statistics`) pops the means when it
logs, with one transfer per device. This module sits below both, so the losses do not depend on the trainer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
