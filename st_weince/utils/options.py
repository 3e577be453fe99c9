"""Validation of loss options at construction: one place for the type, range and finiteness rules, so every loss
class refuses a bad option with the same words, naming it (NumPy numbers are accepted, bools are no numbers)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch


def real_option(
    name: str, value: Any, *, positive: bool = False, optional: bool = False, dtype: torch.dtype | None = None
) -> float | None:
    """A finite real number (Python or NumPy; not a bool), as a float; the error names the option. With ``dtype``
    (the dtype the option is stored or computed in) it must also be finite there, and a positive one must stay a
    normal positive number there (a subnormal is flushed to 0 on GPUs)."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    if positive and not number > 0:
        raise ValueError(f"{name} must be > 0, got {number!r}")
    if dtype is not None:
        check_representable(name, number, dtype, positive=positive)
    return number


def check_representable(name: str, number: float, dtype: torch.dtype, *, positive: bool = False) -> None:
    """Refuse ``number`` if it overflows ``dtype`` (or, with ``positive``, underflows below its smallest normal
    number), naming the option and the dtype."""
    info = torch.finfo(dtype)
    if abs(number) > info.max:
        raise ValueError(
            f"{name} = {number!r} overflows {dtype} (largest finite value {info.max:.4g}), the dtype it is "
            "stored and computed in"
        )
    if positive and number < info.tiny:
        raise ValueError(
            f"{name} = {number!r} underflows {dtype} (smallest normal value {info.tiny:.4g}), the dtype it is "
            "stored and computed in: it would become 0"
        )


def stored_scale_option(name: str, value: Any) -> float:
    """A scale ``t > 0`` validated as it is stored, a float32 ``log_t`` whose ``exp`` is ``t``: refused, naming it,
    when that ``t`` overflows or underflows float32 (1e39 has a finite float32 log, whose exp is Inf; 1e-46 gives
    t = 0)."""
    number = real_option(name, value, positive=True)
    # t from the float32 log_t, in float64 on the host (no tensor), with a margin of 1e-6 relative for the rounding of
    # float32 exp implementations at the range's ends
    log_t = float(np.float32(math.log(number)))
    t = math.exp(log_t) if log_t < 710.0 else math.inf
    info = torch.finfo(torch.float32)
    if not t <= info.max * (1.0 - 1e-6):
        raise ValueError(
            f"{name} = {number!r} overflows float32 as stored (t = exp(log_t) with a float32 log_t is {t:.4g}; "
            f"largest finite value {info.max:.4g})"
        )
    if t < info.tiny * (1.0 + 1e-6):
        raise ValueError(
            f"{name} = {number!r} underflows float32 as stored (t = exp(log_t) with a float32 log_t is {t:.4g}, "
            f"below the smallest normal value {info.tiny:.4g})"
        )
    return number


def log_scale_cap(max_scale: float) -> float:
    """The largest float32 ``c`` whose ``exp`` stays within ``max_scale`` on any CPU or GPU: ``log_t`` is clamped to
    ``c`` so that ``t = exp(log_t) <= max_scale``. ``exp`` in float32 is faithfully rounded (within one ulp), so ``c``
    is taken 2 ulp of ``max_scale`` below it in float64 and rounded down to float32."""
    target = math.log(max_scale * (1.0 - 2.0**-22))
    cap = np.float32(target)  # NumPy, not a torch tensor: building a loss reads no device value
    if float(cap) > target:
        cap = np.nextafter(cap, np.float32(-np.inf))
    return float(cap)


def integer_option(name: str, value: Any, minimum: int) -> int:
    """An integer (Python or NumPy; not a bool) of at least ``minimum``, as an int; the error names the option."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def flag_option(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def positive_int_option(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        expected = "a positive integer or None" if optional else "a positive integer"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}")
    return int(value)


def choice_option(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value
