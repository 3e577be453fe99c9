"""Command-line pieces the recipes and CLIs share: ``KEY=VALUE`` loss options and argument types, one-line exits
for a user's error, and the one list of known-harmless library warnings that the command lines filter."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# Warnings (message regex, category, regex of the module they are attributed to) that libraries print on every run
# of these command lines and that say nothing the user can act on. Filtered by ``quiet_known_warnings`` in the CLIs
# only: a library user keeps them.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # torch's DataLoader when pin_memory is on without an accelerator (the trainer's default on a CPU)
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning, ""),
    # mteb: the local STS tasks are the versions the published tables use, not their ".v2" successors
    (r"The task '.*' is superseded by", UserWarning, r"mteb\."),
    # mteb calling sentence-transformers' renamed methods (get_sentence_embedding_dimension ...): mteb's to update
    (r"", FutureWarning, r"mteb\."),
)
# The same mteb notice also goes to its logger.
_KNOWN_HARMLESS_LOG_RECORDS = {"mteb": "is superseded by"}
# A user's mistake on the command line (a missing file, a bad value) rather than a bug: one line, exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError)


class _DropRecords(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_HARMLESS_WARNINGS` (and the matching log records); ``PYTHONWARNINGS`` still wins."""
    if os.environ.get("PYTHONWARNINGS"):
        return
    for message, category, module in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, fragment in _KNOWN_HARMLESS_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(_DropRecords(fragment))


@contextlib.contextmanager
def user_errors_exit(prog: str) -> Iterator[None]:
    """Turn an expected user error (:data:`USER_ERRORS`) into one line on stderr, ``PROG: error: MESSAGE``, and exit
    status 2, as argparse does for a bad flag; no traceback. Anything else is a bug and keeps its traceback."""
    try:
        yield
    except USER_ERRORS as error:
        message = str(error).strip() or type(error).__name__
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def parse_key_values(items: Sequence[str], flag: str = "--loss-option") -> dict[str, Any]:
    """``["beta=1", "mode=rho", "top_m.m=10"]`` -> ``{"beta": 1, "mode": "rho", "top_m": {"m": 10}}``; a VALUE is
    parsed as JSON when it is JSON (numbers, true/false, null, lists, objects), else kept as a string; a dotted KEY
    sets one field of a nested option (WEINCE's ``top_m``). A key given twice is an error."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        outer, dot, inner = key.partition(".")
        if not dot:
            if key in options:
                raise ValueError(f"{flag} {key} is given twice")
            options[key] = value
            continue
        nested = options.setdefault(outer, {})
        if not isinstance(nested, dict) or inner in nested:
            raise ValueError(f"{flag} {key} is given twice")
        nested[inner] = value
    return options


def merge_options(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied, nested options (dicts) field by field: a preset's
    ``{"top_m": {"shortfall_weight": 0.5, "infonce_weight": 0.5}}`` with ``top_m.m=10`` keeps both weights."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def positive_float(value: str) -> float:
    """argparse type: a finite float > 0."""
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return number
