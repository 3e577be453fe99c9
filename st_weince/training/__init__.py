"""Trainer integration: logging of loss statistics (and, for losses with parameters, their state handling)."""

from st_weince.training.loss_state import (
    LOSS_STATE_FILE,
    LossStateCallback,
    average_loss_gradients,
    load_loss_state,
    load_loss_state_dict,
    loss_state_dict,
    prepare_trainer,
    save_loss_state,
)
from st_weince.training.statistics import LossStatisticsCallback, RunningMeans, log_loss_statistics

__all__ = [
    "LOSS_STATE_FILE",
    "LossStateCallback",
    "average_loss_gradients",
    "load_loss_state",
    "load_loss_state_dict",
    "loss_state_dict",
    "prepare_trainer",
    "save_loss_state",
    "LossStatisticsCallback",
    "RunningMeans",
    "log_loss_statistics",
]
