"""How many processes a launcher asked for and how many a recipe trains on. Both recipes print the count at start and
warn when the launcher asked for more: ``accelerate launch --num_processes 2`` on a CPU starts ONE process and says
nothing (on a CPU it starts several only through MPI).

What each launcher leaves in the environment of the processes it starts (read in accelerate 1.16's
``commands/launch.py`` and ``utils/launch.py``, and observed with it and torch 2.14's torchrun):

- ``torchrun --nproc_per_node N`` (and ``accelerate launch --multi_gpu``, which runs torchrun's code): ``WORLD_SIZE=N``,
  ``LOCAL_WORLD_SIZE=N``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` ...
- ``accelerate launch`` without a multi-device mode (its "simple launcher": ``--cpu``, or no ``--multi_gpu`` on a
  machine with fewer than 2 GPUs): one ``python SCRIPT``, with ``ACCELERATE_USE_CPU`` (always) and
  ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=29500`` (only when ``--num_processes``, given or from a config file, is
  above 1); no ``WORLD_SIZE``, and no variable carries N: N is only on the launcher's command line.
- ``mpirun`` (``accelerate launch --mpirun_hostfile``): ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE`` or
  ``MV2_COMM_WORLD_SIZE``, which accelerate's ``PartialState`` reads.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
ACCELERATE_NUM_PROCESSES_FLAGS = ("--num_processes", "--num-processes")  # accelerate takes both spellings


@dataclass(frozen=True)
class ProcessCount:
    """What :func:`count_processes` found; ``record()`` goes into results.json beside ``world_size``."""

    launcher: str  # "torchrun", "mpirun", "accelerate launch", "a launcher" (WORLD_SIZE alone) or "python" (none)
    requested: int | None  # None: more than one, but the count reached this process nowhere
    actual: int
    summary: str  # "training on 2 processes (world size 2, rank 0 prints)"
    warning: str | None  # only when the launcher asked for more processes than this run has: why, and what works

    def record(self) -> dict[str, Any]:
        return {"launcher": self.launcher, "requested": self.requested, "actual": self.actual}

    def announce(self) -> None:
        """The summary on stdout, the warning (if any) on stderr; the recipes call it on the main process only."""
        print(self.summary, flush=True)
        if self.warning:
            print(self.warning, file=sys.stderr, flush=True)


def count_processes(
    actual: int,
    *,
    gpus: int,
    environ: Mapping[str, str] | None = None,
    launcher_argv: Sequence[str] | None = None,
    argv: Sequence[str] | None = None,
) -> ProcessCount:
    """Compare the processes the launcher asked for (read from ``environ``, default ``os.environ``) with ``actual``,
    the processes the recipe trains on. ``gpus``: CUDA devices of this machine, which decide the command the warning
    names (torchrun on a CPU, ``accelerate launch --multi_gpu`` on GPUs). ``launcher_argv``: the command line of
    accelerate's simple launcher (default: the parent process's, read from /proc), the one place its N is;
    ``argv``: this script's command line (default ``sys.argv``), repeated in the command the warning names."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    launcher, requested = _requested_processes(environ, launcher_argv, script=argv[0] if argv else "")
    plural = "process" if actual == 1 else "processes"
    summary = f"training on {actual} {plural} (world size {actual}{', rank 0 prints' if actual > 1 else ''})"
    warning = None
    if (requested is None and actual == 1) or (requested is not None and requested > actual):
        count = str(requested) if requested is not None else "N"
        script = " ".join(shlex.quote(a) for a in argv)
        if gpus:
            command = f"accelerate launch --multi_gpu --num_processes {count} {script}"
            why = "; accelerate launch starts one process per GPU with --multi_gpu" + (
                f" (this machine has {gpus})" if requested is None or gpus < requested else ""
            )
        else:
            command = f"torchrun --nproc_per_node {count} {script}"
            why = "; on a CPU accelerate launch starts several processes only through MPI (--mpirun_hostfile)"
        asked = f"{requested} processes" if requested is not None else "more than one process (--num_processes)"
        warning = (
            f"warning: {launcher} asked for {asked}, but this run trains on {actual}"
            f"{why if launcher == 'accelerate launch' else ''}. To train on {count} processes:\n    {command}"
        )
    return ProcessCount(launcher=launcher, requested=requested, actual=actual, summary=summary, warning=warning)


def _requested_processes(
    environ: Mapping[str, str], launcher_argv: Sequence[str] | None, script: str
) -> tuple[str, int | None]:
    """``(launcher, processes it asked for)`` from the variables each launcher sets (the module docstring)."""
    if "WORLD_SIZE" in environ:
        return ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else "a launcher"), int(environ["WORLD_SIZE"])
    for name in MPI_SIZE_VARIABLES:
        if name in environ:
            return "mpirun", int(environ[name])
    if "ACCELERATE_USE_CPU" not in environ:  # set by every accelerate launch, whatever its mode
        return "python", 1
    if launcher_argv is None:
        launcher_argv = _parent_command_line()
    # Only the launcher's own options, before the script: the script's arguments are not the launcher's.
    options = launcher_argv[: list(launcher_argv).index(script)] if script in launcher_argv else []
    for index, token in enumerate(options):
        flag, equals, value = token.partition("=")
        if flag in ACCELERATE_NUM_PROCESSES_FLAGS:
            value = value if equals else (options[index + 1] if index + 1 < len(options) else "")
            if value.isdigit():
                return "accelerate launch", int(value)
    # No readable count: MASTER_ADDR is what accelerate adds when it was asked for more than one (a config file's N).
    return "accelerate launch", None if "MASTER_ADDR" in environ else 1


def _parent_command_line() -> list[str]:
    """The parent process's arguments (Linux); [] where /proc cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []
