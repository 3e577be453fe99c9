"""How many processes train: what the launcher asked for, what the trainer trains on, and the process group. Two faults
are never silent (docs/distributed.md):

- a process group of N > 1 processes that the trainer does not train in parallel (``torchrun`` on a CPU without
  ``use_cpu=True``: transformers sets up the group, then trains NOT_PARALLEL, each process alone) while the loss
  gathers across devices: every anchor would meet the other processes' copies of its own batch as negatives.
  :func:`check_trained_in_parallel` (``prepare_trainer``) and :func:`check_process_group` (the loss's first training
  step) refuse it, naming ``use_cpu=True`` and the command that works;
- a launcher that asked for more processes than started (``accelerate launch --cpu --num_processes 2`` starts one):
  :func:`count_processes` reads it and ``prepare_trainer`` warns, naming a working command.

What each launcher leaves in the environment of the processes it starts (read in accelerate 1.16's
``commands/launch.py`` and ``utils/launch.py``, and observed with it and torch 2.14's torchrun):

- ``torchrun --nproc_per_node N`` (and ``accelerate launch --multi_gpu --num_processes N``, which runs torchrun's code
  and starts N processes also on a machine without a GPU): ``WORLD_SIZE=N``, ``LOCAL_WORLD_SIZE=N``, ``RANK``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` ...
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
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
ACCELERATE_NUM_PROCESSES_FLAGS = ("--num_processes", "--num-processes")  # accelerate takes both spellings
# On a machine without a GPU: which launches start several processes, and what the script needs then (checked with
# accelerate 1.16.0 and torch 2.14.1, docs/distributed.md).
CPU_NOTE = (
    "on a CPU the training arguments need use_cpu=True (Accelerator(cpu=True) in a loop of your own), and accelerate "
    "launch starts several processes only with --multi_gpu (with --cpu it starts one)"
)


def working_command(count: int | str, argv: Sequence[str] | None = None, gpus: int | None = None) -> str:
    """The command that starts ``count`` processes of this script (``argv``, default ``sys.argv``): torchrun on a
    machine without a GPU, ``accelerate launch --multi_gpu`` on GPUs."""
    argv = sys.argv if argv is None else argv
    script = " ".join(shlex.quote(a) for a in argv) or "your_script.py"
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus:
        return f"accelerate launch --multi_gpu --num_processes {count} {script}"
    return f"torchrun --nproc_per_node {count} {script}"


@dataclass(frozen=True)
class ProcessCount:
    """What :func:`count_processes` found; ``record()`` goes into a recipe's results.json beside ``world_size``."""

    launcher: str  # "torchrun", "mpirun", "accelerate launch", "a launcher" (WORLD_SIZE alone) or "python" (none)
    requested: int | None  # None: more than one, but the count reached this process nowhere
    actual: int
    summary: str  # "training on 2 processes (world size 2, rank 0 prints)"
    warning: str | None  # only when the launcher asked for more processes than this run has: why, and what works

    def record(self) -> dict[str, Any]:
        return {"launcher": self.launcher, "requested": self.requested, "actual": self.actual}

    def announce(self, warn: bool = True) -> None:
        """The summary on stdout and (``warn``) the warning, if any, on stderr."""
        print(self.summary, flush=True)
        if warn and self.warning:
            print(f"warning: {self.warning}", file=sys.stderr, flush=True)


def count_processes(
    actual: int,
    *,
    gpus: int | None = None,
    environ: Mapping[str, str] | None = None,
    launcher_argv: Sequence[str] | None = None,
    argv: Sequence[str] | None = None,
) -> ProcessCount:
    """Compare the processes the launcher asked for (read from ``environ``, default ``os.environ``) with ``actual``,
    the processes that train. ``gpus``: CUDA devices of this machine (default: counted), which decide the command the
    warning names (torchrun on a CPU, ``accelerate launch --multi_gpu`` on GPUs). ``launcher_argv``: the command line
    of accelerate's simple launcher (default: the parent process's, read from /proc), the one place its N is;
    ``argv``: this script's command line (default ``sys.argv``), repeated in the command the warning names."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    gpus = torch.cuda.device_count() if gpus is None else gpus
    launcher, requested = _requested_processes(environ, launcher_argv, script=argv[0] if argv else "")
    plural = "process" if actual == 1 else "processes"
    summary = f"training on {actual} {plural} (world size {actual}{', rank 0 prints' if actual > 1 else ''})"
    warning = None
    if (requested is None and actual == 1) or (requested is not None and requested > actual):
        count = str(requested) if requested is not None else "N"
        if gpus:
            why = "; accelerate launch starts one process per GPU with --multi_gpu" + (
                f" (this machine has {gpus})" if requested is None or gpus < requested else ""
            )
        else:
            why = f"; {CPU_NOTE}"
        asked = f"{requested} processes" if requested is not None else "more than one process (--num_processes)"
        warning = (
            f"{launcher} asked for {asked}, but this run trains on {actual}{why}. To train on {count} processes:\n"
            f"    {working_command(count, argv, gpus)}"
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


# ----- the process group against the processes that train -----


def process_group_size() -> int:
    """The size of torch.distributed's default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gathers_across_devices(loss: Any) -> bool:
    """Whether any module of the loss tree (a loss, a wrapper, a dict of losses) gathers across devices: the attribute
    sentence-transformers' losses (MNRL, CMNRL, ...) and this project's have alike."""
    roots = loss.values() if isinstance(loss, dict) else [loss]
    for root in roots:
        for module in root.modules() if isinstance(root, torch.nn.Module) else [root]:
            if getattr(module, "gather_across_devices", False) is True:
                return True
    return False


def unparallel_process_group_message(group_size: int, trained: int, who: str, argv: Sequence[str] | None = None) -> str:
    """Why a process group of ``group_size`` processes trained as ``trained`` is wrong with a gathering loss, and the
    fix."""
    return (
        f"{who}: torch.distributed has a process group of {group_size} processes, but the trainer trains on {trained} "
        "(transformers' parallel mode NOT_PARALLEL: each process trains a model of its own on the same batches), while "
        "the loss gathers across devices (gather_across_devices=True): every anchor would meet the other processes' "
        "copies of its own batch as negatives, and the processes would end with different parameters. On a CPU, "
        "transformers trains the processes together only with use_cpu=True: pass it to the training arguments "
        "(SentenceTransformerTrainingArguments(..., use_cpu=True); Accelerator(cpu=True) in a loop of your own), and "
        f"launch with:\n    {working_command(group_size, argv)}\nor train one process (python your_script.py)."
    )


def check_trained_in_parallel(loss: Any, trained: int, who: str = "prepare_trainer") -> None:
    """Refuse a process group of N > 1 processes that train as ``trained`` == 1 process when ``loss`` gathers across
    devices: a RuntimeError naming ``use_cpu=True`` and the command that works. (Without gathering each process
    trains a model of its own: :func:`warn_fewer_processes` says so for the launchers' processes.) Host facts only."""
    group_size = process_group_size()
    if group_size > 1 and trained <= 1 and gathers_across_devices(loss):
        raise RuntimeError(unparallel_process_group_message(group_size, trained, who))


def accelerate_trains_unparallel() -> bool:
    """Whether accelerate's state (set up by transformers' TrainingArguments or an ``Accelerator``) says NOT
    distributed while a process group of several processes exists: transformers' and accelerate's loops then train
    every process alone. False when accelerate was never set up (a loop of plain torch: DDP or FSDP by hand)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState._shared_state
    return bool(state) and state.get("distributed_type") == DistributedType.NO and process_group_size() > 1


def check_process_group(gathers: bool, who: str) -> None:
    """The loss's first-training-step check (once, host facts only): refuse a loss that gathers across devices
    (``gathers``) whose processes accelerate (hence transformers' trainer, or an ``Accelerator`` loop) trains each
    alone."""
    if gathers and accelerate_trains_unparallel():
        raise RuntimeError(unparallel_process_group_message(process_group_size(), 1, who))


def warn_fewer_processes(actual: int, who: str = "prepare_trainer") -> ProcessCount:
    """Warn (UserWarning) when the launcher asked for more processes than the ``actual`` that train, naming a working
    command; returns the count."""
    count = count_processes(actual)
    if count.warning:
        warnings.warn(f"{who}: {count.warning}", stacklevel=3)
    return count


__all__ = [
    "ProcessCount",
    "check_process_group",
    "check_trained_in_parallel",
    "count_processes",
    "gathers_across_devices",
    "warn_fewer_processes",
    "working_command",
]
