"""Each loss's options object is the one home of its defaults: the constructors' signatures read it, get_config_dict
writes it out, and no second literal of a default stands anywhere in the package."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import st_weince
from st_weince.functional import Gate, RBSigmoidOptions, WEINCEOptions
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.losses._gradcache import GradCacheOptions

PACKAGE = Path(st_weince.__file__).parent
# (options object, field, a pattern for the names a copy of that default would be assigned to)
DEFAULTS = [
    (WEINCEOptions(), "scale", r"\w*scale\w*"),
    (WEINCEOptions(), "beta", r"\w*beta\w*"),
    (Gate(), "q", r"q|\w*quantile\w*"),
    (Gate(), "kappa_rho", r"\w*kappa_rho\w*"),
    (RBSigmoidOptions(), "scale", r"\w*scale\w*|t|t_start|\w*temperature\w*"),
    (RBSigmoidOptions(), "relative_bias", r"\w*relative_bias\w*|b_rel\w*|\w*RELATIVE_BIAS\w*"),
]


def _named_constants(tree: ast.AST) -> list[tuple[str, object, int]]:
    """(name, literal value, line) of every assignment, parameter default and keyword argument whose value is a
    literal; docstrings and comments are prose and do not count."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                if name:
                    found.append((name, node.value.value, node.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = node.args.posonlyargs + node.args.args
            pairs = list(zip(positional[len(positional) - len(node.args.defaults) :], node.args.defaults))
            pairs += [(arg, default) for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults) if default]
            for arg, default in pairs:
                if isinstance(default, ast.Constant):
                    found.append((arg.arg, default.value, default.lineno))
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg and isinstance(keyword.value, ast.Constant):
                    found.append((keyword.arg, keyword.value.value, keyword.value.lineno))
    return found


def _literal_assignments(names: str, value: object) -> list[str]:
    """Places in the package that assign or default ``value``, written as a literal, to a name matching ``names``."""
    pattern = re.compile(rf"(?:{names})", re.IGNORECASE)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, constant, line in _named_constants(ast.parse(path.read_text())):
            if (
                isinstance(constant, bool)
                or type(constant) is not type(value)
                and not (isinstance(constant, (int, float)) and isinstance(value, (int, float)))
            ):
                continue
            if constant == value and pattern.fullmatch(name):
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {name} = {constant!r}")
    return found


@pytest.mark.parametrize(
    ("options", "name", "names"), DEFAULTS, ids=[f"{type(options).__name__}.{name}" for options, name, _ in DEFAULTS]
)
def test_each_default_is_written_once_in_the_package(options, name, names):
    value = getattr(options, name)
    found = _literal_assignments(names, value)
    # the one literal: the field of the options class itself
    assert len(found) == 1, f"the default {name}={value!r} is written {len(found)} times:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("loss_class", "options_classes"),
    [
        (WEINCELoss, [WEINCEOptions]),
        (RBSigmoidLoss, [RBSigmoidOptions]),
        (CachedWEINCELoss, [WEINCEOptions, GradCacheOptions]),
        (CachedRBSigmoidLoss, [RBSigmoidOptions, GradCacheOptions]),
    ],
)
def test_signatures_and_configs_derive_from_the_options(loss_class, options_classes):
    """Every option of the uncached class is named in the signature, with its default, the cached variants' too;
    get_config_dict writes every option and rebuilds the loss."""
    parameters = inspect.signature(loss_class).parameters
    fields = [field for options in options_classes for field in dataclasses.fields(options)]
    for field in fields:
        assert parameters[field.name].default == field.default, (loss_class.__name__, field.name)
    config = loss_class(None).get_config_dict()
    assert sorted(config) == sorted(field.name for field in fields)
    assert loss_class(None, **config).get_config_dict() == config
    # the options object holds the values; the loss keeps no copies of them as attributes
    loss = loss_class(None)
    for field in fields:
        assert field.name not in vars(loss), field.name


def test_adding_nothing_else_to_the_signature():
    """Every keyword of a loss is an option field or one of MNRL's arguments it accepts as a no-op."""
    mnrl_only = {"similarity_fct", "hardness_mode", "hardness_strength", "partition_mode", "directions"}
    for loss_class, options in ((WEINCELoss, WEINCEOptions), (RBSigmoidLoss, RBSigmoidOptions)):
        names = set(inspect.signature(loss_class).parameters) - {"model"}
        assert names - mnrl_only <= {field.name for field in dataclasses.fields(options)}, loss_class.__name__
    cached_own = {field.name for field in dataclasses.fields(GradCacheOptions)}
    for cached, uncached in ((CachedWEINCELoss, WEINCELoss), (CachedRBSigmoidLoss, RBSigmoidLoss)):
        names = set(inspect.signature(cached).parameters)
        assert names - cached_own == set(inspect.signature(uncached).parameters), cached.__name__
