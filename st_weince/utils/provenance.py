"""What every committed output records: machine, library versions, command, git commit.

The one record for all of them: eval/, the diagnostics, the recipes and the benchmarks.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

_PACKAGES = (
    "st-weince",
    "torch",
    "transformers",
    "sentence-transformers",
    "mteb",
    "datasets",
    "numpy",
    "scipy",
    "scikit-learn",
    "torchvision",
    "accelerate",
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]  # the repository holding st_weince/
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def cpu_record() -> dict:
    """The processor as float rounding depends on it: vendor, family and model numbers (a VM may hide the model
    name), whether AVX-512 is there, and the kernel family torch chose (``ATEN_CPU_CAPABILITY`` can lower it).
    ``family`` joins what decides the rounding of a float32 run: two runs pair only within one family."""
    import torch

    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "cpu family", "model", "model name", "flags") and key not in fields:
                fields[key] = value.strip()
    except OSError:  # not Linux: the platform's own words
        fields = {"model name": platform.processor() or platform.machine()}
    capability = torch.backends.cpu.get_cpu_capability()
    vendor = fields.get("vendor_id", platform.machine())
    return {
        "model_name": fields.get("model name"),
        "vendor": vendor,
        "cpu_family": fields.get("cpu family"),
        "cpu_model": fields.get("model"),
        "avx512": "avx512f" in fields.get("flags", "").split(),
        "aten_capability": capability,
        "family": f"{vendor} family {fields.get('cpu family')} model {fields.get('model')}, {capability}",
    }


def provenance(argv: list[str] | None = None, processes: dict | None = None) -> dict:
    """A JSON-able record of where and how a result was produced. ``processes``: a recipe's
    ``ProcessCount.record()`` (recipes/recipe_tools.py), the processes its launcher asked for and those it trained
    on; its ``actual`` is then the ``world_size``."""
    import torch

    argv = sys.argv if argv is None else argv
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu": cpu_record(),
        },
        # processes of a torchrun / accelerate launch
        "world_size": processes["actual"] if processes else int(os.environ.get("WORLD_SIZE", "1")),
        **({"processes": processes} if processes else {}),
        "python": platform.python_version(),
        # torch's own string keeps the build tag (e.g. +cu130 or +cpu) that the package metadata drops
        "versions": {**{p: _version(p) for p in _PACKAGES}, "torch": torch.__version__},
    }
