"""Trainer integration: logging of loss statistics (and, for losses with parameters, their state handling)."""

from st_weince.training.checkpoints import (
    LOSS_STATE_RECORD,
    check_record_resumable,
    check_resumable,
    last_complete_checkpoint,
    read_checkpoint_loss_state,
)
from st_weince.training.loss_state import (
    DEFAULT_LOSS_LEARNING_RATE,
    LossStateCallback,
    LossStateRecord,
    prepare_trainer,
    take_weight_decay_off,
)
from st_weince.training.loss_tensors import (
    LOSS_STATE_FILE,
    average_loss_gradients,
    load_loss_state,
    load_loss_state_dict,
    loss_state_dict,
    no_weight_decay_names,
    own_tensors,
    save_loss_state,
)
from st_weince.training.statistics import LossStatisticsCallback, RunningMeans, log_loss_statistics

__all__ = [
    "DEFAULT_LOSS_LEARNING_RATE",
    "LOSS_STATE_FILE",
    "LOSS_STATE_RECORD",
    "check_record_resumable",
    "check_resumable",
    "last_complete_checkpoint",
    "LossStateCallback",
    "LossStateRecord",
    "average_loss_gradients",
    "load_loss_state",
    "load_loss_state_dict",
    "loss_state_dict",
    "no_weight_decay_names",
    "own_tensors",
    "prepare_trainer",
    "take_weight_decay_off",
    "read_checkpoint_loss_state",
    "save_loss_state",
    "LossStatisticsCallback",
    "RunningMeans",
    "log_loss_statistics",
]
