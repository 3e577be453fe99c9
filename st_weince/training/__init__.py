"""Trainer integration for the losses' own state, through one protocol (:mod:`st_weince.training.protocol`):
:func:`prepare_trainer` for sentence-transformers' trainer; the record and its file for training loops of your own."""

from st_weince.training.callbacks import DEFAULT_LOSS_LEARNING_RATE, prepare_trainer
from st_weince.training.checkpoints import (
    LOSS_STATE_FILE,
    LOSS_STATE_RECORD,
    check_resumable,
    last_complete_checkpoint,
    load_loss_state,
    loss_state_record,
    read_checkpoint_loss_state,
    restore_loss_state,
    save_loss_state,
)
from st_weince.training.loss_tensors import (
    after_optimizer_step,
    average_loss_gradients,
    clip_loss_gradients,
    state_tensors,
)
from st_weince.training.processes import count_processes
from st_weince.training.protocol import LossState

__all__ = [
    "DEFAULT_LOSS_LEARNING_RATE",
    "LOSS_STATE_FILE",
    "LOSS_STATE_RECORD",
    "LossState",
    "after_optimizer_step",
    "average_loss_gradients",
    "check_resumable",
    "clip_loss_gradients",
    "count_processes",
    "last_complete_checkpoint",
    "load_loss_state",
    "loss_state_record",
    "prepare_trainer",
    "read_checkpoint_loss_state",
    "restore_loss_state",
    "save_loss_state",
    "state_tensors",
]
