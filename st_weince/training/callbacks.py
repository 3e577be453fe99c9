"""Trainer integration in one call, :func:`prepare_trainer`, for the loss state of :mod:`st_weince.training.protocol`:
what the trainer does not do for a loss's own parameters (average, clip, checkpoint, log them, their learning rate and
no weight decay), through the protocol alone (docs/training.md). The state travels in every checkpoint's
``trainer_state.json`` as the ``ExportableState`` of :class:`LossStateRecord`, which the trainer restores before the
optimizer: a checkpoint of another loss is refused naming the change before torch refuses its parameter groups.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from st_weince.calibration import CONFIG_KEY, carry_values, mark_carried_values_stale, mark_values_not_carried
from st_weince.training.checkpoints import (
    LOSS_STATE_RECORD,
    TRAINER_STATE_FILE,
    check_record_resumable,
    loss_state_record,
    read_checkpoint_loss_state,
    record_loss_state,
    stored_record,
)
from st_weince.training.label_columns import check_label_columns
from st_weince.training.loss_tensors import (
    LossTree,
    after_optimizer_step,
    average_loss_gradients,
    check_finite_loss_state,
    clip_loss_gradients,
    load_loss_state_dict,
    loss_state_dict,
    no_weight_decay_names,
    state_modules,
    state_parameters,
    state_tensors,
)
from st_weince.training.processes import check_trained_in_parallel, warn_fewer_processes

logger = logging.getLogger(__name__)

#: Learning rate of the loss's own parameters set by :func:`prepare_trainer` (chosen by measurement:
#: benchmarks/loss_learning_rate.py, docs/training.md).
DEFAULT_LOSS_LEARNING_RATE = 3e-2

class LossStateRecord(TrainerCallback, ExportableState):
    """Carries the loss state into every checkpoint's ``trainer_state.json``: :meth:`state` is the record. The trainer
    re-creates it from a checkpoint after :func:`_check_record_before_restore` checked the record; the
    :class:`LossStateCallback` links the new one to the trainer at ``on_train_begin``."""

    def __init__(self, output_dir: str | None = None) -> None:
        self.output_dir = output_dir
        self.trainer: Any = None

    def state(self) -> dict[str, Any]:
        if self.trainer is None:
            raise RuntimeError("LossStateRecord is not linked to a trainer: call st_weince.training.prepare_trainer")
        record = loss_state_record(self.trainer.loss, self.trainer.state.global_step)
        return {"args": {"output_dir": self.output_dir}, "attributes": record}


class LossStateCallback(TrainerCallback):
    """Restores the loss state on resume, runs each loss's step after the optimizer's, refuses to checkpoint a
    non-finite state, loads the best checkpoint's with the best model, and lets the model carry the trained values."""

    def __init__(self, trainer: Any, *, carried_values_from: str | None = None) -> None:
        self.trainer = trainer
        self.carried_values_from = carried_values_from

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        for record in self.trainer.callback_handler.callbacks:
            if isinstance(record, LossStateRecord):
                record.trainer = self.trainer  # also one the trainer re-created from the checkpoint
        if optimizer is not None:
            take_weight_decay_off(optimizer, self.trainer.loss)
        if state.global_step == 0:
            return  # not a resume (the trainer restored a checkpoint's trainer state)
        source = f"the {TRAINER_STATE_FILE} of the checkpoint resumed from (step {state.global_step})"
        # The record was checked against the loss before the trainer restored it (_check_record_before_restore).
        stored = stored_record(state.stateful_callbacks, source)
        if not state_tensors(self.trainer.loss):
            return  # nothing to restore
        if stored is None:
            logger.warning("%s holds no loss state: the loss parameters keep their current values", source)
            # The trainer updates the entries of the loaded state in place and fails on a key it does not find.
            state.stateful_callbacks.setdefault(LOSS_STATE_RECORD, None)
            if optimizer is not None:
                for parameter in state_parameters(self.trainer.loss).values():
                    optimizer.state.pop(parameter, None)
            return
        step, values = record_loss_state(stored, source)
        if step != state.global_step:
            raise ValueError(f"{source}: its loss state is from step {step}, not from step {state.global_step}")
        load_loss_state_dict(self.trainer.loss, values, source=source)

    def on_optimizer_step(self, args, state, control, **kwargs):
        # after the step of the averaged gradients: the same on every process, so they stay equal
        after_optimizer_step(self.trainer.loss)

    def on_step_end(self, args, state, control, **kwargs):
        # The trainer decided to save (DefaultFlowCallback runs first): refuse before the checkpoint folder exists,
        # and let the model carry the trained values it is saved with.
        if control.should_save:
            if state.is_world_process_zero:
                check_finite_loss_state(loss_state_dict(self.trainer.loss), f"checkpoint at step {state.global_step}")
            carry_trained_values(self.trainer.model, self.trainer.loss, state.global_step, self.carried_values_from)

    on_epoch_end = on_step_end

    def on_train_end(self, args, state, control, **kwargs):
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best and os.path.isdir(best) and state_tensors(self.trainer.loss):
            values = read_checkpoint_loss_state(best)
            if values is None:
                raise FileNotFoundError(f"{os.path.join(best, TRAINER_STATE_FILE)} holds no st-weince loss state")
            load_loss_state_dict(self.trainer.loss, values, source=os.path.join(best, TRAINER_STATE_FILE))
        carry_trained_values(self.trainer.model, self.trainer.loss, state.global_step, self.carried_values_from)


class LossStatisticsCallback(TrainerCallback):
    """Adds every loss module's :meth:`~st_weince.training.protocol.LossState.pop_logged_statistics` to every
    training log record, named after their dataset with a dict of losses; the losses compute them only in the steps
    that a record will hold (docs/training.md, "How a loss's statistics reach the logs"). Also averages the loss
    parameters' gradients across processes, clips them to ``max_grad_norm`` on their own (the trainer clips the
    model's only) and logs their norm as ``loss_grad_norm``. First of the callbacks, so that the printers and
    reporters see what it logs."""

    def __init__(self, loss: LossTree) -> None:
        self.loss = loss
        self.gradient_norm: Any = None  # the last optimizer step's, a device tensor: read at logging steps only
        self._pending: set[str] = set()  # the loss modules whose statistics no step has computed since the last record
        self._latest: dict[str, float] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self._latest = {}
        self._pending = set(state_modules(self.loss)) if isinstance(self.loss, dict) else set()
        for module in state_modules(self.loss).values():
            module.pop_logged_statistics()  # forwards before training (an evaluation) belong to no record

    def on_step_begin(self, args, state, control, **kwargs):
        # A step after which the trainer logs (DefaultFlowCallback.on_step_end's rule), and with a dict of losses
        # those no step has computed since the last record: the batch sampler, unseen here, picks the dataset.
        step = state.global_step + 1
        if args.logging_strategy == "steps":
            logs = step % state.logging_steps == 0 or (step == 1 and args.logging_first_step)
        else:
            logs = args.logging_strategy != "no"
        for prefix, module in state_modules(self.loss).items():
            module.log_statistics = logs or prefix in self._pending

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        average_loss_gradients(self.loss)
        self.gradient_norm = clip_loss_gradients(self.loss, args.max_grad_norm)

    def on_step_end(self, args, state, control, **kwargs):
        for prefix, module in state_modules(self.loss).items():
            if module.log_statistics and module.end_statistics_step():  # it ran: a Python fact, no host read
                self._pending.discard(prefix)
            module.log_statistics = False  # an evaluation's forwards after the step add nothing to the training logs

    def on_train_end(self, args, state, control, **kwargs):
        for module in state_modules(self.loss).values():
            module.log_statistics = True  # after training, every forward keeps its statistics again

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        if self.gradient_norm is not None:
            _add_to_logs(state, logs, {"loss_grad_norm": float(self.gradient_norm)})
        for prefix, module in state_modules(self.loss).items():
            dataset = prefix.split(".")[0] + "_" if isinstance(self.loss, dict) else ""
            values = module.pop_logged_statistics()
            self._latest.update({dataset + key: round(value, 6) for key, value in values.items()})
        if isinstance(self.loss, dict):
            self._pending = set(state_modules(self.loss))
        _add_to_logs(state, logs, self._latest)


def _add_to_logs(state: Any, logs: dict[str, Any], values: dict[str, Any]) -> None:
    """Add ``values`` to a log record and to its copy that the trainer appended to the history before calling the
    callbacks."""
    logs.update(values)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(values)


def carry_trained_values(model: nn.Module, loss: LossTree, global_step: int, source: str | None = None) -> None:
    """Store the trained values of the loss tree's one carrying loss (``source``: the dataset of a dict of losses) in
    the model's configuration and model card, at ``global_step``. With several and no ``source`` none (their values
    differ): the model records why, with a warning."""
    carrying = [(prefix, module) for prefix, module in state_modules(loss).items() if module.carried_values()]
    if source is not None:
        carrying = [(prefix, module) for prefix, module in carrying if prefix.split(".")[0] == source]
    if len(carrying) > 1:
        where = [p.split(".")[0] if isinstance(loss, dict) else p.rstrip(".") or "loss" for p, _ in carrying]
        choose = (
            "choose the dataset whose loss's values the model carries with "
            f"st_weince.training.prepare_trainer(trainer, carried_values_from={where[0]!r})"
            if isinstance(loss, dict)
            else "train the encoder with one of them"
        )
        reason = (
            f"{len(carrying)} losses train their own t and b_rel (those of {', '.join(where)}), one pair per loss and "
            f"their values differ, so the model carries none of them: {choose}"
        )
        if mark_values_not_carried(model, reason):  # warned once, not at every checkpoint
            logger.warning("%s", reason)
    if len(carrying) != 1:
        return
    prefix, module = carrying[0]
    values = {**module.carried_values(), "global_step": int(global_step)}
    if not carry_values(model, values):
        logger.warning(
            "%s has no Hugging Face configuration to carry the trained values in; they stay in the checkpoints' loss "
            "state only",
            type(model).__name__,
        )
        return
    _annotate_model_card(model, loss, prefix, values)


def _annotate_model_card(model: nn.Module, loss: LossTree, prefix: str, values: dict[str, Any]) -> None:
    """Add the trained values to the loss block of the model card data (for the loss's dataset), after the
    configuration sentence-transformers wrote there."""
    card = getattr(model, "model_card_data", None)
    if card is None:
        return
    dataset = prefix.split(".")[0] if isinstance(loss, dict) else None
    for datasets in (card.train_datasets or [], card.eval_datasets or []):
        for index, info in enumerate(datasets):
            block = info.get("loss") if isinstance(info, dict) else None
            named = dataset is None or (isinstance(loss, dict) and list(loss)[index : index + 1] == [dataset])
            if not isinstance(block, dict) or "config_code" not in block or not named:
                continue
            configured = block.setdefault("st_weince_configured_config_code", block["config_code"])
            trained = json.dumps(values, indent=4)
            block["config_code"] = (
                f"{configured}\n  Trained values (the model carries them in its config.json, {CONFIG_KEY!r}):\n"
                + "\n".join("  " + line for line in f"```json\n{trained}\n```".splitlines())
            )


# ----- the one call -----
def _loss_learning_rate_pattern(loss: LossTree) -> str | None:
    """A regex for the trainer's ``learning_rate_mapping`` matching exactly the loss's own trainable parameters."""
    names = sorted(state_parameters(loss))
    return "^(?:" + "|".join(re.escape(name) for name in names) + ")$" if names else None


def prepare_trainer(
    trainer: Any,
    loss_learning_rate: float | None = DEFAULT_LOSS_LEARNING_RATE,
    allow_missing_loss_state: bool = False,
    carried_values_from: str | None = None,
) -> Any:
    """One call after building a SentenceTransformerTrainer (or any transformers Trainer with a ``loss``) and before
    ``trainer.train()``. For every loss module of the trainer's loss (:mod:`st_weince.training.protocol`; also inside
    ``MatryoshkaLoss`` and co., and a dict of losses) it checkpoints and restores the state (never a non-finite one),
    refusing a checkpoint without it (unless ``allow_missing_loss_state``) or of another loss configuration before the
    optimizer is loaded; gives the parameters ``loss_learning_rate`` (None: the trainer's; an entry of yours for them
    wins) and no weight decay; averages and clips their gradients on their own; logs the statistics; lets the model
    carry the trained values (``carried_values_from``: whose, with a dict of several); refuses, before step 1, a
    process group that the trainer trains one process at a time with a gathering loss and a ``"same_label"`` dataset
    without integer labels; and warns when a launcher started fewer processes than asked. docs/training.md ("What it
    does") has each rule and its why, docs/distributed.md the processes.

    It adds callbacks, and on a copy of ``trainer.args`` a ``learning_rate_mapping`` entry and
    ``restore_callback_states_from_checkpoint=True``; the one trainer method it wraps is ``_load_callback_state``, to
    check the checkpoint's loss-state record before transformers reads it. An optimizer passed to the trainer is used
    as built, and refused if it misses a loss parameter or decays one. A second call with the same arguments does
    nothing; with other arguments it is refused, naming the first call's. Returns the trainer.
    """
    arguments = {
        "loss_learning_rate": loss_learning_rate,
        "allow_missing_loss_state": allow_missing_loss_state,
        "carried_values_from": carried_values_from,
    }
    prepared = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LossStateCallback)), None)
    if prepared is not None:
        _check_same_arguments(getattr(prepared, "prepared_with", {}), arguments)
        return trainer  # prepared already
    if loss_learning_rate is not None and not (
        isinstance(loss_learning_rate, (int, float)) and math.isfinite(loss_learning_rate) and loss_learning_rate > 0
    ):
        raise ValueError(f"loss_learning_rate must be a finite number > 0 or None, got {loss_learning_rate!r}")
    _check_carried_values_from(trainer.loss, carried_values_from)
    check_label_columns(trainer)
    trained = getattr(trainer.args, "world_size", 1)
    check_trained_in_parallel(trainer.loss, trained)  # a process group the trainer trains NOT_PARALLEL
    if getattr(trainer.args, "process_index", 0) == 0:
        warn_fewer_processes(trained)  # the launcher asked for more processes than train
    for module in state_modules(trainer.loss).values():
        module.mark_state_managed("st_weince.training.prepare_trainer")  # the callbacks below handle it
    trainer.callback_handler.callbacks.insert(0, LossStatisticsCallback(trainer.loss))  # before printers, reporters
    trainer.args = copy.copy(trainer.args)  # an arguments object reused for another trainer must not carry these
    trainer.args.restore_callback_states_from_checkpoint = True
    record = LossStateRecord(os.path.abspath(trainer.args.output_dir or "."))
    record.trainer = trainer
    trainer.add_callback(record)
    callback = LossStateCallback(trainer, carried_values_from=carried_values_from)
    callback.prepared_with = arguments
    trainer.add_callback(callback)
    _check_record_before_restore(trainer, allow_missing_loss_state)
    carry_trained_values(trainer.model, trainer.loss, 0, carried_values_from)  # the configured starts until a save
    trained_by = sorted({type(module).__name__ for module in state_modules(trainer.loss).values()})
    if trained_by and not any(module.carried_values() for module in state_modules(trainer.loss).values()):
        mark_carried_values_stale(trainer.model, trained_by=", ".join(trained_by))  # values no loss here trains

    # Their own learning rate, through the trainer's learning_rate_mapping, which also gives them optimizer groups of
    # their own, so that LossStateCallback can take the weight decay off those groups at on_train_begin.
    pattern = _loss_learning_rate_pattern(trainer.loss)
    if pattern is not None and hasattr(trainer.args, "learning_rate_mapping") and trainer.optimizer is None:
        user_mapping = dict(trainer.args.learning_rate_mapping or {})
        own_names = state_parameters(trainer.loss)
        if not any(re.search(p, name) for p in user_mapping for name in own_names):
            rate = trainer.args.learning_rate if loss_learning_rate is None else loss_learning_rate
            # First in the mapping: the trainer applies the entries in order, so a later user entry would still win.
            trainer.args.learning_rate_mapping = {pattern: float(rate), **user_mapping}
    if trainer.optimizer is not None:
        _check_given_optimizer(trainer)
    return trainer


def _check_same_arguments(first: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse a second ``prepare_trainer`` call whose arguments differ from the first's (its setup would be ignored)."""
    changed = [
        f"{name}={now[name]!r} now, {first[name]!r} in the first call"
        for name in now
        if name in first and first[name] != now[name]
    ]
    if changed:
        raise ValueError(
            f"prepare_trainer was called on this trainer already, with other arguments ({'; '.join(changed)}): the "
            "first call's setup stays, so this call would change nothing. Pass the arguments you want in one call "
            "(on a new trainer to change them)"
        )


def _check_carried_values_from(loss: LossTree, dataset: str | None) -> None:
    """``carried_values_from`` names a dataset of a dict of losses whose loss trains values the model can carry."""
    if dataset is None:
        return
    if not isinstance(loss, dict):
        raise ValueError(
            f"carried_values_from={dataset!r} names a dataset of a dict of losses, and this trainer has one loss "
            f"({type(loss).__name__}): leave it None"
        )
    if dataset not in loss:
        raise ValueError(f"carried_values_from={dataset!r} is none of the trainer's datasets {sorted(loss)}")
    if not any(module.carried_values() for module in state_modules({dataset: loss[dataset]}).values()):
        raise ValueError(
            f"carried_values_from={dataset!r}: its loss ({type(loss[dataset]).__name__}) trains no values for the "
            "model to carry (RBSigmoidLoss and CachedRBSigmoidLoss do)"
        )


def _check_record_before_restore(trainer: Any, allow_missing_loss_state: bool) -> None:
    """Wrap the trainer's ``_load_callback_state`` (run on resume after it read ``trainer_state.json``, before the
    optimizer, with no hook between) to check the loss-state record first: a corrupt entry (an AttributeError in
    transformers) and another loss's checkpoint are refused naming the cause, wherever the checkpoint lies."""
    restore = trainer._load_callback_state

    def load_callback_state() -> None:
        state = trainer.state
        source = f"the {TRAINER_STATE_FILE} of the checkpoint resumed from (step {state.global_step})"
        record = stored_record(state.stateful_callbacks, source)
        check_record_resumable(trainer.loss, record, source, allow_missing_loss_state)
        restore()

    trainer._load_callback_state = load_callback_state


def take_weight_decay_off(optimizer: Any, loss: LossTree) -> None:
    """Set ``weight_decay=0`` on every optimizer group holding a parameter in the loss's
    :meth:`~st_weince.training.protocol.LossState.no_weight_decay`; a group that mixes one with other parameters is
    refused, naming both (prepare_trainer's ``learning_rate_mapping`` entry gives them groups of their own)."""
    names = {id(p): name for name, p in state_parameters(loss).items()}
    no_decay = {id(p) for name, p in state_parameters(loss).items() if name in no_weight_decay_names(loss)}
    for index, group in enumerate(optimizer.param_groups):
        held = [p for p in group["params"] if id(p) in no_decay]
        if not held or not group.get("weight_decay"):
            continue
        if len(held) != len(group["params"]):
            raise ValueError(
                f"Optimizer group {index} (weight_decay={group['weight_decay']}) holds the loss parameters "
                f"{sorted(names.get(id(p), '?') for p in held)} together with {len(group['params']) - len(held)} "
                "other parameters: a learning_rate_mapping entry of yours matches both. Give the loss parameters an "
                "entry of their own (for example r'(^|\\.)(log_t|b_rel)$'), so that they train without weight decay."
            )
        group["weight_decay"] = 0.0


def _check_given_optimizer(trainer: Any) -> None:
    """An optimizer passed to the trainer (``optimizers=(optimizer, scheduler)``) is used as it was built: refuse it
    when it misses a loss parameter (which would then never train) or puts weight decay on one."""
    params = state_parameters(trainer.loss)
    no_decay = no_weight_decay_names(trainer.loss)
    groups = {id(p): group for group in trainer.optimizer.param_groups for p in group["params"]}
    missing = sorted(name for name, p in params.items() if id(p) not in groups)
    decayed = sorted(
        name for name, p in params.items() if id(p) in groups and name in no_decay and groups[id(p)].get("weight_decay")
    )
    if missing or decayed:
        problem = f"does not hold the loss parameters {missing}" if missing else f"puts weight decay on {decayed}"
        raise ValueError(
            f"The optimizer given to the trainer {problem}. prepare_trainer does not regroup an optimizer it did not "
            "build: put the loss's own parameters (st_weince.training.state_tensors(trainer.loss)) in a group with "
            "weight_decay=0 and the learning rate you want, or let the trainer build the optimizer (then they get "
            "loss_learning_rate)."
        )


__all__ = [
    "DEFAULT_LOSS_LEARNING_RATE",
    "LossStateCallback",
    "LossStateRecord",
    "LossStatisticsCallback",
    "prepare_trainer",
    "take_weight_decay_off",
]
