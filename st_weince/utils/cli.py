"""Command-line pieces the recipes share: ``KEY=VALUE`` loss options and argument types."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any


def parse_key_values(items: Sequence[str], flag: str = "--loss-option") -> dict[str, Any]:
    """``["beta=1", "mode=rho"]`` -> ``{"beta": 1, "mode": "rho"}``; a VALUE is parsed as JSON when it is JSON
    (numbers, true/false, null, lists), else kept as a string. A key given twice is an error."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        if key in options:
            raise ValueError(f"{flag} {key} is given twice")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def positive_float(value: str) -> float:
    """argparse type: a finite float > 0."""
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return number
