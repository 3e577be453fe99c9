"""RB-Sigmoid's cap on the inverse temperature: ``max_scale`` validated in the options, ``t`` never above it over
1,000 steps of a persistent gradient sign at the default loss learning rate (with the loss's own optimizer setup),
its gradient live at the cap, and the cap's state in the logs."""

from __future__ import annotations

import math

import pytest
import torch

from st_weince.functional import RBSigmoidOptions
from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss
from st_weince.training import DEFAULT_LOSS_LEARNING_RATE
from st_weince.utils.options import log_scale_cap


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"max_scale": 5.0}, ValueError, "max_scale must be >= scale"),
        ({"max_scale": 0.0}, ValueError, "max_scale must be > 0"),
        ({"max_scale": float("inf")}, ValueError, "max_scale must be finite"),
        ({"max_scale": 1e39}, ValueError, "max_scale must be finite in float32"),
        ({"max_scale": "100"}, TypeError, "max_scale must be a real number"),
    ],
)
def test_bad_max_scale_is_refused_naming_it(options, error, message):
    with pytest.raises(error, match=message):
        RBSigmoidOptions(**options)
    with pytest.raises(error, match=message):
        CachedRBSigmoidLoss(None, **options)


@pytest.mark.parametrize("max_scale", [10.0, 100.0, 1e4, 3e38])
def test_the_cap_keeps_t_within_max_scale_in_float32_and_float64(max_scale):
    cap = torch.tensor(log_scale_cap(max_scale), dtype=torch.float32)
    assert cap.exp().item() <= max_scale and cap.double().exp().item() <= max_scale
    # and no further below than the float32 rounding of log_t: a few ulp of log(max_scale), relative in exp
    ulps = 4 * 2.0**-23 * max(1.0, math.log(max_scale))
    assert cap.double().exp().item() == pytest.approx(max_scale, rel=ulps)


def persistent_sign_run(loss: RBSigmoidLoss, steps: int, sign: float = 1.0) -> list[float]:
    """``steps`` steps of the optimizer prepare_trainer sets up for the loss's parameters (the trainer's AdamW, no
    weight decay, the default loss learning rate) under a gradient that pushes ``t`` up (``sign`` 1) or down at every
    step, on the parameter alone: the objective ``-sign * t`` with ``t`` as the loss computes it (through the cap).
    The loss's own gradient on ``t`` fades once the pairs separate (the sigmoid saturates); a persistent sign is the
    worst case of a long run. After each step the clamp of prepare_trainer's callback. Returns ``t`` at each step and
    logs one loss computation per step (the statistics the trainer would log)."""
    optimizer = torch.optim.AdamW(loss.parameters(), lr=DEFAULT_LOSS_LEARNING_RATE, weight_decay=0.0)
    embeddings = [torch.eye(4, 8), torch.eye(4, 8)]
    used = []
    for _ in range(steps):
        optimizer.zero_grad()
        (-sign * loss.scale).backward()
        with torch.no_grad():
            loss.compute_loss_from_embeddings(embeddings)  # what the logs see at this step
        used.append(loss.scale.item())
        optimizer.step()
        loss.clamp_parameters_()
    return used


@pytest.mark.parametrize("cls", [RBSigmoidLoss, CachedRBSigmoidLoss])
def test_t_never_exceeds_the_cap_over_1000_steps_of_persistent_gradient_sign(cls):
    loss = cls(None)
    assert loss.options.max_scale == 100.0
    used = persistent_sign_run(loss, 1000)
    assert max(used) <= 100.0
    assert used[-1] == pytest.approx(100.0, rel=1e-5)  # reached the cap: uncapped, log_t would gain 0.03 a step
    assert loss.log_t.item() <= log_scale_cap(100.0)  # the parameter itself never sits above the cap
    stats = loss.pop_logged_statistics()  # t, b_rel and t_capped as they are now (state, not means)
    assert stats["rb_sigmoid_t"] == pytest.approx(100.0, rel=1e-5) and stats["rb_sigmoid_t_capped"] == 1.0
    assert stats["rb_sigmoid_b_rel"] == pytest.approx(loss.b_rel.item(), rel=1e-7)
    # At the cap the gradient is live: when its sign turns, t leaves the cap as soon as Adam's momentum turns (after
    # 7 steps: 0.9^k < 1/2), instead of sitting above the cap with a zero gradient.
    used = persistent_sign_run(loss, 20, sign=-1.0)
    assert used[0] == pytest.approx(100.0, rel=1e-5) and used[-1] < used[-2] < used[0]
    assert used[-1] < 95.0
    assert loss.pop_logged_statistics()["rb_sigmoid_t_capped"] == 0.0


def test_without_the_parameter_clamp_the_forward_cap_still_holds():
    """A custom loop that forgets clamp_parameters_: t as used never exceeds the cap (the gradient is then zero above
    it, which is why prepare_trainer clamps the parameter too)."""
    loss = RBSigmoidLoss(None, max_scale=20.0)
    optimizer = torch.optim.AdamW(loss.parameters(), lr=DEFAULT_LOSS_LEARNING_RATE, weight_decay=0.0)
    anchors = torch.eye(4, 8)
    for _ in range(200):
        optimizer.zero_grad()
        loss.compute_loss_from_embeddings([anchors, anchors.clone()]).backward()
        optimizer.step()
    assert loss.log_t.item() > math.log(20.0)  # the parameter drifted past the cap
    assert loss.scale.item() <= 20.0
    assert loss.trained_values()["t"] <= 20.0


@pytest.mark.parametrize("cls", [RBSigmoidLoss, CachedRBSigmoidLoss])
@pytest.mark.parametrize("exchange", ["all_gather", "neighbour"])
def test_the_cap_holds_on_every_path(cls, exchange):
    """A log_t far above the cap computes the loss of t = max_scale, on the all-gather and the neighbour-exchange
    path, uncached and cached (one process), and its gradient is zero there."""
    options = {"max_scale": 20.0, "gather_across_devices": True, "exchange": exchange}
    if cls is CachedRBSigmoidLoss:
        options["mini_batch_size"] = 3
    drifted, at_cap = cls(None, **options), cls(None, 20.0, **options)
    with torch.no_grad():
        drifted.log_t.fill_(math.log(50.0))
    g = torch.Generator().manual_seed(1)
    columns = [torch.randn(5, 6, generator=g) for _ in range(3)]
    if cls is CachedRBSigmoidLoss:
        reps = [[part.clone().requires_grad_() for part in column.split(3)] for column in columns]
        values = [loss.calculate_loss(reps, None, with_backward=True) for loss in (drifted, at_cap)]
    else:
        values = [loss.compute_loss_from_embeddings(columns) for loss in (drifted, at_cap)]
    for value in values:
        value.backward()  # the cached loss returns its parameters' gradients as a zero-valued term
    assert torch.equal(values[0], values[1])
    assert drifted.scale.item() <= 20.0 and drifted.log_t.grad.item() == 0.0
