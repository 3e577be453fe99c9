"""The sigmoid contrastive loss as pure functions: values against the direct formula, gradients against the analytic
ones, stability at extreme temperatures, chunking, the locked-encoder adapter, margins and input errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from st_weince.functional import (
    FalseNegativeFilter,
    apply_false_negative_filter,
    check_scores,
    constellation_margin,
    sigmoid_contrastive_loss,
)
from st_weince.functional.sigmoid import (
    CandidateGuard,
    SigmoidLogits,
    chunked_sigmoid_contrastive_loss,
    locked_adapter_scores,
    sigmoid_logits,
    targets_from_positive_index,
)
from st_weince.utils.hotpath import count_host_syncs


def direct_loss(scores, targets, t, *, b_rel=None, b=None, mask=None) -> float:
    """-(1/A) sum_valid [y log sigmoid(z) + (1 - y) log(1 - sigmoid(z))], in float64 with plain sigmoid/log."""
    scores, targets = scores.double(), targets.double()
    z = t * (scores - b_rel) if b_rel is not None else t * scores - b
    p = torch.sigmoid(z)
    per_pair = -(targets * torch.log(p) + (1 - targets) * torch.log(1 - p))
    if mask is not None:
        per_pair = per_pair * mask.double()
    return float(per_pair.sum() / scores.shape[0])


def random_case(seed: int = 0, anchors: int = 6, candidates: int = 9):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(anchors, candidates, generator=g) * 2 - 1
    targets = (torch.rand(anchors, candidates, generator=g) < 0.3).float()
    return scores, targets


@pytest.mark.parametrize("t", [0.5, 3.0, 10.0])
@pytest.mark.parametrize("b_rel", [-0.4, 0.0, 0.7])
def test_relative_parametrization_equals_direct_formula(t, b_rel):
    scores, targets = random_case()
    value = sigmoid_contrastive_loss(scores, targets, scale=t, relative_bias=b_rel)
    assert value.item() == pytest.approx(direct_loss(scores, targets, t, b_rel=b_rel), rel=1e-5)


@pytest.mark.parametrize("t,b", [(1.0, -2.0), (10.0, 0.0), (10.0, 10.0), (4.0, 1.5)])
def test_absolute_parametrization_equals_direct_formula(t, b):
    scores, targets = random_case(1)
    value = sigmoid_contrastive_loss(scores, targets, scale=t, bias=b)
    assert value.item() == pytest.approx(direct_loss(scores, targets, t, b=b), rel=1e-5)


def test_relative_and_absolute_agree_when_b_is_t_times_b_rel():
    scores, targets = random_case(2)
    relative = sigmoid_contrastive_loss(scores, targets, scale=7.0, relative_bias=0.3)
    absolute = sigmoid_contrastive_loss(scores, targets, scale=7.0, bias=2.1)
    assert relative.item() == pytest.approx(absolute.item(), rel=1e-6)
    logits = sigmoid_logits(scores, scale=7.0, relative_bias=0.3)
    torch.testing.assert_close(logits, 7.0 * scores - 2.1, rtol=1e-5, atol=1e-5)


def test_normalization_is_mean_over_anchors_of_sum_over_candidates():
    scores, targets = random_case(3, anchors=4, candidates=5)
    one_row = [sigmoid_contrastive_loss(scores[i : i + 1], targets[i : i + 1], scale=2.0, bias=0.5) for i in range(4)]
    total = sigmoid_contrastive_loss(scores, targets, scale=2.0, bias=0.5)
    assert total.item() == pytest.approx(sum(v.item() for v in one_row) / 4, rel=1e-6)


def test_valid_mask_leaves_entries_out():
    scores, targets = random_case(4)
    mask = torch.rand(scores.shape, generator=torch.Generator().manual_seed(9)) > 0.4
    value = sigmoid_contrastive_loss(scores, targets, scale=5.0, relative_bias=0.2, valid_mask=mask)
    assert value.item() == pytest.approx(direct_loss(scores, targets, 5.0, b_rel=0.2, mask=mask), rel=1e-5)
    # Excluded entries may even be NaN (e.g. a masked self-pair) without poisoning the loss.
    poisoned = scores.clone()
    poisoned[~mask] = float("nan")
    again = sigmoid_contrastive_loss(poisoned, targets, scale=5.0, relative_bias=0.2, valid_mask=mask)
    assert again.item() == pytest.approx(value.item(), rel=1e-6)


@pytest.mark.parametrize("parametrization", ["relative", "absolute"])
def test_gradients_match_the_analytic_ones(parametrization):
    scores, targets = random_case(5)
    scores.requires_grad_(True)
    log_t = torch.tensor(math.log(4.0), requires_grad=True)
    bias = torch.tensor(0.3, requires_grad=True)
    t = log_t.exp()
    kwargs = {"relative_bias": bias} if parametrization == "relative" else {"bias": bias}
    sigmoid_contrastive_loss(scores, targets, scale=t, **kwargs).backward()
    a = scores.shape[0]
    with torch.no_grad():
        z = 4.0 * (scores - 0.3) if parametrization == "relative" else 4.0 * scores - 0.3
        residual = torch.sigmoid(z) - targets  # dloss/dz per pair, times A
        expected_scores = residual * 4.0 / a
        if parametrization == "relative":
            expected_t = (residual * (scores - 0.3)).sum() / a
            expected_bias = -(residual * 4.0).sum() / a
        else:
            expected_t = (residual * scores).sum() / a
            expected_bias = -residual.sum() / a
    torch.testing.assert_close(scores.grad, expected_scores, rtol=1e-4, atol=1e-6)
    assert log_t.grad.item() == pytest.approx(float(expected_t) * 4.0, rel=1e-4)  # d/dlog t = t d/dt
    assert bias.grad.item() == pytest.approx(float(expected_bias), rel=1e-4)


UNIT_ROUNDOFF = 2.0**-24  # float32: every elementary operation is exact to this relative error


def float32_bounds(scores: torch.Tensor, matching: torch.Tensor, t: float, b_rel: float) -> tuple[float, torch.Tensor]:
    """How far the float32 loss and its gradient d/ds may lie from the float64 ones on the same float32 scores,
    relative to each term's own value (u = 2^-24):

    - ``z = t (s - b_rel)`` takes two roundings: ``|dz| <= 2u |z|``;
    - a term ``softplus(v)`` (``v = -z`` at a match, ``z`` elsewhere) moves by ``sigmoid(v) |dz|`` from that, plus
      ``4u softplus(v)`` for its own evaluation (within 2 ulp of log1p, and the adds);
    - the sum of N positive terms adds ``(log2 N + 4) u`` of the total (torch's CPU sum is pairwise), and the mean
      over anchors one rounding more;
    - a gradient entry ``+-t sigmoid(v) / A`` moves by ``(1 - sigmoid(v)) |dz|`` relative, plus ``8u`` for its own
      evaluation: exp (up to 2u), ``w = 1 + e`` and ``e / w`` (u each), the upstream factor and ``t`` (u each), and
      one u to spare;
    - a value below float32's smallest normal number (2^-126) may flush to zero: an absolute floor of ``2^-126`` per
      term and per gradient entry (times ``t / A``).

    Returns the loss's bound and the gradient's bound per entry, both from the float64 reference values."""
    z = t * (scores.double() - b_rel)
    v = torch.where(matching, -z, z)
    terms = F.softplus(v)
    moved = 2 * UNIT_ROUNDOFF * z.abs()
    count = scores.numel()
    tiny = torch.finfo(torch.float32).tiny
    loss_bound = (torch.sigmoid(v) * moved + 4 * UNIT_ROUNDOFF * terms + tiny).sum() + (
        math.log2(count) + 5
    ) * UNIT_ROUNDOFF * terms.sum()
    gradient = t * torch.sigmoid(v) / scores.shape[0]
    gradient_bound = ((1 - torch.sigmoid(v)) * moved + 8 * UNIT_ROUNDOFF) * gradient + tiny * t / scores.shape[0]
    return float(loss_bound) / scores.shape[0], gradient_bound


def saturated_case(t: float, b_rel: float, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """64 x 64 scores: matching pairs near or at 1 (saturated terms, far below the ulp of their logit), some exactly
    1 and -1, the rest spread over [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(64, 64, generator=g) * 2 - 1
    scores.fill_diagonal_(0.97)
    scores[:8, :8].fill_diagonal_(1.0)
    scores[8, 9], scores[9, 8] = -1.0, 1.0
    return scores, torch.eye(64, dtype=torch.bool)


def float32_number(value: float) -> float:
    """``value`` rounded to float32: the float64 reference must see the same inputs as the float32 loss."""
    return float(torch.tensor(value, dtype=torch.float32))


CASES = [
    (t, float32_number(b_rel))
    for t, b_rel in [(10.0, 0.7), (10.0, -0.78), (55.0, 0.3), (100.0, 0.7), (100.0, -0.5), (1e4, 0.7), (1e4, 0.0)]
]


@pytest.mark.parametrize("t,b_rel", CASES)
def test_the_float32_loss_and_gradient_hold_a_bound_relative_to_their_value(t, b_rel):
    """Against float64 on the same float32 scores, at saturated matches, scores of exactly +-1, t up to the cap (100)
    and t = 1e4: the loss within :func:`float32_bounds` of the value (so a term of 2e-8 is not rounded away), never
    negative, and every gradient entry within its own bound."""
    scores, matching = saturated_case(t, b_rel)
    targets = matching.float()
    loss_bound, gradient_bound = float32_bounds(scores, matching, t, b_rel)
    scores32 = scores.clone().requires_grad_()
    value = sigmoid_contrastive_loss(scores32, targets, scale=t, relative_bias=b_rel)
    value.backward()
    scores64 = scores.double().requires_grad_()
    expected = sigmoid_contrastive_loss(scores64, targets.double(), scale=t, relative_bias=b_rel)
    expected.backward()
    assert float(value.detach()) >= 0.0
    assert abs(float(value.detach()) - float(expected.detach())) <= loss_bound
    assert ((scores32.grad.double() - scores64.grad).abs() <= gradient_bound).all()


@pytest.mark.parametrize("t,b_rel", CASES)
@pytest.mark.parametrize("guarded", [False, True])
def test_the_fused_block_loss_on_embeddings_holds_the_same_float32_bound(t, b_rel, guarded):
    """The embedding path's fused block loss (its own softplus, ``max(v, 0) + log(w) + (u - (w - 1)) / w``) and its
    gradient d/ds (read through ``score_transform``) against the float64 loss of the same float32 scores, within
    :func:`float32_bounds`; with a guard (a valid_mask) too, and a guard that removes nothing gives the unguarded
    value bit for bit."""
    g = torch.Generator().manual_seed(11)
    anchors = F.normalize(torch.randn(64, 16, generator=g), dim=-1)
    candidates = F.normalize(anchors + 0.1 * torch.randn(64, 16, generator=g), dim=-1)
    anchors[:4] = candidates[:4]  # matching scores of (nearly) exactly 1
    positive_index = torch.arange(64)
    scores = anchors @ candidates.T  # the same float32 product the block computes
    filter_spec = ("absolute", 0.9) if guarded else None  # leaves out the negatives above s_pos - 0.9
    blocks: list[torch.Tensor] = []

    def keep(block: torch.Tensor) -> torch.Tensor:
        block.retain_grad()
        blocks.append(block)
        return block

    logits = SigmoidLogits(t, relative_bias=b_rel, score_transform=keep)
    value = chunked_sigmoid_contrastive_loss(
        anchors.requires_grad_(), candidates, positive_index, logits, guard=CandidateGuard(filter_spec)
    ).loss
    value.backward()
    assert torch.equal(blocks[0].detach(), scores)
    valid_mask, _ = apply_false_negative_filter(scores, positive_index, None, FalseNegativeFilter.parse(filter_spec))
    assert valid_mask is None or 0 < int((~valid_mask).sum()) < 64 * 63
    scores64 = scores.double().requires_grad_()
    targets = torch.eye(64, dtype=torch.float64)
    expected = sigmoid_contrastive_loss(scores64, targets, valid_mask=valid_mask, scale=t, relative_bias=b_rel)
    expected.backward()
    kept = torch.ones_like(scores, dtype=torch.bool) if valid_mask is None else valid_mask
    loss_bound, gradient_bound = float32_bounds(
        scores.masked_fill(~kept, 0.0), torch.eye(64, dtype=torch.bool), t, b_rel
    )
    assert float(value.detach()) >= 0.0
    assert abs(float(value.detach()) - float(expected.detach())) <= loss_bound
    assert ((blocks[0].grad.double() - scores64.grad).abs() <= gradient_bound.masked_fill(~kept, 0.0)).all()
    block = (anchors.detach(), candidates, positive_index, SigmoidLogits(t, relative_bias=b_rel))
    # ("absolute", 0): only negatives above the row's own positive score, of which these rows have none
    nothing = FalseNegativeFilter.parse(("absolute", 0.0))
    assert apply_false_negative_filter(scores, positive_index, None, nothing)[0].all()
    removes_nothing = chunked_sigmoid_contrastive_loss(*block, guard=CandidateGuard(nothing)).loss
    assert torch.equal(removes_nothing, chunked_sigmoid_contrastive_loss(*block).loss)


@pytest.mark.parametrize("b_rel", [-1.0, 0.0, 1.0])
def test_finite_at_t_1e4_and_scores_of_exactly_plus_minus_one(b_rel):
    scores = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]], requires_grad=True)
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    t = torch.tensor(1e4, requires_grad=True)
    rel = torch.tensor(b_rel, requires_grad=True)
    value = sigmoid_contrastive_loss(scores, targets, scale=t, relative_bias=rel)
    value.backward()
    assert torch.isfinite(value)
    for grad in (scores.grad, t.grad, rel.grad):
        assert torch.isfinite(grad).all()
    # softplus(-y z) exactly: the wrong-sided entries cost t * |s - b_rel| each (up to log 2 at z = 0).
    z = 1e4 * (scores.detach().double() - b_rel)
    expected = F.softplus(-(2 * targets.double() - 1) * z).sum() / 2
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)


def test_half_precision_scores_are_computed_in_float32():
    scores, targets = random_case(6)
    half = sigmoid_contrastive_loss(scores.bfloat16(), targets, scale=30.0, relative_bias=0.1)
    assert half.dtype == torch.float32
    assert half.item() == pytest.approx(direct_loss(scores.bfloat16().float(), targets, 30.0, b_rel=0.1), rel=1e-5)


def test_targets_from_positive_index():
    targets = targets_from_positive_index(torch.tensor([2, -1, 0]), 4)
    expected = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(targets, expected)
    with pytest.raises(ValueError, match="positive_index must lie in"):
        check_scores(torch.zeros(1, 4), torch.tensor([4]))
    with pytest.raises(ValueError, match="integer"):
        targets_from_positive_index(torch.tensor([0.0]), 4)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
@pytest.mark.parametrize("parametrization", ["relative", "absolute"])
def test_chunked_equals_unchunked_values_and_gradients(chunk_size, parametrization):
    g = torch.Generator().manual_seed(7)
    anchors0 = F.normalize(torch.randn(5, 8, generator=g), dim=-1)
    candidates0 = F.normalize(torch.randn(11, 8, generator=g), dim=-1)
    positive_index = torch.tensor([0, 3, -1, 10, 4])
    results = []
    for size in (None, chunk_size):
        anchors = anchors0.clone().requires_grad_(True)
        candidates = candidates0.clone().requires_grad_(True)
        log_t = torch.tensor(1.5, requires_grad=True)
        bias = torch.tensor(0.2, requires_grad=True)
        x = torch.tensor(0.4, requires_grad=True)
        kwargs = {"relative_bias": bias} if parametrization == "relative" else {"bias": bias}
        logits = SigmoidLogits(
            scale=log_t.exp(), score_transform=lambda s, x=x: locked_adapter_scores(s, torch.sigmoid(x)), **kwargs
        )
        value = chunked_sigmoid_contrastive_loss(anchors, candidates, positive_index, logits, chunk_size=size).loss
        value.backward()
        results.append((value.detach(), anchors.grad, candidates.grad, log_t.grad, bias.grad, x.grad))
    # The whole-matrix path equals the plain functional on the score matrix.
    scores = locked_adapter_scores(anchors0 @ candidates0.T, torch.sigmoid(torch.tensor(0.4)))
    targets = targets_from_positive_index(positive_index, 11)
    kwargs = {"relative_bias": 0.2} if parametrization == "relative" else {"bias": 0.2}
    reference = sigmoid_contrastive_loss(scores, targets, scale=math.exp(1.5), **kwargs)
    assert results[0][0].item() == pytest.approx(reference.item(), rel=1e-5)
    for full, chunked in zip(results[0], results[1]):
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)


def test_chunking_keeps_only_small_blocks_in_the_autograd_graph():
    anchors = F.normalize(torch.randn(64, 4), dim=-1).requires_grad_(True)
    candidates = F.normalize(torch.randn(256, 4), dim=-1).requires_grad_(True)
    positive_index = torch.arange(64)

    def largest_saved(chunk_size):
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            chunked_sigmoid_contrastive_loss(
                anchors, candidates, positive_index, SigmoidLogits(10.0, relative_bias=0.5), chunk_size=chunk_size
            )
        return max(sizes)

    assert largest_saved(None) >= 64 * 256  # the full score matrix is kept
    assert largest_saved(16) <= max(64 * 16, 256 * 4)  # only inputs and one block


def test_locked_adapter_is_the_inner_product_of_the_extended_vectors():
    g = torch.Generator().manual_seed(8)
    u = F.normalize(torch.randn(4, 5, generator=g), dim=-1)
    v = F.normalize(torch.randn(6, 5, generator=g), dim=-1)
    delta = torch.sigmoid(torch.tensor(0.3))
    extra = torch.sqrt(1 - delta**2)
    u_ext = torch.cat([delta * u, extra.expand(4, 1)], dim=1)
    v_ext = torch.cat([delta * v, -extra.expand(6, 1)], dim=1)
    torch.testing.assert_close(locked_adapter_scores(u @ v.T, delta), u_ext @ v_ext.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u_ext.norm(dim=1), torch.ones(4))


def test_margin_and_centre_and_zero_loss_on_a_constellation():
    scores = torch.tensor([[0.9, 0.1, -0.2], [0.3, 0.6, 0.0], [-0.5, 0.2, 0.7]])
    targets = torch.eye(3)
    margin, centre = constellation_margin(scores, targets)
    assert margin.item() == pytest.approx((0.6 - 0.3) / 2)
    assert centre.item() == pytest.approx((0.6 + 0.3) / 2)
    # A constellation (m > 0): at b_rel = centre the loss goes to 0 as t grows; off it, it does not at b_rel = 0.35.
    small = sigmoid_contrastive_loss(scores, targets, scale=1e3, relative_bias=centre)
    assert small.item() < 1e-30
    stuck = sigmoid_contrastive_loss(scores, targets, scale=1e3, relative_bias=0.65)
    assert stuck.item() > 1.0
    # The chunked path returns the same extremes from its score blocks (anchors = identity: blocks of ``scores``).
    for chunk_size in (None, 1, 2):
        _, low, high, guard_counts = chunked_sigmoid_contrastive_loss(
            torch.eye(3), scores.T.contiguous(), torch.arange(3), SigmoidLogits(1.0, 0.0), chunk_size=chunk_size
        )
        assert guard_counts is None  # no guard
        assert [low.item(), high.item()] == pytest.approx([0.6, 0.3])


def test_clear_errors_for_bad_inputs():
    scores, targets = random_case()
    with pytest.raises(ValueError, match="exactly one of"):
        sigmoid_contrastive_loss(scores, targets, scale=1.0)
    with pytest.raises(ValueError, match="exactly one of"):
        sigmoid_contrastive_loss(scores, targets, scale=1.0, relative_bias=0.0, bias=0.0)
    with pytest.raises(ValueError, match="scale must be > 0"):
        sigmoid_contrastive_loss(scores, targets, scale=0.0, relative_bias=0.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        sigmoid_contrastive_loss(scores, targets, scale=float("inf"), relative_bias=0.0)
    with pytest.raises(ValueError, match="relative_bias must be finite"):
        sigmoid_contrastive_loss(scores, targets, scale=1.0, relative_bias=float("nan"))
    with pytest.raises(ValueError, match="only 0"):
        check_scores(scores, targets=targets * 0.5)
    with pytest.raises(ValueError, match="targets must have the scores' shape"):
        sigmoid_contrastive_loss(scores, targets[:, :3], scale=1.0, relative_bias=0.0)
    with pytest.raises(ValueError, match="2-D"):
        sigmoid_contrastive_loss(scores[0], targets[0], scale=1.0, relative_bias=0.0)
    with pytest.raises(ValueError, match="empty"):
        sigmoid_contrastive_loss(scores[:0], targets[:0], scale=1.0, relative_bias=0.0)
    bad = scores.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_scores(bad, targets=targets)
    with pytest.raises(ValueError, match="valid_mask must be a bool"):
        sigmoid_contrastive_loss(scores, targets, scale=1.0, relative_bias=0.0, valid_mask=targets)
    with pytest.raises(ValueError, match="excludes every entry"):
        check_scores(scores, targets=targets, valid_mask=torch.zeros_like(targets).bool())
    with pytest.raises(ValueError, match="must be a scalar"):
        sigmoid_contrastive_loss(scores, targets, scale=torch.ones(2), relative_bias=0.0)
    # no non-matching pair: no constellation constrains the margin from above
    assert constellation_margin(scores, torch.ones_like(scores))[0].item() == float("inf")
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_sigmoid_contrastive_loss(
            torch.ones(2, 3), torch.ones(2, 3), torch.arange(2), SigmoidLogits(1.0, 0.0), chunk_size=0
        )
    with pytest.raises(ValueError, match="same D"):
        chunked_sigmoid_contrastive_loss(torch.ones(2, 3), torch.ones(2, 4), torch.arange(2), SigmoidLogits(1.0, 0.0))


def test_the_math_checks_shapes_only_and_check_scores_the_values():
    scores, targets = random_case(12)
    bad = scores.clone()
    bad[1, 2] = float("nan")
    # check_inputs=False (the loss classes' path): no value check and no sync; shape errors are still raised (free).
    with count_host_syncs() as syncs:
        unchecked = sigmoid_contrastive_loss(
            bad, targets, scale=torch.tensor(2.0), relative_bias=torch.tensor(0.1), check_inputs=False
        )
        chunked_sigmoid_contrastive_loss(
            torch.randn(3, 4), torch.randn(5, 4), torch.arange(3), SigmoidLogits(2.0, bias=0.0), check_inputs=False
        )
    assert syncs.total == 0 and torch.isnan(unchecked)
    # By default the math refuses bad values itself, with one sync.
    with count_host_syncs() as syncs, pytest.raises(ValueError, match="NaN or Inf"):
        sigmoid_contrastive_loss(bad, targets, scale=torch.tensor(2.0), relative_bias=torch.tensor(0.1))
    assert syncs.total == 1
    with pytest.raises(ValueError, match="targets must have the scores' shape"):
        sigmoid_contrastive_loss(scores, targets[:, :2], scale=1.0, relative_bias=0.0)
    # check_scores reads every value check with one sync.
    with count_host_syncs() as syncs:
        check_scores(scores, targets=targets)
    assert syncs.total == 1
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_scores(bad, targets=targets)
    with pytest.raises(TypeError, match="scale must be a real number or a scalar tensor"):
        sigmoid_contrastive_loss(scores, targets, scale="2", relative_bias=0.0)
