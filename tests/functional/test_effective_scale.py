"""The effective scale of WEINCE's terms (st_weince.functional.effective_scale): the secant slope of each term's logit
over the scores its softmax runs over, against hand computations; logged by both loss classes."""

from __future__ import annotations

import math

import pytest
import torch

from st_weince.functional import TopM, nt_xent_layout
from st_weince.functional.effective_scale import blend_effective_scale, shortfall_secant_slope
from st_weince.functional.top_m import top_m_selection, top_m_terms
from st_weince.losses import CachedWEINCELoss, WEINCELoss

EPS = 1e-6


def test_the_shortfall_secant_slope_by_hand_and_its_tangent_limit():
    low = torch.tensor([0.1, -0.5, 0.9, 0.3], dtype=torch.float64)
    high = torch.tensor([0.6, 0.5, 0.99, 0.3], dtype=torch.float64)
    slope = shortfall_secant_slope(torch.stack([low, high], dim=1), None, EPS)
    expected = [(math.log(1 - a) - math.log(1 - b)) / (b - a) for a, b in zip(low.tolist()[:3], high.tolist()[:3])]
    assert slope[:3].tolist() == pytest.approx(expected, rel=1e-12)
    assert float(slope[3]) == pytest.approx(1 / 0.7, rel=1e-12)  # one score: the tangent beta / (1 - s)
    # scores at the cap use 1 - eps, as the logits do: finite
    assert math.isfinite(float(shortfall_secant_slope(torch.tensor([[0.0, 1.0]]), None, EPS)))


def test_the_blend_scale_is_the_temperature_at_lambda_0_and_the_shortfall_secant_at_1():
    scores = torch.tensor([[0.2, 0.7, -0.1], [0.5, 0.5, 0.9]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True], [True, False, True]])
    beta = torch.tensor([2.0, 3.0], dtype=torch.float64)
    at_zero = blend_effective_scale(scores, valid, torch.zeros(2, dtype=torch.float64), beta, scale=20.0, eps=EPS)
    assert at_zero.tolist() == [20.0, 20.0]
    at_one = blend_effective_scale(scores, valid, torch.ones(2, dtype=torch.float64), beta, scale=20.0, eps=EPS)
    row0 = 2.0 * (math.log(1.1) - math.log(0.3)) / 0.8  # range -0.1 .. 0.7
    row1 = 3.0 * (math.log(0.5) - math.log(0.1)) / 0.4  # 0.5 .. 0.9 (the masked 0.5 changes nothing here)
    assert at_one.tolist() == pytest.approx([row0, row1], rel=1e-12)
    half = blend_effective_scale(scores, valid, torch.full((2,), 0.5, dtype=torch.float64), beta, scale=20.0, eps=EPS)
    assert half.tolist() == pytest.approx([10 + row0 / 2, 10 + row1 / 2], rel=1e-12)


def test_a_linear_top_m_term_at_the_effective_scale_is_close_to_the_shortfall_term_at_initialisation():
    """The check the definition must pass (issue "link or temperature"): at initialisation, InfoNCE over the same
    positive and M hardest negatives at the shortfall term's effective scale has a loss close to the shortfall
    term's."""
    torch.manual_seed(0)
    # At initialisation an encoder's projections share one direction: every cosine score lies near 1 (here 0.79-0.96).
    common = torch.randn(1, 64)
    features = common + 0.2 * torch.randn(256, 64)
    z1 = features + 0.3 * torch.randn(256, 64)
    z2 = features + 0.3 * torch.randn(256, 64)
    scores, positive_index, valid_mask = nt_xent_layout(z1, z2)
    beta = torch.tensor(10.0)
    scale = top_m_terms(scores, positive_index, valid_mask, TopM(m=50), beta=beta, scale=1.0, eps=EPS)[2]
    terms = top_m_terms(scores, positive_index, valid_mask, TopM(m=50), beta=beta, scale=float(scale.mean()), eps=EPS)
    shortfall, matched = terms[0].mean(), terms[1]
    assert float(matched.mean()) == pytest.approx(float(shortfall), rel=0.25)
    # The secant slope lies between the tangents at the set's lowest and highest score (mean value theorem).
    picked, used = top_m_selection(scores, positive_index, valid_mask, top_m=50)
    positive, negatives, used = picked[:, 0], picked[:, 1:], used[:, 1:]
    highest = torch.maximum(positive, negatives[:, 0])
    lowest = torch.minimum(positive, negatives.masked_fill(~used, 2.0).amin(dim=1))
    assert bool(((beta / (1 - lowest) <= scale * (1 + 1e-5)) & (scale <= beta / (1 - highest) * (1 + 1e-5))).all())


@pytest.mark.parametrize("cached", [False, True])
def test_both_losses_log_each_terms_effective_scale(cached):
    torch.manual_seed(1)
    columns = [torch.randn(12, 8, dtype=torch.float64) for _ in range(2)]
    columns[1] = columns[0] + 0.5 * columns[1]
    options = {"scale": 2.0, "beta": 1.0, "top_m": {"shortfall_weight": 0.5, "infonce_weight": 0.5}}
    plain = WEINCELoss(None, **options).double()
    plain.compute_loss_from_embeddings(columns, None)
    logged = plain.pop_logged_statistics()
    if cached:
        loss = CachedWEINCELoss(None, mini_batch_size=5, **options).double()
        loss.calculate_loss([list(c.split(5)) for c in columns], None, with_backward=False)
        got = loss.pop_logged_statistics()
        for name in ("blend", "top_m_shortfall", "top_m_infonce"):
            key = f"weince_effective_scale_{name}"
            assert got[key] == pytest.approx(logged[key], rel=1e-10), key
        return
    assert logged["weince_effective_scale_top_m_infonce"] == 2.0
    stats = plain.last_statistics
    assert stats is not None and logged["weince_effective_scale_top_m_shortfall"] > 2.0
    # mode "none" (lambda = 0): the blend is InfoNCE, its scale the temperature's
    none = WEINCELoss(None, scale=20.0, mode="none").double()
    none.compute_loss_from_embeddings(columns, None)
    assert none.pop_logged_statistics()["weince_effective_scale_blend"] == pytest.approx(20.0, rel=1e-12)
