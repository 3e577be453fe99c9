"""The docs follow the code: every options table of docs/options.md matches its dataclass (names, defaults, ranges,
which options may differ at resume); every backticked ``st_weince.*`` name and package path in README.md and docs/
exists; every command shown there parses as written (tests/docs_commands.py)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import st_weince
from st_weince.functional import Gate, RBSigmoidOptions, TopM, WEINCEOptions
from st_weince.functional.options import Within
from st_weince.losses._gradcache import GradCacheOptions

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(st_weince.__file__).parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SPAN = re.compile(r"`([^`\n]+)`")

# ----- the options tables -----

TABLES = {  # the heading of each table in docs/options.md -> its dataclass
    "WEINCELoss, CachedWEINCELoss (`WEINCEOptions`)": WEINCEOptions,
    "`gate` (`Gate`)": Gate,
    "`top_m` (`TopM`)": TopM,
    "RBSigmoidLoss, CachedRBSigmoidLoss (`RBSigmoidOptions`)": RBSigmoidOptions,
    "The cached variants (`GradCacheOptions`)": GradCacheOptions,
}


def options_tables() -> dict[str, list[dict[str, str]]]:
    """The rows of each table of docs/options.md under its heading, as {column: cell}."""
    tables: dict[str, list[dict[str, str]]] = {}
    heading, header = None, None
    for line in (REPO / "docs" / "options.md").read_text().splitlines():
        if line.startswith("#"):
            heading, header = line.lstrip("#").strip(), None
        elif line.startswith("|") and heading is not None:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not set(cells[0]) <= set("-: "):
                tables.setdefault(heading, []).append(dict(zip(header, cells)))
    return tables


def _literal(cell: str) -> object:
    """A default cell (one backticked Python expression) as its value."""
    (code,) = SPAN.findall(cell)
    return eval(code, {"__builtins__": {}}, {"Gate": Gate, "TopM": TopM})  # noqa: S307 - our own docs


def test_one_options_table_per_dataclass_matching_its_fields():
    tables = options_tables()
    assert set(TABLES) <= set(tables), f"tables missing from docs/options.md: {set(TABLES) - set(tables)}"
    for heading, options_class in TABLES.items():
        rows = {SPAN.findall(row["option"])[0]: row for row in tables[heading]}
        fields = {field.name: field for field in dataclasses.fields(options_class)}
        assert list(rows) == list(fields), f"{heading}: the table's options are not the fields, in order"
        hints = typing.get_type_hints(options_class, include_extras=True)
        operational = options_class.operational_fields()
        for name, field in fields.items():
            row = rows[name]
            assert _literal(row["default"]) == field.default, f"{heading}: {name}'s default"
            assert row["resume"] == ("may differ" if name in operational else "must match"), f"{heading}: {name}"
            for meta in getattr(hints[name], "__metadata__", ()):
                if isinstance(meta, Within):
                    expected = "> 0" if meta.positive else f"`{meta.interval}`" if meta.interval else "any finite"
                    assert expected in row["range"], f"{heading}: {name}'s range is {expected}, not {row['range']!r}"
            for choice in typing.get_args(hints[name]) if typing.get_origin(hints[name]) is typing.Literal else ():
                assert f'"{choice}"' in row["range"], f"{heading}: {name}'s range lacks {choice!r}"
            assert row["meaning"], f"{heading}: {name} has no meaning"


# ----- names and package paths -----

NAME = re.compile(r"\bst_weince(?:\.\w+)+")
# a path inside the package: "st_weince/..." or one of its subpackages' folders ("functional/weince_step.py")
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__"))
PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:st_weince/|(?:{'|'.join(SUBPACKAGES)})/)[\w./-]*\w)")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def _spans() -> list[tuple[str, int, str]]:
    return [
        (page.relative_to(REPO).as_posix(), number, span)
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for span in SPAN.findall(line)
    ]


def test_every_backticked_st_weince_name_exists():
    dead = sorted(
        {
            f"{page}:{line}: {name}"
            for page, line, span in _spans()
            for name in NAME.findall(span)
            if not _resolves(name)
        }
    )
    assert not dead, "names in the docs that do not exist:\n" + "\n".join(dead)


def test_every_backticked_package_path_exists():
    dead = []
    for page, line, span in _spans():
        for path in PACKAGE_PATH.findall(span):
            base = REPO if path.startswith("st_weince/") else PACKAGE
            if not (base / path).exists():
                dead.append(f"{page}:{line}: {path}")
    assert not dead, "package paths in the docs that do not exist:\n" + "\n".join(dead)


# ----- commands -----

LAUNCHER_OPTIONS_WITH_VALUES = {"--num_processes", "--nproc_per_node", "--nproc-per-node", "--num_machines"}


def _command_lines(page: Path) -> list[tuple[int, str, bool]]:
    """(line, command, in a section run at another commit) of every shell command of a page: the lines of its bash /
    sh / plain code blocks (with their continuation lines joined) and its inline code."""
    lines = page.read_text().splitlines()
    found, block, pending, section = [], None, "", 0
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            block = None if block is not None else stripped[3:].strip()
            continue
        if block is None and stripped.startswith("#"):
            section = number - 1
        # a section that says its commands run in a checkout of another commit (retired scripts)
        elsewhere = "git worktree add" in "\n".join(lines[section:number])
        if block in ("bash", "sh", "shell", ""):
            pending += stripped.removesuffix("\\")
            if stripped.endswith("\\"):
                pending += " "
                continue
            found.append((number, pending, elsewhere))
            pending = ""
        elif block is None:
            found += [(number, span, elsewhere) for span in SPAN.findall(line)]
    return found


def _parse_command(text: str) -> list[dict]:
    """The Python programs a shell command runs (``python [-m module | script.py] args``, also after environment
    assignments, ``taskset``, ``accelerate launch`` or ``torchrun``), each as a docs_commands request."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return []
    programs, current = [], []
    for word in words + ["&&"]:
        if word in ("&&", ";", "||"):
            programs.append(current)
            current = []
        else:
            current.append(word)
    requests = []
    for words in programs:
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["taskset"]:
            words = words[3:]
        if words[:2] == ["accelerate", "launch"] or words[:1] == ["torchrun"]:
            words = words[2:] if words[0] == "accelerate" else words[1:]
            while words and words[0].startswith("--"):
                words = words[2:] if words[0] in LAUNCHER_OPTIONS_WITH_VALUES else words[1:]
            words = ["python", *words]
        if not words or words[0] not in ("python", "python3") or len(words) < 2:
            continue
        if words[1] == "-m":
            if len(words) < 3 or not words[2].startswith("st_weince"):
                continue  # pytest, venv, ruff: not this project's programs
            kind, target, argv = "module", words[2], words[3:]
        elif words[1].endswith(".py"):
            kind, target, argv = "script", words[1], words[2:]
        else:
            continue
        synopsis = any(word == "..." or word.startswith("[") or "|" in word for word in argv)
        if synopsis or not argv:
            argv = [word for word in argv if word == "--help"]  # the program's --help (added below)
        help_only = synopsis or not argv or "--help" in argv
        requests.append({"kind": kind, "target": target, "argv": [w for w in argv if w != "--help"], "help": help_only})
    return requests


def documented_commands() -> list[tuple[str, dict]]:
    commands = []
    for page in PAGES:
        for number, text, elsewhere in _command_lines(page):
            if elsewhere:
                continue  # a retired script's command, run at the commit the page names
            for request in _parse_command(text):
                commands.append((f"{page.relative_to(REPO)}:{number}: {text.strip()}", request))
    return commands


def test_the_command_finder_reads_shell_lines():
    (request,) = _parse_command("OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/simcse_compare.py  # all")
    assert request == {"kind": "script", "target": "benchmarks/simcse_compare.py", "argv": [], "help": True}
    (request,) = _parse_command("accelerate launch --multi_gpu --num_processes 4 recipes/simcse.py --preset paper")
    assert request["target"] == "recipes/simcse.py" and request["argv"] == ["--preset", "paper"]
    assert _parse_command("python3 -m venv .venv && . .venv/bin/activate") == []
    (request,) = _parse_command("python eval/sts.py --model PATH [--tasks STS12 ... SICK-R]")
    assert request["help"] and request["argv"] == []
    (request,) = _parse_command("python -m st_weince.diagnostics --help")
    assert request == {"kind": "module", "target": "st_weince.diagnostics", "argv": [], "help": True}


@pytest.mark.slow
def test_every_documented_command_parses():
    """Each command of README.md and docs/ names a script or module that exists and whose parser accepts the
    arguments as written (a synopsis with ``[...]`` and a bare program name: its ``--help``)."""
    # a bare file name (``torchrun ... train.py``) stands for the reader's own script; the project's are in folders
    commands = [(where, r) for where, r in documented_commands() if r["kind"] != "script" or "/" in r["target"]]
    assert len(commands) >= 30, "the command finder found too few commands"
    missing = [
        where for where, request in commands if request["kind"] == "script" and not (REPO / request["target"]).is_file()
    ]
    assert not missing, "commands of scripts that do not exist:\n" + "\n".join(missing)
    process = subprocess.run(
        [sys.executable, "-m", "tests.docs_commands"],
        input=json.dumps([request for _, request in commands]),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads(process.stdout.strip().splitlines()[-1])
    failed = [f"{where}\n    {result['detail']}" for (where, _), result in zip(commands, results) if not result["ok"]]
    assert not failed, "documented commands that do not parse:\n" + "\n".join(failed)
