"""Dtype fidelity: statistics and logits follow the scores' dtype (float16/bfloat16 in float32), and float64 inputs
reproduce the released implementation's algorithm (tests/weince_reference.py) to 1e-6 in loss and lambda."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from st_weince.functional import WEINCEOptions, weince_cross_entropy, weince_logits, weince_statistics
from st_weince.losses import WEINCELoss
from tests.weince_reference import options_of, reference_loss, reference_statistics


def scores_of(num_anchors: int, num_candidates: int, dtype: torch.dtype, seed: int = 0, noise: float = 0.5):
    generator = torch.Generator().manual_seed(seed)
    anchors = F.normalize(torch.randn(num_anchors, 24, generator=generator, dtype=torch.float64), dim=1)
    candidates = torch.randn(num_candidates, 24, generator=generator, dtype=torch.float64)
    candidates[:num_anchors] = anchors + noise * candidates[:num_anchors]
    return (anchors @ F.normalize(candidates, dim=1).T).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
    ],
)
def test_statistics_and_logits_follow_the_input_dtype(dtype, expected):
    scores = scores_of(40, 50, dtype)
    stats = weince_statistics(scores, torch.arange(40))  # beta "auto" by default
    for value in (stats.lam, stats.beta, stats.rho, stats.delta_aic, stats.rho0, stats.beta_hat):
        assert value.dtype == expected
    logits = weince_logits(scores, stats.lam, stats.beta, scale=20.0)
    assert logits.dtype == expected
    assert weince_cross_entropy(scores, torch.arange(40), None, WEINCEOptions(scale=20.0)).dtype == expected


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"beta": "auto"},
        {"mode": "rho", "q": 0.5},
        {"mode": "aic", "tail_frac": 0.3, "min_tail_points": 12},
        {"kappa_rho": 20.0, "kappa_aic": 0.5, "aic_margin": 0.0},
    ],
)
def test_float64_reproduces_the_reference_to_1e_6(seed, options):
    num_anchors, num_candidates = 96, 150
    scores = scores_of(num_anchors, num_candidates, torch.float64, seed=seed, noise=0.3 + 0.2 * seed)
    generator = torch.Generator().manual_seed(seed)
    positive_index = torch.randperm(num_candidates, generator=generator)[:num_anchors]
    valid_mask = torch.rand(num_anchors, num_candidates, generator=generator, dtype=torch.float64) > 0.1
    valid_mask[torch.arange(num_anchors), positive_index] = True
    stats = weince_statistics(scores, positive_index, valid_mask, options_of(**options))
    ref = reference_statistics(scores.numpy(), positive_index.numpy(), valid_mask.numpy(), **options)
    assert float(stats.lam.max()) > 0.05, "the comparison needs a non-trivial blend"
    np.testing.assert_allclose(stats.lam.numpy(), ref["lam"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(stats.rho0), ref["rho0"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(stats.delta_aic.numpy(), ref["delta_aic"], rtol=1e-8, atol=1e-7)
    loss = weince_cross_entropy(scores, positive_index, valid_mask, options_of(20.0, **options))
    expected = reference_loss(scores.numpy(), positive_index.numpy(), valid_mask.numpy(), temperature=0.05, **options)
    assert abs(float(loss) - expected) < 1e-6


def test_float64_embeddings_give_a_float64_loss_equal_to_the_reference():
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(64, 16, generator=generator, dtype=torch.float64)
    columns = [
        (base + 0.8 * torch.randn(64, 16, generator=generator, dtype=torch.float64)).requires_grad_() for _ in "ab"
    ]
    loss_fn = WEINCELoss(None, beta=1.0)
    loss = loss_fn.compute_loss_from_embeddings(columns, None)
    assert loss.dtype == torch.float64 and loss_fn.last_statistics.lam.dtype == torch.float64
    scores = F.normalize(columns[0].detach(), dim=1) @ F.normalize(columns[1].detach(), dim=1).T
    expected = reference_loss(scores.numpy(), np.arange(64), temperature=0.05, beta=1.0)
    ref = reference_statistics(scores.numpy(), np.arange(64), beta=1.0)
    assert abs(float(loss.detach()) - expected) < 1e-6
    np.testing.assert_allclose(loss_fn.last_statistics.lam.numpy(), ref["lam"], rtol=0, atol=1e-6)
    loss.backward()
    assert columns[0].grad.dtype == torch.float64
