"""Every ```python block of README.md and docs/usage.md runs as pasted: in a fresh interpreter, in an empty folder,
offline (HF_HUB_OFFLINE=1), without the warnings a user must learn to ignore, and leaves nothing behind, neither in
that folder nor in the temporary directory. The README stays a front door (at most 150 lines), and its links lead to
files and headings that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
PAGES_WITH_EXAMPLES = (README, REPO_ROOT / "docs" / "usage.md")


def python_blocks(page: Path = README) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert python_blocks(), "README.md has no ```python block"


def test_readme_is_a_front_door():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown page."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M),
                          flags=re.M)  # fmt: skip
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_readme_links_lead_to_existing_files_and_headings():
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        assert (REPO_ROOT / path).is_file(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in heading_anchors(REPO_ROOT / path), f"README.md links to {target}: no such heading"


EXAMPLES = [(page, index) for page in PAGES_WITH_EXAMPLES for index in range(len(python_blocks(page)))]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index"), EXAMPLES, ids=[f"{page.name}-{index}" for page, index in EXAMPLES])
def test_readme_python_block_runs_as_pasted(page, index, tmp_path):
    block = python_blocks(page)[index]
    script, empty, scratch = tmp_path / "block.py", tmp_path / "cwd", tmp_path / "tmp"
    script.write_text(block, encoding="utf-8")
    empty.mkdir()
    scratch.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),  # this checkout's st_weince, as an installed one would be
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TMPDIR": str(scratch),
        "OMP_NUM_THREADS": "1",
        # torch keeps its compile cache under TMPDIR by default (torchinductor_<user>): a cache, not the block's
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cache"),
    }
    env.pop("WANDB_DISABLED", None)  # the block itself must keep reporters off
    result = subprocess.run(
        [sys.executable, str(script)], cwd=empty, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{page.name} block {index} failed:\n{block}\n{result.stderr[-4000:]}"
    # quiet, and WEINCE acts: no pinned-memory warning on a CPU, no batch too small for the tail fit
    for noise in ("pin_memory", "fits no anchor's tail", "does not use labels"):
        assert noise not in result.stderr, f"{page.name} block {index} prints {noise!r}:\n{result.stderr[-4000:]}"
    where = f"{page.name} block {index}"
    assert sorted(p.name for p in empty.iterdir()) == [], f"{where} left files in the working folder"
    assert sorted(p.name for p in scratch.iterdir()) == [], f"{where} left files in the temporary directory"
