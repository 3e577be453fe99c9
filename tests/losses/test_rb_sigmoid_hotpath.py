"""RBSigmoidLoss's training hot path: host-device syncs per forward+backward (at most 1 with the default checks, 0
with check_inputs=False; MultipleNegativesRankingLoss is the control at 0), torch.compile(fullgraph=True) equal to
eager, the clear errors still raised from the one deferred check, statistics kept on the device, and the dtype
(float64 stays float64 and equals the direct float64 formula to 1e-9; float16 / bfloat16 are computed in float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_weince.functional import nt_xent_layout, sigmoid_contrastive_loss
from st_weince.losses import RBSigmoidLoss
from st_weince.utils.hotpath import count_host_syncs

CONFIGURATIONS = [
    {},
    {"parametrization": "absolute"},
    {"chunk_size": 3, "symmetric": True, "locked_adapter": True},
    {"columns": "modalities", "symmetric": True, "trainable_bias": False},
]


def columns(*rows: int, dim: int = 6, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True) for n in rows]


def syncs_of_one_step(loss_fn, embeddings) -> int:
    with count_host_syncs() as syncs:
        loss_fn(embeddings).backward()
    return syncs.total


def test_mnrl_control_makes_no_sync():
    mnrl = MultipleNegativesRankingLoss(None)
    assert syncs_of_one_step(lambda e: mnrl.compute_loss_from_embeddings(e, None), columns(8, 8, 8)) == 0


@pytest.mark.parametrize("options", CONFIGURATIONS)
def test_one_sync_with_checks_and_none_without(options, one_torch_thread):
    checked = RBSigmoidLoss(None, **options)
    unchecked = RBSigmoidLoss(None, check_inputs=False, **options)
    assert syncs_of_one_step(checked.compute_loss_from_embeddings, columns(8, 8, 8)) == 1
    assert syncs_of_one_step(unchecked.compute_loss_from_embeddings, columns(8, 8, 8)) == 0
    # The score-matrix entry point of the vision recipe, too.
    view_a, view_b = columns(4, 4, seed=1)
    for loss_fn, expected in ((checked, 1), (unchecked, 0)):
        step = lambda views, f=loss_fn: f.loss_from_scores(*nt_xent_layout(*views))  # noqa: E731
        assert syncs_of_one_step(step, [view_a, view_b]) == expected
    # The statistics were recorded without a sync; they are read (one transfer) when the trainer logs.
    assert unchecked.pop_logged_statistics()["rb_sigmoid_t"] == pytest.approx(10.0, rel=1e-6)


def test_bad_input_still_raises_its_clear_error_with_one_sync():
    loss = RBSigmoidLoss(None)
    a, p, n = columns(4, 4, 4)
    bad = n.detach().clone()
    bad[2, 1] = float("inf")
    with pytest.raises(ValueError, match="column 2 has NaN or Inf embeddings"):
        loss.compute_loss_from_embeddings([a, p, bad])
    with torch.no_grad():
        loss.log_t.fill_(float("nan"))
    with pytest.raises(ValueError, match="loss parameter log_t is not finite: training diverged"):
        loss.compute_loss_from_embeddings([a, p, n])
    with pytest.raises(ValueError, match="positive_index must lie in"):
        RBSigmoidLoss(None).loss_from_scores(torch.zeros(2, 2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="2-D"):
        RBSigmoidLoss(None).compute_loss_from_embeddings([a[0], p[0]])
    with pytest.raises(ValueError, match="same embedding dimension"):
        RBSigmoidLoss(None).compute_loss_from_embeddings([a, p[:, :3]])
    # Without checks the NaN reaches the loss (the documented trade-off), and nothing is recorded as an error.
    unchecked = RBSigmoidLoss(None, check_inputs=False)
    assert torch.isnan(unchecked.compute_loss_from_embeddings([a, p, bad * float("nan")]))


def test_statistics_stay_on_the_device_and_skip_blocks_without_negatives():
    loss = RBSigmoidLoss(None, check_inputs=False)
    a, p = columns(1, 1)  # one pair: no non-matching pair, so no margin
    loss.compute_loss_from_embeddings([a, p])
    assert "rb_sigmoid_margin" not in loss.pop_logged_statistics()
    a, p = columns(5, 5, seed=3)
    for _ in range(3):
        loss.compute_loss_from_embeddings([a, p])
    s = F.normalize(a.detach(), dim=-1) @ F.normalize(p.detach(), dim=-1).T
    margin = (s.diagonal().min() - s[~torch.eye(5, dtype=torch.bool)].max()) / 2
    assert loss.pop_logged_statistics()["rb_sigmoid_margin"] == pytest.approx(margin.item(), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"chunk_size": 3, "symmetric": True, "locked_adapter": True}])
def test_compiled_fullgraph_equals_eager(options, one_torch_thread):
    torch._dynamo.reset()
    eager, compiled = (RBSigmoidLoss(None, check_inputs=False, **options) for _ in range(2))
    compiled_fn = torch.compile(compiled.compute_loss_from_embeddings, fullgraph=True)
    results = []
    for loss_fn, call in ((eager, eager.compute_loss_from_embeddings), (compiled, compiled_fn)):
        embeddings = columns(8, 8, 8, seed=5)
        value = call(embeddings)
        value.backward()
        grads = [e.grad for e in embeddings] + [p.grad for _, p in sorted(loss_fn.named_parameters())]
        results.append((value.detach(), grads, loss_fn.pop_logged_statistics()))
    (eager_value, eager_grads, eager_stats), (compiled_value, compiled_grads, compiled_stats) = results
    torch.testing.assert_close(compiled_value, eager_value, rtol=1e-5, atol=1e-6)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)
    # The statistics were recorded by the compiled call too (dynamo replays the side effect).
    assert compiled_stats == pytest.approx(eager_stats, rel=1e-5)


def direct_float64(embeddings: list[torch.Tensor], log_t: torch.Tensor, b_rel: torch.Tensor) -> torch.Tensor:
    """docs/algorithms.md section 2 in float64, written independently: anchors against all other columns' rows."""
    u = embeddings[0] / embeddings[0].norm(dim=1, keepdim=True)
    v = torch.cat([e / e.norm(dim=1, keepdim=True) for e in embeddings[1:]])
    s = u @ v.T
    y = torch.zeros_like(s)
    y[torch.arange(s.shape[0]), torch.arange(s.shape[0])] = 1.0
    z = log_t.double().exp() * (s - b_rel.double())
    return -(y * torch.log(torch.sigmoid(z)) + (1 - y) * torch.log(torch.sigmoid(-z))).sum() / s.shape[0]


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_float64_stays_float64_and_equals_the_direct_formula(chunk_size):
    loss = RBSigmoidLoss(None, 7.0, relative_bias=0.3, chunk_size=chunk_size)
    embeddings = columns(6, 6, 6, seed=7, dtype=torch.float64)
    value = loss.compute_loss_from_embeddings(embeddings)
    assert value.dtype == torch.float64
    value.backward()
    copies = [e.detach().clone().requires_grad_(True) for e in embeddings]
    log_t = loss.log_t.detach().clone().requires_grad_(True)
    b_rel = loss.b_rel.detach().clone().requires_grad_(True)
    expected = direct_float64(copies, log_t, b_rel)
    expected.backward()
    assert abs(value.item() - expected.item()) <= 1e-9 * max(1.0, abs(expected.item()))
    for ours, theirs in zip([e.grad for e in embeddings], [c.grad for c in copies]):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)
    assert loss.log_t.grad.item() == pytest.approx(log_t.grad.item(), rel=1e-9)
    assert loss.b_rel.grad.item() == pytest.approx(b_rel.grad.item(), rel=1e-9)
    # The score-matrix entry point and the functional follow the dtype too.
    scores = torch.rand(4, 5, dtype=torch.float64) * 2 - 1
    assert loss.loss_from_scores(scores, torch.arange(4)).dtype == torch.float64
    assert sigmoid_contrastive_loss(scores, torch.eye(4, 5, dtype=torch.float64), scale=2.0, bias=0.1).dtype == (
        torch.float64
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    loss = RBSigmoidLoss(None, 20.0, relative_bias=0.2)
    embeddings = columns(6, 6, seed=8, dtype=dtype)
    value = loss.compute_loss_from_embeddings(embeddings)
    assert value.dtype == torch.float32
    value.backward()
    assert embeddings[0].grad.dtype == dtype
    # The same as the float64 formula on the (rounded) half-precision values, to float32 accuracy.
    rounded = [e.detach().double() for e in embeddings]
    expected = direct_float64(rounded, loss.log_t.detach(), loss.b_rel.detach())
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
