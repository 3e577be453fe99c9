"""The diagnostics' inputs, read as the command line takes them (docs/diagnostics.md, "Inputs"): tables by the
``datasets`` loaders (:func:`load_table`: CSV / TSV with a header, JSON lines, Parquet, a ``save_to_disk`` folder),
headerless ``sentence1,sentence2[,score]`` CSV files (:func:`read_pair_csv`) and sentence files
(:func:`sample_distinct_lines`: distinct lines only, since a sentence paired with its own copy is no negative). Cells
are read as they are ("NA" stays text); pair sentences are whitespace-normalised as SentEval's loaders do.
"""

from __future__ import annotations

import csv
import io
import json
import random
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

FILE_FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".csv": ("csv", {"keep_default_na": False}),
    ".tsv": ("csv", {"keep_default_na": False, "sep": "\t"}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
}
DEFAULT_SPLIT = "train"
Item = TypeVar("Item")


class MissingDataError(FileNotFoundError, ValueError):
    """A data file is not there (both a FileNotFoundError and a ValueError; eval/'s STS readers raise it too)."""


def load_table(path: str | Path, split: str | None = None) -> Any:
    """The ``datasets.Dataset`` in ``path``: a file of one of :data:`FILE_FORMATS`, or a ``save_to_disk`` folder
    (of a DatasetDict: its ``split``, default ``"train"``). Files are loaded in memory, through a temporary cache
    folder, so nothing is left in the user's Hugging Face cache."""
    import datasets

    path = Path(path)
    if path.is_dir():
        table = datasets.load_from_disk(str(path))
        if isinstance(table, datasets.DatasetDict):
            name = split or DEFAULT_SPLIT
            if name not in table:
                raise ValueError(f"{path} holds the splits {', '.join(table)}, not {name!r}; name one")
            return table[name]
        if split is not None:
            raise ValueError(f"{path} holds one Dataset, not a DatasetDict with splits (asked for {split!r})")
        return table
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    if path.suffix.lower() not in FILE_FORMATS:
        known = ", ".join(FILE_FORMATS)
        raise ValueError(f"{path}: unknown file type {path.suffix!r}; expected one of {known} or a save_to_disk folder")
    loader, options = FILE_FORMATS[path.suffix.lower()]
    _check_readable(path, loader)  # an empty, non-UTF-8 or truncated file: one line naming the file (and line)
    read = getattr(datasets.Dataset, f"from_{loader}")  # from_csv, from_json, from_parquet
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # "Generating train split" bars say nothing for a file read in memory
    try:
        with tempfile.TemporaryDirectory() as cache:
            table = read(str(path), cache_dir=cache, keep_in_memory=True, **options)
    except Exception as error:  # datasets' generation errors wrap the parser's: name the file and what to do
        raise _unreadable(path, loader, error) from None
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
    if len(table) == 0:
        raise ValueError(f"{path} holds no rows (only a header?); add one pair a row")
    return table


_FORMAT_FIX = {
    "csv": "a CSV file with a header row naming the columns and one pair a row",
    "json": 'one JSON object a line, e.g. {"anchor": "...", "positive": "..."}',
    "parquet": "a complete Parquet file (write it again, e.g. with DataFrame.to_parquet)",
}


def _check_readable(path: Path, loader: str) -> None:
    """ValueErrors that name the file (and the line) for what ``datasets`` reports only by a traceback or a message
    without the file: an empty file, bytes that are not UTF-8, a JSON line that does not parse, a truncated Parquet."""
    if loader == "parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            pq.read_metadata(path)
        except (pyarrow.ArrowException, OSError) as error:
            reason = f"{path} is not a readable Parquet file ({error})"
            raise ValueError(f"{reason}; expected {_FORMAT_FIX['parquet']}") from None
        return
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path} is empty; expected {_FORMAT_FIX[loader]}")
    text = _utf8(path, data)
    if loader == "json" and not text.lstrip().startswith("["):  # JSON lines (a .json array is parsed whole)
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{number}: not a JSON object ({error.msg} at column {error.colno}); expected "
                    f"{_FORMAT_FIX['json']}"
                ) from None


def _utf8(path: Path, data: bytes) -> str:
    """``data`` decoded as UTF-8, or a ValueError naming the file, the line of the first bad byte and the fix."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}); save the file as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}"
        ) from None


def _unreadable(path: Path, loader: str, error: BaseException) -> ValueError:
    """A one-line ValueError for a file ``datasets`` could not read: the innermost cause, the file and the fix."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    reason = " ".join(str(error).split()) or type(error).__name__
    if "corresponds to no data" in reason:
        return ValueError(f"{path} holds no rows (only a header?); add one pair a row")
    return ValueError(f"{path} could not be read as {loader} ({reason}); expected {_FORMAT_FIX[loader]}")


def table_columns(table: Any, names: Sequence[str], source: str | Path, option: str = "--columns") -> list[list[Any]]:
    """The values of the named columns of a ``datasets.Dataset``, one list per name. A missing column raises a
    ValueError that names it, the ``option`` that asked for it and the columns the table has."""
    for name in names:
        if name not in table.column_names:
            raise ValueError(
                f"{source} has no column {name!r} ({option}); its columns: {', '.join(table.column_names)}"
            )
    return [table[name] for name in names]


def normalise_whitespace(sentence: str) -> str:
    return " ".join(sentence.split())


def read_pair_csv(path: str | Path, *, scored: bool = True) -> tuple[list[str], list[str], list[float]]:
    """Sentence pairs from a CSV without a header: ``sentence1,sentence2,score`` (STS-B's layout), or
    ``sentence1,sentence2[,...]`` with ``scored=False`` (then the scores list is empty).

    Raises a ValueError naming the file and line for a row with the wrong number of fields or a non-numeric score,
    and a :class:`MissingDataError` for a missing file.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"sentence-pair file {path} not found (CSV sentence1,sentence2,score without header)")
    s1, s2, scores = [], [], []
    text = _utf8(path, path.read_bytes())
    for number, row in enumerate(csv.reader(io.StringIO(text, newline="")), start=1):
        if scored and len(row) != 3:
            raise ValueError(f"{path}:{number}: expected 3 CSV fields sentence1,sentence2,score, found {len(row)}")
        if len(row) < 2:
            raise ValueError(f"{path}:{number}: expected 2 or more CSV fields sentence1,sentence2, found {len(row)}")
        if scored:
            try:
                scores.append(float(row[2]))
            except ValueError:
                raise ValueError(f"{path}:{number}: score {row[2]!r} is not a number") from None
        s1.append(normalise_whitespace(row[0]))
        s2.append(normalise_whitespace(row[1]))
    return s1, s2, scores


def seeded_subset(items: Sequence[Item], limit: int | None, seed: int = 0) -> list[Item]:
    """A seeded random subset of ``limit`` of the items, in their order (all of them when ``limit`` is None or not
    smaller than their number)."""
    if limit is None or limit >= len(items):
        return list(items)
    keep = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in keep]


def sample_distinct(
    texts: Iterable[str], limit: int | None = None, seed: int = 0, source: str = "the input"
) -> list[str]:
    """Non-empty, distinct texts (stripped) in first-seen order; a seeded random subset of ``limit`` of them.
    ``source`` names where the texts come from in the errors."""
    sentences = [text for text in dict.fromkeys(text.strip() for text in texts) if text]
    if len(sentences) < 2:
        raise ValueError(f"{source} holds {len(sentences)} distinct sentences; at least 2 are needed")
    if limit is not None and limit < 2:
        raise ValueError(f"limit must be at least 2, got {limit}")
    return seeded_subset(sentences, limit, seed)


def sample_distinct_lines(path: str | Path, limit: int | None = None, seed: int = 0) -> list[str]:
    """Non-empty, distinct lines of a text file in file order; a seeded random subset of ``limit`` of them."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sentence file {path} not found")
    return sample_distinct(_utf8(path, path.read_bytes()).splitlines(), limit, seed, source=str(path))
