"""Trainer integration for losses WITH parameters (RB-Sigmoid's ``log_t``, ``b_rel`` ...), in one call.

The sentence-transformers trainer puts a loss's parameters into its optimizer, but:

1. under DDP only the model is wrapped, so the loss parameters' gradients are not averaged across processes;
2. checkpoints hold only the model, so a resumed run restarts the loss parameters from their initial values;
3. weight decay reaches every parameter whose name does not look like a bias or a norm (``log_t``, ``b_rel``);
4. the loss parameters train at the model's learning rate, at which fine-tuning leaves them almost where they start.

:func:`prepare_trainer` fixes all four, through wrappers too (``MatryoshkaLoss``, ``Matryoshka2dLoss``,
``AdaptiveLayerLoss``: the loss's "own" tensors are every parameter and buffer in the loss's module tree that is not
a tensor of a ``model`` child, whatever the prefix: :mod:`st_weince.training.loss_tensors`), and attaches the
statistics logging of :mod:`st_weince.training.statistics`.

How the loss state travels with checkpoints (transformers 5 ``Trainer``): ``_save_checkpoint`` writes the model,
the optimizer, the RNG states and, last, ``trainer_state.json``, which holds the state of every callback that is an
``ExportableState`` (the documented way for callbacks to keep state in checkpoints). :class:`LossStateRecord` is
such a callback: its ``state()``, called by the trainer while it writes ``trainer_state.json``, is the loss state.
So the loss state is inside the one file without which the trainer cannot resume from a checkpoint at all: there is
no moment at which a checkpoint has ``trainer_state.json`` but not the loss state. On resume the trainer loads that
file into ``trainer.state`` before ``on_train_begin``, where :class:`LossStateCallback` copies the loss state back
(nothing patches ``trainer.train``; the resume path need not be known). Reading the record, interrupted saves and
the refusal of a checkpoint of another loss: :mod:`st_weince.training.checkpoints`.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from st_weince.training.checkpoints import (
    LOSS_STATE_RECORD,
    TRAINER_STATE_FILE,
    check_record_resumable,
    loss_state_record,
    read_checkpoint_loss_state,
    record_loss_state,
    stored_record,
)
from st_weince.training.loss_tensors import (
    average_loss_gradients,
    check_finite_loss_state,
    load_loss_state_dict,
    loss_state_dict,
    losses_by_prefix,
    no_weight_decay_parameters,
    own_parameters,
    own_tensors,
)
from st_weince.training.setup_checks import check_trainer_setup
from st_weince.training.statistics import LossStatisticsCallback, log_loss_statistics
from st_weince.training.trained_values import TrainedValuesCallback, carry_trained_values, rb_sigmoid_losses

logger = logging.getLogger(__name__)

#: Learning rate of the loss's own parameters set by :func:`prepare_trainer` (chosen by measurement:
#: benchmarks/loss_learning_rate.py, docs/training.md).
DEFAULT_LOSS_LEARNING_RATE = 3e-2


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
        return {"args": {}, "attributes": loss_state_record(self.loss, self.global_step)}


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
        if optimizer is not None:
            take_weight_decay_off(optimizer, self.trainer.loss)
        if state.global_step == 0:
            return  # not a resume (the trainer restored a checkpoint's trainer state)
        source = f"the {TRAINER_STATE_FILE} of the checkpoint resumed from (step {state.global_step})"
        stored = stored_record(state.stateful_callbacks)
        # Another loss class or configuration, or no loss state for a loss with parameters: refused with the reason.
        check_record_resumable(self.trainer.loss, stored, source, self.allow_missing_loss_state)
        if not own_tensors(self.trainer.loss):
            return  # nothing to restore
        if stored is None:
            logger.warning("%s holds no loss state: the loss parameters keep their current values", source)
            # The trainer updates the entries of the loaded state in place and fails on a key it does not find.
            state.stateful_callbacks.setdefault(LOSS_STATE_RECORD, None)
            if optimizer is not None:
                for parameter in own_parameters(self.trainer.loss):
                    optimizer.state.pop(parameter, None)
            return
        step, values = record_loss_state(stored, source)
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
      non-finite values stop training before they are written; after a run killed while saving, resume with
      ``resume_from_checkpoint=last_complete_checkpoint(output_dir)`` (:func:`last_complete_checkpoint`);
    - their own learning rate ``loss_learning_rate`` through the trainer's ``learning_rate_mapping`` (an entry the
      caller gave for the same parameters wins; None: the trainer's rate), and no weight decay (set to 0 on their
      optimizer groups at ``on_train_begin``);
    - their gradients are averaged across processes;
    - their statistics (``rb_sigmoid_t``, ``rb_sigmoid_b_rel``, ``rb_sigmoid_t_capped`` ...) are added to the
      training logs;
    - RB-Sigmoid's ``log_t`` is clamped at its ``max_scale`` cap after every optimizer step, and the trained ``t`` and
      ``b_rel`` are written into the model's configuration and its model card before every checkpoint and at the end
      of training, so the saved model carries them (:func:`st_weince.match_probability`).

    For every loss: a warning (once) when WEINCE's configured batch is too small for any tail fit (it would be
    InfoNCE) or the dataset has a label column that the loss ignores (:mod:`st_weince.training.setup_checks`).

    For every loss, also one without parameters (WEINCELoss): each checkpoint records the loss class and configuration,
    and ``train(resume_from_checkpoint=...)`` refuses a checkpoint written under another loss class or configuration
    (:func:`check_record_resumable`, at ``on_train_begin``; an optimizer whose groups differ is refused by torch
    before that). Nothing of the trainer is replaced: it adds callbacks and a ``learning_rate_mapping`` entry (on a
    copy of ``trainer.args``). An optimizer passed to the trainer is used as built, and refused if it misses a loss
    parameter or decays one. Idempotent; returns the trainer.
    """
    if any(isinstance(cb, LossStateCallback) for cb in trainer.callback_handler.callbacks):
        return trainer  # prepared already
    if loss_learning_rate is not None and not (
        isinstance(loss_learning_rate, (int, float)) and math.isfinite(loss_learning_rate) and loss_learning_rate > 0
    ):
        raise ValueError(f"loss_learning_rate must be a finite number > 0 or None, got {loss_learning_rate!r}")
    if not any(isinstance(cb, LossStatisticsCallback) for cb in trainer.callback_handler.callbacks):
        log_loss_statistics(trainer)
    check_trainer_setup(trainer)  # WEINCE at a batch too small to fit; ignored label columns

    for top in losses_by_prefix(trainer.loss).values():
        for module in top.modules():
            if callable(getattr(module, "mark_state_managed", None)):
                module.mark_state_managed("st_weince.training.prepare_trainer")  # the callbacks below handle it
    # For every loss, also one without parameters: the record names the loss class and configuration in each
    # checkpoint, so that resuming under another loss is refused with that reason.
    record = LossStateRecord()
    record.loss = trainer.loss
    trainer.add_callback(record)
    trainer.add_callback(LossStateCallback(trainer, allow_missing_loss_state=allow_missing_loss_state))
    if rb_sigmoid_losses(trainer.loss):
        # after LossStateCallback: the cap applies to the step's averaged gradients, the carried values are those
        # of the best checkpoint when it is loaded at the end
        carry_trained_values(trainer.model, trainer.loss, 0)  # the configured starts until the first save
        trainer.add_callback(TrainedValuesCallback(trainer))

    # Their own learning rate, through the trainer's learning_rate_mapping, which also gives them optimizer groups of
    # their own, so that LossStateCallback can take the weight decay off those groups at on_train_begin (nothing of
    # the trainer is replaced). loss_learning_rate=None: their own groups at the trainer's rate.
    pattern = _loss_learning_rate_pattern(trainer.loss)
    if pattern is not None and hasattr(trainer.args, "learning_rate_mapping") and trainer.optimizer is None:
        user_mapping = dict(trainer.args.learning_rate_mapping or {})
        own_names = own_tensors(trainer.loss, trainable_only=True)
        if not any(re.search(p, name) for p in user_mapping for name in own_names):
            rate = trainer.args.learning_rate if loss_learning_rate is None else loss_learning_rate
            # First in the mapping: the trainer applies the entries in order, so a later user entry would still win.
            # On a copy of the arguments: an arguments object reused for another trainer (another loss) must not
            # carry this pattern, which the trainer would refuse there ("No parameters found matching").
            trainer.args = copy.copy(trainer.args)
            trainer.args.learning_rate_mapping = {pattern: float(rate), **user_mapping}
    if trainer.optimizer is not None:
        _check_given_optimizer(trainer)

    return trainer


def take_weight_decay_off(optimizer: Any, loss: nn.Module | dict[str, nn.Module]) -> None:
    """Set ``weight_decay=0`` on every optimizer group that holds a parameter the loss names in
    ``no_weight_decay_parameter_names()``. Such a group must hold nothing else (the trainer's ``learning_rate_mapping``
    entry that prepare_trainer adds gives them groups of their own); a group that mixes them with other parameters
    is refused, naming both. Runs after the trainer built (and, on resume, loaded) the optimizer; the scheduler does
    not touch weight decay."""
    no_decay = {id(p) for p in no_weight_decay_parameters(loss)}
    names = {id(p): name for name, p in own_tensors(loss, trainable_only=True).items()}
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
    no_decay = {id(p) for p in no_weight_decay_parameters(trainer.loss)}
    groups = {id(p): group for group in trainer.optimizer.param_groups for p in group["params"]}
    names = {id(p): name for name, p in own_tensors(trainer.loss, trainable_only=True).items()}
    missing = sorted(name for key, name in names.items() if key not in groups)
    decayed = sorted(
        name for key, name in names.items() if key in groups and key in no_decay and groups[key].get("weight_decay")
    )
    if missing or decayed:
        problem = f"does not hold the loss parameters {missing}" if missing else f"puts weight decay on {decayed}"
        raise ValueError(
            f"The optimizer given to the trainer {problem}. prepare_trainer does not regroup an optimizer it did not "
            "build: put the loss's own parameters (st_weince.training.own_tensors(trainer.loss, trainable_only=True))"
            " in a group with weight_decay=0 and the learning rate you want, or let the trainer build the optimizer "
            "(then they get loss_learning_rate)."
        )
