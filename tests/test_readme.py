"""Every ```python block of README.md runs as pasted: in a fresh interpreter, in an empty folder, offline
(HF_HUB_OFFLINE=1), without the warnings a user must learn to ignore, and leaves nothing behind, neither in that
folder nor in the temporary directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert python_blocks(), "README.md has no ```python block"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs_as_pasted(index, tmp_path):
    block = python_blocks()[index]
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
    assert result.returncode == 0, f"README block {index} failed:\n{block}\n{result.stderr[-4000:]}"
    # quiet, and WEINCE acts: no pinned-memory warning on a CPU, no batch too small for the tail fit
    for noise in ("pin_memory", "fits no anchor's tail", "does not use labels"):
        assert noise not in result.stderr, f"README block {index} prints {noise!r}:\n{result.stderr[-4000:]}"
    assert sorted(p.name for p in empty.iterdir()) == [], "the block left files in the working folder"
    assert sorted(p.name for p in scratch.iterdir()) == [], "the block left files in the temporary directory"
