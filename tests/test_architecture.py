"""The import rules of the package, read from the source (every ``import``, at module level or inside a function):

- the losses' core (``st_weince.functional``, ``st_weince.losses``, ``st_weince.training``) imports nothing of the
  adapters and tools around it (``st_weince.vision``, ``st_weince.diagnostics``) nor of the STS evaluation and data
  readers, which live outside the package (eval/sts_tasks.py);
- the package imports nothing of the repository outside it (recipes/, eval/, benchmarks/, tests/): the wheel holds
  ``st_weince`` only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "st_weince"
CORE = ("functional", "losses", "training")
NOT_IN_THE_CORE = ("st_weince.vision", "st_weince.diagnostics", "st_weince.evaluation", "st_weince.data")
# The repository's folders outside the package, and the modules its scripts import from their own folder.
OUTSIDE_THE_PACKAGE = (
    *("recipes", "eval", "benchmarks", "tests"),
    *("recipe_tools", "simclr_diagnostics", "simclr_tools", "sts_tasks"),
)


def imported_modules(path: Path, root: Path = REPO_ROOT) -> list[tuple[str, int]]:
    """``(module, line)`` of every import in a file under ``root``, in line order, relative imports resolved against
    its package."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names = [f"{module}.{alias.name}" if node.module is None else module for alias in node.names]
            found += [(name, node.lineno) for name in names]
    return sorted(found, key=lambda item: item[1])


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


@pytest.mark.parametrize("part", CORE)
def test_the_losses_core_imports_no_adapter_tool_or_evaluation(part):
    files = sorted((PACKAGE / part).rglob("*.py"))
    assert files, f"st_weince/{part} has no module"
    wrong = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
        for path in files
        for module, line in imported_modules(path)
        if within(module, NOT_IN_THE_CORE)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_package_imports_nothing_of_the_repository_outside_it():
    wrong = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for module, line in imported_modules(path)
        if within(module, OUTSIDE_THE_PACKAGE)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rules_see_imports_inside_functions_and_relative_ones(tmp_path):
    path = tmp_path / "st_weince" / "losses" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text(
        "def f():\n    from st_weince.vision import models\n\nfrom ..diagnostics import evt\nimport recipe_tools\n",
        encoding="utf-8",
    )
    found = [name for name, _ in imported_modules(path, tmp_path)]
    assert found == ["st_weince.vision", "st_weince.diagnostics", "recipe_tools"]
    assert within(found[0], NOT_IN_THE_CORE) and within(found[1], NOT_IN_THE_CORE)
    assert within(found[2], OUTSIDE_THE_PACKAGE) and not within("st_weince.visionary", NOT_IN_THE_CORE)


def test_the_tests_mirror_the_package_and_the_repository() -> None:
    """A test file sits in the folder of the part it tests: one of the package's subpackages, or recipes/, eval/,
    benchmarks/; at the top only the project-wide checks and the tests of the package's top-level modules. A new
    folder that names no part, or a test file dropped at the top, fails here."""
    tests = REPO_ROOT / "tests"
    parts = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    parts |= {"recipes", "eval", "benchmarks"}
    folders = {path.name for path in tests.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders <= parts, f"test folders that name no part of the package or repository: {sorted(folders - parts)}"
    project_wide = {"architecture", "docs", "readme", "packaging", "cli_errors"}
    allowed_at_top = project_wide | {"calibration_minilm", "match_probability"}  # st_weince/calibration.py
    at_top = {path.stem.removeprefix("test_") for path in tests.glob("test_*.py")}
    assert at_top <= allowed_at_top, f"test files at the top of tests/: {sorted(at_top - allowed_at_top)}"
    for folder in folders:
        assert (tests / folder / "__init__.py").exists(), f"tests/{folder} needs an __init__.py (module names)"
        assert any((tests / folder).glob("test_*.py")), f"tests/{folder} holds no test file"
