"""RBSigmoidLoss and CachedRBSigmoidLoss in 2 processes (gloo, CPU; forked by tests/forked.py with torchrun's
environment): the loss equals one process on the same global batch, loss-parameter gradients averaged across
processes equal the single-process ones, and after several trainer steps with prepare_trainer the loss parameters are
identical on both ranks (without it they drift apart), with the cached loss ending where the uncached one does."""

from __future__ import annotations

import pytest
import torch

from st_weince.losses import RBSigmoidLoss
from tests.forked import run_ranks
from tests.rb_sigmoid_distributed_worker import GLOBAL_BATCH, SETTINGS, global_batch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(fork_server, tmp_path_factory, tiny_model_dir) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("rb-sigmoid-ddp")
    argv = [output_dir, tiny_model_dir]  # every run loads conftest's tiny BERT (build_tiny_bert, seed 0)
    run_ranks(fork_server, "tests.rb_sigmoid_distributed_worker", argv, output_dir, timeout=420)
    return [torch.load(output_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_two_processes_equal_one_process(ranks, setting):
    options, num_columns = SETTINGS[setting]
    per_rank = [ranks[r]["embedding"][setting] for r in range(2)]
    columns = [c.clone().requires_grad_(True) for c in global_batch(GLOBAL_BATCH, num_columns)]
    loss_fn = RBSigmoidLoss(None, **options)
    loss = loss_fn.compute_loss_from_embeddings(columns)
    loss.backward()
    if "false_negative_filter" in options:  # the guard must act for the check to mean something
        assert loss_fn.pop_logged_statistics()["rb_sigmoid_fn_masked_share"] > 0.01

    # Each rank averages over its own anchors: the global loss is the mean of the two rank losses.
    assert float((per_rank[0]["loss"] + per_rank[1]["loss"]) / 2) == pytest.approx(loss.item(), rel=1e-5)
    # Loss parameters: the averaged gradient is the single-process gradient, and identical on both ranks.
    for name, parameter in loss_fn.named_parameters():
        for r in range(2):
            torch.testing.assert_close(per_rank[r]["param_grads_averaged"][name], parameter.grad, rtol=1e-4, atol=1e-6)
    # ... while before averaging the ranks disagree (so the check above is not vacuous).
    assert not torch.allclose(per_rank[0]["param_grads_local"]["log_t"], per_rank[1]["param_grads_local"]["log_t"])
    # Embedding rows: each rank's rows receive d(sum of rank losses)/d(rows) = 2 x d(global mean)/d(rows).
    for index, column in enumerate(columns):
        distributed = torch.cat([per_rank[r]["grads"][index] for r in range(2)]) / 2
        torch.testing.assert_close(distributed, column.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_cached_loss_stage_two_processes_equal_one_process(ranks, setting):
    """CachedRBSigmoidLoss with gather_across_devices: the loss stage on each rank's mini-batches equals the
    single-process uncached loss on the global batch, as the uncached loss does above."""
    options, num_columns = SETTINGS[setting]
    per_rank = [ranks[r]["embedding"][setting]["cached"] for r in range(2)]
    columns = [c.clone().requires_grad_(True) for c in global_batch(GLOBAL_BATCH, num_columns)]
    loss_fn = RBSigmoidLoss(None, **options)
    loss = loss_fn.compute_loss_from_embeddings(columns)
    loss.backward()
    assert float((per_rank[0]["loss"] + per_rank[1]["loss"]) / 2) == pytest.approx(loss.item(), rel=1e-5)
    for name, parameter in loss_fn.named_parameters():
        for r in range(2):
            torch.testing.assert_close(per_rank[r]["param_grads_averaged"][name], parameter.grad, rtol=1e-4, atol=1e-6)
    for index, column in enumerate(columns):
        distributed = torch.cat([per_rank[r]["grads"][index] for r in range(2)]) / 2
        torch.testing.assert_close(distributed, column.grad, rtol=1e-4, atol=1e-6)


def test_trainer_keeps_loss_parameters_identical_across_ranks(ranks):
    prepared = [ranks[r]["trainer"]["prepared"] for r in range(2)]
    plain = [ranks[r]["trainer"]["plain"] for r in range(2)]
    assert prepared[0] == pytest.approx(prepared[1], rel=1e-6, abs=1e-7)
    assert prepared[0][0] != pytest.approx(10.0, rel=1e-3), "t must have moved during training"
    # Without prepare_trainer the ranks would drift apart: each refuses its first step instead, naming the line to add,
    # before any optimizer step (t and b_rel are still their starts).
    for rank in plain:
        assert rank["error"] is not None and "st_weince.training.prepare_trainer(trainer)" in rank["error"]
        assert "drift apart across processes" in rank["error"] and "log_t, b_rel" in rank["error"]
        assert rank["values"] == pytest.approx([10.0, 0.7], rel=1e-6)


def test_cached_trainer_run_equals_the_uncached_one(ranks):
    """Two DDP processes, gather_across_devices, prepare_trainer, SGD: the cached loss moves t and b_rel exactly as
    the uncached one, identically on both ranks."""
    cached = [ranks[r]["trainer"]["cached"] for r in range(2)]
    uncached = [ranks[r]["trainer"]["uncached"] for r in range(2)]
    assert cached[0] == pytest.approx(cached[1], rel=1e-6, abs=1e-7)
    assert uncached[0][0] != pytest.approx(10.0, rel=1e-4), "t must have moved"
    assert cached[0] == pytest.approx(uncached[0], rel=1e-5, abs=1e-6)
