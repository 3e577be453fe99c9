"""The WEINCE math on score matrices, against an independent plain implementation of the specification."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from st_weince.functional import (
    Gate,
    WEINCEOptions,
    check_scores,
    nt_xent_layout,
    weince_cross_entropy,
    weince_logits,
    weince_statistics,
)
from st_weince.functional.weince import tail_sizes, weince_tail_fit
from st_weince.utils.hotpath import count_host_syncs
from tests.float32_tolerance import tail_fit_tolerances
from tests.weince_reference import reference_loss, reference_statistics


def paired_scores(
    num_anchors: int, num_candidates: int | None = None, dim: int = 16, noise: float = 0.4, seed: int = 0
):
    generator = torch.Generator().manual_seed(seed)
    num_candidates = num_candidates or num_anchors
    anchors = F.normalize(torch.randn(num_anchors, dim, generator=generator), dim=1)
    candidates = torch.randn(num_candidates, dim, generator=generator)
    candidates[:num_anchors] = anchors + noise * candidates[:num_anchors]
    return anchors @ F.normalize(candidates, dim=1).T


@pytest.mark.numerics
@pytest.mark.parametrize("num_anchors", [2, 5, 12, 40, 130])
@pytest.mark.parametrize("beta", [1.0, "auto"])
@pytest.mark.parametrize("mode", ["both", "rho", "aic"])
def test_statistics_match_reference(num_anchors, beta, mode):
    """float32 statistics against the float64 reference on the same scores: within what the float32 fit's own rounding
    can move them (tests/float32_tolerance.py: 4 x the measured one-ulp sensitivity), plus the output's rounding."""
    scores = paired_scores(num_anchors, num_anchors + 7, seed=num_anchors)
    positive_index = torch.arange(num_anchors)
    options = WEINCEOptions(beta=beta, mode=mode)
    stats = weince_statistics(scores, positive_index, None, options)
    ref = reference_statistics(scores.double().numpy(), positive_index.numpy(), beta=beta, mode=mode)
    tolerance = tail_fit_tolerances(scores, positive_index, None, options)
    eps = torch.finfo(scores.dtype).eps
    for field in ("rho", "delta_aic", "beta_hat", "lam", "beta", "rho0"):
        actual = getattr(stats, field).double().numpy()
        np.testing.assert_allclose(actual, ref[field], rtol=eps, atol=tolerance[field], err_msg=field)
    np.testing.assert_array_equal(stats.fitted.numpy(), ref["fitted"])


def test_loss_matches_reference_with_mask_and_options():
    scores = paired_scores(48, 60, seed=3)
    positive_index = torch.randperm(60, generator=torch.Generator().manual_seed(1))[:48]
    valid_mask = torch.rand(48, 60, generator=torch.Generator().manual_seed(2)) > 0.15
    valid_mask[torch.arange(48), positive_index] = True
    gate = {"q": 0.5, "kappa_rho": 5.0, "kappa_aic": 0.5, "aic_margin": 0.0}
    tail = {"tail_frac": 0.3, "min_tail_points": 12}
    options = WEINCEOptions(scale=10.0, beta="auto", gate=Gate(**gate), **tail)
    loss = weince_cross_entropy(scores, positive_index, valid_mask, options)
    expected = reference_loss(
        scores.double().numpy(), positive_index.numpy(), valid_mask.numpy(), temperature=0.1, beta="auto",
        **gate, **tail,
    )  # fmt: skip
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_tail_sizes_follow_the_spec():
    counts = torch.tensor([0, 3, 9, 10, 31, 63, 319, 320, 330, 1000])
    k = tail_sizes(counts, tail_frac=0.10, min_tail_points=32)
    assert k.tolist() == [0, 3, 9, 10, 31, 32, 32, 32, 33, 100]


def test_lambda_zero_is_infonce():
    scores = paired_scores(64, seed=4).requires_grad_(True)
    positive_index = torch.arange(64)
    loss = weince_cross_entropy(scores, positive_index, None, WEINCEOptions(scale=20.0, gate=Gate(aic_margin=1e9)))
    infonce = F.cross_entropy(scores * 20.0, positive_index)
    assert float(loss.detach()) == pytest.approx(float(infonce.detach()), abs=1e-6)
    (grad,) = torch.autograd.grad(loss, scores)
    (grad_ref,) = torch.autograd.grad(infonce, scores)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)


def test_gradient_flows_through_scores_only():
    """The statistics are constants: the gradient equals that of the logits with lambda, beta frozen."""
    scores = paired_scores(40, seed=5)
    positive_index = torch.arange(40)
    stats = weince_statistics(scores, positive_index)  # beta "auto" by default
    assert not stats.lam.requires_grad and not stats.beta.requires_grad
    assert float(stats.lam.max()) > 0.05, "test needs a non-trivial blend"
    leaf = scores.clone().requires_grad_(True)
    loss = weince_cross_entropy(leaf, positive_index, None, WEINCEOptions(scale=20.0, beta="auto"))
    (grad,) = torch.autograd.grad(loss, leaf)
    lam, beta = stats.lam[:, None].double(), stats.beta[:, None].double()
    s = scores.double()
    # d loss / d s[a, c] = (softmax(l)[a, c] - 1[c = c+]) / A * dl/ds, with dl/ds = (1 - lam)/tau + lam beta/(1 - s)
    logits = (1 - lam) * s / 0.05 - lam * beta * torch.log1p(-s)
    expected = (
        (torch.softmax(logits, 1) - F.one_hot(positive_index, 40)) / 40 * ((1 - lam) / 0.05 + lam * beta / (1 - s))
    )
    torch.testing.assert_close(grad.double(), expected, atol=1e-6, rtol=1e-4)


def test_nt_xent_layout_through_valid_mask():
    generator = torch.Generator().manual_seed(6)
    view_a, view_b = torch.randn(20, 8, generator=generator), torch.randn(20, 8, generator=generator)
    scores, positive_index, valid_mask = nt_xent_layout(view_a, view_b)
    assert scores.shape == (40, 40) and not valid_mask.diagonal().any()
    assert positive_index[:20].tolist() == list(range(20, 40)) and positive_index[20:].tolist() == list(range(20))
    loss = weince_cross_entropy(scores, positive_index, valid_mask, WEINCEOptions(scale=2.0, beta=1.0))
    expected = reference_loss(scores.double().numpy(), positive_index.numpy(), valid_mask.numpy(), temperature=0.5)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # with lambda forced to 0 it is NT-Xent: cross-entropy over the 2N - 1 other views
    infonce = weince_cross_entropy(
        scores, positive_index, valid_mask, WEINCEOptions(scale=2.0, beta=1.0, gate=Gate(aic_margin=1e9))
    )
    z = F.normalize(torch.cat([view_a, view_b]), dim=1)
    sim = (z @ z.T / 0.5).masked_fill(torch.eye(40, dtype=torch.bool), float("-inf"))
    assert float(infonce) == pytest.approx(float(F.cross_entropy(sim, positive_index)), abs=1e-6)


@pytest.mark.parametrize(
    "scores",
    [
        torch.ones(6, 6),  # every score exactly 1
        -torch.ones(6, 6),  # every score exactly -1
        torch.full((8, 8), 0.3),  # duplicate rows, zero-variance tails
        torch.tensor([[1.0, 1.0], [1.0, 1.0]]),  # a batch of 2
    ],
)
@pytest.mark.parametrize("beta", [1.0, "auto"])
def test_edges_are_finite(scores, beta):
    scores = scores.clone().requires_grad_(True)
    positive_index = torch.arange(scores.shape[0])
    loss = weince_cross_entropy(scores, positive_index, None, WEINCEOptions(scale=20.0, beta=beta))
    (grad,) = torch.autograd.grad(loss, scores)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_scores_at_one_with_real_blend_are_finite():
    scores = paired_scores(60, seed=7)
    scores[:8, 5] = 1.0  # a negative exactly at the cap for a few anchors (and a positive at 1 for anchor 5)
    scores[10] = scores[11]  # duplicate rows
    scores = scores.requires_grad_(True)
    stats = weince_statistics(scores, torch.arange(60), None, WEINCEOptions(beta="auto"))
    assert float(stats.lam.max()) > 0.5
    loss = weince_cross_entropy(scores, torch.arange(60), None, WEINCEOptions(scale=20.0, beta="auto"))
    (grad,) = torch.autograd.grad(loss, scores)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_fewer_than_ten_negatives_fall_back_to_infonce():
    scores = paired_scores(4, seed=8)  # 3 negatives per anchor: n = 2 tail points after burn-in
    stats = weince_statistics(scores, torch.arange(4))
    assert stats.lam.tolist() == [0.0] * 4 and not stats.fitted.any()
    scores = paired_scores(9, seed=8)  # 8 negatives: k = 8, burn-in 1, 7 points: fitted
    assert weince_statistics(scores, torch.arange(9)).fitted.all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_scores_are_finite_and_close(dtype):
    scores = paired_scores(64, seed=9)
    positive_index = torch.arange(64)
    options = WEINCEOptions(scale=20.0, beta="auto")
    full = weince_cross_entropy(scores, positive_index, None, options)
    with torch.autocast("cpu", dtype=dtype):
        low = weince_cross_entropy(scores.to(dtype), positive_index, None, options)
        logits = weince_logits(scores.to(dtype), torch.full((64,), 0.5), torch.ones(64), scale=20.0)
    assert logits.dtype == torch.float32
    assert torch.isfinite(low)
    assert float(low) == pytest.approx(float(full), rel=0.05)


def test_bad_inputs_raise_clear_errors():
    scores = paired_scores(8, seed=10)
    positive_index = torch.arange(8)
    with pytest.raises(ValueError, match="temperature"):
        WEINCEOptions(scale=0.0)
    with pytest.raises(ValueError, match="temperature"):
        WEINCEOptions(scale=-1.0)
    bad = scores.clone()
    bad[2, 3] = float("nan")
    # the cross-entropy checks its values like torch's losses (one sync); check_inputs=False checks shapes only
    with pytest.raises(ValueError, match="NaN"):
        weince_cross_entropy(bad, positive_index)
    unchecked_options = WEINCEOptions(check_inputs=False)
    with count_host_syncs() as syncs:
        unchecked = weince_cross_entropy(bad, positive_index, None, unchecked_options)
    assert syncs.total == 0 and torch.isnan(unchecked)
    with pytest.raises(ValueError, match="NaN"):
        check_scores(bad, positive_index)
    with pytest.raises(ValueError, match="one entry per anchor"):
        weince_cross_entropy(scores, torch.arange(7))
    with pytest.raises(ValueError, match="2-D"):
        weince_statistics(scores[0], positive_index)
    with pytest.raises(ValueError, match="mode"):
        WEINCEOptions(mode="gumbel")
    with pytest.raises(ValueError, match="beta"):
        WEINCEOptions(beta=0.0)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[0, 0] = False
    with pytest.raises(ValueError, match="masked out"):
        check_scores(scores, positive_index, mask, every_row_has_positive=True)
    check_scores(scores, positive_index, mask)  # a row without a valid positive is fine outside a cross-entropy
    with pytest.raises(ValueError, match="needs a positive"):
        check_scores(scores, torch.full((8,), -1), every_row_has_positive=True)


@settings(max_examples=40, deadline=None)
@given(
    num_anchors=st.integers(2, 24),
    extra=st.integers(0, 16),
    noise=st.floats(0.0, 2.0),
    seed=st.integers(0, 10_000),
    beta=st.sampled_from([1.0, "auto"]),
)
def test_property_finite_bounded_and_permutation_invariant(num_anchors, extra, noise, seed, beta):
    scores = paired_scores(num_anchors, num_anchors + extra, noise=noise, seed=seed).clamp(-1, 1)
    positive_index = torch.arange(num_anchors)
    options = WEINCEOptions(scale=20.0, beta=beta)
    stats = weince_statistics(scores, positive_index, None, options)
    assert ((stats.lam >= 0) & (stats.lam <= 1)).all()
    assert (stats.rho > 0).all() and torch.isfinite(stats.delta_aic).all()
    loss = weince_cross_entropy(scores, positive_index, None, options)
    assert torch.isfinite(loss) and float(loss) >= 0
    # permuting the candidate columns (and the positives with them) changes nothing
    perm = torch.randperm(scores.shape[1], generator=torch.Generator().manual_seed(seed))
    inverse = torch.argsort(perm)
    permuted = weince_cross_entropy(scores[:, perm], inverse[positive_index], None, options)
    assert float(permuted) == pytest.approx(float(loss), rel=1e-5, abs=1e-6)


def test_statistics_do_not_depend_on_how_many_rows_are_fitted_together():
    """Row blocks (as a cached loss fits them) give bit-identical statistics to the whole matrix, although the
    fit design is tabulated per tail size for the whole matrix and computed per row for small blocks."""
    scores = paired_scores(90, 130, seed=11)
    valid_mask = torch.rand(90, 130, generator=torch.Generator().manual_seed(3)) > 0.3  # many distinct tail sizes
    positive_index = torch.arange(90)
    valid_mask[positive_index, positive_index] = True
    whole = weince_tail_fit(scores, positive_index, valid_mask)
    blocks = [
        weince_tail_fit(scores[i : i + 7], positive_index[i : i + 7], valid_mask[i : i + 7]) for i in range(0, 90, 7)
    ]
    for field in ("rho", "beta_hat", "delta_aic", "fitted"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(b, field) for b in blocks])), field


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_cross_entropy_equals_logits_then_cross_entropy(dtype):
    from st_weince.functional.weince import blended_cross_entropy

    scores = paired_scores(30, 40, seed=12).to(dtype)
    scores[3, 7] = 1.0  # a negative at the cap: the clamp's zero shortfall gradient
    scores[5, 5] = 1.0  # a positive at the cap
    positive_index = torch.arange(30)
    valid_mask = torch.rand(30, 40, generator=torch.Generator().manual_seed(4)) > 0.2
    valid_mask[positive_index, positive_index] = True
    lam = torch.rand(30, generator=torch.Generator().manual_seed(5), dtype=dtype)
    beta = 0.5 + 10 * torch.rand(30, generator=torch.Generator().manual_seed(6), dtype=dtype)
    weights = torch.rand(30, generator=torch.Generator().manual_seed(7), dtype=dtype)  # upstream gradient per row
    fused_input = scores.clone().requires_grad_()
    plain_input = scores.clone().requires_grad_()
    fused = blended_cross_entropy(fused_input, lam, beta, positive_index, valid_mask, scale=20.0)
    logits = weince_logits(plain_input, lam, beta, valid_mask, scale=20.0)
    plain = F.cross_entropy(logits, positive_index, reduction="none")
    assert fused.dtype == dtype
    torch.testing.assert_close(fused, plain)
    (fused * weights).sum().backward()
    (plain * weights).sum().backward()
    # float32: p - 1 at the positive cancels, so compare against the gradient's scale there
    scale = float(plain_input.grad.abs().max())
    atol = 1e-12 if dtype == torch.float64 else 1e-5 * scale
    torch.testing.assert_close(fused_input.grad, plain_input.grad, atol=atol, rtol=1e-5)
