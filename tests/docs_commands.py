"""Parses documented commands as the scripts would, without running them: each script or module runs as
``__main__`` until its first ``ArgumentParser.parse_args`` returns (then it stops), or with ``--help``; a script
without argparse is not run (it would do its work). Reads a JSON
list of ``{"kind": "script" | "module", "target", "argv", "help"}`` on stdin, prints one JSON result per command:
``{"ok": bool, "detail": str}``. One process for all commands, so the libraries are imported once (tests/test_docs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Parsed(Exception):
    """The command's arguments parsed: the script stops here."""


def _stop_after_parsing() -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed()

    argparse.ArgumentParser.parse_args = parse_args


def check(command: dict) -> dict:
    argv = list(command["argv"]) + (["--help"] if command["help"] else [])
    output = io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            if command["kind"] == "module":
                sys.argv = [command["target"], *argv]
                runpy.run_module(command["target"], run_name="__main__", alter_sys=True)
            else:
                script = REPO / command["target"]
                if "argparse" not in script.read_text():  # it reads sys.argv itself: checking would run it
                    return {"ok": True, "detail": "exists; parses its arguments without argparse, not run"}
                sys.argv = [str(script), *argv]
                sys.path.insert(0, str(script.parent))
                runpy.run_path(str(script), run_name="__main__")
    except Parsed:
        return {"ok": not command["help"], "detail": "parsed"}
    except SystemExit as exit_info:
        code = exit_info.code or 0
        return {"ok": command["help"] and code == 0, "detail": f"exit {code}: {output.getvalue()[-600:]}"}
    except BaseException as error:  # noqa: BLE001 - reported, not raised: one bad command must not hide the others
        return {"ok": False, "detail": f"{type(error).__name__}: {error}; {output.getvalue()[-600:]}"}
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"ok": False, "detail": f"ran to the end without parsing arguments: {output.getvalue()[-300:]}"}


def main() -> None:
    os.chdir(REPO)
    _stop_after_parsing()
    commands = json.loads(sys.stdin.read())
    results = [check(command) for command in commands]
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
