"""WEINCE's hot path: at most one host-device sync per forward + backward (none with check_inputs=False), the
same clear errors, and torch.compile(fullgraph=True) equal to eager."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_weince.functional import nt_xent_layout
from st_weince.losses import WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.float32_tolerance import query_group, tail_fit_tolerances

SETTINGS = [
    (("query_to_doc",), "joint", 3),
    (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint", 2),
    (("query_to_doc", "doc_to_doc"), "joint", 3),
    (("query_to_doc", "doc_to_query"), "per_direction", 2),
]


def columns(batch_size: int, num_columns: int, dim: int = 16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, dim, generator=generator)
    return [(base + torch.randn(batch_size, dim, generator=generator)).requires_grad_() for _ in range(num_columns)]


def syncs_of_one_step(loss, embeddings) -> int:
    with count_host_syncs() as syncs:
        loss.compute_loss_from_embeddings(embeddings, None).backward()
    return syncs.total


def test_mnrl_control_makes_no_sync():
    assert syncs_of_one_step(MultipleNegativesRankingLoss(None), columns(64, 3)) == 0


@pytest.mark.parametrize(("directions", "partition_mode", "num_columns"), SETTINGS)
@pytest.mark.parametrize("beta", [1.0, "auto"])
def test_at_most_one_sync_with_checks_and_none_without(directions, partition_mode, num_columns, beta):
    embeddings = columns(64, num_columns)
    checked = WEINCELoss(None, directions=directions, partition_mode=partition_mode, beta=beta)
    unchecked = WEINCELoss(None, directions=directions, partition_mode=partition_mode, beta=beta, check_inputs=False)
    assert syncs_of_one_step(checked, embeddings) == 1
    assert syncs_of_one_step(unchecked, embeddings) == 0
    assert float(checked.last_statistics.lam.max()) > 0.05, "the blend must be active for the count to mean much"
    # the logged statistics stay on the device until the trainer logs
    with count_host_syncs() as syncs:
        checked.compute_loss_from_embeddings(embeddings, None)
    assert syncs.total == 1
    logged = checked.pop_logged_statistics()
    assert set(logged) >= {"weince_lambda_mean", "weince_rho0"} and 0 <= logged["weince_lambda_mean"] <= 1


def test_loss_from_scores_syncs_once():
    scores, positive_index, valid_mask = nt_xent_layout(*columns(32, 2))
    with count_host_syncs() as syncs:
        WEINCELoss(None, scale=2.0).loss_from_scores(scores, positive_index, valid_mask).backward()
    assert syncs.total == 1
    with count_host_syncs() as syncs:
        WEINCELoss(None, scale=2.0, check_inputs=False).loss_from_scores(scores, positive_index, valid_mask)
    assert syncs.total == 0


def test_errors_are_still_raised_with_one_sync():
    embeddings = [c.detach().clone() for c in columns(16, 3)]
    embeddings[2][4, 1] = float("inf")
    with pytest.raises(ValueError, match="column 2 has NaN or Inf"):
        WEINCELoss(None).compute_loss_from_embeddings(embeddings, None)
    # unchecked, the same input is not refused: the caller opted out of the check (documented)
    loss = WEINCELoss(None, check_inputs=False).compute_loss_from_embeddings(embeddings, None)
    assert not torch.isfinite(loss)


@pytest.mark.slow
def test_compiled_equals_eager(one_torch_thread):
    embeddings = columns(48, 3, seed=3)
    loss_fn = WEINCELoss(
        None, directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), check_inputs=False
    )
    eager = loss_fn.compute_loss_from_embeddings(embeddings, None)
    eager_grads = torch.autograd.grad(eager, embeddings)
    eager_lam = loss_fn.last_statistics.lam
    compiled_fn = torch.compile(loss_fn.compute_loss_from_embeddings, fullgraph=True)
    compiled = compiled_fn(embeddings, None)
    compiled_grads = torch.autograd.grad(compiled, embeddings)
    assert float(eager_lam.max()) > 0.05
    torch.testing.assert_close(compiled.detach(), eager.detach(), rtol=1e-5, atol=1e-6)
    for grad, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    # both calls were recorded for the logs, on the device
    # The logged mean is (eager + compiled) / 2; the compiled kernels may round the scores differently, by about an
    # ulp, and lam moves by what tests/float32_tolerance.py derives for that.
    group = query_group(loss_fn, [e.detach() for e in embeddings])
    tolerance = tail_fit_tolerances(group.scores, group.positive_index, group.valid_mask, loss_fn.options)["lam"]
    logged = loss_fn.pop_logged_statistics()["weince_lambda_mean"]
    assert logged == pytest.approx(float(eager_lam.mean()), rel=1e-6, abs=tolerance)
