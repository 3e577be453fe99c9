"""A loss call's fixed cost: on a GPU every operator is a kernel launch, so the number of top-level operators of one
forward + backward is held under a budget in multiples of MultipleNegativesRankingLoss's (WEINCE 3x, the released
composite 5x, RB-Sigmoid 2x; benchmarks/operator_count.py commits the counts). The logged statistics cost nothing
on the steps that do not log them, and leave the loss as it is."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from benchmarks.operator_count import TARGETS, build_loss, embeddings, top_level_operators
from st_weince.losses import RBSigmoidLoss, WEINCELoss
from st_weince.training.callbacks import LossStatisticsCallback


@pytest.mark.parametrize("columns", [2, 3])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_call_runs_at_most_its_budget_of_operators(name, columns):
    batch = embeddings(16, columns)
    mnrl = sum(top_level_operators(build_loss("mnrl"), batch).values())
    count = sum(top_level_operators(build_loss(name), batch).values())  # a step that logs its statistics
    assert count <= TARGETS[name] * mnrl, f"{name}: {count} operators, MNRL {mnrl}"


@pytest.mark.parametrize("make", [WEINCELoss.released, RBSigmoidLoss], ids=["composite", "rb_sigmoid"])
def test_without_statistics_the_loss_is_the_same_and_nothing_is_logged(make):
    logged, silent = make(None), make(None)
    silent.log_statistics = False
    batch = embeddings(32, 2)
    loss = logged.compute_loss_from_embeddings(batch, None)
    assert torch.equal(loss, silent.compute_loss_from_embeddings(batch, None))
    state = {key: float(value) for key, value in silent.logged_state().items()}  # RB-Sigmoid's t ...: not statistics
    assert logged.pop_logged_statistics().keys() - state.keys()
    assert silent.pop_logged_statistics() == pytest.approx(state)
    if isinstance(silent, WEINCELoss):
        assert silent.last_step.effective_scales == {} and logged.last_step.effective_scales
        assert torch.equal(silent.last_step.statistics.lam, logged.last_step.statistics.lam)


@pytest.mark.parametrize(
    ("settings", "logged_steps"),
    [
        ({"logging_steps": 3}, [3, 6]),
        ({"logging_steps": 3, "logging_first_step": True}, [1, 3, 6]),
        ({"logging_strategy": "epoch"}, [1, 2, 3, 4, 5, 6, 7]),
        ({"logging_strategy": "no"}, []),
    ],
)
def test_the_trainer_integration_asks_for_statistics_at_the_steps_it_logs(tmp_path, settings, logged_steps):
    """As transformers' DefaultFlowCallback decides after each step whether to log, for the step about to run; after
    the step (an evaluation's forwards) and after training, as the loss was built."""
    loss = WEINCELoss(None)
    callback = LossStatisticsCallback(loss)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)
    state, control = TrainerState(), TrainerControl()
    state.logging_steps = settings.get("logging_steps", 500)
    asked = []
    for step in range(7):
        state.global_step = step
        callback.on_step_begin(args, state, control)
        if loss.log_statistics:
            asked.append(step + 1)
        callback.on_step_end(args, state, control)
        assert not loss.log_statistics
    callback.on_train_end(args, state, control)
    assert asked == logged_steps and loss.log_statistics
