"""Command-line pieces the recipes share: ``KEY=VALUE`` options and deprecated flag aliases."""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from collections.abc import Callable, Sequence
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


class DeprecatedAlias(argparse.Action):
    """An old flag kept for one release: it warns (``FutureWarning``, shown by default) naming the new flag, then
    stores ``convert(value)`` into the new flag's destination, or appends it when that destination is a list
    (``--beta 1`` -> ``--loss-option beta=1``).

    Example::

        parser.add_argument("--num-threads", dest="threads", type=int, action=DeprecatedAlias, new_flag="--threads")
    """

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        new_flag: str,
        convert: Callable[[Any], Any] | None = None,
        append: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("help", f"deprecated: use {new_flag}")
        kwargs["default"] = argparse.SUPPRESS  # the new flag owns the default
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag
        self.convert = convert
        self.append = append

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        warnings.warn(
            f"{option_string} is deprecated and will be removed in the next release; use {self.new_flag}",
            FutureWarning,
            stacklevel=2,
        )
        try:
            value = self.convert(values) if self.convert is not None else values
        except ValueError as error:
            parser.error(f"{option_string}: {error}")
        if self.append:  # a list value (e.g. from a JSON object) extends the list
            added = value if isinstance(value, list) else [value]
            setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *added])
        else:
            setattr(namespace, self.dest, value)


def json_object_to_key_values(value: str) -> list[str]:
    """``--loss-kwargs '{"beta": 1}'`` -> ``["beta=1"]`` (what ``--loss-option beta=1`` gives)."""
    options = None
    with contextlib.suppress(json.JSONDecodeError):
        options = json.loads(value)
    if not isinstance(options, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return [f"{key}={json.dumps(item)}" for key, item in options.items()]


def inverse_temperature(value: str) -> float:
    """``--temperature T`` -> the ``--scale`` it means, ``1 / T``."""
    temperature = float(value)
    if not temperature > 0:
        raise ValueError(f"the temperature must be > 0, got {value}")
    return 1.0 / temperature


def positive_float(value: str) -> float:
    """argparse type: a finite float > 0."""
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return number
