"""Link selection: a known lambda from choices simulated under the blended link, the LR test, identifiability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from st_weince.diagnostics import fit_link, link_loglik
from st_weince.functional.weince import weince_logits


def _simulate(lam: float, *, beta: float = 1.0, tau: float = 0.1, anchors: int = 1500, candidates: int = 32, seed=0):
    """Scores with a tail toward the cap 1; winners drawn from the blended link (WEINCE's own logits)."""
    generator = torch.Generator().manual_seed(seed)
    distances = np.random.default_rng(seed).beta(2.0, 3.0, size=(anchors, candidates))
    scores = torch.from_numpy(1.0 - 2.0 * distances).float()
    logits = weince_logits(scores, torch.full((anchors,), lam), torch.full((anchors,), beta), scale=1 / tau)
    winners = torch.multinomial(torch.softmax(logits.double(), dim=1), 1, generator=generator).squeeze(1)
    return scores, winners


def test_known_lambda_recovered_with_beta_fixed() -> None:
    scores, winners = _simulate(0.5, anchors=4000)
    fit = fit_link(scores, winners, temperature=0.1, profile_points=5)
    assert fit.lam_ci[0] < 0.5 < fit.lam_ci[1]
    assert fit.lam == pytest.approx(0.5, abs=0.1)
    assert fit.tau == pytest.approx(0.1, rel=0.15)
    assert fit.lr_statistic > 30 and fit.p_value < 1e-6
    assert not fit.separated
    # the reported likelihood is the one of WEINCE's logits at the fitted values (one formula)
    assert fit.loglik == pytest.approx(link_loglik(scores, winners, lam=fit.lam, beta=fit.beta, tau=fit.tau), abs=1e-3)
    assert fit.loglik_softmax == pytest.approx(
        link_loglik(scores, winners, lam=0.0, beta=1.0, tau=fit.tau_softmax), abs=1e-3
    )
    assert max(fit.profile_loglik) <= fit.loglik + 1e-6  # the MLE is the top of its own profile


def test_known_lambda_recovered_with_tau_fixed() -> None:
    scores, winners = _simulate(0.4, beta=2.0, tau=0.1, seed=1)
    fit = fit_link(scores, winners, free=("lambda", "beta"), temperature=0.1, profile_points=5)
    assert fit.lam_ci[0] < 0.4 < fit.lam_ci[1]
    assert fit.lam == pytest.approx(0.4, abs=0.08)
    assert fit.beta == pytest.approx(2.0, rel=0.3)
    assert fit.tau == 0.1


def test_softmax_data_gives_small_lambda_and_no_rejection() -> None:
    scores, winners = _simulate(0.0, tau=0.1, seed=2)
    fit = fit_link(scores, winners, temperature=0.1, profile_points=5)
    assert fit.lam < 0.15
    assert fit.lam_ci[0] == 0.0
    assert fit.p_value > 0.01
    assert fit.tau_softmax == pytest.approx(0.1, rel=0.15)
    assert fit.loglik >= fit.loglik_softmax - 1e-9


def test_fit_is_invariant_to_the_order_of_candidates() -> None:
    scores, winners = _simulate(0.3, anchors=600, seed=3)
    perm = torch.randperm(scores.shape[1], generator=torch.Generator().manual_seed(0))
    inverse = torch.argsort(perm)
    a = fit_link(scores, winners, profile_points=3)
    b = fit_link(scores[:, perm], inverse[winners], profile_points=3)
    assert a.lam == pytest.approx(b.lam, abs=1e-4)
    assert a.loglik == pytest.approx(b.loglik, rel=1e-8)


def test_masked_candidates_are_ignored() -> None:
    scores, winners = _simulate(0.3, anchors=600, candidates=16, seed=4)
    extra = torch.full((scores.shape[0], 4), 0.999)  # would dominate the shortfall logit if they counted
    mask = torch.cat([torch.ones_like(scores, dtype=torch.bool), torch.zeros_like(extra, dtype=torch.bool)], 1)
    a = fit_link(scores, winners, profile_points=3)
    b = fit_link(torch.cat([scores, extra], 1), winners, mask, profile_points=3)
    assert a.lam == pytest.approx(b.lam, abs=1e-4)
    assert b.mean_candidates == 16


def test_separated_data_are_flagged() -> None:
    scores = torch.rand(50, 8) * 0.5
    scores[:, 0] = 0.9  # the winner always has the top score
    fit = fit_link(scores, torch.zeros(50, dtype=torch.long), profile_points=3)
    assert fit.separated and fit.top1_accuracy == 1.0
    assert "separated data" in fit.note
    assert fit.lam_ci == (0.0, 1.0)


def test_errors() -> None:
    scores, winners = _simulate(0.2, anchors=20, candidates=8)
    with pytest.raises(ValueError, match="not identified"):
        fit_link(scores, winners, free=("lambda", "beta", "tau"))
    with pytest.raises(ValueError, match="free must be"):
        fit_link(scores, winners, free=("beta", "tau"))
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        fit_link(scores * 3, winners)
    mask = torch.ones_like(scores, dtype=torch.bool)
    mask[0, winners[0]] = False
    with pytest.raises(ValueError, match="masked out"):
        fit_link(scores, winners, mask)
    with pytest.raises(ValueError, match="winner_index must lie"):
        fit_link(scores, winners + 8)
    bad = scores.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fit_link(bad, winners)
    with pytest.raises(ValueError, match="beta must be"):
        fit_link(scores, winners, beta=0.0)


def test_tau_fixed_fit_at_the_lambda_zero_limit() -> None:
    # Winners from a sharp link (tau = 0.1 with a shortfall term) fitted with tau fixed at 0.5: the softmax coefficient
    # wanted (about 1 / 0.1 (1 - lambda)) exceeds 1 / 0.5, so the optimum is the limit lambda -> 0, beta -> infinity.
    scores, winners = _simulate(0.3, tau=0.1, anchors=600, seed=5)
    fit = fit_link(scores, winners, free=("lambda", "beta"), temperature=0.5, profile_points=3)
    assert fit.lam == 0.0 and fit.beta == float("inf")
    assert fit.softmax_coef == pytest.approx(2.0) and fit.shortfall_coef > 0
    assert "beta -> infinity" in fit.note
    assert fit.lam_ci[0] == 0.0 and fit.lam_ci[1] < 0.5
    assert fit.profile_loglik[0] == pytest.approx(fit.loglik, abs=1e-6)  # the closure point is the profile's top
