"""Trainer integration: logging of loss statistics (and, for losses with parameters, their state handling)."""

from st_weince.training.statistics import LossStatisticsCallback, RunningMeans, log_loss_statistics

__all__ = ["LossStatisticsCallback", "RunningMeans", "log_loss_statistics"]
