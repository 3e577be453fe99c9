"""The logged loss statistics stay on the device between two log events: RunningMeans.add and the per-step
callbacks of prepare_trainer cause no host-device synchronisation; the values are read once, at the log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from st_weince.losses import RBSigmoidLoss
from st_weince.training.callbacks import LossStateCallback, LossStatisticsCallback
from st_weince.utils.hotpath import count_host_syncs
from st_weince.utils.logged_statistics import RunningMeans


def test_running_means_accumulate_without_syncs_and_read_once():
    means = RunningMeans()
    parameter = torch.nn.Parameter(torch.tensor(0.5))
    values = torch.tensor([1.0, 2.0, 6.0])
    with count_host_syncs() as syncs:
        for value in values:
            with torch.no_grad():
                means.add({"mean": value, "parameter": parameter})
                parameter.add_(1.0)  # the optimizer step after the forward: the logged value is the one before
    assert syncs.total == 0, syncs.by_op
    with count_host_syncs() as reads:
        float(values[0])  # what add() did before: the counter sees it, so the zero above means something
    assert reads.total == 1
    result = means.pop()
    assert result == pytest.approx({"mean": 3.0, "parameter": 1.5})
    assert means.pop() == {}


def test_per_step_callbacks_do_not_sync(tiny_model):
    loss = RBSigmoidLoss(tiny_model)

    class Trainer:  # what LossStateCallback reads of the trainer
        pass

    trainer = Trainer()
    trainer.loss, trainer.model = loss, tiny_model
    callback = LossStateCallback(trainer)
    clipping = LossStatisticsCallback(loss)  # averages and clips the loss parameters' gradients (issue 53)
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


def test_running_means_pop_the_latest_ended_step_and_current_values_in_one_read(monkeypatch):
    """In the trainer each step is ended (end_step, no sync): pop gives the latest step that added values, whatever
    later steps added nothing; ``current`` values (state such as t) are read as they are, in the same transfer."""
    means = RunningMeans()
    with count_host_syncs() as syncs:
        assert not means.end_step()  # nothing added
        means.add({"margin": torch.tensor(1.0)})
        means.add({"margin": torch.tensor(3.0)})  # two batches of one step (gradient accumulation): their mean
        assert means.end_step()
        means.add({"margin": torch.tensor(10.0)})
        means.add({"margin": torch.tensor(20.0)})
        assert means.end_step()  # replaces the earlier step's
        assert not means.end_step()  # a step that did not run this loss keeps the latest
    assert syncs.total == 0, syncs.by_op
    parameter = torch.nn.Parameter(torch.tensor(2.5))
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: transfers.append(tensor.shape) or tolist(tensor))
    result = means.pop(current={"t": parameter, "capped": torch.tensor(0.0)})
    assert transfers == [torch.Size([4])]  # one transfer for the means (sum, count) and the current values together
    assert result == {"margin": 15.0, "t": 2.5, "capped": 0.0}
    assert means.pop(current={"t": parameter}) == {"t": 2.5}  # popped: the state only


def test_the_statistics_callback_keeps_host_reads_to_the_log(tiny_model):
    """A dict of losses: the per-step callbacks decide which losses compute statistics from Python facts alone."""
    from transformers import TrainingArguments

    from st_weince.training.callbacks import LossStatisticsCallback

    losses = {"a": RBSigmoidLoss(tiny_model), "b": RBSigmoidLoss(tiny_model)}
    callback = LossStatisticsCallback(losses)
    args = TrainingArguments(output_dir="unused", report_to="none", logging_steps=3)
    state, control = TrainerState(global_step=0), TrainerControl()
    state.logging_steps = 3
    callback.on_train_begin(args, state, control)
    embeddings = [torch.randn(4, 8), torch.randn(4, 8)]
    with count_host_syncs() as syncs:
        callback.on_step_begin(args, state, control)
        assert losses["a"].log_statistics and losses["b"].log_statistics  # neither has run since the last record
        losses["a"].compute_loss_from_embeddings(embeddings)  # check_inputs: a sync of the loss's own, below
        state.global_step = 1
        callback.on_step_end(args, state, control)
        callback.on_step_begin(args, state, control)
        assert not losses["a"].log_statistics and losses["b"].log_statistics
        callback.on_step_end(args, state, control)
    assert syncs.total == 1, syncs.by_op  # the loss's input check (check_inputs=True), none of the callback's


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:WEINCELoss at a batch", "ignore:CachedWEINCELoss at a batch")
@pytest.mark.parametrize("logging_steps", [3, 1])
def test_every_record_holds_every_datasets_statistics_and_the_state(
    tiny_model, tmp_path, one_torch_thread, logging_steps
):
    """Issue 54: a DatasetDict of three datasets, a dict of three losses, round robin. Before, a record held only
    the statistics of the dataset whose batch ran at the logging step (with logging_steps=3 always the third), and
    RB-Sigmoid's t and b_rel never appeared. Now every record holds each dataset's latest statistics, and t and b_rel
    as they are at the log."""
    from datasets import DatasetDict
    from transformers import TrainerCallback

    from st_weince.losses import CachedWEINCELoss, WEINCELoss
    from st_weince.training import prepare_trainer
    from tests.conftest import SHORT_RUN, TINY_SENTENCES, build_trainer, pairs_dataset

    intents = pairs_dataset(TINY_SENTENCES, shift=1).add_column("label", [index % 3 for index in range(12)])
    datasets = DatasetDict(
        {"intents": intents, "sts": pairs_dataset(TINY_SENTENCES, shift=5), "wiki": pairs_dataset(TINY_SENTENCES, 0)}
    )
    losses = {
        "intents": WEINCELoss(tiny_model, false_negative_filter="same_label"),
        "sts": RBSigmoidLoss(tiny_model),
        "wiki": CachedWEINCELoss(tiny_model, mini_batch_size=3),
    }

    class ComputedAt(TrainerCallback):  # after the statistics callback: which losses compute at each step
        def __init__(self):
            self.steps: dict[int, set[str]] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.steps[state.global_step + 1] = {name for name, loss in losses.items() if loss.log_statistics}

    computed_at = ComputedAt()
    arguments = {**SHORT_RUN, "logging_steps": logging_steps, "multi_dataset_batch_sampler": "round_robin"}
    trainer = build_trainer(
        tiny_model, losses, tmp_path, dataset=datasets, callbacks=[computed_at], **arguments,
        per_device_train_batch_size=6, max_steps=6, save_strategy="no",
    )  # fmt: skip
    prepare_trainer(trainer)
    trainer.train()
    records = [record for record in trainer.state.log_history if "loss" in record]
    assert [record["step"] for record in records] == list(range(logging_steps, 7, logging_steps))
    statistics = {"intents_weince_lambda_mean", "intents_weince_fn_masked_share", "sts_rb_sigmoid_margin",
                  "wiki_weince_lambda_mean", "wiki_weince_rho0"}  # fmt: skip
    state = {"sts_rb_sigmoid_t", "sts_rb_sigmoid_b_rel", "sts_rb_sigmoid_b", "sts_rb_sigmoid_t_capped"}
    for record in records:
        assert state <= set(record), record  # at every record, also before the sts dataset's first batch
        if record["step"] >= 3:  # round robin: each dataset has run once by step 3
            assert statistics <= set(record), record
    assert records[-1]["sts_rb_sigmoid_t"] == pytest.approx(losses["sts"].trained_values()["t"], abs=1e-6)
    assert records[-1]["sts_rb_sigmoid_b_rel"] == pytest.approx(losses["sts"].trained_values()["b_rel"], abs=1e-6)
    assert records[-1]["sts_rb_sigmoid_t"] != pytest.approx(10.0, rel=1e-3)  # trained, at 3e-2 a step
    if logging_steps == 3:
        # fresh each record: the sts batches of steps 2 and 5 hold other sentences, so other margins
        assert records[0]["sts_rb_sigmoid_margin"] != records[1]["sts_rb_sigmoid_margin"]
        # computed at the logging steps, and at each loss's first step after a record (round robin: a, b, c, a, ...)
        everyone = set(losses)
        assert computed_at.steps == {1: everyone, 2: {"sts", "wiki"}, 3: everyone, 4: everyone, 5: {"sts", "wiki"},
                                     6: everyone}  # fmt: skip
