"""What float32 can guarantee when two code paths compute WEINCE's tail fit from scores that are not bitwise equal.

Two paths that compute the same cosine scores with a different order of operations (embedding in mini-batches
instead of one batch, a row-chunked or per-process matmul instead of one matmul, another CPU kernel family) agree
only to a few units in the last place (ulp) of float32. The tail fit amplifies that: it fits lines through
``log(1 - s)`` of each anchor's top negatives, ``delta_aic = n log(SSE_Gumbel / SSE_Weibull)`` is a log-ratio of
small residual sums, and ``lam`` moves with the pivot ``rho0``. A fixed tolerance such as 1e-6 on ``lam`` holds on
one machine and fails on another (an AVX-512 AMD EPYC gave 3.1e-6).

So a float32 comparison of tail-fit outputs gets a tolerance derived from a MEASURED sensitivity, on the very
scores of the test:

1. ``one_ulp_sensitivity``: move every score by one ulp (all up, all down, and 32 random sign patterns), recompute
   the statistics, and take the largest change of each output. One ulp is that of the scores in [0.5, 1), where
   tails lie (2^-24 in float32; ``score_ulp``), and differences are counted in the same unit. Measured on the
   tiny-BERT triplets of tests/losses/test_cached_weince.py (48 anchors, 96 or 144 candidates, tails of 32): lam 1.8e-5
   to 2.1e-5 (1.1e-5 with the pivot held fixed: the pivot's own one-ulp move doubles it), beta ("auto") 1.1e-4 to
   1.6e-4, rho 6e-8 (one ulp), delta_aic 4.3e-3 to 6.9e-3; the same with ATEN_CPU_CAPABILITY=default.
2. The probes do not hit the worst direction exactly: moving each score alone by one ulp and summing the absolute
   changes of a row (the linearised worst case, every score moved in its worst direction) gave at most 1.0x (lam,
   rho) and 1.6x (beta, delta_aic) the probes' maximum on the same scores.
3. Two paths whose scores are ``m`` ulps apart differ, to first order, by at most ``m`` times the one-ulp change.

Tolerance = ``SAFETY * max(m, 1) * sensitivity`` with ``SAFETY = 4``: 1.6 for step 2, and 2.5 for the
non-linearity over a few ulps (a tail point that changes rank, the log-ratio). ``m`` is measured by the test
(``ulps_apart``) where both paths' scores can be rebuilt, else taken as 1 (the float32 fit against a float64
reference on the same scores: its own rounding of ``1 - s``, the logs and the sums; measured at most 0.5x the
one-ulp sensitivity, plus the rounding of the output itself).
"""

from __future__ import annotations

import torch
from torch import Tensor

from st_weince.functional import WEINCEOptions, mnrl_layout, normalize_rows, weince_statistics
from st_weince.functional.layouts import CandidateGroup
from st_weince.functional.weince import WEINCEStatistics
from st_weince.losses import WEINCELoss

SAFETY = 4.0
FIELDS = ("lam", "beta", "beta_hat", "rho", "delta_aic", "rho0")


def score_ulp(dtype: torch.dtype) -> float:
    """One ulp of the scores that make a tail, those in [0.5, 1): 2^-24 in float32, 2^-53 in float64. Differences
    and perturbations are counted in this absolute unit (a score near 0 has a finer ulp of its own, in which a
    harmless difference would count as thousands)."""
    return torch.finfo(dtype).eps / 2


def one_ulp_apart(scores: Tensor, signs: Tensor) -> Tensor:
    """Each score moved by one :func:`score_ulp`: up where ``signs > 0``, down elsewhere (exact for |s| < 1)."""
    return scores + signs.to(scores.dtype) * score_ulp(scores.dtype)


def one_ulp_sensitivity(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None,
    options: WEINCEOptions,
    draws: int = 32,
    seed: int = 0,
) -> dict[str, float]:
    """The largest change of each statistic in ``FIELDS`` when every score moves by one ulp (all up, all down and
    ``draws`` random sign patterns), in the scores' dtype."""
    reference = weince_statistics(scores, positive_index, valid_mask, options)
    generator = torch.Generator().manual_seed(seed)
    patterns = [torch.ones(scores.shape), -torch.ones(scores.shape)]
    patterns += [torch.randint(0, 2, scores.shape, generator=generator) * 2.0 - 1.0 for _ in range(draws)]
    worst = dict.fromkeys(FIELDS, 0.0)
    for signs in patterns:
        moved = weince_statistics(one_ulp_apart(scores, signs.to(scores.device)), positive_index, valid_mask, options)
        for field in FIELDS:
            change = (getattr(moved, field) - getattr(reference, field)).abs().max()
            worst[field] = max(worst[field], float(change))
    return worst


def ulps_apart(a: Tensor, b: Tensor) -> float:
    """The largest difference of two score matrices, in :func:`score_ulp` units."""
    return float((a - b).abs().max()) / score_ulp(a.dtype)


def tail_fit_tolerances(
    scores: Tensor,
    positive_index: Tensor | None,
    valid_mask: Tensor | None,
    options: WEINCEOptions,
    ulps: float = 1.0,
) -> dict[str, float]:
    """Per statistic: ``SAFETY * max(ulps, 1) * one_ulp_sensitivity`` (see the module docstring)."""
    sensitivity = one_ulp_sensitivity(scores, positive_index, valid_mask, options)
    return {field: SAFETY * max(ulps, 1.0) * value for field, value in sensitivity.items()}


def assert_statistics_close(actual: WEINCEStatistics, expected: WEINCEStatistics, tolerances: dict[str, float]):
    """Every statistic of ``FIELDS`` within its tolerance (and the fitted anchors the same)."""
    assert torch.equal(actual.fitted, expected.fitted)
    for field in FIELDS:
        difference = float((getattr(actual, field) - getattr(expected, field)).abs().max())
        assert difference <= tolerances[field], (
            f"{field}: paths differ by {difference:.3g}, more than float32 explains ({tolerances[field]:.3g})"
        )


def query_group(
    loss: WEINCELoss, embeddings: list[Tensor], row_start: int = 0, row_end: int | None = None
) -> CandidateGroup:
    """The query-anchored candidate group (whose statistics the loss keeps) of rows ``row_start:row_end``."""
    queries, *docs = [normalize_rows(column) for column in embeddings]
    layout = mnrl_layout(
        queries, docs, loss.options.directions, loss.options.partition_mode, row_start=row_start, row_end=row_end
    )
    return layout.groups[0]


def row_chunks(num_rows: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
    """``(begin, end)`` of consecutive chunks of ``chunk`` rows from ``start`` to ``start + num_rows``."""
    return [(begin, min(begin + chunk, start + num_rows)) for begin in range(start, start + num_rows, chunk)]


def block_scores(loss: WEINCELoss, embeddings: list[Tensor], bounds: list[tuple[int, int]]) -> Tensor:
    """The query group's scores computed block of rows by block of rows (a cached loss's chunks, a process's rows)."""
    return torch.cat([query_group(loss, embeddings, begin, end).scores for begin, end in bounds])


def assert_share_above_close(
    actual_share: float, expected_share: float, values: Tensor, threshold: float, tolerance: float, name: str = ""
) -> None:
    """Two paths' logged share of ``values > threshold`` (e.g. ``weince_lambda_gt_half``) agree up to the entries that
    lie within ``tolerance`` (what the paths' rounding can move them) of the threshold: each of those may fall either
    way, so the counts may differ by at most their number; a share is compared as a count of ``values.numel()``."""
    count = values.numel()
    near = int(((values.double() - threshold).abs() <= tolerance).sum())
    difference = abs(actual_share - expected_share) * count
    assert difference <= near + 1e-6, (
        f"{name}: the paths' counts above {threshold} differ by {difference:.3g} of {count}, more than the {near} "
        f"entries within {tolerance:.3g} of the threshold"
    )
