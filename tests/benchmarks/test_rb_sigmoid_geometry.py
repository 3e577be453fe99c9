"""Geometry diagnostics for paired embeddings: margin, constellation test, modality-gap linear separability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.lab.geometry import constellation_test, margin, modality_gap_separability


def test_margin_by_hand():
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.8, 0.6]])
    # matching: 1, 1, 0.96; non-matching max: <u_3, v_2> = 0.8
    m, centre = margin(u, v)
    assert m == pytest.approx((0.96 - 0.8) / 2)
    assert centre == pytest.approx((0.96 + 0.8) / 2)
    m_scaled, _ = margin(2 * u, 3 * v)  # cosine by default: scale-free
    assert m_scaled == pytest.approx(m)
    m_raw, _ = margin(2 * u, v, normalize=False)
    assert m_raw == pytest.approx((1.92 - 1.6) / 2)


def test_constellation_test_on_an_orthonormal_configuration():
    u = torch.eye(5)
    report = constellation_test(u, u.clone(), b_rel=0.9)
    assert report.is_constellation and report.margin == pytest.approx(0.5) and report.centre == pytest.approx(0.5)
    assert report.margin_at_b_rel == pytest.approx(0.1)  # min(1 - 0.9, 0.9 - 0)
    assert report.matching_violations == 0 and report.non_matching_violations == 0
    assert report.retrieval_u_to_v == 1.0 and report.retrieval_v_to_u == 1.0
    shifted = constellation_test(u, u.clone(), b_rel=1.2)
    assert shifted.matching_violations == 5 and shifted.margin_at_b_rel == pytest.approx(-0.2)
    negative = constellation_test(u, u.clone(), b_rel=-0.1)
    assert negative.non_matching_violations == 20


def test_not_a_constellation_when_a_negative_beats_a_positive():
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # swapped: retrieval fails
    report = constellation_test(u, v)
    assert not report.is_constellation and report.margin == pytest.approx(-0.5)
    assert report.retrieval_u_to_v == 0.0


def test_separability_detects_a_modality_gap():
    g = torch.Generator().manual_seed(0)
    base = F.normalize(torch.randn(30, 4, generator=g), dim=-1)
    gap = 0.3
    u = torch.cat([base, torch.full((30, 1), gap)], dim=1)
    v = torch.cat([base, torch.full((30, 1), -gap)], dim=1)
    report = modality_gap_separability(u, v, normalize=False)
    assert report.separable and report.accuracy == 1.0
    assert report.centroid_gap == pytest.approx(2 * gap, rel=1e-6)
    assert abs(report.normal[-1]) > 0.99  # the separating direction is the gap coordinate
    aligned = modality_gap_separability(base, base.clone())  # identical clouds cannot be separated
    assert not aligned.separable and aligned.accuracy <= 0.5 + 1e-9


def test_errors():
    with pytest.raises(ValueError, match="same shape"):
        margin(torch.ones(3, 2), torch.ones(4, 2))
    with pytest.raises(ValueError, match="at least 2 pairs"):
        constellation_test(torch.ones(1, 2), torch.ones(1, 2))
    bad = torch.ones(3, 2)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        modality_gap_separability(bad, torch.ones(3, 2))
    with pytest.raises(ValueError, match="D"):
        modality_gap_separability(torch.ones(3, 2), torch.ones(3, 4))
