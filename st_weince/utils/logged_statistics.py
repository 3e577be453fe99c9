"""The one way a loss logs its own statistics (WEINCE's lambda, RB-Sigmoid's t and b_rel ...): running means keyed
by name, kept on the device.

A loss adds a dict of scalar tensors every step (device operations only, no host-device sync, so the hot path stays
free of them and compiles); the trainer integration (:class:`st_weince.training.LossStatisticsCallback`) ends each
training step (:meth:`RunningMeans.end_step`, no sync) and pops the latest step's means when it logs, with one
transfer per device. This module sits below both, so the losses do not depend on the trainer.
"""

from __future__ import annotations

import torch
from torch import Tensor


class RunningMeans:
    """Accumulates scalar tensor statistics between two log events; no autograd graph is kept and no host-device
    synchronisation happens before :meth:`pop`. Non-finite values (e.g. the margin of a block without negatives) are
    left out of their mean instead of turning it into NaN.

    The tensors of one :meth:`add` (0-d, on one device) are stacked into one vector, so that a step adds a handful of
    operators however many statistics it logs (on a GPU each operator is a kernel launch)."""

    def __init__(self) -> None:
        # per set of names added together: (sums [N], counts [N]) of their finite values, since the last end_step or
        # pop; and those of the latest ended step
        self._groups: dict[tuple[str, ...], tuple[Tensor, Tensor]] = {}
        self._ended_groups: dict[tuple[str, ...], tuple[Tensor, Tensor]] = {}

    @torch.no_grad()
    def add(self, values: dict[str, Tensor]) -> None:
        """Add one step's (or batch's) 0-d tensors ``values``, on one device."""
        # stack copies: a value may be a view of a parameter that the optimizer changes before the log
        stacked = torch.stack(list(values.values()))
        if stacked.dtype != torch.float32:
            stacked = stacked.to(torch.float32)
        finite = torch.isfinite(stacked)
        stacked = torch.nan_to_num(stacked, nan=0.0, posinf=0.0, neginf=0.0)
        names = tuple(values)
        previous = self._groups.get(names)
        if previous is None:
            self._groups[names] = (stacked, finite.to(torch.float32))
        else:
            previous[0].add_(stacked)
            previous[1].add_(finite)

    def end_step(self) -> bool:
        """End a training step: the values added since the last call (or :meth:`pop`) become the ones :meth:`pop`
        returns, replacing those of an earlier step; nothing changes when none were added. Returns whether any were
        added (a Python fact: no host-device sync)."""
        if not self._groups:
            return False
        self._ended_groups, self._groups = self._groups, {}
        return True

    def pop(self, current: dict[str, Tensor] | None = None) -> dict[str, float]:
        """The means of the latest step ended by :meth:`end_step` or, without steps, of everything added since the
        last call (values added after the latest ended step end a step of their own), as Python floats; with
        ``current`` (0-d tensors: state such as a parameter's value now, not a mean) those values too, read in the
        same transfer, one device-to-host transfer per device."""
        self.end_step()
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        # per device: (names, sums, counts) of the means, and (names, values, None) of the current values
        by_device: dict[torch.device, list[tuple[tuple[str, ...], Tensor, Tensor | None]]] = {}
        for names, (total, count) in self._ended_groups.items():
            by_device.setdefault(total.device, []).append((names, total, count))
        for names, values in _stacked_by_device(current or {}).items():
            by_device.setdefault(values.device, []).append((names, values, None))
        now: dict[str, float] = {}
        for groups in by_device.values():
            flat = torch.cat([t for _, total, count in groups for t in (total, count) if t is not None]).tolist()
            offset = 0
            for names, _, count in groups:
                width = len(names)
                for index, key in enumerate(names):
                    if count is None:
                        now[key] = flat[offset + index]
                    else:
                        sums[key] = sums.get(key, 0.0) + flat[offset + index]
                        counts[key] = counts.get(key, 0.0) + flat[offset + width + index]
                offset += width if count is None else 2 * width
        self._ended_groups = {}
        return {**{key: sums[key] / counts[key] for key in sums if counts[key] > 0}, **now}


def _stacked_by_device(values: dict[str, Tensor]) -> dict[tuple[str, ...], Tensor]:
    """The 0-d tensors ``values`` as one float32 vector per device, keyed by their names."""
    by_device: dict[torch.device, dict[str, Tensor]] = {}
    for key, value in values.items():
        by_device.setdefault(value.device, {})[key] = value.detach()
    return {tuple(group): torch.stack(list(group.values())).to(torch.float32) for group in by_device.values()}
