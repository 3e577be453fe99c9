"""Peak tensor memory of a call on CPU, for the benchmarks (CUDA has ``torch.cuda.max_memory_allocated``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """The peak of live CPU tensor memory while ``fn()`` runs, replayed from the PyTorch profiler's allocation and
    free events in time order (deterministic, unlike the process's resident size, which the allocator's caching
    blurs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        fn()
    # An op's own allocations are its self memory; frees arrive as separate "[memory]" events. At equal
    # timestamps allocations go first, so a tie cannot hide a peak.
    changes = [
        (event.time_range.start, event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage)
        for event in profiler.events()
    ]
    live = peak = 0
    for _, change in sorted(changes, key=lambda item: (item[0], item[1] < 0)):
        live += change
        peak = max(peak, live)
    return peak
