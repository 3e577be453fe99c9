"""Trainer integration for losses WITH parameters (RB-Sigmoid's ``log_t``, ``b_rel`` ...), in one call.

The sentence-transformers trainer puts a loss's parameters into its optimizer, but:

1. under DDP only the model is wrapped, so the loss parameters' gradients are not averaged across processes;
2. checkpoints hold only the model, so a resumed run restarts the loss parameters from their initial values;
3. weight decay reaches every parameter whose name does not look like a bias or a norm (``log_t``, ``b_rel``);
4. the loss parameters train at the model's learning rate, at which fine-tuning leaves them almost where they start.

:func:`prepare_trainer` fixes all four, through wrappers too (``MatryoshkaLoss``, ``Matryoshka2dLoss``,
``AdaptiveLayerLoss``: the loss's "own" tensors are every parameter and buffer in the loss's module tree that is not
a tensor of a ``model`` child, whatever the prefix), and attaches the statistics logging of
:mod:`st_weince.training.statistics`.

How the loss state travels with checkpoints (transformers 5 ``Trainer``): ``_save_checkpoint`` writes the model,
the optimizer, the RNG states and, last, ``trainer_state.json``, which holds the state of every callback that is an
``ExportableState`` (the documented way for callbacks to keep state in checkpoints). :class:`LossStateRecord` is
such a callback: its ``state()``, called by the trainer while it writes ``trainer_state.json``, is the loss state.
So the loss state is inside the one file without which the trainer cannot resume from a checkpoint at all: there is
no moment at which a checkpoint has ``trainer_state.json`` but not the loss state. On resume the trainer loads that
file into ``trainer.state`` before ``on_train_begin``, where :class:`LossStateCallback` copies the loss state back
(nothing patches ``trainer.train``; the resume path need not be known). A checkpoint whose ``trainer_state.json``
is missing, empty or unreadable (a run killed while saving) can never be resumed from; ``prepare_trainer`` renames
such folders in ``output_dir`` to ``incomplete-checkpoint-N`` so that ``resume_from_checkpoint=True`` picks the
last complete one. The record also names the loss class and configuration; the trainer's ``_load_from_checkpoint``,
which ``train()`` calls before it loads the optimizer, first runs :func:`check_resumable`, which refuses a checkpoint
of another loss (or a set-aside one) with that reason.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import re
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from st_weince.training.setup_checks import check_trainer_setup
from st_weince.training.statistics import LossStatisticsCallback, log_loss_statistics
from st_weince.training.trained_values import TrainedValuesCallback, carry_trained_values, rb_sigmoid_losses
from st_weince.utils.options import options_config

logger = logging.getLogger(__name__)

#: File written by :func:`save_loss_state` (custom training loops; the trainer integration keeps the loss state in
#: ``trainer_state.json`` instead, see the module docstring).
LOSS_STATE_FILE = "st_weince_loss_state.pt"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
LOSS_STATE_RECORD = "LossStateRecord"  # the key of the loss state in trainer_state.json's "stateful_callbacks"
INCOMPLETE_PREFIX = "incomplete-"
_RECORD_FORMAT = 1
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # as transformers.trainer_utils._re_checkpoint

#: Learning rate of the loss's own parameters set by :func:`prepare_trainer` (chosen by measurement:
#: benchmarks/loss_learning_rate.py, docs/training.md).
DEFAULT_LOSS_LEARNING_RATE = 3e-2


# ----- which tensors belong to the loss -----
def _losses(loss: nn.Module | dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``{prefix: loss}``: one entry with prefix "" for a single loss, one per dataset name for a dict of losses
    (the trainer names their parameters ``"{dataset name}.{name}"``)."""
    if isinstance(loss, dict):
        return {f"{name}.": module for name, module in loss.items()}
    return {"": loss}


def _model_tensor_ids(loss: nn.Module) -> set[int]:
    """Ids of the tensors of every ``model`` child in the loss tree (the sentence-transformers convention: a loss
    stores its model as ``self.model``; wrappers store it again). The trainer checkpoints those itself."""
    ids: set[int] = set()
    for module in loss.modules():
        model = module._modules.get("model")
        if model is not None:
            ids.update(id(t) for t in model.parameters())
            ids.update(id(t) for t in model.buffers())
    return ids


def own_tensors(loss: nn.Module | dict[str, nn.Module], trainable_only: bool = False) -> dict[str, Tensor]:
    """The loss's own parameters and persistent buffers (not the model's), by the names the trainer gives them
    (``log_t``; ``loss.log_t`` under ``MatryoshkaLoss``; ``{dataset}.log_t`` for a dict of losses). The tensors
    themselves, not copies; each once."""
    found: dict[str, Tensor] = {}
    for prefix, module in _losses(loss).items():
        excluded = _model_tensor_ids(module)
        seen: set[int] = set()
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in excluded or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if trainable_only and not (isinstance(tensor, nn.Parameter) and tensor.requires_grad):
                continue
            found[prefix + name] = tensor
    return found


def _own_parameters(loss: nn.Module | dict[str, nn.Module]) -> list[nn.Parameter]:
    return list(own_tensors(loss, trainable_only=True).values())


def no_weight_decay_parameters(loss: nn.Module | dict[str, nn.Module]) -> list[nn.Parameter]:
    """Parameters that must not get weight decay: those named by ``no_weight_decay_parameter_names()`` of any
    module in the loss tree (RBSigmoidLoss: all its own; a wrapper passes its inner loss's through)."""
    params: dict[int, nn.Parameter] = {}
    for module in _losses(loss).values():
        for submodule in module.modules():
            if hasattr(submodule, "no_weight_decay_parameter_names"):
                named = dict(submodule.named_parameters())
                for name in submodule.no_weight_decay_parameter_names():
                    params[id(named[name])] = named[name]
    return list(params.values())


def no_weight_decay_names(loss: nn.Module | dict[str, nn.Module]) -> set[str]:
    """The trainer's names of :func:`no_weight_decay_parameters`."""
    ids = {id(p) for p in no_weight_decay_parameters(loss)}
    return {name for name, p in own_tensors(loss, trainable_only=True).items() if id(p) in ids}


# ----- the loss state as plain data -----
def loss_state_dict(loss: nn.Module | dict[str, nn.Module]) -> dict[str, Tensor]:
    """The loss's own parameters and buffers (:func:`own_tensors`), detached copies on the CPU."""
    return {name: value.detach().cpu().clone() for name, value in own_tensors(loss).items()}


def check_finite_loss_state(state: dict[str, Tensor], where: str) -> None:
    """Raise FloatingPointError naming the entries that are NaN or infinite (they must never be checkpointed)."""
    bad = [name for name, value in state.items() if value.is_floating_point() and not bool(value.isfinite().all())]
    if bad:
        values = {name: state[name].tolist() for name in bad}
        raise FloatingPointError(
            f"{where}: the loss parameters {values} are not finite; training is stopped and they are not written "
            "to a checkpoint. The loss parameters diverged: lower their learning rate "
            "(prepare_trainer(trainer, loss_learning_rate=...)) or the model's, and resume from the last checkpoint."
        )


@torch.no_grad()
def load_loss_state_dict(loss: nn.Module | dict[str, nn.Module], state: dict[str, Tensor], source: str = "") -> None:
    """Copy ``state`` (from :func:`loss_state_dict`) into the loss(es) in place; names and shapes must match."""
    targets = own_tensors(loss)
    where = f" ({source})" if source else ""
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"the saved loss state{where} does not fit this loss: missing {missing}, unexpected {unexpected}. "
            "Was it written with another loss configuration or another wrapper?"
        )
    for name, target in targets.items():
        if tuple(target.shape) != tuple(state[name].shape):
            raise ValueError(
                f"loss state entry {name!r}{where} has shape {tuple(state[name].shape)}, expected {tuple(target.shape)}"
            )
    check_finite_loss_state(state, f"loss state{where}")
    for name, target in targets.items():
        target.copy_(state[name].to(device=target.device, dtype=target.dtype))


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


def _record_state(record: Any, source: str) -> tuple[int, dict[str, Tensor]]:
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
    for prefix, top in _losses(loss).items():
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
            old_config, new_config = before.get("config") or {}, now["config"]
            options = [
                f"{option}={old_config.get(option)!r} in the checkpoint, {new_config.get(option)!r} now"
                for option in sorted(set(old_config) | set(new_config))
                if old_config.get(option) != new_config.get(option)
            ]
            changes.append(f"{key} ({now['class']}): " + "; ".join(options))
    return "; ".join(changes) if changes else None


def read_checkpoint_loss_state(checkpoint: str | os.PathLike) -> dict[str, Tensor] | None:
    """The loss state that :func:`prepare_trainer` stored in ``checkpoint/trainer_state.json``, or None when that
    file holds none (a checkpoint written without prepare_trainer, or of a loss without state of its own).

    Raises FileNotFoundError / ValueError naming the file when it is missing, empty or corrupt."""
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    problem = _trainer_state_problem(path)
    if problem is not None:
        raise (FileNotFoundError if problem == "is missing" else ValueError)(
            f"{path} {problem}: this checkpoint is incomplete (was the run killed while saving it?)"
        )
    with open(path, encoding="utf-8") as handle:
        content = json.load(handle)
    record = (content.get("stateful_callbacks") or {}).get(LOSS_STATE_RECORD)
    if record is None:
        return None
    return _record_state(record, path)[1]


# ----- the loss state as a file (custom training loops) -----
def _atomic_write(path: str, write) -> None:
    """Write through a temporary file in the same folder, flushed to disk, then renamed over ``path``: a reader (or a
    kill) sees the old file or the complete new one, never a partial one."""
    directory = os.path.dirname(path) or "."
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def save_loss_state(loss: nn.Module | dict[str, nn.Module], directory: str | os.PathLike) -> str | None:
    """Write :func:`loss_state_dict` to ``directory/st_weince_loss_state.pt`` atomically; returns the path, or None
    when the loss has no state of its own (nothing is written). Refuses non-finite values (FloatingPointError)."""
    state = loss_state_dict(loss)
    if not state:
        return None
    path = os.path.join(os.fspath(directory), LOSS_STATE_FILE)
    check_finite_loss_state(state, f"writing {path}")
    os.makedirs(directory, exist_ok=True)
    _atomic_write(path, lambda stream: torch.save(state, stream))
    return path


def load_loss_state(loss: nn.Module | dict[str, nn.Module], directory: str | os.PathLike) -> None:
    """Restore the loss state written by :func:`save_loss_state` into ``directory``.

    Raises FileNotFoundError naming the file when it is absent (for a loss with state of its own), and ValueError
    naming it when it is empty or not a loss-state file."""
    path = os.path.join(os.fspath(directory), LOSS_STATE_FILE)
    if not own_tensors(loss):
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: {directory} holds no loss state")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty (0 bytes): the loss state was not written completely")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's own message would suggest weights_only=False: never load untrusted pickles
        raise ValueError(f"{path} is corrupt or not a loss-state file ({type(error).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a loss-state file (expected a mapping of names to tensors)")
    load_loss_state_dict(loss, state, source=path)


# ----- distributed -----
def average_loss_gradients(loss: nn.Module | dict[str, nn.Module]) -> None:
    """Average the gradients of the loss's own trainable parameters over all processes (one all-reduce).

    Call it on every rank after backward and before the optimizer step (``prepare_trainer`` does it for the
    trainer; custom training loops call it themselves). A parameter without gradient on a rank counts as zero, so
    the collective is the same on every rank. No-op without an initialised process group or with one process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = _own_parameters(loss)
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        count = p.numel()
        p.grad = flat[offset : offset + count].view_as(p).to(p.dtype)
        offset += count


# ----- checkpoints -----
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


def set_aside_incomplete_checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """Rename every ``checkpoint-N`` in ``output_dir`` whose ``trainer_state.json`` is missing, empty or unreadable
    (the trainer writes it last, so the save was interrupted) to ``incomplete-checkpoint-N``, which neither
    ``resume_from_checkpoint=True`` nor checkpoint rotation considers. Returns the new paths; logs a warning each."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return []
    moved = []
    for name in sorted(os.listdir(output_dir)):
        folder = os.path.join(output_dir, name)
        if not (_CHECKPOINT_NAME.match(name) and os.path.isdir(folder)):
            continue
        problem = _trainer_state_problem(os.path.join(folder, TRAINER_STATE_FILE))
        if problem is None:
            continue
        target, suffix = os.path.join(output_dir, INCOMPLETE_PREFIX + name), 1
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(output_dir, f"{INCOMPLETE_PREFIX}{name}.{suffix}")
        os.rename(folder, target)
        logger.warning(
            "%s %s: the save of this checkpoint was interrupted, so it cannot be resumed from; moved to %s",
            os.path.join(folder, TRAINER_STATE_FILE),
            problem,
            target,
        )
        moved.append(target)
    return moved


def _set_aside_as(checkpoint: str) -> str | None:
    """Where :func:`set_aside_incomplete_checkpoints` moved ``checkpoint`` (the newest such folder), or None."""
    directory, name = os.path.split(os.path.normpath(checkpoint))
    if not _CHECKPOINT_NAME.match(name) or not os.path.isdir(directory):
        return None
    pattern = re.compile(rf"^{re.escape(INCOMPLETE_PREFIX + name)}(?:\.(\d+))?$")
    found = [(int(m.group(1) or 1), entry) for entry in os.listdir(directory) if (m := pattern.match(entry))]
    return os.path.join(directory, max(found)[1]) if found else None


def check_resumable(
    loss: nn.Module | dict[str, nn.Module], checkpoint: str | os.PathLike, allow_missing_loss_state: bool = False
) -> None:
    """Refuse, naming the cause, a checkpoint this loss cannot resume from, before the trainer loads anything from
    it (the model, then the optimizer, whose own error would only say that the parameter groups differ):

    - a ``checkpoint-N`` that was set aside as ``incomplete-checkpoint-N`` (an interrupted save): FileNotFoundError
      naming the new folder and why;
    - a ``trainer_state.json`` that is missing, empty or unreadable: FileNotFoundError / ValueError naming it;
    - a checkpoint written under another loss class or configuration (recorded with its loss state): ValueError
      naming what differs;
    - for a loss with parameters, a checkpoint without loss state (unless ``allow_missing_loss_state``):
      FileNotFoundError.
    """
    checkpoint = os.fspath(checkpoint)
    if not os.path.isdir(checkpoint):
        moved = _set_aside_as(checkpoint)
        if moved is not None:
            problem = _trainer_state_problem(os.path.join(moved, TRAINER_STATE_FILE)) or "was incomplete"
            raise FileNotFoundError(
                f"{checkpoint} was set aside as {moved}: its {TRAINER_STATE_FILE} {problem}, so its save was "
                "interrupted and it cannot be resumed from. Resume from an earlier checkpoint, or with "
                "resume_from_checkpoint=True (the last complete one)."
            )
        return  # the trainer's own error names the missing path
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    problem = _trainer_state_problem(path)
    if problem is not None:
        raise (FileNotFoundError if problem == "is missing" else ValueError)(
            f"{path} {problem}: this checkpoint is incomplete (was the run killed while saving it?) and cannot be "
            "resumed from"
        )
    with open(path, encoding="utf-8") as handle:
        record = (json.load(handle).get("stateful_callbacks") or {}).get(LOSS_STATE_RECORD)
    if isinstance(record, list):
        record = record[0] if record else None
    attributes = record.get("attributes") if isinstance(record, dict) else None
    saved = attributes.get("loss") if isinstance(attributes, dict) else None
    if isinstance(saved, dict):
        change = describe_loss_change(saved, loss_description(loss))
        if change is not None:
            raise ValueError(
                f"{checkpoint} was written under another loss configuration than this trainer's loss ({change}). "
                "Its loss state and optimizer state belong to that loss: resume with the loss it was written with, "
                "or start a new run in another output_dir."
            )
    elif record is None and own_tensors(loss) and not allow_missing_loss_state:
        raise FileNotFoundError(
            f"{path} holds no st-weince loss state (stateful_callbacks[{LOSS_STATE_RECORD!r}] is missing): the "
            "checkpoint was written without st_weince.training.prepare_trainer, or under a loss without parameters. "
            f"Resuming would restart the loss parameters {sorted(own_tensors(loss))} from their current values. "
            "To do that knowingly, call prepare_trainer(trainer, allow_missing_loss_state=True)."
        )


class LossStateRecord(TrainerCallback, ExportableState):
    """Carries the loss state into every checkpoint's ``trainer_state.json`` (``stateful_callbacks``).

    The trainer calls :meth:`state` while it writes that file, after the model and the optimizer. Added and linked
    to the loss by :func:`prepare_trainer`; an instance re-created by the trainer
    (``restore_callback_states_from_checkpoint=True``) is linked again at ``on_train_begin``.
    """

    def __init__(self) -> None:
        self.loss: nn.Module | dict[str, nn.Module] | None = None
        self.global_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.global_step = state.global_step

    def on_train_begin(self, args, state, control, **kwargs):
        self.global_step = state.global_step

    def state(self) -> dict[str, Any]:
        if self.loss is None:
            raise RuntimeError("LossStateRecord is not linked to a loss: call st_weince.training.prepare_trainer")
        values = loss_state_dict(self.loss)
        check_finite_loss_state(values, f"checkpoint at step {self.global_step}")
        attributes = {
            "format": _RECORD_FORMAT,
            "global_step": self.global_step,
            "entries": _encode(values),
            "loss": loss_description(self.loss),  # compared at resume, before anything is loaded
        }
        return {"args": {}, "attributes": attributes}


class LossStateCallback(TrainerCallback):
    """Averages loss-parameter gradients across processes, restores the loss state on resume, stops training before
    a non-finite loss state is checkpointed, and loads the best checkpoint's loss state with the best model.
    Added by :func:`prepare_trainer`."""

    def __init__(self, trainer: Any, allow_missing_loss_state: bool = False) -> None:
        self.trainer = trainer
        self.allow_missing_loss_state = allow_missing_loss_state

    def _records(self) -> list[LossStateRecord]:
        return [cb for cb in self.trainer.callback_handler.callbacks if isinstance(cb, LossStateRecord)]

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        for record in self._records():
            record.loss = self.trainer.loss
        if state.global_step == 0 or not own_tensors(self.trainer.loss):
            return  # not a resume (the trainer restored a checkpoint's trainer state) or nothing to restore
        source = f"the {TRAINER_STATE_FILE} of the checkpoint resumed from (step {state.global_step})"
        stored = (state.stateful_callbacks or {}).get(LOSS_STATE_RECORD)
        if isinstance(stored, list):
            stored = stored[0]
        if stored is None:
            if not self.allow_missing_loss_state:
                raise FileNotFoundError(
                    f"{source} holds no st-weince loss state (stateful_callbacks[{LOSS_STATE_RECORD!r}] is missing): "
                    "the checkpoint was written without st_weince.training.prepare_trainer. Resuming would restart the "
                    f"loss parameters {sorted(own_tensors(self.trainer.loss))} from their current values while their "
                    "optimizer state is restored. To do that knowingly (their optimizer state is then reset), call "
                    "prepare_trainer(trainer, allow_missing_loss_state=True)."
                )
            logger.warning("%s holds no loss state: the loss parameters keep their current values", source)
            # The trainer updates the entries of the loaded state in place and fails on a key it does not find.
            state.stateful_callbacks.setdefault(LOSS_STATE_RECORD, None)
            if optimizer is not None:
                for parameter in _own_parameters(self.trainer.loss):
                    optimizer.state.pop(parameter, None)
            return
        step, values = _record_state(stored, source)
        if step != state.global_step:
            raise ValueError(f"{source}: its loss state is from step {step}, not from step {state.global_step}")
        load_loss_state_dict(self.trainer.loss, values, source=source)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        average_loss_gradients(self.trainer.loss)

    def _check_before_save(self, state, control) -> None:
        # The trainer decided to save (DefaultFlowCallback runs first): refuse before the checkpoint folder exists.
        if control.should_save and state.is_world_process_zero:
            check_finite_loss_state(loss_state_dict(self.trainer.loss), f"checkpoint at step {state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):
        self._check_before_save(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._check_before_save(state, control)

    def on_train_end(self, args, state, control, **kwargs):
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best and os.path.isdir(best) and own_tensors(self.trainer.loss):
            values = read_checkpoint_loss_state(best)
            if values is None:
                raise FileNotFoundError(f"{os.path.join(best, TRAINER_STATE_FILE)} holds no st-weince loss state")
            load_loss_state_dict(self.trainer.loss, values, source=os.path.join(best, TRAINER_STATE_FILE))


# ----- the one call -----
def _loss_learning_rate_pattern(loss: nn.Module | dict[str, nn.Module]) -> str | None:
    """A regex for the trainer's ``learning_rate_mapping`` matching exactly the loss's own trainable parameters."""
    names = sorted(own_tensors(loss, trainable_only=True))
    return "^(?:" + "|".join(re.escape(name) for name in names) + ")$" if names else None


def prepare_trainer(
    trainer: Any,
    loss_learning_rate: float | None = DEFAULT_LOSS_LEARNING_RATE,
    allow_missing_loss_state: bool = False,
) -> Any:
    """One call after building a SentenceTransformerTrainer (or any transformers Trainer with a ``loss``) and before
    ``trainer.train()``. For losses with parameters of their own (RBSigmoidLoss, also inside MatryoshkaLoss,
    Matryoshka2dLoss or AdaptiveLayerLoss):

    - their state goes into every checkpoint (inside ``trainer_state.json``) and ``train(resume_from_checkpoint=...)``
      restores it; a checkpoint without it is refused (FileNotFoundError) unless ``allow_missing_loss_state``;
      non-finite values stop training before they are written; interrupted checkpoints in ``output_dir`` are set
      aside (:func:`set_aside_incomplete_checkpoints`);
    - they get no weight decay, and their own learning rate ``loss_learning_rate`` through the trainer's
      ``learning_rate_mapping`` (an entry the caller gave for the same parameters wins; None: the trainer's rate);
    - their gradients are averaged across processes;
    - their statistics (``rb_sigmoid_t``, ``rb_sigmoid_b_rel``, ``rb_sigmoid_t_capped`` ...) are added to the
      training logs;
    - RB-Sigmoid's ``log_t`` is clamped at its ``max_scale`` cap after every optimizer step, and the trained ``t`` and
      ``b_rel`` are written into the model's configuration and its model card before every checkpoint and at the end
      of training, so the saved model carries them (:func:`st_weince.match_probability`).

    For every loss: a warning (once) when WEINCE's configured batch is too small for any tail fit (it would be
    InfoNCE) or the dataset has a label column that the loss ignores (:mod:`st_weince.training.setup_checks`).

    For every loss, also one without parameters (WEINCELoss): each checkpoint records the loss class and configuration,
    and ``train(resume_from_checkpoint=...)`` refuses, before it loads anything, a checkpoint written under another
    loss, or one set aside as incomplete (:func:`check_resumable`). Call it before the optimizer is
    built (an existing optimizer's groups are fixed in place; an existing learning-rate scheduler is an error).
    Idempotent; returns the trainer.
    """
    if getattr(trainer, "_st_weince_prepared", False):
        return trainer
    if loss_learning_rate is not None and not (
        isinstance(loss_learning_rate, (int, float)) and math.isfinite(loss_learning_rate) and loss_learning_rate > 0
    ):
        raise ValueError(f"loss_learning_rate must be a finite number > 0 or None, got {loss_learning_rate!r}")
    if not any(isinstance(cb, LossStatisticsCallback) for cb in trainer.callback_handler.callbacks):
        log_loss_statistics(trainer)
    check_trainer_setup(trainer)  # WEINCE at a batch too small to fit; ignored label columns

    if trainer.is_world_process_zero():
        set_aside_incomplete_checkpoints(trainer.args.output_dir)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank looks for the last checkpoint before the incomplete ones are set aside
    # For every loss, also one without parameters: the record names the loss class and configuration in each
    # checkpoint, so that resuming under another loss is refused with that reason.
    record = LossStateRecord()
    record.loss = trainer.loss
    trainer.add_callback(record)
    trainer.add_callback(LossStateCallback(trainer, allow_missing_loss_state=allow_missing_loss_state))
    _check_before_loading(trainer, allow_missing_loss_state)
    if rb_sigmoid_losses(trainer.loss):
        # after LossStateCallback: the cap applies to the step's averaged gradients, the carried values are those
        # of the best checkpoint when it is loaded at the end
        carry_trained_values(trainer.model, trainer.loss, 0)  # the configured starts until the first save
        trainer.add_callback(TrainedValuesCallback(trainer))

    excluded = {id(p) for p in no_weight_decay_parameters(trainer.loss)}
    original_decay_names = trainer.get_decay_parameter_names

    def get_decay_parameter_names(model: nn.Module) -> list[str]:
        parameters = dict(model.named_parameters())
        return [name for name in original_decay_names(model) if id(parameters.get(name)) not in excluded]

    get_decay_parameter_names.__doc__ = original_decay_names.__doc__
    trainer.get_decay_parameter_names = get_decay_parameter_names

    pattern = _loss_learning_rate_pattern(trainer.loss) if loss_learning_rate is not None else None
    if pattern is not None and hasattr(trainer.args, "learning_rate_mapping"):
        user_mapping = dict(trainer.args.learning_rate_mapping or {})
        own_names = own_tensors(trainer.loss, trainable_only=True)
        if not any(re.search(p, name) for p in user_mapping for name in own_names):
            # First in the mapping: the trainer applies the entries in order, so a later user entry would still win.
            # On a copy of the arguments: an arguments object reused for another trainer (another loss) must not
            # carry this pattern, which the trainer would refuse there ("No parameters found matching").
            trainer.args = copy.copy(trainer.args)
            trainer.args.learning_rate_mapping = {pattern: float(loss_learning_rate), **user_mapping}
    if trainer.optimizer is not None:
        _regroup_existing_optimizer(trainer, loss_learning_rate if pattern is not None else None)

    trainer._st_weince_prepared = True
    return trainer


def _check_before_loading(trainer: Any, allow_missing_loss_state: bool) -> None:
    """:func:`check_resumable` on the checkpoint the trainer resumes from, as the first thing its
    ``_load_from_checkpoint`` does: ``train()`` calls that before it loads the optimizer (and for a regular model,
    before the model), and after ``resume_from_checkpoint=True`` has been resolved to a folder."""
    load_from_checkpoint = getattr(trainer, "_load_from_checkpoint", None)
    if load_from_checkpoint is None:
        return

    def checked_load_from_checkpoint(resume_from_checkpoint: str, *args: Any, **kwargs: Any) -> Any:
        check_resumable(trainer.loss, resume_from_checkpoint, allow_missing_loss_state)
        return load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)

    trainer._load_from_checkpoint = checked_load_from_checkpoint


def _regroup_existing_optimizer(trainer: Any, learning_rate: float | None) -> None:
    """For an optimizer built before prepare_trainer: move the loss parameters into a group without weight decay
    (and with ``learning_rate`` if given)."""
    no_decay = {id(p) for p in no_weight_decay_parameters(trainer.loss)}
    own = {id(p) for p in _own_parameters(trainer.loss)}
    optimizer = trainer.optimizer
    moved: list[nn.Parameter] = []
    for group in optimizer.param_groups:
        wrong_decay = group.get("weight_decay", 0.0) != 0.0
        wrong_rate = learning_rate is not None and group.get("lr") != learning_rate
        take = [p for p in group["params"] if (id(p) in no_decay and wrong_decay) or (id(p) in own and wrong_rate)]
        moved += take
        group["params"] = [p for p in group["params"] if all(p is not q for q in take)]
    if not moved:
        return
    if trainer.lr_scheduler is not None:
        raise RuntimeError("prepare_trainer must be called before the learning-rate scheduler is created")
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
    template = {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}
    decay = 0.0 if all(id(p) in no_decay for p in moved) else template.get("weight_decay", 0.0)
    group = {**template, "params": moved, "weight_decay": decay}
    if learning_rate is not None:
        group["lr"] = learning_rate
    optimizer.add_param_group(group)
