"""Tables of texts (sentence pairs, labelled texts) in the formats the ``datasets`` library reads, by its loaders.

- a CSV or TSV file with a header row naming the columns (``.csv``, ``.tsv``);
- a JSON-lines file, one object a line (``.jsonl``, or ``.json``, which ``datasets`` also reads as a JSON array);
- a Parquet file (``.parquet``);
- a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (one split of it, ``"train"`` by
  default).

Cells are read as they are: a CSV's "NA" or "null" stays that text (``keep_default_na=False``), an empty cell is "".
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FILE_FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".csv": ("csv", {"keep_default_na": False}),
    ".tsv": ("csv", {"keep_default_na": False, "sep": "\t"}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
}
DEFAULT_SPLIT = "train"


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
    read = getattr(datasets.Dataset, f"from_{loader}")  # from_csv, from_json, from_parquet
    with tempfile.TemporaryDirectory() as cache:
        return read(str(path), cache_dir=cache, keep_in_memory=True, **options)


def table_columns(table: Any, names: Sequence[str], source: str | Path, option: str = "--columns") -> list[list[Any]]:
    """The values of the named columns of a ``datasets.Dataset``, one list per name. A missing column raises a
    ValueError that names it, the ``option`` that asked for it and the columns the table has."""
    for name in names:
        if name not in table.column_names:
            raise ValueError(
                f"{source} has no column {name!r} ({option}); its columns: {', '.join(table.column_names)}"
            )
    return [table[name] for name in names]
