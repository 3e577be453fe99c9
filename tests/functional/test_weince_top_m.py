"""WEINCELoss / CachedWEINCELoss with the released composite's two top-M terms and the batch tail index: the loss
against the plain re-implementation of the released loss (tests/weince_release_reference.py) over sequences of
steps, cached equal to uncached, weights 0 equal to the blend exactly, the moving average as the loss's state, the
logged values, the options, the hot path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from st_weince.functional import TopM, mnrl_layout, normalize_rows, nt_xent_layout
from st_weince.functional.options import RELEASED_COMPOSITE
from st_weince.losses import CachedWEINCELoss, WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from st_weince.vision.objectives import SimCLRObjective
from tests.float32_tolerance import (
    assert_share_above_close,
    block_scores,
    query_group,
    row_chunks,
    tail_fit_tolerances,
    ulps_apart,
)
from tests.functional.test_weince_composite import KINDS, _cases, make_batch
from tests.weince_release_reference import ReleasedCompositeReference

TOLERANCE = 1e-6
RELEASED = TopM(shortfall_weight=0.5, infonce_weight=0.5)
MNRL_SETTINGS = [
    (("query_to_doc",), "joint", 3),
    (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint", 2),
    (("query_to_doc", "doc_to_query"), "per_direction", 2),
]


def close(value: torch.Tensor | float, expected: float) -> bool:
    return abs(float(value) - expected) <= TOLERANCE * max(1.0, abs(expected))


def columns(batch_size: int, num_columns: int, dim: int = 8, seed: int = 0, dtype=torch.float32) -> list:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, dim, generator=generator, dtype=dtype)
    return [(base + torch.randn(batch_size, dim, generator=generator, dtype=dtype)) for _ in range(num_columns)]


# --------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", _cases()[:30], ids=lambda case: f"{case[1]}-n{case[2]}-m{case[3]}-#{case[0]}")
def test_loss_from_scores_matches_the_released_reference(case):
    """loss_from_scores (the SimCLR layout and score matrices) over sequences of up to 6 steps, float64, 1e-6:
    the total, the batch tail index carried in the buffer, the logged R^2."""
    index, layout, size, top_m, tail_min_points, tail_frac, steps = case
    generator = torch.Generator().manual_seed(index)
    temperature = float(np.random.default_rng(index).choice([0.5, 0.05, 1.0]))
    loss = WEINCELoss(
        None,
        scale=1.0 / temperature,
        beta=1.0,
        top_m=RELEASED.replace(m=top_m, beta_tail_min_points=tail_min_points, beta_tail_frac=tail_frac),
    ).double()
    reference = ReleasedCompositeReference(top_m=top_m, tail_min_points=tail_min_points, tail_frac=tail_frac)
    for step in range(steps):
        kind = KINDS[layout][(index + step) % 3]
        scores, positive_index, valid_mask = make_batch(layout, size, kind, generator)
        total = loss.loss_from_scores(scores, positive_index, valid_mask)
        expected = reference.step(scores.numpy(), positive_index.numpy(), valid_mask.numpy(), temperature=temperature)
        where = f"step {step}"
        assert total.dtype == torch.float64
        assert close(total, expected["total"]), (where, float(total), expected["total"])
        assert close(loss.batch_beta_ema, expected["beta_t"]), where
        logged = loss.pop_logged_statistics()
        assert close(logged["weince_batch_beta"], expected["beta_t"]), where
        assert close(logged["weince_batch_beta_r2"], expected["r_squared"] or 0.0), where
        shares = (expected["blend"], 0.5 * expected["top_m_shortfall"], 0.5 * expected["top_m_infonce"])
        for name, share in zip(("blend", "top_m_shortfall", "top_m_infonce"), shares):
            assert close(logged[f"weince_share_{name}"], share / expected["total"]), (where, name)


def test_parity_sequences_move_the_moving_average():
    """Among the sequences of 5+ steps above, the tail index moves, with trusted and untrusted fits."""
    moved = trusted = untrusted = 0
    for index, layout, size, top_m, tail_min_points, tail_frac, steps in _cases()[:30]:
        if steps < 5:
            continue
        generator = torch.Generator().manual_seed(index)
        reference = ReleasedCompositeReference(top_m=top_m, tail_min_points=tail_min_points, tail_frac=tail_frac)
        for step in range(steps):
            scores, positive_index, valid_mask = make_batch(layout, size, KINDS[layout][(index + step) % 3], generator)
            expected = reference.step(scores.numpy(), positive_index.numpy(), valid_mask.numpy(), temperature=0.5)
            moved += abs(expected["beta_t"] - 4.0) > 1e-3
            trusted += expected["trusted"]
            untrusted += expected["slope"] is not None and not expected["trusted"]
    assert moved >= 10 and trusted >= 5 and untrusted >= 5, (moved, trusted, untrusted)


@pytest.mark.parametrize("seed", range(4))
def test_mnrl_layout_matches_the_released_reference(seed):
    """compute_loss_from_embeddings on (anchor, positive, negative) columns with query_to_query (one query-anchored
    softmax), 5 steps, float64: each step's candidate matrix handed to the reference."""
    directions = ("query_to_doc", "query_to_query")
    top_m = RELEASED.replace(beta_tail_min_points=40)
    loss = WEINCELoss(None, scale=2.0, beta=1.0, directions=directions, top_m=top_m)
    loss = loss.double()
    reference = ReleasedCompositeReference(tail_min_points=40)
    for step in range(5):
        embeddings = columns(12 + 4 * step, 3, seed=100 * seed + step, dtype=torch.float64)
        total = loss.compute_loss_from_embeddings(embeddings, None)
        group = mnrl_layout(normalize_rows(embeddings[0]), [normalize_rows(e) for e in embeddings[1:]], directions)
        group = group.groups[0]
        expected = reference.step(
            group.scores.numpy(), group.positive_index.numpy(), group.valid_mask.numpy(), temperature=0.5
        )
        assert close(total, expected["total"]), (step, float(total), expected["total"])
        assert close(loss.batch_beta_ema, expected["beta_t"]), step


# --------------------------------------------------------------------------------------------- cached, weights 0


@pytest.mark.parametrize(("directions", "partition_mode", "num_columns"), MNRL_SETTINGS)
def test_cached_equals_uncached_over_steps(directions, partition_mode, num_columns):
    """Loss, gradients, tail index and logged values, 3 steps, mini-batches of 5 rows (float64: only the summation
    order differs)."""
    top_m = RELEASED.replace(beta_tail_min_points=64)
    options = dict(directions=directions, partition_mode=partition_mode, top_m=top_m)
    plain = WEINCELoss(None, **options).double()
    cached = CachedWEINCELoss(None, mini_batch_size=5, **options).double()
    for step in range(3):
        embeddings = [c.requires_grad_() for c in columns(23, num_columns, seed=step, dtype=torch.float64)]
        loss = plain.compute_loss_from_embeddings(embeddings, None)
        loss.backward()
        reps = [[part.detach().clone().requires_grad_() for part in e.detach().split(5)] for e in embeddings]
        cached_loss = cached.calculate_loss(reps, None, with_backward=True)
        torch.testing.assert_close(cached_loss, loss.detach(), rtol=1e-12, atol=1e-12)
        for embedding, column in zip(embeddings, reps):
            torch.testing.assert_close(
                torch.cat([part.grad for part in column]), embedding.grad, rtol=1e-10, atol=1e-12
            )
        torch.testing.assert_close(cached.batch_beta_ema, plain.batch_beta_ema, rtol=1e-12, atol=0.0)
        logged, cached_logged = plain.pop_logged_statistics(), cached.pop_logged_statistics()
        assert set(logged) == set(cached_logged)
        # The share of anchors with lambda > 1/2 is a count: an anchor whose lambda lies within the two paths'
        # rounding of 1/2 may fall either way (float64 here: the paths' scores differ by the chunked matmul's ulps).
        detached = [e.detach() for e in embeddings]
        group = query_group(plain, detached)
        ulps = ulps_apart(block_scores(plain, detached, row_chunks(23, 5)), group.scores)
        lam_tolerance = tail_fit_tolerances(group.scores, group.positive_index, group.valid_mask, plain.options, ulps)[
            "lam"
        ]
        share = logged.pop("weince_lambda_gt_half")
        assert_share_above_close(
            cached_logged.pop("weince_lambda_gt_half"), share, plain.last_statistics.lam, 0.5, lam_tolerance, "lam"
        )
        for name, value in logged.items():
            assert cached_logged[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert float(plain.batch_beta_ema) != TopM.beta_ema_start, "the tail index must move for the check"


@pytest.mark.parametrize("cached", [False, True])
def test_zero_weights_are_todays_loss_exactly(cached):
    """Both weights 0 (any other top-M setting): the same loss and gradients bit for bit, no buffer, no new logs."""
    make = (
        (lambda **o: CachedWEINCELoss(None, mini_batch_size=7, **o)) if cached else (lambda **o: WEINCELoss(None, **o))
    )
    today = make()
    off = make(top_m=TopM(m=3, beta_ema_start=2.0, beta_tail_min_points=16, shortfall_weight=0.0))
    assert dict(off.state_dict()) == {} == dict(today.state_dict())
    for step in range(2):
        results = []
        for loss_fn in (today, off):
            embeddings = [c.requires_grad_() for c in columns(20, 3, seed=step)]
            if cached:
                reps = [[part.detach().clone().requires_grad_() for part in e.detach().split(7)] for e in embeddings]
                value = loss_fn.calculate_loss(reps, None, with_backward=True)
                grads = [torch.cat([part.grad for part in column]) for column in reps]
            else:
                value = loss_fn.compute_loss_from_embeddings(embeddings, None)
                grads = torch.autograd.grad(value, embeddings)
            results.append((value.detach(), grads, loss_fn.pop_logged_statistics()))
        (loss_a, grads_a, logged_a), (loss_b, grads_b, logged_b) = results
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        assert logged_a == logged_b and not any("batch_beta" in name or "share" in name for name in logged_b)


def test_zero_weights_on_the_simclr_layout_are_todays_loss_exactly():
    scores, positive_index, valid_mask = nt_xent_layout(*columns(16, 2, seed=4))
    today = WEINCELoss(None, scale=2.0, beta=1.0).loss_from_scores(scores, positive_index, valid_mask)
    off = WEINCELoss(None, scale=2.0, beta=1.0, top_m=TopM(m=5)).loss_from_scores(scores, positive_index, valid_mask)
    assert torch.equal(today, off)


@pytest.mark.parametrize("cached", [False, True])
def test_the_top_m_infonce_term_at_its_own_scale(cached):
    """``TopM.infonce_scale`` sets only that term's inverse temperature: with lambda = 0 the loss is InfoNCE at
    ``scale`` + 0.5 x InfoNCE at ``infonce_scale`` over the positive and the M hardest negatives, computed
    here by hand (float64), and the logged effective scale is that scale."""
    scale, matched, top_m = 2.0, 9.5, 4
    options = dict(mode="none", scale=scale, top_m=TopM(m=top_m, infonce_weight=0.5, infonce_scale=matched))
    loss_fn = (CachedWEINCELoss(None, mini_batch_size=5, **options) if cached else WEINCELoss(None, **options)).double()
    queries, docs = columns(12, 2, seed=3, dtype=torch.float64)
    if cached:
        reps = [[part.clone() for part in e.split(5)] for e in (queries, docs)]
        value = loss_fn.calculate_loss(reps, None, with_backward=False)
    else:
        value = loss_fn.compute_loss_from_embeddings([queries, docs], None)
    scores = torch.nn.functional.normalize(queries, dim=1) @ torch.nn.functional.normalize(docs, dim=1).T
    positives = scores.diagonal()
    negatives = scores.masked_fill(torch.eye(12, dtype=torch.bool), -torch.inf).topk(top_m, dim=1).values
    infonce = torch.nn.functional.cross_entropy(scale * scores, torch.arange(12))
    hardest = torch.cat([positives[:, None], negatives], dim=1) * matched
    top_m_infonce = torch.nn.functional.cross_entropy(hardest, torch.zeros(12, dtype=torch.long))
    torch.testing.assert_close(value, infonce + 0.5 * top_m_infonce, rtol=1e-10, atol=1e-12)
    assert float(loss_fn.pop_logged_statistics()["weince_effective_scale_top_m_infonce"]) == matched
    assert loss_fn.get_config_dict()["top_m"]["infonce_scale"] == matched
    released = WEINCELoss.released(None)
    assert released.options.top_m.infonce_scale is None and released.options.top_m_infonce_scale == 2.0


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf")])
def test_the_top_m_infonce_scale_is_refused_by_name(value):
    for cls in (WEINCELoss, CachedWEINCELoss):
        with pytest.raises(ValueError, match="infonce_scale"):
            cls(None, top_m={"infonce_weight": 0.5, "infonce_scale": value})


# --------------------------------------------------------------------------------------------- state


def test_the_tail_index_is_state_advanced_only_by_training_steps():
    loss = WEINCELoss.released(None, top_m=RELEASED.replace(beta_tail_min_points=32))
    start = TopM.beta_ema_start
    assert list(loss.state_dict()) == ["batch_beta_ema"] and float(loss.batch_beta_ema) == start
    scores, positive_index, valid_mask = nt_xent_layout(*columns(32, 2, seed=1))
    with torch.no_grad():
        loss.loss_from_scores(scores, positive_index, valid_mask)
    assert float(loss.batch_beta_ema) == start, "evaluation under no_grad reads the state, does not change it"
    loss.eval()
    loss.loss_from_scores(scores, positive_index, valid_mask)
    assert float(loss.batch_beta_ema) == start, "a loss in eval mode does not change it either"
    loss.train()
    loss.loss_from_scores(scores, positive_index, valid_mask)
    moved = float(loss.batch_beta_ema)
    assert moved != start
    # The state travels with state_dict (and so with the loss-state checkpoints of st_weince.training).
    fresh = WEINCELoss.released(None, top_m=RELEASED.replace(beta_tail_min_points=32))
    fresh.load_state_dict(loss.state_dict())
    assert float(fresh.batch_beta_ema) == moved
    a = loss.loss_from_scores(scores, positive_index, valid_mask)
    b = fresh.loss_from_scores(scores, positive_index, valid_mask)
    assert torch.equal(a, b) and torch.equal(loss.batch_beta_ema, fresh.batch_beta_ema)


def test_the_simclr_objective_carries_the_tail_index():
    objective = SimCLRObjective("weince", scale=2.0, beta=1.0, loss_kwargs={"top_m": RELEASED})
    assert list(objective.state_dict()) == ["loss.batch_beta_ema"]
    z1, z2 = (c.requires_grad_() for c in columns(64, 2, dim=16, seed=2))
    objective(z1, z2).backward()
    logged = objective.pop_logged_statistics()
    assert {"weince_batch_beta", "weince_batch_beta_r2", "weince_share_top_m_infonce"} <= set(logged)
    config = objective.get_config_dict()
    top_m = config["top_m"]
    assert (top_m["m"], top_m["shortfall_weight"], top_m["infonce_weight"]) == (50, 0.5, 0.5)


# --------------------------------------------------------------------------------------------- options


def test_released_preset_and_config_round_trip():
    for cls, extra in ((WEINCELoss, {}), (CachedWEINCELoss, {"mini_batch_size": 8})):
        loss = cls.released(None, **extra)
        assert type(loss) is cls
        assert (loss.options.scale, loss.options.beta, loss.options.top_m.m) == (2.0, 1.0, 50)
        assert (loss.options.top_m.shortfall_weight, loss.options.top_m.infonce_weight) == (0.5, 0.5)
        config = loss.get_config_dict()
        rebuilt = cls(None, **json.loads(json.dumps(config)))
        assert rebuilt.options == loss.options and rebuilt.get_config_dict() == config
    overridden = WEINCELoss.released(None, top_m=RELEASED_COMPOSITE.top_m.replace(m=10, infonce_weight=0.0))
    assert (overridden.options.top_m.m, overridden.options.top_m.infonce_weight) == (10, 0.0)
    tuned = TopM(m=7, shortfall_weight=1.0, beta_ema_momentum=0.5, beta_min_r_squared=0.5, beta_tail_frac=0.2)
    tuned_loss = WEINCELoss(None, top_m=tuned)
    assert WEINCELoss(None, **tuned_loss.get_config_dict()).options == tuned_loss.options
    # a TopM with both weights 0 turns both terms off: stored (and written) as None
    assert WEINCELoss(None, top_m=TopM(m=7)).get_config_dict()["top_m"] is None


def test_a_bad_top_m_names_the_option():
    with pytest.raises(TypeError, match=r"top_m must be a TopM, its dict or None, got str"):
        WEINCELoss(None, top_m="released")
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_m_weight'"):
        WEINCELoss(None, top_m_weight=0.5)


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("m", 0, ValueError, "m must be at least 1"),
        ("m", 2.5, TypeError, "m must be an integer"),
        ("shortfall_weight", -0.1, ValueError, "shortfall_weight must be >= 0"),
        ("infonce_weight", float("nan"), ValueError, "infonce_weight must be finite"),
        ("beta_ema_momentum", 1.0, ValueError, r"beta_ema_momentum must lie in \[0, 1\)"),
        ("beta_min_r_squared", 1.5, ValueError, "beta_min_r_squared must lie in"),
        ("beta_ema_start", 0.0, ValueError, "beta_ema_start must be > 0"),
        ("beta_tail_frac", 0.0, ValueError, "beta_tail_frac must lie in"),
    ],
)
def test_options_are_refused_at_construction_by_name(option, value, error, message):
    for cls in (WEINCELoss, CachedWEINCELoss):
        with pytest.raises(error, match=message):
            cls(None, top_m={"shortfall_weight": 0.5, option: value})


# --------------------------------------------------------------------------------------------- hot path, dtypes


@pytest.mark.parametrize(("directions", "partition_mode", "num_columns"), MNRL_SETTINGS)
def test_no_added_host_sync(directions, partition_mode, num_columns):
    embeddings = [c.requires_grad_() for c in columns(48, num_columns)]
    for check_inputs, syncs_expected in ((True, 1), (False, 0)):
        loss = WEINCELoss.released(
            None, directions=directions, partition_mode=partition_mode, check_inputs=check_inputs
        )
        with count_host_syncs() as syncs:
            loss.compute_loss_from_embeddings(embeddings, None).backward()
        assert syncs.total == syncs_expected
        scores, positive_index, valid_mask = nt_xent_layout(*columns(24, 2))
        with count_host_syncs() as syncs:
            loss.loss_from_scores(scores.requires_grad_(), positive_index, valid_mask).backward()
        assert syncs.total == syncs_expected
    assert loss.pop_logged_statistics()["weince_batch_beta"] > 0


@pytest.mark.slow
def test_compiles_with_fullgraph_and_equals_eager():
    eager = WEINCELoss.released(None, check_inputs=False, top_m=RELEASED.replace(beta_tail_min_points=64))
    compiled_loss = WEINCELoss.released(None, check_inputs=False, top_m=RELEASED.replace(beta_tail_min_points=64))
    compiled = torch.compile(compiled_loss.loss_from_scores, fullgraph=True)
    for seed in range(3):
        scores, positive_index, valid_mask = nt_xent_layout(*columns(32, 2, seed=seed))
        expected = eager.loss_from_scores(scores, positive_index, valid_mask)
        got = compiled(scores, positive_index, valid_mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled_loss.batch_beta_ema, eager.batch_beta_ema, rtol=1e-6, atol=0.0)
    assert float(eager.batch_beta_ema) != TopM.beta_ema_start


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_follows_the_input(dtype):
    """The composite comes out in the dtype of the blend alone (half precision: float32), finite."""
    z1, z2 = (c.to(dtype) for c in columns(16, 2, seed=5))
    scores, positive_index, valid_mask = nt_xent_layout(z1, z2)
    blend = WEINCELoss(None, scale=2.0, beta=1.0).loss_from_scores(scores, positive_index, valid_mask)
    composite = WEINCELoss.released(None).loss_from_scores(scores, positive_index, valid_mask)
    assert composite.dtype == blend.dtype and torch.isfinite(composite)
