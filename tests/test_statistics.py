"""The logged loss statistics stay on the device between two log events: RunningMeans.add and the per-step
callbacks of prepare_trainer cause no host-device synchronisation; the values are read once, at the log."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerControl, TrainerState

from st_weince.losses import RBSigmoidLoss
from st_weince.training import LossStateCallback, RunningMeans
from st_weince.utils.hotpath import count_host_syncs


def test_running_means_accumulate_without_syncs_and_read_once():
    means = RunningMeans()
    parameter = torch.nn.Parameter(torch.tensor(0.5))
    values = torch.tensor([1.0, 2.0, 6.0])
    with count_host_syncs() as syncs:
        for value in values:
            with torch.no_grad():
                means.add({"mean": value, "parameter": parameter, "python": 3.0})
                parameter.add_(1.0)  # the optimizer step after the forward: the logged value is the one before
    assert syncs.total == 0, syncs.by_op
    with count_host_syncs() as reads:
        float(values[0])  # what add() did before: the counter sees it, so the zero above means something
    assert reads.total == 1
    result = means.pop()
    assert result == pytest.approx({"mean": 3.0, "parameter": 1.5, "python": 3.0})
    assert means.pop() == {}


def test_per_step_callbacks_do_not_sync(tiny_model):
    loss = RBSigmoidLoss(tiny_model)

    class Trainer:  # what LossStateCallback reads of the trainer
        pass

    trainer = Trainer()
    trainer.loss = loss
    callback = LossStateCallback(trainer)
    state, control = TrainerState(global_step=3), TrainerControl()
    with count_host_syncs() as syncs:
        callback.on_pre_optimizer_step(None, state, control)
        callback.on_step_end(None, state, control)
    assert syncs.total == 0, syncs.by_op
    # On a save step it checks the loss state (that is a read, once per checkpoint).
    control.should_save = True
    with count_host_syncs() as syncs:
        callback.on_step_end(None, state, control)
    assert syncs.total >= 1
