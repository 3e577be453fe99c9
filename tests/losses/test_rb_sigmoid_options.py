"""RBSigmoidLoss's options: validated at construction (types, ranges, finiteness; the error names the option),
NumPy numbers accepted and bools refused as numbers, MultipleNegativesRankingLoss's
arguments accepted or refused with the reason, and the get_config_dict round trip for every configuration."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from sentence_transformers.util import cos_sim, dot_score

from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss
from st_weince.losses.rb_sigmoid import RBSigmoidOptions

DEFAULT_SCALE = RBSigmoidOptions().scale
DEFAULT_RELATIVE_BIAS = RBSigmoidOptions().relative_bias

BAD_OPTIONS = [
    ({"scale": 0.0}, ValueError, "scale must be > 0"),
    ({"scale": -1.0}, ValueError, "scale must be > 0"),
    ({"scale": float("inf")}, ValueError, "scale must be finite"),
    ({"scale": float("nan")}, ValueError, "scale must be finite"),
    ({"scale": "20"}, TypeError, "scale must be a real number, got str"),
    ({"scale": True}, TypeError, "scale must be a real number, got bool"),
    ({"scale": np.bool_(True)}, TypeError, "scale must be a real number"),
    ({"scale": None}, TypeError, "scale must be a real number"),
    ({"relative_bias": float("nan")}, ValueError, "relative_bias must be finite"),
    ({"relative_bias": "0.5"}, TypeError, "relative_bias must be a real number"),
    ({"parametrization": "absolute", "bias": float("-inf")}, ValueError, "bias must be finite"),
    ({"bias": 1.0}, ValueError, "bias is the start of the absolute parametrization"),
    ({"parametrization": "absolute", "bias": 1.0, "relative_bias": 0.1}, ValueError, "not both"),
    ({"parametrization": "siglip"}, ValueError, "parametrization must be one of 'relative', 'absolute'"),
    ({"columns": "pairs"}, ValueError, "columns must be one of 'negatives', 'modalities'"),
    ({"adapter_logit": float("nan")}, ValueError, "adapter_logit must be finite"),
    ({"chunk_size": 0}, ValueError, "chunk_size must be a positive integer or None"),
    ({"chunk_size": 2.5}, TypeError, "chunk_size must be a positive integer or None"),
    ({"chunk_size": True}, TypeError, "chunk_size must be a positive integer or None"),
    ({"trainable_scale": 1}, TypeError, "trainable_scale must be True or False"),
    ({"trainable_bias": "yes"}, TypeError, "trainable_bias must be True or False"),
    ({"gather_across_devices": None}, TypeError, "gather_across_devices must be True or False"),
    ({"symmetric": 0}, TypeError, "symmetric must be True or False"),
    ({"locked_adapter": "False"}, TypeError, "locked_adapter must be True or False"),
    ({"check_inputs": 1}, TypeError, "check_inputs must be True or False"),
    ({"directions": "query_to_doc"}, TypeError, "directions must be a tuple"),
    ({"directions": ("query_to_doc", "query_to_query")}, ValueError, "query_to_query and doc_to_doc"),
    ({"directions": ("query_to_doc", "query_to_doc")}, ValueError, "supports directions"),
    ({"directions": ("query_to_doc",), "symmetric": True}, ValueError, "contradicts"),
    ({"similarity_fct": dot_score}, ValueError, "does not support similarity_fct=.*only sentence_transformers"),
    ({"hardness_mode": "hard_negatives"}, ValueError, "hardness weighting re-weights the softmax denominator"),
    ({"hardness_strength": 0.5}, ValueError, "does not support hardness_strength"),
    ({"partition_mode": "joint"}, ValueError, "no softmax partition function"),
    ({"temperature": 0.05}, TypeError, "unexpected keyword argument 'temperature'"),
    ({"inverse_temperature": 5.0}, TypeError, "unexpected keyword argument 'inverse_temperature'"),
    ({"trainable_temperature": False}, TypeError, "unexpected keyword argument 'trainable_temperature'"),
]


@pytest.mark.parametrize("options,error,message", BAD_OPTIONS)
def test_bad_options_are_refused_at_construction_naming_the_option(options, error, message):
    with pytest.raises(error, match=message):
        RBSigmoidLoss(None, **options)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    loss = RBSigmoidLoss(None, np.float32(20.0), relative_bias=np.float64(0.25), chunk_size=np.int64(3))
    assert loss.scale.item() == pytest.approx(20.0, rel=1e-6)
    assert loss.b_rel.item() == pytest.approx(0.25)
    assert loss.options.chunk_size == 3 and type(loss.options.chunk_size) is int
    config = loss.get_config_dict()
    json.dumps(config)
    assert all(not isinstance(value, np.generic) for value in config.values())
    # Integers are real numbers too.
    assert RBSigmoidLoss(None, 4).scale.item() == pytest.approx(4.0)


def test_scale_is_the_second_positional_argument_as_in_mnrl():
    assert RBSigmoidLoss(None, 5.0).scale.item() == pytest.approx(5.0, rel=1e-6)
    assert RBSigmoidLoss(None).scale.item() == pytest.approx(DEFAULT_SCALE, rel=1e-6)
    assert RBSigmoidLoss(None).b_rel.item() == pytest.approx(DEFAULT_RELATIVE_BIAS)


def test_mnrl_arguments_at_their_no_op_values_are_accepted():
    plain = RBSigmoidLoss(None)
    mnrl_style = RBSigmoidLoss(
        None, 10.0, similarity_fct=cos_sim, hardness_mode=None, hardness_strength=0.0, directions=("query_to_doc",)
    )
    assert mnrl_style.get_config_dict() == plain.get_config_dict()
    both = RBSigmoidLoss(None, directions=("doc_to_query", "query_to_doc"))
    assert both.options.symmetric and both.get_config_dict() == RBSigmoidLoss(None, symmetric=True).get_config_dict()


def test_options_object_is_the_single_source_of_defaults():
    options = RBSigmoidOptions()
    assert (options.scale, options.relative_bias, options.bias) == (DEFAULT_SCALE, DEFAULT_RELATIVE_BIAS, None)
    absolute = RBSigmoidOptions(parametrization="absolute", scale=4.0, relative_bias=0.25)
    assert (absolute.bias, absolute.relative_bias) == (1.0, None)
    with pytest.raises(AttributeError):
        options.scale = 3.0  # frozen


def _configurations() -> list[dict]:
    configurations = []
    axes = itertools.product(
        ("relative", "absolute"), (True, False), (True, False), (False, True), ("negatives", "modalities"), (None, 4)
    )
    for parametrization, trainable_scale, trainable_bias, symmetric, columns, chunk_size in axes:
        configurations.append(
            {
                "parametrization": parametrization,
                "trainable_scale": trainable_scale,
                "trainable_bias": trainable_bias,
                "symmetric": symmetric,
                "columns": columns,
                "chunk_size": chunk_size,
                "locked_adapter": symmetric,  # both values of each flag, without doubling the count
                "check_inputs": not symmetric,
                "gather_across_devices": chunk_size is None,
            }
        )
    # Explicit starts, and the absolute start given as b or as t * b_rel.
    configurations += [
        {"scale": 3.0, "relative_bias": -0.2, "adapter_logit": 0.4, "locked_adapter": True},
        {"parametrization": "absolute", "scale": 8.0, "bias": -2.0},
        {"parametrization": "absolute", "scale": 4.0, "relative_bias": 0.25},
        {"false_negative_filter": ("relative", 0.9)},
        {"false_negative_filter": ["absolute", 0.05], "symmetric": True, "chunk_size": 2},
    ]
    return configurations


@pytest.mark.parametrize("cls", [RBSigmoidLoss, CachedRBSigmoidLoss])
@pytest.mark.parametrize("options", _configurations(), ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_config_rebuilds_the_same_config_and_the_same_loss(cls, options, one_torch_thread):
    if cls is CachedRBSigmoidLoss:
        options = {**options, "mini_batch_size": 3, "show_progress_bar": options.get("symmetric", False)}
    loss = cls(None, **options)
    fresh = cls(None, **options)
    # As after training: the loss parameters are no longer at their starts.
    with torch.no_grad():
        for value in loss.loss_parameters().values():
            value.add_(0.123456789)
    config = loss.get_config_dict()
    json.dumps(config)
    # The configuration is the configured one (the starts), not the trained values: see docs/rb-sigmoid.md.
    assert config == fresh.get_config_dict()
    rebuilt = cls(None, **config)
    assert rebuilt.get_config_dict() == config
    own = {name: value for name, value in fresh.state_dict().items()}
    assert rebuilt.state_dict().keys() == own.keys()
    for name, value in rebuilt.state_dict().items():
        assert torch.equal(value, own[name]), name  # bit for bit the configured starts
    assert {n for n, _ in rebuilt.named_parameters()} == {n for n, _ in loss.named_parameters()}
    assert rebuilt.trained_values() == fresh.trained_values() != loss.trained_values()
    g = torch.Generator().manual_seed(0)
    columns = [torch.randn(5, 6, generator=g) for _ in range(3)]
    torch.testing.assert_close(
        rebuilt.compute_loss_from_embeddings(columns), fresh.compute_loss_from_embeddings(columns), rtol=0, atol=0
    )


def test_default_and_adapter_configs_rebuild():
    """Two failures users met: a config that did not rebuild the loss, and a rebuilt scale off by a rounding."""
    for cls, options in itertools.product((RBSigmoidLoss, CachedRBSigmoidLoss), ({}, {"locked_adapter": True})):
        loss = cls(None, **options)
        assert cls(None, **loss.get_config_dict()).get_config_dict() == loss.get_config_dict()
    assert math.isclose(RBSigmoidLoss(None).get_config_dict()["scale"], DEFAULT_SCALE, rel_tol=1e-7)
