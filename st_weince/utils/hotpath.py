"""Tools for a training hot path without host-device synchronisations: :class:`DeferredChecks` reads all the input
checks of a forward with one sync (only a failure reads the flags again, to name the problem), and
:func:`count_host_syncs` counts the syncing operations on any device (free on a CPU, not on a GPU), as the tests and
``benchmarks/gpu_check.py`` measure them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read a device value on the host. ``index`` counts only with a boolean mask among its indices.
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "item")


@dataclass
class DeferredChecks:
    """Boolean device conditions with their error messages, all read by one sync.

    ::

        checks = DeferredChecks()
        checks.require(torch.isfinite(x).all(), "x has NaN or Inf")
        checks.require(index.max() < n, "index out of range")
        checks.raise_if_failed()  # one sync; ValueError naming the first failed condition
    """

    _checks: list[tuple[Tensor, str]] = field(default_factory=list)  # (a 0-d bool tensor, its message)

    def require(self, condition: Tensor, message: str) -> None:
        """Add a condition (a bool tensor, reduced with ``all``) that must hold."""
        self._checks.append((condition.all(), message))

    def raise_if_failed(self) -> None:
        """Read every condition with one host-device sync; raise a ValueError with the first failed one's message."""
        if not self._checks:
            return
        device = self._checks[0][0].device
        flags = torch.stack([c if c.device == device else c.to(device) for c, _ in self._checks])
        if bool(flags.all()):  # the one sync of the success path
            return
        failed = [message for (_, message), ok in zip(self._checks, flags.tolist()) if not ok]
        raise ValueError(failed[0] if len(failed) == 1 else failed[0] + f" (and {len(failed) - 1} more problems)")


class SyncCount(TorchDispatchMode):
    """What :func:`count_host_syncs` yields: the syncing ops counted while it is active, ``total`` and ``by_op``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.by_op[name] += 1
        elif name == "index" and len(args) > 1:
            if any(isinstance(i, Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                self.by_op["index(bool mask)"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __repr__(self) -> str:
        return f"SyncCount(total={self.total}, by_op={dict(self.by_op)})"


@contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count host-device syncing ops run inside the block (forward and backward), on any device.

    ::

        with count_host_syncs() as syncs:
            loss(features, None).backward()
        assert syncs.total <= 1
    """
    with SyncCount() as counter:
        yield counter
