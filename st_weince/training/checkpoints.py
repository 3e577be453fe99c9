"""The one persistence format of a loss's state, the record: ``{"format", "global_step", "entries", "loss"}``, JSON
data, in every checkpoint's ``trainer_state.json`` or, for a loop of your own, in a file (:func:`save_loss_state`) or
your checkpoints (:func:`loss_state_record`). ``loss`` names the loss classes and configuration, which a resume
compares with its loss (docs/training.md, "Checkpoints: the loss state cannot go missing").
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from typing import Any

import torch
from torch import Tensor, nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from st_weince.training.loss_tensors import (
    LossTree,
    check_finite_loss_state,
    load_loss_state_dict,
    loss_state_dict,
    state_tensors,
)
from st_weince.training.protocol import LossState

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
LOSS_STATE_RECORD = "LossStateRecord"  # the key of the loss state in trainer_state.json's "stateful_callbacks"
_RECORD_FORMAT = 1


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


def loss_state_record(loss: LossTree, global_step: int = 0) -> dict[str, Any]:
    """The loss state of ``global_step`` as a record (JSON data), with the loss description that a resume is compared
    with; refuses non-finite values."""
    values = loss_state_dict(loss)
    check_finite_loss_state(values, f"loss state at step {global_step}")
    return {
        "format": _RECORD_FORMAT,
        "global_step": global_step,
        "entries": _encode(values),
        "loss": loss_description(loss),  # compared at resume, before anything is loaded
    }


def record_loss_state(record: Any, source: str) -> tuple[int, dict[str, Tensor]]:
    """(global step, state) of a record."""
    if not isinstance(record, dict) or record.get("format") != _RECORD_FORMAT:
        raise ValueError(f"{source}: the loss-state record is corrupt or of an unknown format")
    step = record.get("global_step", -1)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(
            f"{source}: the loss-state record is corrupt: its field 'global_step' must be an integer (the training "
            f"step it was written at), got {type(step).__name__} {step!r}"
        )
    return step, _decode(record.get("entries"), source)


def restore_loss_state(loss: LossTree, record: Any, source: str = "the loss-state record") -> int:
    """Copy a record's state into the loss (its names and shapes must fit); returns its global step. A resume that must
    also refuse another loss configuration checks the record first (:func:`check_record_resumable`)."""
    step, values = record_loss_state(record, source)
    load_loss_state_dict(loss, values, source=source)
    return step


def _loss_modules(loss: LossTree) -> dict[str, nn.Module]:
    """Every module of the loss tree but the model's (which the trainer checkpoints itself: a loss, and each wrapper,
    keeps it as ``self.model``), by its path ("loss" for the top one; "{dataset}" for a dict of losses)."""
    roots = loss if isinstance(loss, dict) else {"": loss}
    modules: dict[str, nn.Module] = {}
    for root_name, root in roots.items():
        models = [parent._modules["model"] for parent in root.modules() if parent._modules.get("model") is not None]
        model_modules = {id(m) for model in models for m in model.modules()}
        for name, module in root.named_modules():
            if id(module) not in model_modules:
                modules[".".join(part for part in (root_name, name) if part) or "loss"] = module
    return modules


def _as_json(description: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """As the description reads back from JSON (tuples as lists; anything else JSON cannot hold as its text)."""
    return json.loads(json.dumps(description, default=str))


def loss_description(loss: LossTree) -> dict[str, dict[str, Any]]:
    """The class of every module of the loss tree but the model's and the loss modules'
    :meth:`~st_weince.training.protocol.LossState.resume_config`, as JSON data: what a record is written under and a
    resume compares, by :func:`_loss_modules`' keys."""
    description: dict[str, dict[str, Any]] = {}
    for key, module in _loss_modules(loss).items():
        description[key] = {"class": type(module).__name__}
        if isinstance(module, LossState):
            description[key]["config"] = module.resume_config()
    return _as_json(description)


def _saved_description_read_now(saved: dict[str, Any], loss: LossTree) -> dict[str, Any]:
    """A checkpoint's loss description with each loss module's configuration as this version reads it (a loss of
    the same class at the same key fills in the defaults of options added since; ``resume_config``)."""
    modules = _loss_modules(loss)
    read: dict[str, Any] = {}
    for key, entry in saved.items():
        module = modules.get(key)
        if (
            isinstance(module, LossState)
            and isinstance(entry, dict)
            and entry.get("class") == type(module).__name__
            and isinstance(entry.get("config"), dict)
        ):
            entry = {**entry, "config": module.resume_config(entry["config"])}
        read[key] = entry
    return _as_json(read)


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
            old_config, new_config = before.get("config") or {}, now.get("config") or {}
            options = [
                f"{option}={old_config.get(option)!r} in the checkpoint, {new_config.get(option)!r} now"
                for option in sorted(set(old_config) | set(new_config))
                if old_config.get(option) != new_config.get(option)
            ]
            changes.append(f"{key} ({now['class']}): " + "; ".join(options))
    return "; ".join(changes) if changes else None


def stored_record(stateful_callbacks: Any, source: str = TRAINER_STATE_FILE) -> dict[str, Any] | None:
    """The loss-state record among a trainer state's ``stateful_callbacks`` (the first of several), or None. An entry
    that is not ``{"args": {"output_dir": ...}, "attributes": {...}}`` (or a list of such), as
    :class:`~st_weince.training.callbacks.LossStateRecord` writes it, is refused naming ``source`` and the entry:
    transformers' callback restore would fail on it with an AttributeError that names neither."""
    if stateful_callbacks is None:
        return None
    if not isinstance(stateful_callbacks, dict):
        raise ValueError(
            f"{source}: its 'stateful_callbacks' is corrupt (expected a mapping of callback names to their states, got "
            f"{type(stateful_callbacks).__name__} {_shortened(stateful_callbacks)})"
        )
    entry = stateful_callbacks.get(LOSS_STATE_RECORD)
    for part in entry if isinstance(entry, list) else [] if entry is None else [entry]:
        args, attributes = (part.get("args", {}), part.get("attributes", {})) if isinstance(part, dict) else (0, 0)
        if not (isinstance(args, dict) and set(args) <= {"output_dir"} and isinstance(attributes, dict)):
            raise ValueError(
                f"{source}: its loss-state entry stateful_callbacks[{LOSS_STATE_RECORD!r}] is corrupt (expected "
                "{'args': {'output_dir': ...}, 'attributes': {...}} as st_weince.training.prepare_trainer writes it, "
                f"got {type(entry).__name__} {_shortened(entry)}). The checkpoint's loss state cannot be read: resume "
                "from another checkpoint, or restore the file from a copy"
            )
    if isinstance(entry, list):
        entry = entry[0] if entry else None
    return entry.get("attributes") if isinstance(entry, dict) else None


def _shortened(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _checkpoint_record(checkpoint: str, consequence: str = "") -> tuple[str, Any]:
    """(path of the checkpoint's ``trainer_state.json``, its loss-state record or None); FileNotFoundError /
    ValueError naming the file when it is missing, empty or unreadable, followed by ``consequence``."""
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    content, problem = _read_trainer_state(path)
    if problem is not None:
        raise (FileNotFoundError if problem == "is missing" else ValueError)(
            f"{path} {problem}: this checkpoint is incomplete (was the run killed while saving it?){consequence}"
        )
    return path, stored_record(content.get("stateful_callbacks"), path)


def read_checkpoint_loss_state(checkpoint: str | os.PathLike) -> dict[str, Tensor] | None:
    """The loss state that :func:`prepare_trainer` stored in ``checkpoint/trainer_state.json``, or None when that
    file holds none; FileNotFoundError / ValueError naming the file when it is missing, empty or corrupt."""
    path, record = _checkpoint_record(os.fspath(checkpoint))
    return None if record is None else record_loss_state(record, path)[1]


def _read_json(path: str) -> tuple[Any, str | None]:
    """``(content, None)`` of the JSON file at ``path``, or ``(None, why it cannot be read)``."""
    if not os.path.isfile(path):
        return None, "is missing"
    if os.path.getsize(path) == 0:
        return None, "is empty"
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"is corrupt, not readable JSON ({error})"


def _read_trainer_state(path: str) -> tuple[Any, str | None]:
    """``(content, None)`` of the ``trainer_state.json`` at ``path``, or ``(None, why it cannot be resumed from)``."""
    content, problem = _read_json(path)
    if problem is None and not (isinstance(content, dict) and "global_step" in content):
        return None, "is not a trainer state"
    return content, problem


_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # as transformers.trainer_utils._re_checkpoint


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The highest-numbered ``checkpoint-N`` in ``output_dir`` whose ``trainer_state.json`` is readable, or None. The
    trainer writes that file last, so a run killed while saving leaves a folder without it, which
    ``resume_from_checkpoint=True`` would pick and transformers refuse. Only names that are exactly ``checkpoint-N``
    count, as for the trainer (a copy named ``checkpoint-5-old`` is no checkpoint). Nothing is renamed or deleted."""
    output_dir = os.fspath(output_dir)
    steps = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = _CHECKPOINT_NAME.match(name)
        folder = os.path.join(output_dir, name)
        if match and os.path.isdir(folder):
            _, problem = _read_trainer_state(os.path.join(folder, TRAINER_STATE_FILE))
            if problem is None:
                steps.append((int(match.group(1)), folder))
            else:
                logger.info("%s %s: skipped as incomplete", os.path.join(folder, TRAINER_STATE_FILE), problem)
    return max(steps)[1] if steps else None


def check_record_resumable(loss: LossTree, record: Any, source: str, allow_missing_loss_state: bool = False) -> None:
    """Refuse a checkpoint's loss-state ``record`` (read from ``source``) written under another loss class or
    configuration (ValueError naming what differs) or, for a loss with parameters, a missing one (FileNotFoundError,
    unless ``allow_missing_loss_state``)."""
    saved = record.get("loss") if isinstance(record, dict) else None
    if isinstance(saved, dict):
        change = describe_loss_change(_saved_description_read_now(saved, loss), loss_description(loss))
        if change is not None:
            raise ValueError(
                f"{source} was written under another loss configuration than this trainer's loss ({change}). "
                "Its loss state and optimizer state belong to that loss: resume with the loss it was written with, "
                "or start a new run in another output_dir."
            )
    elif record is None and state_tensors(loss) and not allow_missing_loss_state:
        raise FileNotFoundError(
            f"{source} holds no st-weince loss state (stateful_callbacks[{LOSS_STATE_RECORD!r}] is missing): the "
            "checkpoint was written without st_weince.training.prepare_trainer, or under a loss without parameters. "
            f"Resuming would restart the loss parameters {sorted(state_tensors(loss))} from their current values "
            "while their optimizer state is restored. To do that knowingly (their optimizer state is then reset), "
            "call prepare_trainer(trainer, allow_missing_loss_state=True)."
        )


def check_resumable(loss: LossTree, checkpoint: str | os.PathLike, allow_missing_loss_state: bool = False) -> None:
    """Refuse, naming the cause, a checkpoint folder this loss cannot resume from, without loading anything: an
    incomplete ``trainer_state.json`` (missing, empty or unreadable) and the cases of :func:`check_record_resumable`.
    For a script that wants the answer before it builds a trainer; ``prepare_trainer`` checks on resume itself."""
    checkpoint = os.fspath(checkpoint)
    _, record = _checkpoint_record(checkpoint, " and cannot be resumed from")
    check_record_resumable(loss, record, checkpoint, allow_missing_loss_state)


#: The file of :func:`save_loss_state` (training loops of your own): the record, as JSON.
LOSS_STATE_FILE = "st_weince_loss_state.json"


def save_loss_state(loss: LossTree, directory: str | os.PathLike, global_step: int = 0) -> str | None:
    """Write :func:`loss_state_record` to ``directory/st_weince_loss_state.json`` atomically (a reader, or a kill,
    sees the old file or the complete new one); returns the path, or None for a loss without state of its own."""
    if not state_tensors(loss):
        return None
    record = loss_state_record(loss, global_step)
    path = os.path.join(os.fspath(directory), LOSS_STATE_FILE)
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{LOSS_STATE_FILE}.", suffix=".tmp", dir=os.fspath(directory))
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(record, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return path


def load_loss_state(loss: LossTree, directory: str | os.PathLike) -> int | None:
    """Restore the loss state that :func:`save_loss_state` wrote into ``directory``; returns its global step (None
    for a loss without state of its own). The error names the file when it is absent, empty, or does not fit."""
    if not state_tensors(loss):
        return None
    path = os.path.join(os.fspath(directory), LOSS_STATE_FILE)
    record, problem = _read_json(path)
    if problem is not None:
        raise (FileNotFoundError if problem == "is missing" else ValueError)(
            f"{path} {problem}: {directory} holds no readable loss state (was it written completely?)"
        )
    return restore_loss_state(loss, record, path)
