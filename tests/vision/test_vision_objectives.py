"""The vision objectives are the text-side loss classes in SimCLR's NT-Xent layout, checked against direct math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_weince.functional import WEINCEOptions, nt_xent_layout, weince_logits, weince_statistics
from st_weince.losses import WEINCELoss
from st_weince.vision.objectives import SimCLRObjective
from tests.float32_tolerance import tail_fit_tolerances, ulps_apart

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _views(n: int = 24, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=generator, dtype=torch.float64)
    return (
        base + 0.3 * torch.randn(n, d, generator=generator, dtype=torch.float64),
        base + 0.3 * torch.randn(n, d, generator=generator, dtype=torch.float64),
    )


def _direct_layout(z1: torch.Tensor, z2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NT-Xent written out: rows are the 2N views, positive = the other view, self excluded."""
    n = z1.shape[0]
    z = torch.cat([z1, z2]) / torch.cat([z1, z2]).norm(dim=1, keepdim=True)
    scores = z @ z.T
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    valid = ~torch.eye(2 * n, dtype=torch.bool)
    return scores, target, valid


def _nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    scores, target, valid = _direct_layout(z1, z2)
    return F.cross_entropy((scores / temperature).masked_fill(~valid, float("-inf")), target)


@pytest.mark.parametrize("temperature", [0.5, 0.1])
def test_infonce_objective_is_exactly_nt_xent_with_the_same_gradients(temperature):
    z1, z2 = _views()
    z1.requires_grad_(True)
    z2.requires_grad_(True)
    objective = SimCLRObjective("infonce", scale=1.0 / temperature)
    assert isinstance(objective.loss, MultipleNegativesRankingLoss)
    assert objective.loss.directions == ("query_to_doc", "query_to_query")
    ours = objective(z1, z2)
    grads = torch.autograd.grad(ours, [z1, z2])
    reference = _nt_xent(z1, z2, temperature)
    expected = torch.autograd.grad(reference, [z1, z2])
    assert ours.item() == pytest.approx(reference.item(), rel=1e-12, abs=1e-12)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, expected))


@pytest.mark.numerics
def test_weince_objective_blends_in_the_shortfall_logit_on_the_nt_xent_rows():
    z1, z2 = _views(n=40, d=6, seed=1)
    objective = SimCLRObjective("weince", scale=2.0, beta=1.0)
    assert isinstance(objective.loss, WEINCELoss) and objective.loss.options.beta == 1.0
    loss = objective(z1, z2)
    scores, target, valid = _direct_layout(z1, z2)
    stats = weince_statistics(scores, target, valid, WEINCEOptions(beta=1.0))
    assert (stats.lam > 0.05).any(), "the test batch should switch WEINCE on for some anchors"
    logits = weince_logits(scores, stats.lam, stats.beta, valid, scale=2.0)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, target).item(), rel=1e-5)
    assert loss.item() != pytest.approx(_nt_xent(z1, z2, 0.5).item(), rel=1e-3)
    logged = objective.pop_logged_statistics()
    # The objective's scores (nt_xent_layout) and these are computed apart: float32 may round them differently.
    ulps = ulps_apart(nt_xent_layout(z1, z2)[0], scores)
    tolerance = tail_fit_tolerances(scores, target, valid, objective.loss.options, ulps)["lam"]
    assert logged["weince_lambda_mean"] == pytest.approx(float(stats.lam.mean()), rel=1e-6, abs=tolerance)


def test_weince_with_lambda_zero_is_the_infonce_objective():
    z1, z2 = _views(seed=2)
    no_blend = SimCLRObjective("weince", scale=2.0, loss_kwargs={"gate": {"kappa_aic": 1.0, "aic_margin": 1e9}})
    assert no_blend(z1, z2).item() == pytest.approx(SimCLRObjective("infonce", scale=2.0)(z1, z2).item(), rel=1e-6)


def test_rb_sigmoid_objective_is_the_sigmoid_loss_and_trains_t_and_b_rel():
    rb_sigmoid = pytest.importorskip("st_weince.losses.rb_sigmoid")
    z1, z2 = _views(n=10, d=5, seed=3)
    objective = SimCLRObjective("rb-sigmoid", loss_kwargs={"scale": 10.0, "relative_bias": 0.5})
    assert isinstance(objective.loss, rb_sigmoid.RBSigmoidLoss)
    names = {name for name, p in objective.named_parameters() if p.requires_grad}
    assert names == {"loss.log_t", "loss.b_rel"}
    loss = objective(z1.float(), z2.float())
    scores, target, valid = _direct_layout(z1, z2)
    labels = torch.zeros_like(scores)
    labels[torch.arange(20), target] = 1.0
    z = 10.0 * (scores - 0.5)
    per_entry = -F.logsigmoid((2 * labels - 1) * z) * valid
    assert loss.item() == pytest.approx(per_entry.sum(1).mean().item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs() > 0 for p in objective.parameters())


def test_objective_input_errors():
    with pytest.raises(ValueError, match="unknown loss"):
        SimCLRObjective("triplet")
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        SimCLRObjective("infonce", scale=0.0)
    with pytest.raises(ValueError, match="same shape"):
        SimCLRObjective("infonce")(torch.randn(4, 3), torch.randn(5, 3))
    with pytest.raises(ValueError, match="N >= 2"):  # one pair has no negative; InfoNCE alone would not say so
        SimCLRObjective("infonce")(torch.randn(1, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match="NaN"):
        SimCLRObjective("weince")(torch.full((4, 3), float("nan")), torch.randn(4, 3))


def test_scale_is_one_over_the_temperature():
    z1, z2 = _views(seed=4)
    new = SimCLRObjective("infonce", scale=4.0)
    assert new(z1, z2).item() == pytest.approx(_nt_xent(z1, z2, 0.25).item(), rel=1e-12)
    assert SimCLRObjective("weince").get_config_dict()["scale"] == pytest.approx(2.0)  # SimCLR's temperature 0.5
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        SimCLRObjective("infonce", scale=float("inf"))
    with pytest.raises(TypeError):
        SimCLRObjective("infonce", 0.5)  # keyword-only: a positional number could mean a temperature
