"""The released WEINCE composite (docs/algorithms.md 1.2b) on score matrices: the two top-M terms, the batch tail index
and its moving average, against an independent plain implementation (tests/weince_release_reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from st_weince.functional import TopM, WEINCEOptions, check_scores, mnrl_layout, nt_xent_layout, weince_cross_entropy
from st_weince.functional.batch_tail import (
    BatchTail,
    batch_negative_tail,
    batch_tail_fit,
    initial_beta_ema,
    update_beta_ema,
)
from st_weince.functional.top_m import top_m_selection, top_m_terms
from st_weince.losses import WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.weince_release_reference import ReleasedCompositeReference

RELEASED = TopM(shortfall_weight=0.5, infonce_weight=0.5)
EPS = WEINCEOptions().eps


def composite(scale: float, top_m: TopM | None = RELEASED, dtype: torch.dtype = torch.float32) -> WEINCELoss:
    """The released composite as the loss computes it on one score matrix (``loss_from_scores``: the one assembly of
    the blend and the top-M terms), its tail index a buffer of ``dtype``, advanced on every training step."""
    return WEINCELoss(None, scale=scale, beta=1.0, top_m=top_m).to(dtype)


def top_m_pair(scores, positive_index, valid_mask, options=RELEASED, *, beta, scale):
    """The two top-M terms per row (without the effective scale)."""
    return top_m_terms(scores, positive_index, valid_mask, options, beta=beta, scale=scale, eps=EPS)[:2]


TOLERANCE = 1e-6


def close(value: torch.Tensor | float, expected: float) -> bool:
    return abs(float(value) - expected) <= TOLERANCE * max(1.0, abs(expected))


# --------------------------------------------------------------------------------------------- batches


def _unit(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=1)


def _views(num_pairs: int, dim: int, kind: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.randn(num_pairs, dim, generator=generator, dtype=torch.float64)
    if kind == "near_one":  # every score within ~1e-5 of the cap, some clamped at 1 - eps, some views equal (score 1)
        base = base[:1] + 3e-3 * base
        other = base + 1e-3 * torch.randn(num_pairs, dim, generator=generator, dtype=torch.float64)
        other[: max(1, num_pairs // 3)] = base[: max(1, num_pairs // 3)]
        return base, other
    if kind == "duplicates":  # repeated images: several pairs identical
        base[1::2] = base[0]
    return base, base + 0.5 * torch.randn(num_pairs, dim, generator=generator, dtype=torch.float64)


def _shortfall_scores(shape: tuple[int, int], kind: str, generator: torch.Generator) -> torch.Tensor:
    """Scores 1 - d with d drawn so that the batch fit is trusted ("power": a Weibull-type tail F(d) ~ d^b) or not
    ("bimodal": two clusters, a poor line)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    if kind == "power":
        exponent = 1.0 + 5.0 * float(torch.rand((), generator=generator, dtype=torch.float64))
        d = 0.5 * u.pow(1.0 / exponent)
    else:
        cluster = torch.rand(shape, generator=generator, dtype=torch.float64) < 0.5
        d = torch.where(cluster, 1e-3 * (1.0 + 0.01 * u), 0.5 + 0.01 * u)
    return 1.0 - d


def make_batch(layout: str, size: int, kind: str, generator: torch.Generator):
    """(scores, positive_index, valid_mask) in float64 for one of the layouts."""
    if layout == "nt_xent":
        return nt_xent_layout(*_views(size, 6, kind, generator))
    if layout == "mnrl":  # queries against positives and one hard-negative column, plus query_to_query (masked self)
        queries, positives = _views(size, 6, kind, generator)
        negatives = torch.randn(size, 6, generator=generator, dtype=torch.float64)
        group = mnrl_layout(
            _unit(queries), [_unit(positives), _unit(negatives)], ("query_to_doc", "query_to_query")
        ).groups[0]
        return group.scores, group.positive_index, group.valid_mask
    # a plain matrix with random masks: rows with 0, 1 or few negatives included
    rows, columns = size, size + 3
    scores = _shortfall_scores((rows, columns), kind, generator)
    positive_index = torch.randperm(columns, generator=generator)[:rows]
    valid_mask = torch.rand(rows, columns, generator=generator) < 0.75
    valid_mask[0] = False
    if rows > 1:
        valid_mask[1] = False
        valid_mask[1, (int(positive_index[1]) + 1) % columns] = True
    valid_mask[torch.arange(rows), positive_index] = True
    return scores, positive_index, valid_mask


def _cases() -> list[tuple]:
    cases = []
    rng = np.random.default_rng(2026)
    layouts = ("nt_xent", "mnrl", "matrix")
    for index in range(54):
        layout = layouts[index % 3]
        size = int(rng.choice([2, 3, 4, 6, 10, 17, 33]))
        top_m = int(rng.choice([50, 1, 3, 8]))
        tail_min_points = int(rng.choice([1024, 40, 12]))
        tail_frac = float(rng.choice([0.05, 0.4]))
        steps = 6 if index % 2 == 0 else int(rng.integers(1, 4))
        cases.append((index, layout, size, top_m, tail_min_points, tail_frac, steps))
    return cases


KINDS = {
    "nt_xent": ("gaussian", "duplicates", "near_one"),
    "mnrl": ("gaussian", "duplicates", "near_one"),
    "matrix": ("power", "bimodal", "power"),
}


def run_sequence(case):
    index, layout, size, top_m, tail_min_points, tail_frac, steps = case
    generator = torch.Generator().manual_seed(index)
    options = RELEASED.replace(m=top_m, beta_tail_min_points=tail_min_points, beta_tail_frac=tail_frac)
    reference = ReleasedCompositeReference(top_m=top_m, tail_min_points=tail_min_points, tail_frac=tail_frac)
    temperature = float(np.random.default_rng(index).choice([0.5, 0.05, 1.0]))
    loss = composite(1.0 / temperature, options, torch.float64)
    records = []
    for step in range(steps):
        kind = KINDS[layout][(index + step) % 3]
        scores, positive_index, valid_mask = make_batch(layout, size, kind, generator)
        loss.loss_from_scores(scores, positive_index, valid_mask)
        result = loss.last_step
        expected = reference.step(
            scores.numpy(), positive_index.numpy(), None if valid_mask is None else valid_mask.numpy(),
            temperature=temperature,
        )  # fmt: skip
        records.append((result, expected))
    return records


@pytest.mark.parametrize("case", _cases(), ids=lambda case: f"{case[1]}-n{case[2]}-m{case[3]}-#{case[0]}")
def test_released_composite_matches_reference(case):
    for step, (result, expected) in enumerate(run_sequence(case)):
        where = f"step {step}"
        assert bool(result.fit.trusted) == expected["trusted"], where
        assert close(result.beta_t, expected["beta_t"]), (where, float(result.beta_t), expected["beta_t"])
        if expected["slope"] is None:
            assert not bool(result.fit.fitted), where
        else:
            assert close(result.fit.slope, expected["slope"]), where
            assert close(result.fit.r_squared, expected["r_squared"]), where
        assert close(result.terms.blend, expected["blend"]), where
        assert close(result.terms.top_m_shortfall, expected["top_m_shortfall"]), where
        assert close(result.terms.top_m_infonce, expected["top_m_infonce"]), where
        assert close(result.terms.total, expected["total"]), where
        assert close(result.loss, expected["total"]), where


def test_parity_cases_exercise_the_moving_average():
    """The sequences above contain trusted and untrusted fits and batches too small to fit, and the moving average
    moves away from its start value in some of them."""
    trusted = untrusted = unfitted = moved = 0
    for case in _cases():
        if case[-1] < 5:
            continue
        for _result, expected in run_sequence(case):
            trusted += expected["trusted"]
            untrusted += expected["slope"] is not None and not expected["trusted"]
            unfitted += expected["slope"] is None
            moved += abs(expected["beta_t"] - 4.0) > 1e-3
    assert trusted >= 10 and untrusted >= 10 and unfitted >= 3 and moved >= 10, (trusted, untrusted, unfitted, moved)


# --------------------------------------------------------------------------------------------- pieces


def test_zero_weights_give_exactly_the_blended_loss():
    generator = torch.Generator().manual_seed(0)
    for layout in ("nt_xent", "mnrl", "matrix"):
        scores, positive_index, valid_mask = make_batch(layout, 9, "power" if layout == "matrix" else "gaussian",
                                                        generator)  # fmt: skip
        scores = scores.float().requires_grad_()
        blend = weince_cross_entropy(scores, positive_index, valid_mask, WEINCEOptions(scale=2.0, beta=1.0))
        loss = composite(2.0, TopM(m=3))  # both weights 0: no top-M terms, no tail index
        total = loss.loss_from_scores(scores, positive_index, valid_mask)
        assert torch.equal(total, blend)
        assert loss.options.top_m is None and loss.last_step.terms is None and loss.batch_beta_ema is None
        (grad,) = torch.autograd.grad(total, scores)
        (expected,) = torch.autograd.grad(blend, scores)
        assert torch.equal(grad, expected)


def test_the_step_weights_the_terms_and_gives_their_shares():
    generator = torch.Generator().manual_seed(0)
    scores, positive_index, valid_mask = make_batch("nt_xent", 9, "gaussian", generator)
    loss = composite(2.0)
    total = loss.loss_from_scores(scores, positive_index, valid_mask)
    terms = loss.last_step.terms
    assert torch.equal(total, terms.blend + 0.5 * terms.top_m_shortfall + 0.5 * terms.top_m_infonce)
    shares = terms.shares()
    assert math.isclose(sum(float(v) for v in shares.values()), 1.0, rel_tol=1e-6)
    assert math.isclose(float(shares["top_m_infonce"]), 0.5 * float(terms.top_m_infonce) / float(total), rel_tol=1e-6)
    only_infonce = composite(2.0, TopM(infonce_weight=1.0))
    total = only_infonce.loss_from_scores(scores, positive_index, valid_mask)
    terms = only_infonce.last_step.terms
    assert torch.equal(total, terms.blend + terms.top_m_infonce) and terms.top_m_shortfall is None


def test_top_m_selection_counts_per_row():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3, 0.7], [0.2, 0.8, 0.6, 0.4, 0.0], [0.5, 0.4, 0.3, 0.2, 0.1]])
    positive_index = torch.tensor([0, 1, 2])
    valid_mask = torch.ones(3, 5, dtype=torch.bool)
    valid_mask[1, 2:] = False  # row 1: one negative -> K - 1 = 0 hard negatives
    picked, used = top_m_selection(scores, positive_index, valid_mask, top_m=2)
    positive, negatives, used = picked[:, 0], picked[:, 1:], used[:, 1:]
    assert positive.tolist() == pytest.approx([0.9, 0.8, 0.3])
    assert negatives[0].tolist() == pytest.approx([0.7, 0.5]) and used[0].tolist() == [True, True]
    assert used[1].tolist() == [False, False]
    assert negatives[2].tolist() == pytest.approx([0.5, 0.4])
    shortfall, infonce = top_m_pair(scores, positive_index, valid_mask, TopM(m=2), beta=2.0, scale=3.0)
    assert float(shortfall[1]) == 0.0 and float(infonce[1]) == 0.0  # only the positive: log 1
    expected = math.log(math.exp(0.9 * 3) + math.exp(0.7 * 3) + math.exp(0.5 * 3)) - 0.9 * 3
    assert math.isclose(float(infonce[0]), expected, rel_tol=1e-6)
    # M = min(M, K - 1): with K = 4 negatives and top_m = 50, the 3 hardest are used
    _, used = top_m_selection(scores, positive_index, None, top_m=50)
    assert used[:, 1:].sum(1).tolist() == [3, 3, 3]


def test_the_tail_index_as_a_tensor_or_a_number_gives_the_same_terms():
    generator = torch.Generator().manual_seed(3)
    scores, positive_index, valid_mask = make_batch("nt_xent", 12, "gaussian", generator)
    shortfall, infonce = top_m_pair(scores, positive_index, valid_mask, beta=torch.tensor(3.0), scale=2.0)
    number_shortfall, number_infonce = top_m_pair(scores, positive_index, valid_mask, beta=3.0, scale=2.0)
    assert torch.equal(shortfall, number_shortfall) and torch.equal(infonce, number_infonce)


def test_top_m_gradients():
    generator = torch.Generator().manual_seed(4)
    scores = (0.9 * torch.rand(6, 9, generator=generator, dtype=torch.float64) - 0.2).requires_grad_()
    positive_index = torch.tensor([0, 2, 4, 6, 8, 1])
    valid_mask = torch.rand(6, 9, generator=generator) < 0.8
    valid_mask[torch.arange(6), positive_index] = True

    def both(s):
        shortfall, infonce = top_m_pair(s, positive_index, valid_mask, TopM(m=3), beta=2.5, scale=2.0)
        return shortfall.sum() + 0.3 * infonce.sum()

    assert torch.autograd.gradcheck(both, (scores,))
    # a clamped score (at the cap) gets the InfoNCE gradient only, never NaN
    capped = scores.detach().clone()
    capped[0, 3] = 1.0
    capped.requires_grad_()
    (grad,) = torch.autograd.grad(both(capped), capped)
    assert torch.isfinite(grad).all()

    # every row alike (no mask, every row with its positive): the selection without a mask, the same fused terms
    def alike(s, shortfall_weight=1.0):
        terms = top_m_terms(s, positive_index, None, TopM(m=3), beta=2.5, scale=2.0, eps=EPS, has_positive=True)
        return shortfall_weight * terms[0].sum() + 0.3 * terms[1].sum()

    assert torch.autograd.gradcheck(alike, (scores,))
    unmasked = top_m_pair(scores, positive_index, None, TopM(m=3), beta=2.5, scale=2.0)
    assert torch.equal(
        torch.stack(unmasked),
        torch.stack(
            top_m_terms(scores, positive_index, None, TopM(m=3), beta=2.5, scale=2.0, eps=EPS, has_positive=True)[:2]
        ),
    )
    capped = scores.detach().clone()
    capped[0, 0] = 1.0  # row 0's positive, at the cap: the shortfall term passes it no gradient
    capped.requires_grad_()
    (grad,) = torch.autograd.grad(alike(capped, shortfall_weight=0.0), capped)
    (with_shortfall,) = torch.autograd.grad(alike(capped), capped)
    assert float(with_shortfall[0, 0]) == float(grad[0, 0]) and torch.isfinite(with_shortfall).all()


def test_batch_tail_over_parts_equals_whole():
    """Rows split over two 'processes' (or candidate groups), tails concatenated: the same fit as one matrix."""
    generator = torch.Generator().manual_seed(5)
    scores, positive_index, valid_mask = make_batch("matrix", 40, "power", generator)
    options = TopM(beta_tail_min_points=100)
    whole = batch_tail_fit(batch_negative_tail(scores, positive_index, valid_mask, options, eps=EPS), options)
    parts = [
        batch_negative_tail(
            scores[rows], positive_index[rows], valid_mask[rows], options, eps=EPS, global_entries=scores.numel()
        )
        for rows in (slice(0, 25), slice(25, 40))
    ]
    split = batch_tail_fit(BatchTail.cat(parts), options)
    assert bool(whole.trusted)
    for name in ("slope", "r_squared", "tail_size", "trusted"):
        assert torch.equal(getattr(whole, name), getattr(split, name)), name


def test_moving_average_rules():
    options = TopM()
    ema = torch.tensor(4.0, dtype=torch.float64)
    # fewer than 10 negatives in the batch: keep
    scores, positive_index, valid_mask = nt_xent_layout(torch.randn(2, 4), torch.randn(2, 4))
    fit = batch_tail_fit(batch_negative_tail(scores, positive_index, valid_mask, options, eps=EPS), options)
    assert not bool(fit.fitted) and torch.equal(update_beta_ema(ema, fit, options), ema)
    # every negative at the cap: no tail shape, keep
    flat = torch.ones(8, 8, dtype=torch.float64)
    fit = batch_tail_fit(batch_negative_tail(flat, torch.arange(8), None, options, eps=EPS), options)
    assert bool(fit.fitted) and float(fit.slope) == 0.0 and not bool(fit.trusted)
    # a trusted fit with a slope above the clamp range enters as beta_max
    generator = torch.Generator().manual_seed(6)
    d = 0.5 * torch.rand(30, 30, generator=generator, dtype=torch.float64).pow(1.0 / 40.0)
    fit = batch_tail_fit(batch_negative_tail(1.0 - d, torch.arange(30), None, options, eps=EPS), options)
    assert bool(fit.trusted) and float(fit.slope) > 16.0
    assert math.isclose(float(update_beta_ema(ema, fit, options)), 0.9 * 4.0 + 0.1 * 16.0)
    assert update_beta_ema(ema, fit, options).dtype == torch.float64
    # untrusted below the R^2 threshold, trusted when the threshold is lowered
    bimodal = batch_negative_tail(_shortfall_scores((30, 30), "bimodal", generator), torch.arange(30), None, options,
                                  eps=EPS)  # fmt: skip
    fit = batch_tail_fit(bimodal, options)
    assert 0.0 < float(fit.r_squared) < 0.85 and not bool(fit.trusted)
    bimodal = batch_negative_tail(_shortfall_scores((30, 30), "bimodal", generator), torch.arange(30), None, options,
                                  eps=EPS)  # fmt: skip
    assert bool(batch_tail_fit(bimodal, TopM(beta_min_r_squared=0.3)).trusted)


def test_tail_size_rule():
    from st_weince.functional.batch_tail import batch_tail_size

    for total, expected in ((5, 5), (1000, 1000), (1024, 1024), (20480, 1024), (30000, 1500), (261120, 13056)):
        assert batch_tail_size(total, TopM()) == expected
        assert int(batch_tail_size(torch.tensor(total), TopM())) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes(dtype):
    generator = torch.Generator().manual_seed(7)
    scores, positive_index, valid_mask = make_batch("nt_xent", 16, "gaussian", generator)
    low = scores.to(dtype)
    loss = composite(2.0)
    total = loss.loss_from_scores(low, positive_index, valid_mask)
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert total.dtype == expected_dtype and loss.last_step.terms.top_m_shortfall.dtype == expected_dtype
    assert loss.batch_beta_ema.dtype == torch.float32  # the state keeps its own dtype
    reference = composite(2.0, dtype=torch.float64).loss_from_scores(low.double(), positive_index, valid_mask)
    # the same rounded scores in float64: float32 arithmetic on ~100 terms of size ~10 differs by far less than 1e-4
    assert abs(float(total) - float(reference)) < 1e-4


def test_scores_at_the_cap_stay_finite():
    scores = torch.ones(6, 6, dtype=torch.float64, requires_grad=True)
    positive_index = torch.tensor([1, 0, 3, 2, 5, 4])
    valid_mask = ~torch.eye(6, dtype=torch.bool)
    loss = composite(2.0, dtype=torch.float64)
    total = loss.loss_from_scores(scores, positive_index, valid_mask)
    shortfall = loss.last_step.terms.top_m_shortfall
    assert math.isclose(float(shortfall.detach()), math.log(4.0), rel_tol=1e-12)  # 1 + (K - 1) equal logits
    (grad,) = torch.autograd.grad(total, scores)
    assert torch.isfinite(grad).all()


def test_hot_path_has_no_host_syncs():
    generator = torch.Generator().manual_seed(8)
    scores, positive_index, valid_mask = make_batch("nt_xent", 32, "gaussian", generator)
    scores = scores.float().requires_grad_()
    unchecked = WEINCELoss(None, scale=2.0, beta=1.0, top_m=RELEASED, check_inputs=False)
    with count_host_syncs() as syncs:
        unchecked.loss_from_scores(scores, positive_index, valid_mask).backward()
    assert syncs.total == 0, syncs
    with count_host_syncs() as syncs:  # the value checks: one read for all of them
        composite(2.0).loss_from_scores(scores, positive_index, valid_mask)
    assert syncs.total == 1, syncs


@pytest.mark.slow
def test_compiles_with_fullgraph_and_equals_eager():
    """The top-M terms, the batch tail fit and the moving average in one graph (the blend's own compile test is in
    test_weince_hotpath.py)."""
    generator = torch.Generator().manual_seed(9)
    scores, positive_index, valid_mask = make_batch("nt_xent", 24, "gaussian", generator)
    scores = scores.float()

    def step(s, ema):
        fit = batch_tail_fit(batch_negative_tail(s, positive_index, valid_mask, RELEASED, eps=EPS), RELEASED)
        ema = update_beta_ema(ema, fit, RELEASED)
        shortfall, infonce = top_m_pair(s, positive_index, valid_mask, RELEASED, beta=ema, scale=2.0)
        return s.sum() * 0.0 + 0.5 * shortfall.mean() + 0.5 * infonce.mean(), ema

    eager_scores = scores.clone().requires_grad_()
    eager, eager_ema = step(eager_scores, initial_beta_ema(RELEASED))
    (eager_grad,) = torch.autograd.grad(eager, eager_scores)
    compiled_scores = scores.clone().requires_grad_()
    compiled, compiled_ema = torch.compile(step, fullgraph=True)(compiled_scores, initial_beta_ema(RELEASED))
    (compiled_grad,) = torch.autograd.grad(compiled, compiled_scores)
    assert float(eager_ema) != 4.0  # the fit was trusted: the update is part of the graph
    torch.testing.assert_close(compiled.detach(), eager.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_ema, eager_ema, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("m", 0, "m must be at least 1"),
        ("m", 2.5, "m must be an integer"),
        ("shortfall_weight", -0.1, "shortfall_weight must be >= 0"),
        ("infonce_weight", float("nan"), "infonce_weight must be finite"),
        ("infonce_weight", True, "infonce_weight must be a real number"),
        ("infonce_scale", 0.0, "infonce_scale must be > 0"),
        ("beta_ema_start", 0.0, "beta_ema_start must be > 0"),
        ("beta_ema_momentum", 1.0, r"beta_ema_momentum must lie in \[0, 1\)"),
        ("beta_min_r_squared", 1.5, r"beta_min_r_squared must lie in \[0, 1\]"),
        ("beta_min", 20.0, r"beta_min \(20.0\) must not exceed beta_max"),
        ("beta_tail_min_points", 0, "beta_tail_min_points must be at least 1"),
        ("beta_tail_frac", 0.0, r"beta_tail_frac must lie in \(0, 1\]"),
    ],
)
def test_options_are_validated_by_name(option, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        TopM(**{option: value})


def test_options_defaults_and_errors():
    assert TopM().to_config() == {
        "m": 50,
        "shortfall_weight": 0.0,
        "infonce_weight": 0.0,
        "infonce_scale": None,
        "beta_ema_start": 4.0,
        "beta_ema_momentum": 0.9,
        "beta_min_r_squared": 0.85,
        "beta_min": 0.5,
        "beta_max": 16.0,
        "beta_tail_min_points": 1024,
        "beta_tail_frac": 0.05,
    }
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_m'"):
        TopM().replace(top_m=3)
    with pytest.raises(TypeError, match="beta_ema must be a tensor"):
        fit = batch_tail_fit(batch_negative_tail(torch.rand(4, 4), torch.arange(4), None, TopM(), eps=EPS), TopM())
        update_beta_ema(4.0, fit, TopM())
    scores = torch.rand(3, 4)
    with pytest.raises(ValueError, match="every row needs a positive"):
        check_scores(scores, torch.tensor([0, -1, 2]), every_row_has_positive=True)
    with pytest.raises(ValueError, match="infonce_scale must be > 0"):
        TopM(infonce_weight=0.5, infonce_scale=0.0)
