"""WEINCEOptions: one source of the WEINCE defaults and validation; the loss classes refuse bad options when built."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.util import dot_score

from st_weince.functional import Gate, WEINCEOptions, check_scores, weince_statistics
from st_weince.losses import WEINCELoss

GATE_FIELDS = tuple(field.name for field in dataclasses.fields(Gate))

BAD_OPTIONS = [
    ({"kappa_rho": float("inf")}, ValueError, "kappa_rho must be finite"),
    ({"kappa_aic": float("nan")}, ValueError, "kappa_aic must be finite"),
    ({"aic_margin": float("nan")}, ValueError, "aic_margin must be finite"),
    ({"beta": float("inf")}, ValueError, "beta must be finite"),
    ({"beta": -1.0}, ValueError, "beta must be a positive number"),
    ({"beta": "one"}, ValueError, "beta must be a positive number or 'auto'"),
    ({"beta": True}, TypeError, "beta must be a real number"),
    ({"q": 1.5}, ValueError, r"q must lie in \[0, 1\]"),
    ({"q": "0.2"}, TypeError, "q must be a real number"),
    ({"q": torch.tensor(0.2)}, TypeError, "q must be a real number"),
    ({"kappa_rho": -1.0}, ValueError, "kappa_rho must be >= 0"),
    ({"tail_frac": 0.0}, ValueError, "tail_frac must lie in"),
    ({"tail_frac": float("nan")}, ValueError, "tail_frac must be finite"),
    ({"min_tail_points": 0}, ValueError, "min_tail_points must be at least 1"),
    ({"min_tail_points": 3.5}, TypeError, "min_tail_points must be an integer"),
    ({"min_tail_points": True}, TypeError, "min_tail_points must be an integer"),
    ({"eps": 0.0}, ValueError, "eps must lie in"),
    ({"eps": 0.7}, ValueError, "eps must lie in"),
    ({"mode": "softmax"}, ValueError, "mode must be"),
    ({"mode": 1}, TypeError, "mode must be"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_OPTIONS)
def test_bad_options_are_refused_at_construction(options, error, message):
    # the gate's four are one gate (a Gate or its dict), the others by name
    options = {"gate": options} if set(options) <= set(GATE_FIELDS) else options
    with pytest.raises(error, match=message):
        WEINCEOptions(**options)
    with pytest.raises(error, match=message):
        WEINCELoss(None, **options)


@pytest.mark.parametrize(
    ("scale", "error", "message"),
    [
        ("20", TypeError, "scale must be a real number"),
        (float("inf"), ValueError, "scale must be finite"),
        (float("nan"), ValueError, "scale must be finite"),
        (0.0, ValueError, "scale must be > 0"),
        (True, TypeError, "scale must be a real number"),
    ],
)
def test_bad_scale_is_refused(scale, error, message):
    with pytest.raises(error, match=message):
        WEINCELoss(None, scale=scale)


def test_numpy_numbers_are_accepted_as_python_numbers():
    options = WEINCEOptions(gate=Gate(q=np.float32(0.25), kappa_rho=np.float64(5.0)), min_tail_points=np.int64(12))
    assert options.gate.q == pytest.approx(0.25) and type(options.gate.q) is float
    assert type(options.gate.kappa_rho) is float and type(options.min_tail_points) is int
    loss = WEINCELoss(None, scale=np.float32(10.0), gate={"q": np.float64(0.3)})
    assert type(loss.scale) is float and loss.scale == 10.0
    assert type(loss.options.gate.q) is float and loss.options.gate.q == 0.3


def test_one_source_of_defaults():
    """The loss's signature is its options class's fields with their defaults; the functions take the object."""
    defaults = WEINCEOptions()
    signature = inspect.signature(WEINCELoss).parameters
    for field in dataclasses.fields(WEINCEOptions):
        assert signature[field.name].default == getattr(defaults, field.name), field.name
    assert WEINCELoss(None).options == defaults
    assert defaults.beta == "auto" and defaults.gate == Gate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.scale = 5.0
    generator = torch.Generator().manual_seed(0)
    scores = torch.nn.functional.normalize(torch.randn(40, 8, generator=generator), dim=1)
    scores = scores @ scores.T
    positive_index = torch.arange(40).roll(1)
    options = WEINCEOptions(gate=Gate(q=0.5))
    from_loss = WEINCELoss(None, gate={"q": 0.5}).options
    assert from_loss == options
    stats = weince_statistics(scores, positive_index, None, options)
    again = weince_statistics(scores, positive_index, None, from_loss)
    torch.testing.assert_close(stats.lam, again.lam, rtol=0, atol=0)
    # a removed or misspelt name gives Python's own error, naming it
    with pytest.raises(TypeError, match="unexpected keyword argument 'q'"):
        WEINCELoss(None, q=0.4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kappa'"):
        Gate(kappa=1.0)


def test_every_mnrl_argument_is_accepted_or_refused_with_the_reason():
    mnrl = set(inspect.signature(MultipleNegativesRankingLoss.__init__).parameters) - {"self"}
    weince = set(inspect.signature(WEINCELoss).parameters)
    assert mnrl <= weince, mnrl - weince
    # those without a meaning for WEINCE are accepted at MNRL's default only
    refused = mnrl - {f.name for f in dataclasses.fields(WEINCEOptions)} - {"model"}
    assert refused == {"similarity_fct", "hardness_mode", "hardness_strength"}, refused
    mnrl_defaults = inspect.signature(MultipleNegativesRankingLoss.__init__).parameters
    WEINCELoss(None, **{name: mnrl_defaults[name].default for name in refused})
    for name in refused:
        assert name in WEINCELoss.__doc__, name
    with pytest.raises(ValueError, match="endpoint 1"):
        WEINCELoss(None, similarity_fct=dot_score)
    with pytest.raises(ValueError, match="hardness"):
        WEINCELoss(None, hardness_mode="in_batch_negatives", hardness_strength=9.0)
    with pytest.raises(ValueError, match="hardness"):
        WEINCELoss(None, hardness_strength=5.0)
    with pytest.raises(TypeError, match="gather_across_devices"):
        WEINCELoss(None, gather_across_devices="yes")


def test_shape_and_dtype_mistakes_get_errors_in_the_projects_words():
    generator = torch.Generator().manual_seed(1)
    good = [torch.randn(8, 6, generator=generator) for _ in range(2)]
    loss = WEINCELoss(None)
    with pytest.raises(
        ValueError, match="column 1 must be a 2-D \\[batch, dimension\\] embedding matrix, got shape \\(8, 2, 3\\)"
    ):
        loss.compute_loss_from_embeddings([good[0], good[1].reshape(8, 2, 3)], None)
    with pytest.raises(ValueError, match="column 0 must be a 2-D .* got shape \\(6,\\)"):
        loss.compute_loss_from_embeddings([good[0][0], good[1]], None)
    with pytest.raises(ValueError, match="same embedding dimension, got \\[6, 5\\]"):
        loss.compute_loss_from_embeddings([good[0], good[1][:, :5]], None)
    with pytest.raises(ValueError, match="floating-point embeddings"):
        loss.compute_loss_from_embeddings([good[0], good[1].long()], None)
    scores = torch.nn.functional.normalize(good[0], dim=1) @ torch.nn.functional.normalize(good[1], dim=1).T
    # any integer dtype for the indices, as torch's losses accept; floats and bools are refused
    int32_stats = weince_statistics(scores, torch.arange(8, dtype=torch.int32))
    assert torch.equal(int32_stats.lam, weince_statistics(scores, torch.arange(8)).lam)
    with pytest.raises(ValueError, match="positive_index must be an integer tensor, got torch.float32"):
        weince_statistics(scores, torch.arange(8.0))
    with pytest.raises(ValueError, match="positive_index must lie in"):
        check_scores(scores, torch.full((8,), 8))
    # a NumPy float temperature is a number like any other
    from st_weince.functional import weince_cross_entropy

    value = weince_cross_entropy(scores, torch.arange(8), None, WEINCEOptions(scale=np.float32(20.0)))
    assert torch.isfinite(value)


def test_nested_options_are_checked_as_their_own():
    with pytest.raises(TypeError, match="gate must be a Gate, its dict, got float"):
        WEINCELoss(None, gate=0.4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kappa'"):
        Gate(q=0.4).replace(kappa=1.0)
    from_dict = WEINCELoss(None, gate={"q": 0.4}).options.gate
    assert WEINCELoss(None, gate=Gate(q=0.4)).options.gate == Gate(q=0.4) == from_dict
