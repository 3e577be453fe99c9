"""Validation of loss options at construction: one place for the type, range and finiteness rules, so every loss
class refuses a bad option with the same words, naming it (NumPy numbers are accepted, bools are no numbers)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def real_option(name: str, value: Any, *, positive: bool = False, optional: bool = False) -> float | None:
    """A finite real number (Python or NumPy; not a bool), as a float; the error names the option."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    if positive and not number > 0:
        raise ValueError(f"{name} must be > 0, got {number!r}")
    return number


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
