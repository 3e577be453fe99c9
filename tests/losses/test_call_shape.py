"""Issue 52 item 3: a training call of WEINCELoss and CachedWEINCELoss reaches the fused cross-entropy in at most five
own frames from ``forward``, no own stack is deeper than eight, fewer own functions run than before (71 at 119820b),
nothing in functional/ calls back into losses/, and a forward writes nothing into the model. Measured as
benchmarks/call_shape.py measures it (its committed output: benchmarks/results/call_shape.json)."""

from __future__ import annotations

import pytest

from benchmarks.call_shape import measure
from st_weince.calibration import CONFIG_KEY
from st_weince.losses import WEINCELoss

# 119820b ran 71 own functions in one WEINCELoss call, 81 in one CachedWEINCELoss call (statistics logged)
MOST_FUNCTIONS = {"WEINCELoss": 39, "CachedWEINCELoss": 46}


@pytest.fixture(scope="module")
def shapes(tiny_model_dir):
    from sentence_transformers import SentenceTransformer

    return measure(SentenceTransformer(str(tiny_model_dir), device="cpu"))


@pytest.mark.parametrize("name", ["WEINCELoss", "CachedWEINCELoss"])
def test_a_training_call_reaches_the_formula_in_five_frames_and_goes_at_most_eight_deep(shapes, name):
    shape = shapes[name]
    assert shape["frames_to_blended_cross_entropy"] <= 5, shape
    assert shape["max_own_depth"] <= 8, shape["deepest_stack"]
    assert shape["own_functions"] <= MOST_FUNCTIONS[name], shape["functions"]


@pytest.mark.parametrize("name", ["WEINCELoss", "CachedWEINCELoss", "RBSigmoidLoss"])
def test_the_math_never_calls_back_into_the_losses(shapes, name):
    assert shapes[name]["functional_to_losses_calls"] == 0


def test_a_forward_writes_nothing_into_the_model(tiny_model):
    """The values an RB-Sigmoid run left in the model's configuration stay as they are through a WEINCE training step
    (prepare_trainer marks them stale: tests/test_match_probability.py)."""
    config = tiny_model[0].auto_model.config
    carried = {"t": 10.0, "b_rel": 0.5, "b": 5.0, "loss": "RBSigmoidLoss", "global_step": 5}
    setattr(config, CONFIG_KEY, dict(carried))
    loss = WEINCELoss(tiny_model).train()
    features = [tiny_model.tokenize(["a b", "c d", "e f"]), tiny_model.tokenize(["b a", "d c", "f e"])]
    loss(features).backward()
    assert getattr(config, CONFIG_KEY) == carried
