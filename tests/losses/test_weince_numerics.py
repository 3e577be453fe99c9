"""Numerics found by fuzzing: tails without shape (all negatives equal) and embeddings whose norm overflows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_weince.functional import Gate, WEINCEOptions, normalize_rows, weince_statistics
from st_weince.losses import CachedWEINCELoss, WEINCELoss

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def collapsed_rows(value: float, dtype: torch.dtype, num_anchors: int = 64, num_collapsed: int = 16) -> torch.Tensor:
    """Scores whose first rows have every negative equal to ``value``; the other rows have spread tails with
    larger shortfalls, so the hardness gate of the collapsed rows is near 1 and only the geometry gate can hold
    their lambda down."""
    generator = torch.Generator().manual_seed(0)
    scores = (0.4 * torch.rand(num_anchors, num_anchors, generator=generator, dtype=torch.float64) - 0.6).clamp(-1, 1)
    scores[:num_collapsed] = value
    scores.fill_diagonal_(1.0)
    return scores.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.92, 0.93, 0.5, 0.999, -0.3])
def test_equal_negatives_give_no_tail_shape(value, dtype):
    stats = weince_statistics(collapsed_rows(value, dtype), torch.arange(64))  # beta "auto" by default
    bound = 1.0 / (1.0 + math.exp(2.0))  # sigmoid(-aic_margin) at the default margin 2
    assert float(stats.lam[:16].max()) <= bound + 1e-6
    assert float(stats.delta_aic[:16].abs().max()) == 0.0 and float(stats.beta_hat[:16].abs().max()) == 0.0
    assert stats.fitted[:16].all() and torch.isfinite(stats.lam).all()


@settings(max_examples=60, deadline=None)
@given(
    value=st.floats(-0.999, 0.9999),
    dtype=st.sampled_from(DTYPES),
    margin=st.sampled_from([0.0, 2.0, 6.0]),
    num_anchors=st.integers(12, 80),
)
def test_property_equal_negatives_keep_lambda_below_the_geometry_gate(value, dtype, margin, num_anchors):
    scores = collapsed_rows(value, dtype, num_anchors=num_anchors, num_collapsed=num_anchors // 3)
    stats = weince_statistics(scores, torch.arange(num_anchors), options=WEINCEOptions(gate=Gate(aic_margin=margin)))
    bound = 1.0 / (1.0 + math.exp(margin))
    assert float(stats.lam[: num_anchors // 3].max()) <= bound * (1 + 1e-6)
    assert torch.isfinite(stats.lam).all() and torch.isfinite(stats.delta_aic).all()


def test_spread_tails_are_still_fitted():
    """The relative threshold must not swallow real tails: the non-collapsed rows keep their dAIC."""
    stats = weince_statistics(collapsed_rows(0.92, torch.float32), torch.arange(64))
    assert (stats.delta_aic[16:] != 0).all()


@pytest.mark.parametrize("magnitude", [1e20, 1e30])
@pytest.mark.parametrize("cached", [False, True])
def test_norms_that_overflow_are_refused_clearly(magnitude, cached):
    generator = torch.Generator().manual_seed(1)
    columns = [torch.randn(16, 8, generator=generator) for _ in range(3)]
    columns[2][5] *= magnitude  # finite entries, norm beyond float32
    assert torch.isfinite(columns[2]).all()
    if cached:
        loss = CachedWEINCELoss(None, mini_batch_size=4)
        compute = lambda cols, labels: loss.calculate_loss([list(c.split(4)) for c in cols], labels)  # noqa: E731
    else:
        compute = WEINCELoss(None).compute_loss_from_embeddings
    with pytest.raises(ValueError, match="column 2 has NaN or Inf embeddings, or finite ones whose L2 norm overflows"):
        compute([c.requires_grad_() for c in columns], None)


def test_large_norms_below_the_overflow_are_exact():
    generator = torch.Generator().manual_seed(1)
    base = [torch.randn(16, 8, generator=generator) for _ in range(2)]
    scaled = [(c * 1e15).requires_grad_() for c in base]
    plain = [c.clone().requires_grad_() for c in base]
    loss_scaled = WEINCELoss(None).compute_loss_from_embeddings(scaled, None)
    loss_plain = WEINCELoss(None).compute_loss_from_embeddings(plain, None)
    loss_scaled.backward()
    loss_plain.backward()
    assert float(loss_scaled.detach()) == pytest.approx(float(loss_plain.detach()), rel=1e-5)
    torch.testing.assert_close(scaled[0].grad * 1e15, plain[0].grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(normalize_rows(scaled[0].detach()).norm(dim=1), torch.ones(16))


def test_mnrl_cos_sim_loses_huge_norms_silently():
    """The behaviour the check refuses: sentence-transformers' cos_sim squares the entries, so a norm above ~1e19
    overflows in float32 and the row becomes a zero vector (uniform softmax, zero gradient), without an error.
    WEINCELoss(check_inputs=False) skips the check and behaves the same way."""
    generator = torch.Generator().manual_seed(2)
    columns = [(torch.randn(16, 8, generator=generator) * 1e20).requires_grad_() for _ in range(2)]
    loss = MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(columns, None)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(math.log(16), rel=1e-6)
    assert float(columns[0].grad.abs().max()) == 0.0
    unchecked = WEINCELoss(None, check_inputs=False).compute_loss_from_embeddings(columns, None)
    assert float(unchecked.detach()) == pytest.approx(math.log(16), rel=1e-6)
