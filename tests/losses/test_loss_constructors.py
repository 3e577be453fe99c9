"""The four loss classes as sentence-transformers writes its losses: a constructor in the source with every parameter
named (so IDEs and type checkers see the keywords), one ``Args:`` entry per parameter, defaults that read the options
class; and MultipleNegativesRankingLoss's attribute surface (``loss.scale`` settable, the other hyperparameters
readable)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.util import cos_sim

from st_weince.functional import RBSigmoidOptions, WEINCEOptions
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.losses._gradcache import GradCacheOptions

LOSSES = [WEINCELoss, CachedWEINCELoss, RBSigmoidLoss, CachedRBSigmoidLoss]
OPTIONS = {
    WEINCELoss: [WEINCEOptions],
    CachedWEINCELoss: [WEINCEOptions, GradCacheOptions],
    RBSigmoidLoss: [RBSigmoidOptions],
    CachedRBSigmoidLoss: [RBSigmoidOptions, GradCacheOptions],
}


def _documented_arguments(docstring: str) -> list[str]:
    """The names of the ``Args:`` section's entries (Google style, as sentence-transformers' losses)."""
    lines = inspect.cleandoc(docstring).splitlines()
    start = lines.index("Args:")
    names = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^    (\w+):", line)
        if match:
            names.append(match.group(1))
    return names


@pytest.mark.parametrize("loss_class", LOSSES, ids=lambda c: c.__name__)
def test_the_constructor_is_written_out(loss_class):
    """No signature built at import time and no ``*args`` / ``**kwargs``: the class's own ``__init__`` in the source
    names every option, with the options class's default."""
    assert "__signature__" not in vars(loss_class)
    assert "__init__" in vars(loss_class)
    source = textwrap.dedent(inspect.getsource(loss_class.__init__))
    arguments = ast.parse(source).body[0].args
    assert arguments.vararg is None and arguments.kwarg is None
    parameters = inspect.signature(loss_class).parameters
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters.values())
    for options_class in OPTIONS[loss_class]:
        for field in dataclasses.fields(options_class):
            assert parameters[field.name].default == field.default, (loss_class.__name__, field.name)
            assert parameters[field.name].annotation != inspect.Parameter.empty, field.name
    # a misspelt keyword is Python's own TypeError, naming it
    with pytest.raises(TypeError, match="scael"):
        loss_class(None, scael=10.0)


@pytest.mark.parametrize("loss_class", LOSSES, ids=lambda c: c.__name__)
def test_one_args_entry_per_parameter_in_order(loss_class):
    names = [name for name in inspect.signature(loss_class).parameters]
    assert _documented_arguments(loss_class.__doc__) == names


@pytest.mark.parametrize("loss_class", LOSSES, ids=lambda c: c.__name__)
def test_mnrl_attributes_are_readable(loss_class):
    loss = loss_class(None)
    assert loss.similarity_fct is cos_sim
    assert loss.gather_across_devices is False
    assert loss.directions == ("query_to_doc",)
    assert loss.hardness_mode is None and loss.hardness_strength == 0.0
    temperature, scale = (torch.as_tensor(value).detach().item() for value in (loss.temperature, loss.scale))
    assert temperature == pytest.approx(1.0 / scale, rel=1e-6)
    gathered = loss_class(None, gather_across_devices=True)
    assert gathered.gather_across_devices is True


def test_mnrl_directions_and_partition_mode_as_mnrl_reads_them():
    layout = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}
    mnrl = MultipleNegativesRankingLoss(None, **layout)
    weince = WEINCELoss(None, **layout)
    assert (weince.directions, weince.partition_mode) == (tuple(mnrl.directions), mnrl.partition_mode)
    assert WEINCELoss(None).temperature == pytest.approx(MultipleNegativesRankingLoss(None).temperature, rel=1e-12)
    symmetric = RBSigmoidLoss(None, symmetric=True)
    assert symmetric.directions == ("query_to_doc", "doc_to_query") and symmetric.partition_mode is None


def _batch(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(96, 16, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("loss_class", [WEINCELoss, CachedWEINCELoss], ids=lambda c: c.__name__)
def test_setting_scale_gives_the_loss_built_with_it(loss_class):
    """``loss.scale = 10`` (as MNRL allows) gives exactly ``WEINCELoss(model, scale=10)``'s loss and configuration;
    the value is checked as at construction, and the options object stays frozen and replaced."""
    embeddings = _batch()
    loss = loss_class(None)
    options_before = loss.options
    loss.scale = 10.0
    built = loss_class(None, scale=10.0)
    assert loss.scale == 10.0 and loss.options is not options_before and options_before.scale == 20.0
    assert loss.get_config_dict() == built.get_config_dict()
    assert torch.equal(loss.compute_loss_from_embeddings(embeddings), built.compute_loss_from_embeddings(embeddings))
    assert not torch.equal(
        loss.compute_loss_from_embeddings(embeddings), loss_class(None).compute_loss_from_embeddings(embeddings)
    )
    for bad, message in ((0.0, "scale must be > 0"), (-1.0, "scale must be > 0"), (True, "scale")):
        with pytest.raises((TypeError, ValueError), match=message):
            loss.scale = bad
    assert loss.scale == 10.0  # a refused value changes nothing


@pytest.mark.parametrize("loss_class", [RBSigmoidLoss, CachedRBSigmoidLoss], ids=lambda c: c.__name__)
def test_rb_sigmoid_scale_is_the_trained_t_and_refuses_assignment(loss_class):
    """RB-Sigmoid's ``scale`` is its trained ``t``: read back it is the current value; an assignment is refused with
    the way to get that start (it would reset a parameter behind its optimizer, or leave the recorded start wrong)."""
    loss = loss_class(None, scale=5.0)
    with torch.no_grad():
        loss.log_t.fill_(1.5)
    assert loss.scale.item() == pytest.approx(torch.tensor(1.5).exp().item(), rel=1e-6)
    with pytest.raises(AttributeError, match=r"cannot be assigned: build the loss with \w+\(model, scale=10.0\)"):
        loss.scale = 10.0
    assert loss.log_t.item() == 1.5 and loss.options.scale == 5.0
