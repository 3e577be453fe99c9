"""How many processes train: what the launcher asked for, what the trainer trains on, and the process group. Two faults
are never silent (docs/distributed.md): a process group that the trainer trains one process at a time (``torchrun`` on
a CPU without ``use_cpu=True``) while the loss gathers across devices, so that every anchor would meet the other
processes' copies of its batch as negatives (refused by :func:`check_trained_in_parallel` in ``prepare_trainer`` and
by :func:`check_process_group` at the loss's first training step); and a launcher that asked for more processes than
started (:func:`count_processes`; ``prepare_trainer`` warns), both naming a command that works.
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
    """Compare the processes the launcher asked for (read from ``environ``) with ``actual``, the processes that train.
    ``gpus`` (default: counted) decides the command the warning names; ``launcher_argv``: the command line of
    accelerate's simple launcher (default: the parent process's), the one place its N is; ``argv``: this script's."""
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
        else:  # checked with accelerate 1.16.0 and torch 2.14.1 (docs/distributed.md)
            why = (
                "; on a CPU the training arguments need use_cpu=True (Accelerator(cpu=True) in a loop of your own), "
                "and accelerate launch starts several processes only with --multi_gpu (with --cpu it starts one)"
            )
        asked = f"{requested} processes" if requested is not None else "more than one process (--num_processes)"
        warning = (
            f"{launcher} asked for {asked}, but this run trains on {actual}{why}. To train on {count} processes:\n"
            f"    {working_command(count, argv, gpus)}"
        )
    return ProcessCount(launcher=launcher, requested=requested, actual=actual, summary=summary, warning=warning)


def _requested_processes(
    environ: Mapping[str, str], launcher_argv: Sequence[str] | None, script: str
) -> tuple[str, int | None]:
    """``(launcher, processes it asked for)`` from what each launcher leaves in the environment (read in accelerate
    1.16's ``commands/launch.py`` and ``utils/launch.py``, observed with torch 2.14's torchrun): torchrun, and
    ``accelerate launch --multi_gpu`` which runs its code, ``WORLD_SIZE`` (and ``TORCHELASTIC_RUN_ID``); mpirun one of
    ``MPI_SIZE_VARIABLES``; accelerate's simple launcher (``--cpu``, or no ``--multi_gpu`` below 2 GPUs)
    ``ACCELERATE_USE_CPU`` and, only when asked for more than one process, ``MASTER_ADDR``: no variable carries N."""
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


def unparallel_process_group_message(group_size: int, trained: int, who: str) -> str:
    """Why a process group of ``group_size`` processes trained as ``trained`` is wrong with a gathering loss, and the
    fix."""
    return (
        f"{who}: torch.distributed has a process group of {group_size} processes, but the trainer trains on {trained} "
        "(transformers' parallel mode NOT_PARALLEL: each process trains a model of its own on the same batches), while "
        "the loss gathers across devices (gather_across_devices=True): every anchor would meet the other processes' "
        "copies of its own batch as negatives, and the processes would end with different parameters. On a CPU, "
        "transformers trains the processes together only with use_cpu=True: pass it to the training arguments "
        "(SentenceTransformerTrainingArguments(..., use_cpu=True); Accelerator(cpu=True) in a loop of your own), and "
        f"launch with:\n    {working_command(group_size)}\nor train one process (python your_script.py)."
    )


def check_trained_in_parallel(loss: Any, trained: int, who: str = "prepare_trainer") -> None:
    """Refuse a process group of N > 1 processes that train as ``trained`` == 1 process when a module of the loss tree
    gathers across devices (the attribute of sentence-transformers' losses and this project's alike). Host facts."""
    group_size = process_group_size()
    if group_size <= 1 or trained > 1:
        return
    roots = loss.values() if isinstance(loss, dict) else [loss]
    modules = [m for root in roots for m in (root.modules() if isinstance(root, torch.nn.Module) else [root])]
    if any(getattr(module, "gather_across_devices", False) is True for module in modules):
        raise RuntimeError(unparallel_process_group_message(group_size, trained, who))


def accelerate_trains_unparallel() -> bool:
    """Whether accelerate's state says NOT distributed beside a process group of several processes (then the trainer
    and ``Accelerator`` loops train each process alone); False without accelerate (DDP or FSDP by hand)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState._shared_state
    return bool(state) and state.get("distributed_type") == DistributedType.NO and process_group_size() > 1


def check_process_group(gathers: bool, who: str) -> None:
    """The loss's first-training-step check (once, host facts only): refuse a gathering loss whose processes
    accelerate trains each alone."""
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
    "warn_fewer_processes",
    "working_command",
]
