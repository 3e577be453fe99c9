"""The functional API is what docs/algorithms.md ("The functional API") documents: the table there lists exactly the
names ``st_weince.functional`` exports, and each of them is a real function or class."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import st_weince.functional

PAGE = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def documented_names() -> list[str]:
    """The first column of the table under "## The functional API" in docs/algorithms.md."""
    section = PAGE.read_text().split("## The functional API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.M)


def test_exports_are_the_documented_names():
    documented = documented_names()
    assert len(documented) == len(set(documented)), f"a name is listed twice: {documented}"
    exported = st_weince.functional.__all__
    assert sorted(documented) == sorted(exported), (
        f"documented but not exported: {sorted(set(documented) - set(exported))}; "
        f"exported but not documented: {sorted(set(exported) - set(documented))}"
    )


def test_star_import_gives_the_exports_and_each_is_a_function_or_class():
    namespace: dict[str, object] = {}
    exec("from st_weince.functional import *", namespace)  # noqa: S102 - the import a user writes
    namespace.pop("__builtins__")
    assert sorted(namespace) == sorted(st_weince.functional.__all__)
    for name, value in namespace.items():
        assert inspect.isfunction(value) or inspect.isclass(value), f"{name} is a {type(value).__name__}"
        assert inspect.getdoc(value), f"{name} has no docstring"
