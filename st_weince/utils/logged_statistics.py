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
    without negatives) are left out of their mean instead of turning it into NaN.

    The tensors of one :meth:`add` (0-d, on one device) are stacked into one vector, so that a step adds a handful of
    operators however many statistics it logs (on a GPU each operator is a kernel launch)."""

    def __init__(self) -> None:
        # per set of names added together: (names, sums [N], counts [N]) of their finite values
        self._groups: dict[tuple[str, ...], tuple[Tensor, Tensor]] = {}
        self._floats: dict[str, tuple[float, int]] = {}

    @torch.no_grad()
    def add(self, values: dict[str, Any]) -> None:
        tensors = {key: value for key, value in values.items() if isinstance(value, Tensor)}
        for key, value in values.items():
            if key not in tensors:
                total, count = self._floats.get(key, (0.0, 0))
                self._floats[key] = (total + float(value), count + 1)
        if not tensors:
            return
        # stack copies: a value may be a view of a parameter that the optimizer changes before the log
        stacked = torch.stack(list(tensors.values()))
        if stacked.dtype != torch.float32:
            stacked = stacked.to(torch.float32)
        finite = torch.isfinite(stacked)
        stacked = torch.nan_to_num(stacked, nan=0.0, posinf=0.0, neginf=0.0)
        names = tuple(tensors)
        previous = self._groups.get(names)
        if previous is None:
            self._groups[names] = (stacked, finite.to(torch.float32))
        else:
            previous[0].add_(stacked)
            previous[1].add_(finite)

    def pop(self) -> dict[str, float]:
        """Means since the last call, as Python floats (one device-to-host transfer per device)."""
        sums = {key: total for key, (total, _) in self._floats.items()}
        counts = {key: float(count) for key, (_, count) in self._floats.items()}
        by_device: dict[torch.device, list[tuple[tuple[str, ...], Tensor, Tensor]]] = {}
        for names, (total, count) in self._groups.items():
            by_device.setdefault(total.device, []).append((names, total, count))
        for groups in by_device.values():
            flat = torch.cat([t for _, total, count in groups for t in (total, count)]).tolist()
            offset = 0
            for names, _, _ in groups:
                width = len(names)
                for index, key in enumerate(names):
                    sums[key] = sums.get(key, 0.0) + flat[offset + index]
                    counts[key] = counts.get(key, 0.0) + flat[offset + width + index]
                offset += 2 * width
        self._groups.clear()
        self._floats.clear()
        return {key: sums[key] / counts[key] for key in sums if counts[key] > 0}
