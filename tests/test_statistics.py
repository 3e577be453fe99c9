"""The logged loss statistics stay on the device between two log events: RunningMeans.add and the per-step
callbacks of prepare_trainer cause no host-device synchronisation; the values are read once, at the log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from st_weince.losses import RBSigmoidLoss
from st_weince.training.callbacks import LossGradientClipping, LossStateCallback
from st_weince.utils.hotpath import count_host_syncs
from st_weince.utils.logged_statistics import RunningMeans


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
    trainer.loss, trainer.model = loss, tiny_model
    callback = LossStateCallback(trainer)
    clipping = LossGradientClipping(loss)  # averages and clips the loss parameters' gradients (issue 53)
    state, control = TrainerState(global_step=3), TrainerControl()
    loss.log_t.grad, loss.b_rel.grad = torch.ones_like(loss.log_t), torch.ones_like(loss.b_rel)
    with count_host_syncs() as syncs:
        clipping.on_pre_optimizer_step(SimpleNamespace(max_grad_norm=1.0), state, control)
        callback.on_optimizer_step(None, state, control)
        callback.on_step_end(None, state, control)
    assert syncs.total == 0, syncs.by_op
    # On a save step it checks the loss state (that is a read, once per checkpoint).
    control.should_save = True
    with count_host_syncs() as syncs:
        callback.on_step_end(None, state, control)
    assert syncs.total >= 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:WEINCELoss at a batch")
def test_a_dict_of_losses_logs_each_losss_statistics_under_its_dataset(tiny_model, tmp_path, one_torch_thread):
    """Issue 44: with sentence-transformers' multi-dataset training (a dict of losses), each WEINCE loss's statistics
    are logged under its dataset's name; before, every weince_* value was the second loss's."""
    from st_weince.losses import WEINCELoss
    from st_weince.training import prepare_trainer
    from tests.conftest import SHORT_RUN, TINY_SENTENCES, build_trainer, pairs_dataset

    datasets = {"near": pairs_dataset(TINY_SENTENCES, shift=1), "far": pairs_dataset(TINY_SENTENCES, shift=5)}
    losses = {"near": WEINCELoss(tiny_model, beta=1.0), "far": WEINCELoss(tiny_model, mode="none")}
    trainer = build_trainer(
        tiny_model, losses, tmp_path, dataset=datasets, **SHORT_RUN, per_device_train_batch_size=6, max_steps=4
    )
    prepare_trainer(trainer)
    trainer.train()
    logged = [record for record in trainer.state.log_history if "loss" in record]
    names = set().union(*logged)
    assert {"near_weince_lambda_mean", "far_weince_lambda_mean", "near_weince_rho0", "far_weince_rho0"} <= names
    assert "weince_lambda_mean" not in names  # no name without its dataset
    # each dataset's own values: mode "none" logs lambda 0, the blend a positive lambda
    far = [r["far_weince_lambda_mean"] for r in logged if "far_weince_lambda_mean" in r]
    near = [r["near_weince_lambda_mean"] for r in logged if "near_weince_lambda_mean" in r]
    assert far and all(value == 0.0 for value in far)
    assert near and max(near) > 0.0
