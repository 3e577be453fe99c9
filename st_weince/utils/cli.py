"""Command-line pieces of ``python -m st_weince.diagnostics``, which the repository's scripts (recipes/, eval/) use
too: one-line exits for a user's error, the one list of known-harmless library warnings that the command lines
filter, and the check of a ``--model`` path."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

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
# The same mteb notice also goes to its logger: a filter per logger, made once (``addFilter`` adds an object once).
_KNOWN_HARMLESS_LOG_FILTERS = {"mteb": lambda record: "is superseded by" not in record.getMessage()}
_MODEL_FILES = ("modules.json", "config.json")  # a saved SentenceTransformer / a Hugging Face model folder
# A user's mistake on the command line (a missing file, a bad value) rather than a bug: one line, exit status 2.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError)


def quiet_known_warnings() -> None:
    """Filter :data:`KNOWN_HARMLESS_WARNINGS` (and the matching log records); ``PYTHONWARNINGS`` still wins."""
    if os.environ.get("PYTHONWARNINGS"):
        return
    for message, category, module in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, keep in _KNOWN_HARMLESS_LOG_FILTERS.items():
        logging.getLogger(name).addFilter(keep)


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


def check_model_path(name: str | Path) -> None:
    """A clear ValueError for a ``--model`` that names a local path but cannot be a model: a path that does not exist,
    or a recipe's run folder (its model is in ``final/``). Hub names pass (``org/name``)."""
    name = str(name)
    local = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or local.exists() or name.count("/") > 1
    if looks_like_path and not local.exists():
        raise ValueError(
            f"model path {name!r} does not exist. Pass --model with a local model directory (a saved "
            "SentenceTransformer or a Hugging Face model folder), a hub name when the hub is reachable, or "
            "'tiny' for a random 4-layer BERT."
        )
    final = local / "final"
    if (
        local.is_dir()
        and not any((local / file).is_file() for file in _MODEL_FILES)
        and any((final / file).is_file() for file in _MODEL_FILES)
    ):
        raise ValueError(f"{name} is a run folder; the model is in {final}")
