"""The false-negative guard (``false_negative_filter``) in the four loss classes, and WEINCE's ``mode="none"``.

- ``mode="none"`` is MultipleNegativesRankingLoss (loss and gradients to 1e-6);
- with no candidate above the threshold the loss is the unfiltered loss, exactly;
- planted duplicates of the positive: all of them and only they are removed, i.e. the loss equals the loss computed
  with those candidates removed by hand (an independent computation for InfoNCE and the sigmoid loss);
- cached equals uncached with the guard on; the hot path keeps its sync counts; bad settings fail at construction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import Tensor

from st_weince.functional import mnrl_layout, normalize_rows
from st_weince.functional.layouts import guard_layout
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.float32_tolerance import (
    assert_share_above_close,
    block_scores,
    row_chunks,
    tail_fit_tolerances,
    ulps_apart,
)

ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
MNRL_SETTINGS = [
    {},
    {"directions": ALL_DIRECTIONS},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
    {"directions": ("query_to_doc", "doc_to_doc")},
]
PLANTED = (3, 7, 11)  # rows whose positives are duplicates of each other
PLANTED_PAIRS = {(i, j) for i in PLANTED for j in PLANTED if i != j}


def pairs(
    batch: int = 64, dim: int = 32, seed: int = 0, planted: bool = False, negatives: int = 0, noise: float = 0.3
) -> list[Tensor]:
    """(anchor, positive[, negative...]) embeddings, float64: positives at cosine about 0.96 to their anchor (at
    ``noise`` 0.3), other pairs at about 0 +- 0.18. ``planted``: rows 3, 7, 11 are one intent (near-duplicate anchors,
    duplicate positives)."""
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    positives = anchors + noise * torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    if planted:
        first = PLANTED[0]
        for row in PLANTED[1:]:
            anchors[row] = anchors[first] + 0.02 * torch.randn(dim, generator=generator, dtype=torch.float64)
        positives[PLANTED[1]] = positives[first]
        positives[PLANTED[2]] = positives[first] + 1e-3 * torch.randn(dim, generator=generator, dtype=torch.float64)
    columns = [anchors, positives]
    columns += [torch.randn(batch, dim, generator=generator, dtype=torch.float64) for _ in range(negatives)]
    return [column.requires_grad_() for column in columns]


def value_and_grads(loss_fn, columns) -> tuple[torch.Tensor, list[torch.Tensor]]:
    columns = [column.detach().clone().requires_grad_() for column in columns]
    value = loss_fn.compute_loss_from_embeddings(columns, None)
    return value.detach(), list(torch.autograd.grad(value, columns))


def cached_value_and_grads(loss_fn, columns, mini_batch: int = 5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    reps = [[part.clone().requires_grad_() for part in column.detach().split(mini_batch)] for column in columns]
    value = loss_fn.calculate_loss(reps, None, with_backward=True)
    return value.detach(), [torch.cat([part.grad for part in column]) for column in reps]


# ----- mode="none" is MNRL -----
@pytest.mark.parametrize("options", MNRL_SETTINGS)
def test_mode_none_is_mnrl(options):
    columns = pairs(negatives=1, noise=1.0)  # hard enough that the loss is far from 0
    mnrl = MultipleNegativesRankingLoss(None, scale=20.0, **options)
    none = WEINCELoss(None, scale=20.0, mode="none", **options)
    for column_count in (2, 3):
        expected, expected_grads = value_and_grads(mnrl, columns[:column_count])
        value, grads = value_and_grads(none, columns[:column_count])
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
    assert float(none.last_statistics.lam.abs().max()) == 0.0
    # The default mode differs on the same batch (the control is not vacuous).
    default_mode = WEINCELoss(None, **options).compute_loss_from_embeddings(columns[:2])
    assert abs(float(default_mode.detach() - expected)) > 1e-3 * float(expected)


# ----- no candidate above the threshold: exactly the unfiltered loss -----
GUARDS = [("absolute", 0.1), ("relative", 0.9)]


def four_classes(**options) -> list:
    return [
        WEINCELoss(None, directions=ALL_DIRECTIONS, **options),
        CachedWEINCELoss(None, directions=ALL_DIRECTIONS, mini_batch_size=64, **options),
        RBSigmoidLoss(None, symmetric=True, **options),
        CachedRBSigmoidLoss(None, symmetric=True, mini_batch_size=64, **options),
    ]


@pytest.mark.parametrize("guard", GUARDS)
def test_no_candidate_above_the_threshold_gives_the_unfiltered_loss_exactly(guard):
    columns = pairs()
    for plain, guarded in zip(four_classes(), four_classes(false_negative_filter=guard)):
        cached = hasattr(plain, "calculate_loss")
        run = cached_value_and_grads if cached else value_and_grads
        kwargs = {"mini_batch": 64} if cached else {}
        expected, expected_grads = run(plain, columns, **kwargs)
        value, grads = run(guarded, columns, **kwargs)
        assert torch.equal(value, expected), type(plain).__name__
        for grad, expected_grad in zip(grads, expected_grads):
            assert torch.equal(grad, expected_grad), type(plain).__name__
        logged = guarded.pop_logged_statistics()
        prefix = "weince" if isinstance(plain, WEINCELoss) else "rb_sigmoid"
        assert logged[f"{prefix}_fn_masked_share"] == 0.0 and logged[f"{prefix}_fn_anchors_share"] == 0.0
        assert f"{prefix}_fn_masked_share" not in plain.pop_logged_statistics()
    weince = WEINCELoss(None)
    weince.compute_loss_from_embeddings(columns)
    assert float(weince.last_statistics.lam.max()) > 0.05, "the blend must be active for the check to mean much"


# ----- planted duplicates: all of them and only they are removed -----
def hand_mask(batch: int = 64) -> torch.Tensor:
    """query_to_doc candidates left after removing the planted duplicates of each planted row's positive."""
    mask = torch.ones(batch, batch, dtype=torch.bool)
    for row, column in PLANTED_PAIRS:
        mask[row, column] = False
    return mask


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


@pytest.mark.parametrize("guard", [("absolute", 0.05), ("relative", 0.95)])
def test_planted_duplicates_weince_equals_the_loss_with_them_removed_by_hand(guard):
    columns = pairs(planted=True)
    scores = cosine(columns[0], columns[1]).detach()
    guarded = WEINCELoss(None, false_negative_filter=guard)
    value, grads = value_and_grads(guarded, columns)
    expected = WEINCELoss(None).loss_from_scores(scores, torch.arange(64), hand_mask())
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    # removing anything else (or nothing) gives a different loss: the check can fail
    assert abs(float(WEINCELoss(None).compute_loss_from_embeddings(columns) - value)) > 1e-6
    logged = guarded.pop_logged_statistics()
    assert logged["weince_fn_masked_share"] == pytest.approx(6 / (64 * 63))
    assert logged["weince_fn_anchors_share"] == pytest.approx(3 / 64)
    # InfoNCE with the guard, by hand: log-sum-exp over the kept candidates only.
    none_value, _ = value_and_grads(WEINCELoss(None, mode="none", false_negative_filter=guard), columns)
    logits = (20.0 * cosine(columns[0], columns[1])).masked_fill(~hand_mask(), float("-inf"))
    by_hand = (logits.logsumexp(1) - logits.diagonal()).mean()
    torch.testing.assert_close(none_value, by_hand.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("guard", [("absolute", 0.05), ("relative", 0.95)])
def test_planted_duplicates_rb_sigmoid_equals_the_loss_with_them_removed_by_hand(guard):
    columns = pairs(planted=True)
    for chunk_size in (None, 10):
        guarded = RBSigmoidLoss(None, false_negative_filter=guard, chunk_size=chunk_size)
        value, grads = value_and_grads(guarded, columns)
        scores = cosine(columns[0], columns[1])
        t, b_rel = guarded.log_t.detach().double().exp(), guarded.b_rel.detach().double()  # as the loss computes
        z = t * (scores - b_rel)
        eye = torch.eye(64, dtype=torch.bool)
        per_pair = torch.where(eye, F.softplus(-z), F.softplus(z)).masked_fill(~hand_mask(), 0.0)
        by_hand = per_pair.sum(1).mean()
        torch.testing.assert_close(value, by_hand.detach(), rtol=1e-12, atol=1e-12)
        expected_grads = torch.autograd.grad(by_hand, columns[:2])
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
        logged = guarded.pop_logged_statistics()
        assert logged["rb_sigmoid_fn_masked_share"] == pytest.approx(6 / (64 * 63))
        assert logged["rb_sigmoid_fn_anchors_share"] == pytest.approx(3 / 64)
        # the margin is that of the kept pairs: the duplicates no longer count as the largest negatives
        detached = scores.detach()
        kept_negatives = detached.masked_fill(eye | ~hand_mask(), float("-inf"))
        margin = (detached.diagonal().min() - kept_negatives.max()) / 2
        assert logged["rb_sigmoid_margin"] == pytest.approx(float(margin), abs=1e-6)


def test_rows_without_their_own_positive_use_the_query_to_doc_pair_score():
    """doc_to_doc without doc_to_query: the doc-anchored rows have no positive; the threshold is their pair's."""
    columns = pairs(planted=True)
    loss = WEINCELoss(None, directions=("query_to_doc", "doc_to_doc"), false_negative_filter=("absolute", 0.05))
    queries, docs = (F.normalize(c.detach(), dim=-1) for c in columns)
    layout = mnrl_layout(queries, [docs], loss.options.directions, loss.options.partition_mode)
    layout = guard_layout(layout, loss.options.false_negative_filter)
    doc_group = layout.groups[1]
    assert not doc_group.has_positive and doc_group.directions == ("doc_to_doc",)
    removed = {tuple(x) for x in (~doc_group.valid_mask & ~torch.eye(64, dtype=torch.bool)).nonzero().tolist()}
    assert removed == PLANTED_PAIRS  # doc 3 and docs 7, 11 are (near-)copies: each row drops the other two
    assert {tuple(x) for x in (~layout.groups[0].valid_mask).nonzero().tolist()} == PLANTED_PAIRS


# ----- cached equals uncached with the guard on -----
def assert_cached_equals_uncached(cached, uncached, columns, prefix: str) -> None:
    """The cached loss gives the uncached one's value, gradients and logged statistics, with pairs masked."""
    expected, expected_grads = value_and_grads(uncached, columns)
    value, grads = cached_value_and_grads(cached, columns)
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-8, atol=1e-12)
    logged, expected_logged = cached.pop_logged_statistics(), uncached.pop_logged_statistics()
    assert logged[f"{prefix}_fn_masked_share"] > 0
    if prefix == "weince":
        # A count of anchors past lambda = 1/2: one within the paths' rounding of 1/2 may fall either way.
        queries, *docs = [normalize_rows(column) for column in columns]
        options = uncached.options
        layout = mnrl_layout(queries, docs, options.directions, options.partition_mode)
        layout = guard_layout(layout, options.false_negative_filter)
        group = layout.groups[0]  # the query rows, guarded, whose statistics the loss logs
        ulps = ulps_apart(block_scores(uncached, columns, row_chunks(columns[0].shape[0], 5)), group.scores)
        tolerance = tail_fit_tolerances(group.scores, group.positive_index, group.valid_mask, options, ulps)["lam"]
        assert_share_above_close(
            logged.pop("weince_lambda_gt_half"),
            expected_logged.pop("weince_lambda_gt_half"),
            uncached.last_statistics.lam,
            0.5,
            tolerance,
            "lam",
        )
    assert logged == pytest.approx(expected_logged, rel=1e-9)


@pytest.mark.parametrize(
    "options",
    [
        {"false_negative_filter": ("absolute", 0.05)},
        {"false_negative_filter": ("relative", 0.95), "directions": ALL_DIRECTIONS},
        {"false_negative_filter": ("absolute", 0.05), "directions": ("query_to_doc", "doc_to_doc")},
    ],
)
def test_cached_weince_equals_uncached_with_the_guard(options):
    columns = pairs(planted=True, negatives=1)[:2] if "directions" in options else pairs(planted=True, negatives=1)
    assert_cached_equals_uncached(
        CachedWEINCELoss(None, mini_batch_size=5, **options), WEINCELoss(None, **options), columns, "weince"
    )


@pytest.mark.parametrize("options", [{}, {"symmetric": True, "chunk_size": 7}])
@pytest.mark.parametrize("guard", [("absolute", 0.05), ("relative", 0.95)])
def test_cached_rb_sigmoid_equals_uncached_with_the_guard(options, guard):
    uncached = RBSigmoidLoss(None, false_negative_filter=guard, **options)
    cached = CachedRBSigmoidLoss(None, false_negative_filter=guard, mini_batch_size=5, **options)
    assert_cached_equals_uncached(cached, uncached, pairs(planted=True, negatives=1), "rb_sigmoid")


# ----- the hot path -----
@pytest.mark.parametrize(
    "make",
    [
        lambda **o: WEINCELoss(None, directions=ALL_DIRECTIONS, **o),
        lambda **o: RBSigmoidLoss(None, symmetric=True, chunk_size=16, **o),
    ],
)
def test_guard_keeps_the_sync_counts(make):
    columns = [c.detach().float().requires_grad_() for c in pairs(planted=True)]
    for check_inputs, expected in ((True, 1), (False, 0)):
        loss_fn = make(false_negative_filter=("relative", 0.95), check_inputs=check_inputs)
        with count_host_syncs() as syncs:
            loss_fn.compute_loss_from_embeddings(columns, None).backward()
        assert syncs.total == expected


@pytest.mark.parametrize("cls", [CachedWEINCELoss, CachedRBSigmoidLoss])
def test_cached_loss_stage_keeps_the_sync_counts(cls):
    columns = [c.detach().float() for c in pairs(planted=True)]
    for check_inputs, expected in ((True, 1), (False, 0)):
        loss_fn = cls(None, mini_batch_size=8, false_negative_filter=("absolute", 0.05), check_inputs=check_inputs)
        with count_host_syncs() as syncs:
            cached_value_and_grads(loss_fn, columns, mini_batch=8)
        assert syncs.total == expected


@pytest.mark.slow
def test_compiled_weince_with_the_guard_equals_eager():
    columns = [c.detach().float().requires_grad_() for c in pairs(planted=True)]
    loss_fn = WEINCELoss(None, directions=ALL_DIRECTIONS, check_inputs=False, false_negative_filter=("absolute", 0.05))
    eager = loss_fn.compute_loss_from_embeddings(columns, None)
    eager_grads = torch.autograd.grad(eager, columns)
    compiled_fn = torch.compile(loss_fn.compute_loss_from_embeddings, fullgraph=True)
    compiled = compiled_fn(columns, None)
    compiled_grads = torch.autograd.grad(compiled, columns)
    torch.testing.assert_close(compiled.detach(), eager.detach(), rtol=1e-5, atol=1e-6)
    for grad, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    assert loss_fn.pop_logged_statistics()["weince_fn_masked_share"] > 0


# ----- settings -----
@pytest.mark.parametrize("cls", [WEINCELoss, CachedWEINCELoss, RBSigmoidLoss, CachedRBSigmoidLoss])
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (("absolute", -0.1), "m >= 0"),
        (("relative", 1.2), "0 < r <= 1"),
        (("cosine", 0.1), "rule must be 'absolute' or 'relative'"),
        (0.95, "must be None, \\('absolute', margin\\), \\('relative', ratio\\), 'identical' or 'same_label'"),
        (("relative", float("inf")), "finite number"),
    ],
)
def test_bad_settings_fail_at_construction(cls, spec, message):
    with pytest.raises(ValueError, match=message):
        cls(None, false_negative_filter=spec)


@pytest.mark.parametrize("cls", [WEINCELoss, CachedWEINCELoss, RBSigmoidLoss, CachedRBSigmoidLoss])
def test_config_round_trip_keeps_the_guard(cls):
    loss = cls(None, false_negative_filter=("relative", 0.95))
    config = loss.get_config_dict()
    assert config["false_negative_filter"] == ["relative", 0.95]
    rebuilt = cls(None, **config)
    assert rebuilt.get_config_dict() == config
    assert rebuilt.options.false_negative_filter == loss.options.false_negative_filter
    assert cls(None).get_config_dict()["false_negative_filter"] is None


def test_weince_mode_none_round_trips_and_bad_modes_are_refused():
    loss = WEINCELoss(None, mode="none")
    assert WEINCELoss(None, **loss.get_config_dict()).options.mode == "none"
    with pytest.raises(ValueError, match="'both', 'rho', 'aic' or 'none'"):
        WEINCELoss(None, mode="infonce")
