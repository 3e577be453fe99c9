"""Packaging: a built wheel carries LICENSE, py.typed and the version of st_weince/__init__.py (the one place);
sentence-transformers' unexported embed_columns, which the losses import, still has the import path, signature and
behaviour they rely on (pyproject pins sentence-transformers < 7 for it: this test is what fails when it moves)."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
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
    assert any(re.fullmatch(r"st_weince-[^/]+\.dist-info/licenses/LICENSE", name) for name in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert re.search(r"Requires-Dist: sentence-transformers\[train\]<7,>=6\.3\.0", metadata)


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
