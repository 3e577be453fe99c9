"""Packaging: a built wheel carries LICENSE, py.typed and the version of st_weince/__init__.py (the one place) and
nothing of the recipes' SimCLR apparatus; scipy and matplotlib are the diagnostics' extra (the core does not import
them, the diagnostics without them name the extra); sentence-transformers' unexported embed_columns, which the losses
import, still has the import path, signature and behaviour they rely
on (pyproject pins sentence-transformers < 7 for it: this test is what fails when it moves)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import st_weince
from tests.conftest import REPO_ROOT
from tests.test_architecture import imported_modules, within

tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml without a dependency")
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_is_kept_in_one_place():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "st_weince.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", st_weince.__version__)
    changelog = (REPO_ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{st_weince.__version__}]" in changelog


def test_license_file_is_the_apache_2_text():
    text = (REPO_ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]


@pytest.mark.slow
def test_wheel_ships_py_typed_license_and_the_version(tmp_path):
    # Built from a copy of what the wheel needs: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "st_weince", source / "st_weince", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*command, str(source)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("st_weince-*.whl")
    assert wheel.name.startswith(f"st_weince-{st_weince.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "st_weince/py.typed" in names
    # the vision adapter only: datasets, augmentations, ResNets, setups, step and probes are recipes/simclr_tools'
    assert sorted(n for n in names if n.startswith("st_weince/vision/")) == [
        "st_weince/vision/__init__.py",
        "st_weince/vision/objectives.py",
    ]
    assert any(re.fullmatch(r"st_weince-[^/]+\.dist-info/licenses/LICENSE", name) for name in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert re.search(r"Requires-Dist: sentence-transformers\[train\]<7,>=6\.3\.0", metadata)
    for package in ("scipy", "matplotlib"):  # the diagnostics' extra, not the losses' requirements
        assert re.search(rf"Requires-Dist: {package}>=[\d.]+; extra == \"diagnostics\"", metadata), package
        assert not re.search(rf"Requires-Dist: {package}[<>=!~\d.,]*\n", metadata), package


PLOTTING_AND_FITTING = ("scipy", "matplotlib")


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on this checkout (a module already imported here would hide its imports)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=env)


def test_the_extras_hold_scipy_and_matplotlib_for_the_diagnostics():
    project = PYPROJECT["project"]
    assert not [d for d in project["dependencies"] if d.startswith(PLOTTING_AND_FITTING)]
    assert sorted(re.split(r"[<>=]", d)[0] for d in project["optional-dependencies"]["diagnostics"]) == [
        "matplotlib",
        "scipy",
    ]
    assert "diagnostics" in re.search(r"\[(.*)\]", project["optional-dependencies"]["all"][0]).group(1).split(",")
    assert project["scripts"]["st-weince-diagnostics"] == "st_weince.diagnostics.__main__:main"


def test_only_the_diagnostics_import_scipy_or_matplotlib():
    package = REPO_ROOT / "st_weince"
    wrong = [
        f"{path.relative_to(REPO_ROOT)}:{line} imports {module}"
        for path in sorted(package.rglob("*.py"))
        if "diagnostics" not in path.relative_to(package).parts
        for module, line in imported_modules(path)
        if within(module, PLOTTING_AND_FITTING)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_core_loads_neither_scipy_nor_matplotlib():
    loaded = f"print(sorted(name for name in {PLOTTING_AND_FITTING!r} if name in sys.modules))"
    done = _python(f"import sys\nimport st_weince, st_weince.functional, st_weince.training\n{loaded}")
    assert done.returncode == 0 and done.stdout.split("\n")[-2] == "[]", done.stderr[-2000:]
    # the losses import sentence-transformers, which itself needs scipy (its requirement, not ours): no matplotlib
    losses = "import st_weince.losses, st_weince.vision.objectives"
    done = _python(f"import sys\n{losses}\nprint('matplotlib' in sys.modules)")
    assert done.returncode == 0 and done.stdout.split("\n")[-2] == "False", done.stderr[-2000:]


@pytest.mark.parametrize("missing", PLOTTING_AND_FITTING)
def test_the_diagnostics_without_their_extra_name_it(missing):
    """Without scipy (or matplotlib) the core still imports; the package, its command line's entry point and
    ``python -m st_weince.diagnostics`` fail with one line that names the extra."""
    hide = f"import sys\nsys.modules[{missing!r}] = None  # as if not installed\n"
    assert _python(hide + "import st_weince, st_weince.functional, st_weince.training").returncode == 0
    fix = 'pip install "st-weince[diagnostics]"'
    for attempt in (
        "import st_weince.diagnostics",
        "from st_weince.diagnostics.__main__ import main",  # what the st-weince-diagnostics script runs first
        "import runpy\nsys.argv = ['st-weince-diagnostics', '--help']\n"
        "runpy.run_module('st_weince.diagnostics', run_name='__main__')",
    ):
        done = _python(hide + attempt)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode != 0 and last.startswith("ImportError:") and missing in last and fix in last, last


def test_sentence_transformers_major_version_is_the_pinned_one():
    (requirement,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("sentence-transformers")]
    # >=6.3.0 (issue 53): 6.2's GradCache all-reduces once per mini-batch under DDP, 6.3's once per optimizer step
    assert ">=6.3.0" in requirement and "<7" in requirement
    assert int(importlib.metadata.version("sentence-transformers").split(".")[0]) == 6


def test_embed_columns_still_has_the_api_the_losses_use(tiny_model):
    """If this fails, sentence-transformers moved or changed ``embed_columns``: adapt st_weince/losses/ (or vendor
    the one-liner ``[model(f)["sentence_embedding"] for f in features]``) before widening the pin."""
    from sentence_transformers.base.losses.merged_forward import embed_columns

    parameters = list(inspect.signature(embed_columns).parameters)
    assert parameters[:2] == ["model", "features_list"], parameters
    sentences = [["the cat sat on the mat", "rain falls on the city"], ["a dog runs", "birds fly over the lake"]]
    features = [tiny_model.tokenize(column) for column in sentences]
    tiny_model.eval()
    with torch.no_grad():
        columns = embed_columns(tiny_model, [dict(f) for f in features])
        expected = [tiny_model(dict(f))["sentence_embedding"] for f in features]
    assert isinstance(columns, list) and len(columns) == 2
    for got, want in zip(columns, expected):
        assert got.shape == want.shape == (2, tiny_model.get_sentence_embedding_dimension())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The loss modules import it from exactly this place.
    import st_weince.losses as losses

    users = [importlib.import_module(f"st_weince.losses.{info.name}") for info in pkgutil.iter_modules(losses.__path__)]
    users = [module for module in users if hasattr(module, "embed_columns")]
    assert users and all(module.embed_columns is embed_columns for module in users)
