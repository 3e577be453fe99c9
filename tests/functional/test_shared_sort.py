"""One partial sort per row serves the tail fit and the top-M terms, and the batch tail comes from one top-k of the
flat matrix it was selected from: each checked against an independent computation (masking a full copy and sorting
it), also with ties, masked entries, rows without a positive and widths up to the number of columns. Where the
layout says that every row has the same number of negatives (no mask; every row or none with a positive), the
shortcuts it allows give the general path's values bit for bit."""

from __future__ import annotations

import pytest
import torch

from st_weince.functional.batch_tail import batch_negative_tail
from st_weince.functional.options import TopM
from st_weince.functional.top_m import top_m_selection
from st_weince.functional.weince import hardest_negatives, statistics_from_fit, weince_tail_fit


def scores_with_ties(rows: int, columns: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, columns, generator=generator) * 2 - 1
    scores[:, ::7] = 0.25  # ties, also with the positive
    scores[0, :] = 1.0  # a row of scores exactly 1
    return scores


def independent_negatives(scores, positive_index, valid_mask):
    """Each row's negative scores, descending, -inf padded: a masked full copy, fully sorted."""
    negative = torch.ones_like(scores, dtype=torch.bool) if valid_mask is None else valid_mask.clone()
    has_positive = positive_index >= 0
    negative[has_positive.nonzero().squeeze(1), positive_index[has_positive]] = False
    return scores.masked_fill(~negative, float("-inf")).sort(dim=1, descending=True).values, negative


@pytest.mark.parametrize("width", [1, 5, 15, 16])
@pytest.mark.parametrize("masked", [False, True])
def test_hardest_negatives_are_the_sorted_negatives_and_their_columns(width, masked):
    scores = scores_with_ties(9, 16, seed=width)
    positive_index = torch.tensor([0, 3, 15, -1, 7, 7, 1, 14, 2])
    valid_mask = (torch.rand(9, 16, generator=torch.Generator().manual_seed(1)) > 0.3) if masked else None
    hardest = hardest_negatives(scores, positive_index, valid_mask, width)
    expected, negative = independent_negatives(scores, positive_index, valid_mask)
    assert torch.equal(hardest.values, expected[:, :width])
    real = hardest.values > float("-inf")
    # the columns hold those values and are negatives of their row, each at most once
    assert torch.equal(scores.gather(1, hardest.columns)[real], hardest.values[real])
    assert negative.gather(1, hardest.columns)[real].all()
    for row in range(9):
        columns = hardest.columns[row][real[row]]
        assert columns.unique().numel() == columns.numel()


def test_hardest_negatives_refuses_a_width_beyond_the_columns():
    with pytest.raises(ValueError, match=r"width must be in \[1, 4\]"):
        hardest_negatives(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), None, 5)


def test_the_shared_sort_gives_the_same_tail_fit_and_top_m_selection():
    scores = scores_with_ties(12, 40, seed=3).requires_grad_()
    positive_index = torch.arange(12) * 3
    hardest = hardest_negatives(scores, positive_index, None, 38)
    fit_alone = weince_tail_fit(scores, positive_index)
    fit_shared = weince_tail_fit(scores, positive_index, hardest=hardest)
    for name in ("rho", "beta_hat", "delta_aic", "fitted", "has_negatives"):
        assert torch.equal(getattr(fit_alone, name), getattr(fit_shared, name)), name
    alone = top_m_selection(scores, positive_index, top_m=8)
    shared = top_m_selection(scores, positive_index, top_m=8, hardest=hardest)
    for a, b in zip(alone, shared):
        assert torch.equal(a, b)
    # the gradient reaches the selected scores, each entry of a row's hardest set once
    picked, used = shared
    picked[:, 1:].sum().backward()
    assert torch.equal(scores.grad.sum(1), used[:, 1:].sum(1).float())
    with pytest.raises(ValueError, match=r"the top-M terms of \(12, 40\) scores need \[12, >= 38\]"):
        top_m_selection(scores, positive_index, top_m=50, hardest=hardest_negatives(scores, positive_index, None, 30))
    with pytest.raises(ValueError, match=r"the tail fit of \(12, 40\) scores needs \[12, >= 32\]"):
        weince_tail_fit(scores, positive_index, hardest=hardest_negatives(scores, positive_index, None, 20))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("min_points", [10, 200, 5000])
def test_batch_tail_is_the_smallest_shortfalls_of_all_negatives(masked, min_points):
    scores = scores_with_ties(30, 50, seed=min_points)
    positive_index = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(2))
    positive_index[4] = -1  # a row without a positive: all its valid entries are negatives
    valid_mask = (torch.rand(30, 50, generator=torch.Generator().manual_seed(5)) > 0.2) if masked else None
    options = TopM(beta_tail_min_points=min_points)
    eps = 1e-6
    tail = batch_negative_tail(scores, positive_index, valid_mask, options, eps=eps)
    negatives, negative = independent_negatives(scores, positive_index, valid_mask)
    shortfalls = torch.sort((1 - scores).clamp_min(eps).masked_fill(~negative, float("inf")).reshape(-1))
    # as many as a tail of the batch's entries can need (the fit takes its k of them from the count of negatives)
    keep = min(scores.numel(), max(min_points, int(options.beta_tail_frac * scores.numel())))
    assert tail.ascending and int(tail.num_negatives) == negative.sum().item()
    assert torch.equal(tail.shortfalls, shortfalls.values[:keep])


@pytest.mark.parametrize("has_positive", [True, False])
@pytest.mark.parametrize("columns", [8, 40, 300])
def test_rows_alike_give_the_general_paths_values_bit_for_bit(has_positive, columns):
    """With no valid_mask, a known has_positive lets the tail sizes, the fit design, the pivot and the batch tail's
    count come from the shapes; an all-True valid_mask takes the per-row path over the same entries."""
    scores = scores_with_ties(64, columns, seed=columns)
    positive_index = torch.arange(64) % columns if has_positive else torch.full((64,), -1)
    everything = torch.ones_like(scores, dtype=torch.bool)
    alike = weince_tail_fit(scores, positive_index, None, has_positive=has_positive)
    per_row = weince_tail_fit(scores, positive_index, everything)
    assert alike.alike is not None and per_row.alike is None
    for name in ("rho", "beta_hat", "delta_aic", "fitted", "has_negatives"):
        assert torch.equal(getattr(alike, name), getattr(per_row, name)), name
    for name in ("lam", "beta", "rho0"):
        assert torch.equal(getattr(statistics_from_fit(alike), name), getattr(statistics_from_fit(per_row), name))
    options = TopM(beta_tail_min_points=100)
    width = min(columns, 50)
    shared = hardest_negatives(scores, positive_index, None, width, has_positive=has_positive, keep_selection=True)
    assert torch.equal(shared.values, hardest_negatives(scores, positive_index, everything, width).values)
    from_sort = batch_negative_tail(
        scores, positive_index, None, options, eps=1e-6, hardest=shared, has_positive=has_positive
    )
    own = batch_negative_tail(scores, positive_index, everything, options, eps=1e-6)
    assert isinstance(from_sort.num_negatives, int) and from_sort.num_negatives == int(own.num_negatives)
    assert torch.equal(from_sort.shortfalls, own.shortfalls)
