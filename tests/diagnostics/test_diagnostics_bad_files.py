"""Bad pair files stop the diagnostics command with one line that names the file (and the line where there is one)
and what to do, exit status 2, no traceback (issue 54, item 7). The file is read before the model loads, so the
model directory here needs no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from st_weince.diagnostics.__main__ import main


def _parquet_cut_in_half(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"anchor": ["a b"] * 50, "positive": ["c d"] * 50}), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_FILES = {  # name: (bytes or a writer, extra arguments, what the message must say)
    "empty.csv": (b"", ("--columns", "anchor", "positive"), "is empty"),
    "latin1.csv": (
        "anchor,positive\nun,deux\ncaf\u00e9 au lait,th\u00e9 vert\n".encode("latin-1"),
        ("--columns", "anchor", "positive"),
        "latin1.csv:3: not UTF-8 text (byte 0xe9); save the file as UTF-8",
    ),
    "latin1-no-header.csv": ("caf\u00e9,th\u00e9\n".encode("latin-1"), (), "latin1-no-header.csv:1: not UTF-8 text"),
    "text-score.csv": (
        b"anchor,positive,score\na b,c d,4.5\ne f,g h,high\n",
        ("--columns", "anchor", "positive", "--min-pair-score", "4"),
        "data row 2: score 'high' in column 'score' is not a number",
    ),
    "header-only.csv": (b"anchor,positive,intent\n", ("--columns", "anchor", "positive"), "holds no rows"),
    "broken.jsonl": (
        (json.dumps({"anchor": "a b", "positive": "c d"}) + '\n{"anchor": "e f", "positive": \n').encode(),
        (),
        "broken.jsonl:2: not a JSON object",
    ),
    "truncated.parquet": (_parquet_cut_in_half, (), "is not a readable Parquet file"),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_pair_file_gives_one_line_naming_the_file_and_exit_status_2(name, tmp_path, capsys) -> None:
    content, extra, expected = BAD_FILES[name]
    path = tmp_path / name
    if callable(content):
        content(path)
    else:
        path.write_bytes(content)
    argv = ["--model", str(tmp_path), "--pairs", str(path), *extra, "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # one line: no traceback, no progress bar, no library log line
    assert lines[0].startswith(f"st-weince-diagnostics: error: {path}"), lines[0]
    assert expected in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_latin1_sentence_file_names_the_file_and_line(tmp_path, capsys) -> None:
    sentences = tmp_path / "sentences.txt"
    sentences.write_bytes("one\ntwo\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), "--sentences", str(sentences), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"{sentences}:3: not UTF-8 text" in capsys.readouterr().err
