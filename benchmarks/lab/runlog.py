"""Run files of the benchmark studies: one JSON line per record, appended as a run goes, resumable after a kill.

A run file starts with a ``"type": "header"`` line (configuration, seed, provenance); then ``checkpoint``, ``full``,
``resume`` and one ``final`` line. A line cut short by a kill is dropped on reading, states are replaced atomically,
so a restart continues from the last saved state and loses nothing written before it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

HEADER_KEYS = ("date_utc", "git_commit", "machine", "versions", "command")  # a header's provenance in summaries


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def parse_run_names(names: list[str], arms: list[str] | tuple[str, ...]) -> list[tuple[str, int]]:
    """``arm-seedK`` names -> (arm, seed); ValueError naming the known arms."""
    runs = []
    for name in names:
        arm, _, seed = name.rpartition("-seed")
        if arm not in arms or not seed.isdigit():
            raise ValueError(f"run names look like infonce-seed0, arms {sorted(arms)}; got {name!r}")
        runs.append((arm, int(seed)))
    return runs


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a run file; a truncated last line (killed while writing) is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def final_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``"type": "final"`` line among a run file's records, None while the run is unfinished."""
    return next((r for r in records if r.get("type") == "final"), None)


def final_line(path: Path) -> dict[str, Any] | None:
    return final_record(read_lines(path))


def run_files(output_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Run name -> records of every run file in ``output_dir`` that starts with a header."""
    runs = {}
    for path in sorted(output_dir.glob("*.jsonl")):
        records = read_lines(path)
        if records and records[0].get("type") == "header":
            runs[path.stem] = records
    return runs


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def append_line(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def save_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill during the write leaves the previous state


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
