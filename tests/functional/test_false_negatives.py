"""The false-negative guard as a pure function on score matrices."""

import pytest
import torch

from st_weince.functional.false_negatives import (
    FalseNegativeFilter,
    apply_false_negative_filter,
    false_negative_mask,
)
from st_weince.utils.hotpath import count_host_syncs


def _planted_batch(seed: int = 0, batch: int = 16, dim: int = 32):
    """Pairs of one intent at rows 3, 7, 11 (near-duplicate anchors, duplicate positives); the rest unrelated."""
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.nn.functional.normalize(torch.randn(batch, dim, generator=generator), dim=-1)
    positives = torch.nn.functional.normalize(anchors + 0.05 * torch.randn(batch, dim, generator=generator), dim=-1)
    for row in (7, 11):
        anchors[row] = torch.nn.functional.normalize(anchors[3] + 0.02 * torch.randn(dim, generator=generator), dim=0)
    positives[7] = positives[3]
    positives[11] = torch.nn.functional.normalize(positives[3] + 1e-3 * torch.randn(dim, generator=generator), dim=0)
    scores = anchors @ positives.T
    return scores, torch.arange(batch)


@pytest.mark.parametrize("spec", [("absolute", 0.05), ("relative", 0.95)])
def test_planted_duplicates_and_only_they_are_masked(spec):
    scores, positive_index = _planted_batch()
    masked = false_negative_mask(scores, positive_index, None, FalseNegativeFilter.parse(spec))
    # Independent computation of the rule, row by row.
    rule, value = spec
    expected = torch.zeros_like(masked)
    for row in range(scores.shape[0]):
        s_pos = float(scores[row, row])
        for column in range(scores.shape[1]):
            if column == row:
                continue
            threshold = s_pos - value if rule == "absolute" else (value * s_pos if s_pos > 0 else float("inf"))
            expected[row, column] = float(scores[row, column]) > threshold
    assert torch.equal(masked, expected)
    # Anchors 3, 7 and 11 share one positive: each masks exactly the other two duplicates.
    for row, others in ((3, {7, 11}), (7, {3, 11}), (11, {3, 7})):
        assert set(masked[row].nonzero().flatten().tolist()) == others
    assert masked.sum() == 6
    assert not masked.diagonal().any()


def test_no_candidate_above_threshold_leaves_the_mask_unchanged():
    scores, positive_index = _planted_batch()
    scores = scores.clone()
    scores[7] = scores[7].clamp(max=0.0)
    scores.fill_diagonal_(0.9)
    scores[[3, 7, 11]] = scores[[3, 7, 11]].clamp(max=0.5)
    scores.fill_diagonal_(0.9)
    spec = FalseNegativeFilter.parse(("absolute", 0.1))
    valid_mask = torch.rand(scores.shape, generator=torch.Generator().manual_seed(1)) > 0.2
    valid_mask.fill_diagonal_(True)
    new_mask, counts = apply_false_negative_filter(scores, positive_index, valid_mask, spec)
    assert torch.equal(new_mask, valid_mask)
    assert float(counts.masked_share) == 0.0 and float(counts.anchors_share) == 0.0
    assert apply_false_negative_filter(scores, positive_index, None, None) == (None, None)


def test_positive_never_masked_and_invalid_entries_stay_invalid():
    scores = torch.tensor([[0.2, 0.9, 0.95], [0.99, 0.5, -0.3]])
    positive_index = torch.tensor([0, 1])
    valid_mask = torch.tensor([[True, True, False], [True, True, True]])
    new_mask, counts = apply_false_negative_filter(
        scores, positive_index, valid_mask, FalseNegativeFilter.parse(("absolute", 0.0))
    )
    assert new_mask.tolist() == [[True, False, False], [False, True, True]]
    # Row 0 has 1 valid negative (masked), row 1 has 2 (one masked): 2 of 3.
    assert float(counts.masked_share) == pytest.approx(2 / 3)
    assert float(counts.anchors_share) == 1.0


def test_relative_rule_does_not_depend_on_the_sign_of_the_positive_score():
    """``s > s_pos - (1 - r) |s_pos|``: for a positive s_pos it is ``r * s_pos``; for a negative or zero s_pos the
    threshold stays at or below s_pos (the old ``r * s_pos`` lay above a negative s_pos and masked nothing)."""
    scores = torch.tensor([[-0.2, 0.5, -0.21], [0.3, 0.8, 0.79], [0.0, 1e-3, -1e-3]])
    spec = FalseNegativeFilter.parse(("relative", 0.9))
    masked = false_negative_mask(scores, torch.tensor([0, 1, 0]), None, spec)
    # row 0: threshold -0.2 - 0.1 * 0.2 = -0.22 masks 0.5 and -0.21; row 1: 0.72 masks 0.79; row 2: 0 masks 1e-3
    assert masked.tolist() == [[False, True, True], [False, False, True], [False, True, False]]
    # the same as the absolute rule with the margin (1 - r) |s_pos| of each row
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(64, 9, generator=g) * 2 - 1
    positive_index = torch.randint(0, 9, (64,), generator=g)
    relative = false_negative_mask(scores, positive_index, None, spec)
    for row in range(64):
        s_pos = scores[row, positive_index[row]]
        margin = FalseNegativeFilter.parse(("absolute", float((1 - 0.9) * s_pos.abs())))
        expected = false_negative_mask(scores[row : row + 1], positive_index[row : row + 1], None, margin)
        assert torch.equal(relative[row : row + 1], expected)


def test_rows_without_positive_use_the_given_positive_scores():
    scores = torch.tensor([[0.1, 0.85, 0.4]])
    spec = FalseNegativeFilter.parse(("absolute", 0.1))
    assert not false_negative_mask(scores, torch.tensor([-1]), None, spec).any()
    masked = false_negative_mask(scores, torch.tensor([-1]), None, spec, positive_scores=torch.tensor([0.9]))
    assert masked.tolist() == [[False, True, False]]


def test_no_host_sync():
    scores, positive_index = _planted_batch()
    spec = FalseNegativeFilter.parse(("relative", 0.95))
    with count_host_syncs() as syncs:
        apply_false_negative_filter(scores, positive_index, None, spec)
    assert syncs.total == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (("cosine", 0.1), "rule must be 'absolute' or 'relative'"),
        (("absolute", -0.1), "m >= 0"),
        (("relative", 0.0), "0 < r <= 1"),
        (("relative", 1.5), "0 < r <= 1"),
        (("absolute", float("nan")), "finite number"),
        (("absolute", True), "finite number"),
        (("absolute", "0.1"), "finite number"),
        (0.1, "must be None"),
        (("absolute",), "must be None"),
    ],
)
def test_invalid_settings_raise_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        FalseNegativeFilter.parse(spec)


def test_config_round_trip():
    spec = FalseNegativeFilter.parse(("relative", 0.95))
    assert FalseNegativeFilter.parse(spec.to_config()) == spec
    assert FalseNegativeFilter.parse(spec) is spec
