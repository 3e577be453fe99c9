"""WEINCELoss and CachedWEINCELoss in 2 processes (gloo, CPU; forked by tests/forked.py with torchrun's environment)
equal one process on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from st_weince.functional import TopM
from st_weince.losses import WEINCELoss
from tests.float32_tolerance import block_scores, query_group, row_chunks, tail_fit_tolerances, ulps_apart
from tests.forked import run_ranks
from tests.weince_distributed_worker import (
    COMPOSITE_SETTINGS,
    COMPOSITE_STEPS,
    GUARD,
    SETTINGS,
    composite_step_batch,
    global_batch,
)


@pytest.fixture(scope="module")
def distributed_output(fork_server, tmp_path_factory) -> Path:
    """One 2-process launch for every test of this file (forked from the fork server: starting processes is slow)."""
    output_dir = tmp_path_factory.mktemp("weince-ddp")
    run_ranks(fork_server, "tests.weince_distributed_worker", [output_dir], output_dir, timeout=180)
    return output_dir


@pytest.fixture(scope="module")
def distributed_results(distributed_output) -> list[list[dict]]:
    return [torch.load(distributed_output / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def composite_results(distributed_output) -> list[list[list[dict]]]:
    return [torch.load(distributed_output / f"composite-rank{r}.pt") for r in range(2)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_two_processes_equal_one(distributed_results, setting):
    """Each rank scores its own 32 rows (the cached stage: 5 at a time), one process all 64 at once: float32 matmuls
    of other shapes, which a CPU kernel may round differently. lam and rho0 are held to what that rounding can move
    them (tests/float32_tolerance.py: 4 x the measured ulps apart x the measured one-ulp sensitivity)."""
    directions, partition_mode, num_columns = SETTINGS[setting]
    ranks = [distributed_results[r][setting] for r in range(2)]
    columns = [c.clone().requires_grad_(True) for c in global_batch(64, num_columns)]
    loss_fn = WEINCELoss(None, directions=directions, partition_mode=partition_mode)
    loss = loss_fn.compute_loss_from_embeddings(columns, None)
    loss.backward()
    with torch.no_grad():
        plain = [c.detach() for c in columns]
        group = query_group(loss_fn, plain)
        blocks = [[(0, 32), (32, 64)], row_chunks(32, 5) + row_chunks(32, 5, start=32)]
        ulps = max(ulps_apart(block_scores(loss_fn, plain, bounds), group.scores) for bounds in blocks)
    assert ulps <= 64, f"the processes' scores are {ulps} ulps from one process's"
    tolerance = tail_fit_tolerances(group.scores, group.positive_index, group.valid_mask, loss_fn.options, ulps)

    # Each rank averages over its own anchors; the global mean is the mean of the two.
    distributed_loss = (ranks[0]["loss"] + ranks[1]["loss"]) / 2
    assert abs(float(distributed_loss - loss.detach())) < 1e-5
    assert float(ranks[0]["rho0"]) == pytest.approx(float(loss_fn.last_statistics.rho0), abs=tolerance["rho0"])
    lam = loss_fn.last_statistics.lam
    torch.testing.assert_close(torch.cat([r["lam"] for r in ranks]), lam, atol=tolerance["lam"], rtol=0)
    assert float(loss_fn.last_statistics.lam.max()) > 0.05, "the check needs a non-trivial blend"
    # Gradients: each rank's rows receive d(sum of rank losses)/d(rows) = 2 x d(global mean)/d(rows).
    for column_index, column in enumerate(columns):
        distributed_grad = torch.cat([r["grads"][column_index] for r in ranks]) / 2
        torch.testing.assert_close(distributed_grad, column.grad, atol=1e-5, rtol=1e-4)
    # The cached loss stage (mini-batches of 5 rows on each rank) gives the same.
    assert abs(float((ranks[0]["cached_loss"] + ranks[1]["cached_loss"]) / 2 - loss.detach())) < 1e-5
    assert float(ranks[1]["cached_rho0"]) == pytest.approx(float(loss_fn.last_statistics.rho0), abs=tolerance["rho0"])
    torch.testing.assert_close(torch.cat([r["cached_lam"] for r in ranks]), lam, atol=tolerance["lam"], rtol=0)
    for column_index, column in enumerate(columns):
        distributed_grad = torch.cat([r["cached_grads"][column_index] for r in ranks]) / 2
        torch.testing.assert_close(distributed_grad, column.grad, atol=1e-5, rtol=1e-4)


def test_local_pivot_would_differ():
    """Sanity check of the fixture: split into halves, the local pivots differ from the global one, so the
    distributed test above really checks the global pivot."""
    columns = global_batch(64, 2)
    loss_fn = WEINCELoss(None)
    loss_fn.compute_loss_from_embeddings(columns, None)
    global_rho0 = float(loss_fn.last_statistics.rho0)
    loss_fn.compute_loss_from_embeddings([c[:32] for c in columns], None)
    assert abs(float(loss_fn.last_statistics.rho0) - global_rho0) > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_two_processes_equal_one_with_the_false_negative_guard(distributed_results, setting):
    """The guard sees the same global candidates with and without gather_across_devices (uncached and cached)."""
    directions, partition_mode, num_columns = SETTINGS[setting]
    ranks = [distributed_results[r][setting] for r in range(2)]
    columns = [c.clone().requires_grad_(True) for c in global_batch(64, num_columns)]
    loss_fn = WEINCELoss(None, directions=directions, partition_mode=partition_mode, false_negative_filter=GUARD)
    loss = loss_fn.compute_loss_from_embeddings(columns, None)
    loss.backward()
    assert loss_fn.pop_logged_statistics()["weince_fn_masked_share"] > 0.01, "the guard must act for the check"
    for prefix in ("guarded_", "guarded_cached_"):
        distributed_loss = (ranks[0][f"{prefix}loss"] + ranks[1][f"{prefix}loss"]) / 2
        assert abs(float(distributed_loss - loss.detach())) < 1e-5
        for column_index, column in enumerate(columns):
            distributed_grad = torch.cat([r[f"{prefix}grads"][column_index] for r in ranks]) / 2
            torch.testing.assert_close(distributed_grad, column.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("setting", range(len(COMPOSITE_SETTINGS)))
def test_two_processes_equal_one_with_the_top_m_terms(composite_results, setting):
    """The released composite under gather_across_devices: the batch tail index is fitted on the global batch's
    negatives, so both ranks carry the same moving average, equal to one process's, step after step; the loss and
    gradients (uncached and cached) equal one process's."""
    directions, partition_mode, num_columns = COMPOSITE_SETTINGS[setting]
    ranks = [composite_results[r][setting] for r in range(2)]
    single = WEINCELoss.released(None, directions=directions, partition_mode=partition_mode)
    for step in range(COMPOSITE_STEPS):
        columns = [c.clone().requires_grad_(True) for c in composite_step_batch(step, num_columns)]
        loss = single.compute_loss_from_embeddings(columns, None)
        loss.backward()
        mine = [ranks[r][step] for r in range(2)]
        for prefix in ("", "cached_"):
            # the same gathered tail on both ranks: the same moving average, bit for bit
            assert torch.equal(mine[0][f"{prefix}beta"], mine[1][f"{prefix}beta"]), (step, prefix)
            assert float(mine[0][f"{prefix}beta"]) == pytest.approx(float(single.batch_beta_ema), rel=1e-5)
            distributed_loss = (mine[0][f"{prefix}loss"] + mine[1][f"{prefix}loss"]) / 2
            assert abs(float(distributed_loss - loss.detach())) < 1e-5, (step, prefix)
            for column_index, column in enumerate(columns):
                distributed_grad = torch.cat([r[f"{prefix}grads"][column_index] for r in mine]) / 2
                torch.testing.assert_close(distributed_grad, column.grad, atol=1e-5, rtol=1e-4)
    assert float(single.batch_beta_ema) != TopM.beta_ema_start, "the tail index must move"
