"""RBSigmoidLoss, the sentence-transformers adapter: values against the direct formula on embeddings, both
parametrizations, trainable / fixed parameters, columns, symmetric term, modalities, the locked adapter, chunking,
the score-matrix entry point used by the vision recipe, logged statistics and input errors."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from st_weince.functional import nt_xent_layout
from st_weince.losses import RBSigmoidLoss
from st_weince.losses.rb_sigmoid import RBSigmoidOptions


def direct(u, v_all, positive_index, t, *, b_rel=None, b=None, mask=None) -> torch.Tensor:
    """The formula of docs/algorithms.md section 2 on cosine scores, float64, written independently of the package."""
    u = F.normalize(u.double(), dim=-1)
    v_all = F.normalize(v_all.double(), dim=-1)
    s = u @ v_all.T
    y = torch.zeros_like(s)
    rows = torch.arange(s.shape[0])
    keep = positive_index >= 0
    y[rows[keep], positive_index[keep]] = 1.0
    z = t * (s - b_rel) if b_rel is not None else t * s - b
    per_pair = -(y * torch.log(torch.sigmoid(z)) + (1 - y) * torch.log(torch.sigmoid(-z)))
    if mask is not None:
        per_pair = per_pair * mask.double()
    return per_pair.sum() / s.shape[0]


def embeddings(*shape_rows: int, dim: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, dim, generator=g) for rows in shape_rows]


def test_pairs_relative_equals_direct_formula():
    a, p = embeddings(8, 8)
    loss = RBSigmoidLoss(None, scale=5.0, relative_bias=0.3)
    value = loss.compute_loss_from_embeddings([a, p])
    assert value.item() == pytest.approx(direct(a, p, torch.arange(8), 5.0, b_rel=0.3).item(), rel=1e-5)


def test_hard_negatives_absolute_equals_direct_formula():
    a, p, n1, n2 = embeddings(6, 6, 6, 6, seed=1)
    loss = RBSigmoidLoss(None, parametrization="absolute", scale=8.0, bias=-2.0)
    value = loss.compute_loss_from_embeddings([a, p, n1, n2])
    expected = direct(a, torch.cat([p, n1, n2]), torch.arange(6), 8.0, b=-2.0)
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)


def test_absolute_default_start_is_t_times_b_rel_and_both_agree():
    a, p, n = embeddings(5, 5, 5, seed=2)
    relative = RBSigmoidLoss(None, scale=4.0, relative_bias=0.25)
    absolute = RBSigmoidLoss(None, parametrization="absolute", scale=4.0, relative_bias=0.25)
    assert absolute.bias.item() == pytest.approx(1.0)
    assert absolute.relative_bias.item() == pytest.approx(0.25)
    assert relative.absolute_bias.item() == pytest.approx(1.0)
    torch.testing.assert_close(
        relative.compute_loss_from_embeddings([a, p, n]), absolute.compute_loss_from_embeddings([a, p, n])
    )


def test_gradients_reach_embeddings_and_loss_parameters():
    a, p = embeddings(6, 6, seed=3)
    a.requires_grad_(True)
    loss = RBSigmoidLoss(None)
    loss.compute_loss_from_embeddings([a, p]).backward()
    assert a.grad is not None and a.grad.abs().sum() > 0
    assert loss.log_t.grad is not None and loss.b_rel.grad is not None
    assert {name for name, _ in loss.named_parameters()} == {"log_t", "b_rel"}
    # Gradient of b_rel by finite differences of the direct formula.
    t, b_rel = loss.scale.item(), loss.b_rel.item()
    eps = 1e-5
    numeric = (
        direct(a.detach(), p, torch.arange(6), t, b_rel=b_rel + eps)
        - direct(a.detach(), p, torch.arange(6), t, b_rel=b_rel - eps)
    ) / (2 * eps)
    assert loss.b_rel.grad.item() == pytest.approx(numeric.item(), rel=1e-3)


def test_fixed_parameters_are_buffers_without_gradient():
    loss = RBSigmoidLoss(None, trainable_scale=False, trainable_bias=False, relative_bias=0.5)
    assert list(loss.parameters()) == []
    assert set(dict(loss.named_buffers())) == {"log_t", "b_rel"}
    a, p = embeddings(4, 4, seed=4)
    a.requires_grad_(True)
    loss.compute_loss_from_embeddings([a, p]).backward()
    assert a.grad is not None
    assert loss.no_weight_decay() == set()


def test_finite_loss_at_t_1e4_with_scores_of_exactly_plus_minus_one():
    eye = torch.eye(4)
    anchors = torch.cat([eye, -eye[:1]])  # scores exactly +1, 0 and -1
    positives = torch.cat([eye, eye[:1]])
    loss = RBSigmoidLoss(None, scale=1e4, max_scale=1e4, relative_bias=0.0)
    value = loss.compute_loss_from_embeddings([anchors, positives])
    value.backward()
    assert torch.isfinite(value)
    assert torch.isfinite(loss.log_t.grad) and torch.isfinite(loss.b_rel.grad)
    # Wrong-sided pairs cost t |s| = 1e4 each: anchor e1 against the duplicate candidate e1 (+1, non-matching) and
    # anchor -e1 against its positive e1 (-1). Scores of 0 cost log 2 each (18 of them); right-sided ones ~0.
    assert value.item() == pytest.approx((2e4 + 18 * math.log(2)) / 5, rel=1e-6)


def float64_loss(loss: RBSigmoidLoss, columns: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same loss (its float32 t and b_rel, widened) in float64 on the same float32 embeddings; and the
    embeddings' gradients."""
    wide = [column.detach().double().requires_grad_() for column in columns]
    value = loss.double().compute_loss_from_embeddings(wide)
    value.backward()
    return value.detach(), [column.grad for column in wide]


def test_a_match_at_t_1e4_gives_float64s_zero_not_a_negative_loss():
    """Issue 44 reproducer: every match at s = 1 (z = 3000) and every non-match far below b_rel: float64 gives 0 (the
    terms are below its smallest number); float32 gave -3.3e-4, the ulp of z = 3000 left over by softplus(z) - z."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    loss = RBSigmoidLoss(None, scale=1e4, max_scale=1e4)
    value = loss.compute_loss_from_embeddings([x, x.clone()])
    expected, _ = float64_loss(loss, [x, x.clone()])
    assert float(expected) == 0.0
    assert float(value.detach()) == 0.0


def test_a_saturated_match_keeps_its_loss_and_gradient():
    """Issue 44 reproducer: one pair at cosine 0.9939, t = 10, b_rel = -0.78 (z = 17.7): float64 gives loss and gradient
    2.0e-8; float32 gave exactly 0 for both. Relative to the value, float32's error is |dz| ~ t (d + 4) u from the
    scores (d = 3, u = 2^-24) plus 2u |z| from the logit: about 100u = 6e-6; the embedding gradient's normalisation
    adds a few u."""
    u = torch.tensor([[1.0, 0.0, 0.0]], requires_grad=True)
    v = torch.tensor([[0.9, 0.1, 0.0]])
    loss = RBSigmoidLoss(None, scale=10.0, relative_bias=-0.78)
    value = loss.compute_loss_from_embeddings([u, v])
    value.backward()
    expected, (expected_grad, _) = float64_loss(loss, [u, v])
    assert float(expected) == pytest.approx(1.98e-8, rel=1e-2)
    assert float(value.detach()) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(u.grad.double(), expected_grad, rtol=1e-5, atol=0.0)
    assert u.grad[0, 1] < 0  # the match still pulls u toward v


@pytest.mark.parametrize("chunk_size", [1, 4, 9])
def test_chunked_and_unchunked_agree_in_loss_and_gradients(chunk_size):
    a0, p0, n0 = embeddings(6, 6, 6, seed=5)
    outputs = []
    for size in (None, chunk_size):
        a, p, n = (x.clone().requires_grad_(True) for x in (a0, p0, n0))
        loss = RBSigmoidLoss(None, chunk_size=size, symmetric=True, locked_adapter=True, adapter_logit=0.7)
        value = loss.compute_loss_from_embeddings([a, p, n])
        value.backward()
        outputs.append(
            [value.detach(), a.grad, p.grad, n.grad, loss.log_t.grad, loss.b_rel.grad, loss.adapter_logit.grad]
        )
        stats = loss.pop_logged_statistics()
        outputs[-1].append(torch.tensor(stats["rb_sigmoid_margin"]))
    for full, chunked in zip(*outputs):
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)


def test_symmetric_changes_nothing_without_negatives_and_averages_directions_with_them():
    a, p, n = embeddings(5, 5, 5, seed=6)
    plain = RBSigmoidLoss(None).compute_loss_from_embeddings([a, p])
    symmetric = RBSigmoidLoss(None, symmetric=True).compute_loss_from_embeddings([a, p])
    assert symmetric.item() == pytest.approx(plain.item(), rel=1e-6)
    t, b_rel = RBSigmoidOptions().scale, RBSigmoidOptions().relative_bias
    with_negatives = RBSigmoidLoss(None, symmetric=True).compute_loss_from_embeddings([a, p, n])
    expected = (
        direct(a, torch.cat([p, n]), torch.arange(5), t, b_rel=b_rel) + direct(p, a, torch.arange(5), t, b_rel=b_rel)
    ) / 2
    assert with_negatives.item() == pytest.approx(expected.item(), rel=1e-5)


def test_modalities_is_the_sum_of_pairwise_losses():
    m1, m2, m3 = embeddings(6, 6, 6, seed=7)
    loss = RBSigmoidLoss(None, columns="modalities", scale=3.0, relative_bias=0.1)
    value = loss.compute_loss_from_embeddings([m1, m2, m3])
    index = torch.arange(6)
    expected = sum(direct(x, y, index, 3.0, b_rel=0.1) for x, y in ((m1, m2), (m1, m3), (m2, m3)))
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)


def test_locked_adapter_equals_the_loss_of_the_extended_vectors():
    a, p = embeddings(6, 6, seed=8)
    loss = RBSigmoidLoss(None, locked_adapter=True, adapter_logit=0.5, scale=6.0, relative_bias=-0.2)
    value = loss.compute_loss_from_embeddings([a, p])
    delta = torch.sigmoid(torch.tensor(0.5, dtype=torch.float64))
    extra = torch.sqrt(1 - delta**2).expand(6, 1)
    a_ext = torch.cat([delta * F.normalize(a.double(), dim=-1), extra], dim=1)
    p_ext = torch.cat([delta * F.normalize(p.double(), dim=-1), -extra], dim=1)
    expected = direct(a_ext, p_ext, torch.arange(6), 6.0, b_rel=-0.2)
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    value.backward()
    assert loss.adapter_logit.grad is not None and loss.adapter_logit.grad != 0
    assert "adapter_logit" in loss.no_weight_decay()
    assert loss.pop_logged_statistics()["rb_sigmoid_delta"] == pytest.approx(float(delta), rel=1e-6)


def test_loss_from_scores_with_the_nt_xent_layout():
    view_a, view_b = embeddings(4, 4, seed=9)
    scores, positive_index, valid_mask = nt_xent_layout(view_a, view_b)
    loss = RBSigmoidLoss(None, scale=2.0, relative_bias=0.4)
    value = loss.loss_from_scores(scores, positive_index, valid_mask)
    views = torch.cat([view_a, view_b])
    expected = direct(views, views, positive_index, 2.0, b_rel=0.4, mask=valid_mask)
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    stats = loss.pop_logged_statistics()
    positives = scores[torch.arange(8), positive_index]
    negatives = scores[valid_mask & (torch.arange(8)[None, :] != positive_index[:, None])]
    assert stats["rb_sigmoid_margin"] == pytest.approx(((positives.min() - negatives.max()) / 2).item(), abs=1e-6)


def test_logged_statistics_are_t_b_rel_b_and_the_margin():
    a, p = embeddings(6, 6, seed=10)
    loss = RBSigmoidLoss(None, scale=7.0, relative_bias=0.2)
    loss.compute_loss_from_embeddings([a, p])
    stats = loss.pop_logged_statistics()
    s = F.normalize(a, dim=-1) @ F.normalize(p, dim=-1).T
    off_diagonal = s[~torch.eye(6, dtype=torch.bool)]
    assert stats["rb_sigmoid_t"] == pytest.approx(7.0, rel=1e-6)
    assert stats["rb_sigmoid_b_rel"] == pytest.approx(0.2, rel=1e-6)
    assert stats["rb_sigmoid_b"] == pytest.approx(1.4, rel=1e-6)
    assert stats["rb_sigmoid_margin"] == pytest.approx(((s.diagonal().min() - off_diagonal.max()) / 2).item(), abs=1e-6)
    assert "rb_sigmoid_margin" not in loss.pop_logged_statistics()  # no forward since: the state only


def forward_backward(tiny_model, loss) -> torch.Tensor:
    """The loss of three (anchor, positive) pairs through the tiny model, after its backward pass."""
    features = [
        tiny_model.tokenize(["the cat sat", "a dog runs", "rain falls"]),
        tiny_model.tokenize(["on the mat", "in the park", "on the city"]),
    ]
    value = loss(features, None)
    value.backward()
    return value


def test_forward_with_a_tiny_model(tiny_model):
    loss = RBSigmoidLoss(tiny_model).mark_state_managed()  # this test is the training loop
    assert torch.isfinite(forward_backward(tiny_model, loss))
    assert any(p.grad is not None for p in tiny_model.parameters())
    assert loss.log_t.grad is not None


def test_config_and_citation():
    loss = RBSigmoidLoss(None, parametrization="absolute", locked_adapter=True)
    config = loss.get_config_dict()
    json.dumps(config)
    # The adapter's start is its constructor option adapter_logit (x, delta = sigmoid(x)), not delta itself.
    assert config["parametrization"] == "absolute" and config["adapter_logit"] == 0.0
    assert "Bangachev" in loss.citation


def test_clear_errors_for_bad_inputs():
    for option, value, message in [
        ("parametrization", "siglip", "parametrization"),
        ("scale", 0.0, "scale"),
        ("bias", 1.0, "bias is the start of the absolute"),
        ("chunk_size", 0, "chunk_size"),
        ("columns", "pairs", "columns"),
    ]:
        with pytest.raises(ValueError, match=message):
            RBSigmoidLoss(None, **{option: value})
    loss = RBSigmoidLoss(None)
    a, p = embeddings(4, 4)
    with pytest.raises(ValueError, match="at least 2 input columns"):
        loss.compute_loss_from_embeddings([a])
    with pytest.raises(ValueError, match="same batch size"):
        loss.compute_loss_from_embeddings([a, p[:3]])
    bad = a.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        loss.compute_loss_from_embeddings([bad, p])
    with pytest.raises(ValueError, match="positive_index must lie in"):
        loss.loss_from_scores(torch.zeros(2, 2), torch.tensor([0, 2]))


@pytest.mark.parametrize("wrapper", ["MatryoshkaLoss", "Matryoshka2dLoss", "AdaptiveLayerLoss"])
def test_works_inside_sentence_transformers_wrappers(tiny_model, wrapper):
    from sentence_transformers.sentence_transformer import losses

    inner = RBSigmoidLoss(tiny_model).mark_state_managed()  # this test is the training loop
    if wrapper == "AdaptiveLayerLoss":
        loss = losses.AdaptiveLayerLoss(tiny_model, inner)
    else:
        loss = getattr(losses, wrapper)(tiny_model, inner, [32, 16])
    assert torch.isfinite(forward_backward(tiny_model, loss))
    own = {name for name, _ in loss.named_parameters() if "model." not in name}
    # The prefix a learning_rate_mapping pattern must allow for (Matryoshka2dLoss nests two wrappers).
    prefix = "loss.loss." if wrapper == "Matryoshka2dLoss" else "loss."
    assert own == {prefix + "log_t", prefix + "b_rel"}
    # The documented learning_rate_mapping pattern finds them through the wrapper, and no model parameter.
    pattern = r"(^|\.)(log_t|b_rel)$"
    assert {name for name, _ in loss.named_parameters() if re.search(pattern, name)} == own
    assert inner.log_t.grad is not None and inner.b_rel.grad is not None
    assert inner.pop_logged_statistics()["rb_sigmoid_t"] == pytest.approx(10.0, rel=1e-6)


@pytest.mark.parametrize("cached", [False, True])
def test_overflowing_norms_are_refused_not_zeroed(cached):
    """A finite float32 row with a norm above ~1e19 would normalise to a zero vector with zero gradient (as in
    cos_sim); the checks refuse it and name the column."""
    from st_weince.losses import CachedRBSigmoidLoss

    embeddings = [torch.randn(6, 8), torch.randn(6, 8)]
    embeddings[1][2] = 3e19
    loss = CachedRBSigmoidLoss(None, mini_batch_size=2) if cached else RBSigmoidLoss(None)
    compute = loss.calculate_loss if cached else loss.compute_loss_from_embeddings
    reps = [[e] for e in embeddings] if cached else embeddings
    with pytest.raises(ValueError, match="column 1 .*overflows"):
        compute(reps, None)
