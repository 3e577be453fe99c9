"""Validation of loss options at construction: one place for the type, range and finiteness rules, so every loss
class refuses a bad option with the same words, naming it (NumPy numbers are accepted, bools are no numbers)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def current_name(name: str, renamed: Mapping[str, str], what: str, *, warn: bool = True) -> str:
    """The current name of ``name``: an old one (a key of ``renamed``) gives its new name, with a
    ``DeprecationWarning`` naming it unless ``warn`` is False (reading a file written under the old name); any
    other name is returned as it is. The old names go in 0.3."""
    new = renamed.get(name)
    if new is not None and warn:
        # stacklevel 3: the line that used the old name, through the one function that resolves it
        message = f"{what} {name!r} is now named {new!r}; the old name goes in 0.3"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
    return name if new is None else new


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


def options_from_arguments(options_class: type[T], arguments: dict[str, Any]) -> T:
    """An options dataclass built from a constructor's ``locals()``: every field is taken by its name, so a loss
    class lists an option once in its signature (whose default reads the dataclass's) and nowhere else."""
    return options_class(**{f.name: arguments[f.name] for f in dataclasses.fields(options_class) if f.init})


def options_config(options: Any) -> dict[str, Any]:
    """An options dataclass as the JSON-able keyword arguments of its loss class (``get_config_dict``): tuples
    become lists and values with a ``to_config`` (the false-negative guard) their JSON form."""
    config: dict[str, Any] = {}
    for field in dataclasses.fields(options):
        if not field.init:  # derived, not a constructor argument
            continue
        value = getattr(options, field.name)
        if hasattr(value, "to_config"):
            value = value.to_config()
        elif isinstance(value, tuple):
            value = list(value)
        config[field.name] = value
    return config
