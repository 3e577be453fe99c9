"""The loss's record in a checkpoint (``trainer_state.json``, see :mod:`st_weince.training.loss_state`), and whether a
loss can resume from a checkpoint.

A checkpoint whose ``trainer_state.json`` is missing, empty or unreadable (a run killed while saving) can never be
resumed from; :func:`last_complete_checkpoint` finds the last one that can (nothing is renamed). The record also
names the loss class and configuration; on resume :func:`check_record_resumable` refuses a checkpoint of another loss
with that reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import torch
from torch import Tensor, nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from st_weince.losses.options import fold_flat_options
from st_weince.training.loss_tensors import check_finite_loss_state, loss_state_dict, losses_by_prefix, own_tensors
from st_weince.utils.options import options_config

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
LOSS_STATE_RECORD = "LossStateRecord"  # the key of the loss state in trainer_state.json's "stateful_callbacks"
_RECORD_FORMAT = 1
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # as transformers.trainer_utils._re_checkpoint


def _encode(state: dict[str, Tensor]) -> dict[str, dict[str, Any]]:
    """JSON-able form: float32 / float64 values become Python floats, which JSON stores exactly."""
    return {
        name: {
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "values": value.flatten().tolist(),
        }
        for name, value in state.items()
    }


def _decode(entries: Any, source: str) -> dict[str, Tensor]:
    if not isinstance(entries, dict):
        raise ValueError(
            f"{source}: the loss state is corrupt (expected a mapping of entries, got {type(entries).__name__})"
        )
    state = {}
    for name, entry in entries.items():
        try:
            dtype = getattr(torch, entry["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise TypeError(entry["dtype"])
            state[name] = torch.tensor(entry["values"], dtype=dtype).reshape(entry["shape"])
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as error:
            message = f"{source}: loss state entry {name!r} is corrupt ({type(error).__name__}: {error})"
            raise ValueError(message) from None
    return state


def loss_state_record(loss: nn.Module | dict[str, nn.Module], global_step: int) -> dict[str, Any]:
    """The loss state of ``global_step`` as the record kept in ``trainer_state.json`` (read by
    :func:`record_loss_state`), with the loss description that a resume is compared with; refuses non-finite values."""
    values = loss_state_dict(loss)
    check_finite_loss_state(values, f"checkpoint at step {global_step}")
    return {
        "format": _RECORD_FORMAT,
        "global_step": global_step,
        "entries": _encode(values),
        "loss": loss_description(loss),  # compared at resume, before anything is loaded
    }


def record_loss_state(record: Any, source: str) -> tuple[int, dict[str, Tensor]]:
    """(global step, state) of a LossStateRecord's exported state read from trainer_state.json."""
    attributes = record.get("attributes") if isinstance(record, dict) else None
    if not isinstance(attributes, dict) or attributes.get("format") != _RECORD_FORMAT:
        raise ValueError(
            f"{source}: the entry stateful_callbacks[{LOSS_STATE_RECORD!r}] is corrupt or of an unknown format"
        )
    return int(attributes.get("global_step", -1)), _decode(attributes.get("entries"), source)


# Options that change how a loss is computed in memory, not what it computes: they may differ at resume.
_OPERATIONAL_OPTIONS = frozenset(
    {"check_inputs", "show_progress_bar", "mini_batch_size", "mini_batch_num_tokens", "chunk_size"}
)


def _configuration(module: nn.Module) -> dict[str, Any]:
    """A loss module's configuration as constructed: its options objects (this project's losses; the starting values,
    not the trained ones, which are the loss state), else its ``get_config_dict()``."""
    options = getattr(module, "options", None)
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        config = options_config(options)
        cache_options = getattr(module, "cache_options", None)
        if dataclasses.is_dataclass(cache_options) and not isinstance(cache_options, type):
            config.update(options_config(cache_options))
    elif callable(getattr(module, "get_config_dict", None)):
        config = module.get_config_dict()
    else:
        config = {}
    return {name: value for name, value in config.items() if name not in _OPERATIONAL_OPTIONS}


def loss_description(loss: nn.Module | dict[str, nn.Module]) -> dict[str, dict[str, Any]]:
    """The class and configuration of every loss module in the loss tree (wrappers such as ``MatryoshkaLoss`` and
    the loss they wrap; not the model), as JSON data: what a checkpoint's loss state is recorded under, and what a
    resume compares it with. Keys: the module's path ("loss" for the top one; "{dataset}" for a dict of losses)."""
    description: dict[str, dict[str, Any]] = {}
    for prefix, top in losses_by_prefix(loss).items():
        model_modules = {
            id(module)
            for parent in top.modules()
            if parent._modules.get("model") is not None
            for module in parent._modules["model"].modules()
        }
        for name, module in top.named_modules():
            if id(module) in model_modules or not (name == "" or callable(getattr(module, "get_config_dict", None))):
                continue
            key = ".".join(part for part in (prefix.rstrip("."), name) if part) or "loss"
            description[key] = {"class": type(module).__name__, "config": _configuration(module)}
    # as it reads back from JSON (tuples as lists; anything else JSON cannot hold as its text)
    return json.loads(json.dumps(description, default=str))


def describe_loss_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between two :func:`loss_description` results, in words; None when nothing does."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        before, now = saved.get(key), current.get(key)
        if before == now:
            continue
        if before is None:
            changes.append(f"{key}: {now['class']} now, no such loss in the checkpoint")
        elif now is None:
            changes.append(f"{key}: {before['class']} in the checkpoint, no such loss now")
        elif before.get("class") != now["class"]:
            changes.append(f"{key}: {before.get('class')} in the checkpoint, {now['class']} now")
        else:
            # a 0.1 checkpoint records WEINCE's top-M and gate options flat; the same configuration now has one top_m
            # and one gate
            old_config, new_config = before.get("config") or {}, now["config"]
            if now["class"] in ("WEINCELoss", "CachedWEINCELoss"):
                old_config = fold_flat_options(old_config)
            if old_config == new_config:
                continue
            options = [
                f"{option}={old_config.get(option)!r} in the checkpoint, {new_config.get(option)!r} now"
                for option in sorted(set(old_config) | set(new_config))
                if old_config.get(option) != new_config.get(option)
            ]
            changes.append(f"{key} ({now['class']}): " + "; ".join(options))
    return "; ".join(changes) if changes else None


def stored_record(stateful_callbacks: dict[str, Any] | None) -> Any:
    """The loss-state record among a trainer state's ``stateful_callbacks`` (the first of several), or None."""
    record = (stateful_callbacks or {}).get(LOSS_STATE_RECORD)
    if isinstance(record, list):
        record = record[0] if record else None
    return record


def _checkpoint_record(checkpoint: str, consequence: str = "") -> tuple[str, Any]:
    """(path of the checkpoint's ``trainer_state.json``, its loss-state record or None); FileNotFoundError /
    ValueError naming the file when it is missing, empty or unreadable, followed by ``consequence``."""
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    problem = _trainer_state_problem(path)
    if problem is not None:
        raise (FileNotFoundError if problem == "is missing" else ValueError)(
            f"{path} {problem}: this checkpoint is incomplete (was the run killed while saving it?){consequence}"
        )
    with open(path, encoding="utf-8") as handle:
        return path, stored_record(json.load(handle).get("stateful_callbacks"))


def missing_loss_state_error(source: str, loss: nn.Module | dict[str, nn.Module]) -> FileNotFoundError:
    """The error for a checkpoint without loss state, resumed by a loss with parameters of its own."""
    return FileNotFoundError(
        f"{source} holds no st-weince loss state (stateful_callbacks[{LOSS_STATE_RECORD!r}] is missing): the "
        "checkpoint was written without st_weince.training.prepare_trainer, or under a loss without parameters. "
        f"Resuming would restart the loss parameters {sorted(own_tensors(loss))} from their current values while "
        "their optimizer state is restored. To do that knowingly (their optimizer state is then reset), call "
        "prepare_trainer(trainer, allow_missing_loss_state=True)."
    )


def read_checkpoint_loss_state(checkpoint: str | os.PathLike) -> dict[str, Tensor] | None:
    """The loss state that :func:`prepare_trainer` stored in ``checkpoint/trainer_state.json``, or None when that
    file holds none (a checkpoint written without prepare_trainer, or of a loss without state of its own).

    Raises FileNotFoundError / ValueError naming the file when it is missing, empty or corrupt."""
    path, record = _checkpoint_record(os.fspath(checkpoint))
    return None if record is None else record_loss_state(record, path)[1]


def _trainer_state_problem(path: str) -> str | None:
    """Why ``trainer_state.json`` at ``path`` cannot be resumed from, or None if it is readable."""
    if not os.path.isfile(path):
        return "is missing"
    if os.path.getsize(path) == 0:
        return "is empty"
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"is not readable JSON ({error})"
    if not isinstance(content, dict) or "global_step" not in content:
        return "is not a trainer state"
    return None


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The highest-numbered ``checkpoint-N`` in ``output_dir`` whose ``trainer_state.json`` is readable, or None.

    ``train(resume_from_checkpoint=True)`` takes the highest-numbered ``checkpoint-N`` folder, complete or not; the
    trainer writes ``trainer_state.json`` last, so a run killed while saving leaves a folder without it, from which
    transformers refuses to resume (``FileNotFoundError``). ``trainer.train(resume_from_checkpoint=
    last_complete_checkpoint(args.output_dir))`` resumes from the last complete one instead, and starts afresh when
    there is none. Nothing is renamed or deleted."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_NAME.match(name)
        folder = os.path.join(output_dir, name)
        if match and os.path.isdir(folder):
            problem = _trainer_state_problem(os.path.join(folder, TRAINER_STATE_FILE))
            if problem is None:
                steps.append((int(match.group(1)), folder))
            else:
                logger.info("%s %s: skipped as incomplete", os.path.join(folder, TRAINER_STATE_FILE), problem)
    return max(steps)[1] if steps else None


def check_record_resumable(
    loss: nn.Module | dict[str, nn.Module], record: Any, source: str, allow_missing_loss_state: bool = False
) -> None:
    """Refuse, naming the cause, a checkpoint's loss-state ``record`` (read from ``source``) that this loss cannot
    resume from:

    - written under another loss class or configuration: ValueError naming what differs;
    - for a loss with parameters, no loss state at all (unless ``allow_missing_loss_state``): FileNotFoundError.
    """
    attributes = record.get("attributes") if isinstance(record, dict) else None
    saved = attributes.get("loss") if isinstance(attributes, dict) else None
    if isinstance(saved, dict):
        change = describe_loss_change(saved, loss_description(loss))
        if change is not None:
            raise ValueError(
                f"{source} was written under another loss configuration than this trainer's loss ({change}). "
                "Its loss state and optimizer state belong to that loss: resume with the loss it was written with, "
                "or start a new run in another output_dir."
            )
    elif record is None and own_tensors(loss) and not allow_missing_loss_state:
        raise missing_loss_state_error(source, loss)


def check_resumable(
    loss: nn.Module | dict[str, nn.Module], checkpoint: str | os.PathLike, allow_missing_loss_state: bool = False
) -> None:
    """Refuse, naming the cause, a checkpoint folder this loss cannot resume from, without loading anything:

    - a ``trainer_state.json`` that is missing, empty or unreadable (an interrupted save): FileNotFoundError /
      ValueError naming it;
    - the cases of :func:`check_record_resumable`.

    ``prepare_trainer`` runs the record check itself when the trainer resumes (at ``on_train_begin``); this is for a
    script that wants the answer before it builds a trainer.
    """
    checkpoint = os.fspath(checkpoint)
    path, record = _checkpoint_record(checkpoint, " and cannot be resumed from")
    check_record_resumable(loss, record, checkpoint, allow_missing_loss_state)
