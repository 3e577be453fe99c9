"""The options of the loss classes: one frozen object a loss, the one home of its defaults and of their validation.
The loss signatures read their defaults from here; ``get_config_dict`` writes them out."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch

from st_weince.functional.false_negatives import FalseNegativeFilter
from st_weince.functional.layouts import Direction, PartitionMode, check_directions
from st_weince.functional.options import GATE_DEFAULTS, GATE_FIELDS, TOP_M_DEFAULTS, Gate, TopM
from st_weince.functional.weince import DEFAULTS, WeinceMode, WeinceOptions, check_scale
from st_weince.utils.options import (
    check_representable,
    choice_option,
    flag_option,
    positive_int_option,
    real_option,
    stored_scale_option,
)

Parametrization = Literal["relative", "absolute"]
ColumnMode = Literal["negatives", "modalities"]
Exchange = Literal["all_gather", "neighbour"]
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class WEINCELossOptions:
    """The options of :class:`WEINCELoss` (and :class:`~st_weince.losses.CachedWEINCELoss`): the one place of their
    defaults and their validation; the loss signatures read their defaults from here, ``get_config_dict`` writes
    them out. The nine options of the math (the gate's four as one :class:`~st_weince.functional.Gate`) default to
    the released implementation's (:class:`~st_weince.functional.WeinceOptions`), except ``beta``: "auto" here,
    because the released 1.0 was tuned at temperature 0.5 and is 10-20x too soft at SimCSE's 0.05
    (``docs/weince.md``). The scale is MNRL's (temperature 0.05)."""

    scale: float = 20.0
    gather_across_devices: bool = False
    directions: tuple[Direction, ...] = ("query_to_doc",)
    partition_mode: PartitionMode = "joint"
    beta: float | str = "auto"
    mode: WeinceMode = DEFAULTS.mode
    # the gate lambda's pivot quantile, slopes and margin (Gate, whose defaults are the released implementation's)
    gate: Gate = GATE_DEFAULTS
    tail_frac: float = DEFAULTS.tail_frac
    min_tail_points: int = DEFAULTS.min_tail_points
    eps: float = DEFAULTS.eps
    false_negative_filter: FalseNegativeFilter | None = None
    check_inputs: bool = True
    # The released vision composite's two top-M terms and the batch tail index of the shortfall term (TopM, whose
    # defaults are the released implementation's): off by default. A TopM with both weights 0 is stored as None.
    top_m: TopM | None = None
    # The options of the statistics (:mod:`st_weince.functional.weince`), derived from the fields above.
    math: WeinceOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("scale", check_scale(self.scale))
        for name in ("gather_across_devices", "check_inputs"):
            put(name, flag_option(name, getattr(self, name)))
        check_directions(self.directions, self.partition_mode)
        put("directions", tuple(self.directions))
        put("gate", _gate_option(self.gate))
        own = {f.name: getattr(self, f.name) for f in fields(WeinceOptions) if f.name not in GATE_FIELDS}
        put("math", WeinceOptions(**own, **self.gate.as_dict()))
        for name in own:  # validated and normalised there (NumPy numbers -> Python numbers)
            put(name, getattr(self.math, name))
        put("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))
        put("top_m", _top_m_option(self.top_m, self.eps))


def _gate_option(value: Any) -> Gate:
    """The ``gate`` option: a :class:`Gate` or its JSON form (``get_config_dict``'s dict)."""
    if isinstance(value, Mapping):
        value = Gate(**value)
    if not isinstance(value, Gate):
        raise TypeError(f"gate must be a Gate or its dict, got {type(value).__name__} {value!r}")
    return value


def _top_m_option(value: Any, eps: float) -> TopM | None:
    """The ``top_m`` option: a :class:`TopM`, its JSON form (``get_config_dict``'s dict), or None; stored with the
    loss's ``eps`` (one floor of the shortfall for every term), None when neither term is on."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = TopM(**value)
    if not isinstance(value, TopM):
        hint = " (M is TopM(m=...) since 0.2)" if isinstance(value, int) and not isinstance(value, bool) else ""
        raise TypeError(f"top_m must be a TopM, its dict or None, got {type(value).__name__} {value!r}{hint}")
    if value.eps not in (TOP_M_DEFAULTS.eps, eps):
        raise ValueError(
            f"top_m has eps={value.eps}, the loss eps={eps}: the floor of the shortfall is one for every term, set "
            "it as the loss's eps"
        )
    return value.replace(eps=eps) if value.has_terms else None


# The flat top-M options of 0.1 (WEINCELoss(top_m_shortfall_weight=0.5, ...)) -> the TopM fields since 0.2.
FLAT_TOP_M_OPTIONS: dict[str, str] = {
    "top_m": "m",
    "top_m_shortfall_weight": "shortfall_weight",
    "top_m_infonce_weight": "infonce_weight",
    "top_m_infonce_scale": "infonce_scale",
    **{name: name for name in ("beta_ema_start", "beta_ema_momentum", "beta_min_r_squared", "beta_min", "beta_max")},
    **{name: name for name in ("beta_tail_min_points", "beta_tail_frac")},
}


def _is_flat(name: str, value: Any) -> bool:
    """Whether option ``name`` = ``value`` is one of 0.1's flat top-M options (``top_m`` only as the integer M)."""
    return name != "top_m" or (isinstance(value, int) and not isinstance(value, bool))


def is_flat_top_m_config(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` holds 0.1's flat top-M options (``top_m`` as M, ``top_m_shortfall_weight``, ...)."""
    return any(_is_flat(name, config[name]) for name in FLAT_TOP_M_OPTIONS if name in config)


def fold_flat_top_m(config: Mapping[str, Any]) -> dict[str, Any]:
    """0.1's flat top-M options of a WEINCE configuration folded into one ``top_m`` (its JSON form, None when both
    weights are 0, as the options store it), applied over the ``top_m`` it has (a :class:`TopM` or its dict, e.g.
    :meth:`~st_weince.losses.WEINCELoss.released`'s); a configuration without them is returned as it is. Used where
    a loss is built from 0.1's keyword arguments (deprecated) and where a 0.1 checkpoint's recorded configuration is
    compared with the current one."""
    if not is_flat_top_m_config(config):
        return dict(config)
    top_m = config.get("top_m")
    base = TopM(**top_m) if isinstance(top_m, Mapping) else top_m if isinstance(top_m, TopM) else TOP_M_DEFAULTS
    flat = {name: value for name, value in config.items() if name in FLAT_TOP_M_OPTIONS and _is_flat(name, value)}
    folded = base.replace(**{FLAT_TOP_M_OPTIONS[name]: value for name, value in flat.items()})
    return {
        **{name: value for name, value in config.items() if name not in FLAT_TOP_M_OPTIONS},
        "top_m": folded.to_config() if folded.has_terms else None,
    }


def fold_flat_gate(config: Mapping[str, Any]) -> dict[str, Any]:
    """0.1's flat gate options of a WEINCE configuration (``q``, ``kappa_rho``, ``kappa_aic``, ``aic_margin``) folded
    into one ``gate`` (its JSON form), applied over the ``gate`` it has; a configuration without them is returned as
    it is. Used like :func:`fold_flat_top_m`."""
    flat = {name: config[name] for name in GATE_FIELDS if name in config}
    if not flat:
        return dict(config)
    gate = config.get("gate", GATE_DEFAULTS)
    base = Gate(**gate) if isinstance(gate, Mapping) else gate
    return {
        **{name: value for name, value in config.items() if name not in GATE_FIELDS},
        "gate": base.replace(**flat).to_config(),
    }


def fold_flat_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """A WEINCE configuration of 0.1 (flat top-M and gate options) in the form of 0.2 (one ``top_m``, one ``gate``);
    a configuration of 0.2 is returned as it is. A resume compares a 0.1 checkpoint's recorded configuration so."""
    return fold_flat_gate(fold_flat_top_m(config))


def deprecated_flat_options(owner: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A loss's keyword ``arguments`` with 0.1's flat top-M and gate options folded into ``top_m`` and ``gate``, and
    a DeprecationWarning naming them (they go in 0.3)."""
    flat_top_m = sorted(name for name in arguments if name in FLAT_TOP_M_OPTIONS and _is_flat(name, arguments[name]))
    flat_gate = [name for name in GATE_FIELDS if name in arguments]
    replacements = []
    if flat_top_m:
        replacements.append(
            f"the flat top-M options {flat_top_m}: pass one top_m=TopM(m=..., shortfall_weight=..., "
            "infonce_weight=..., ...) (st_weince.functional.TopM)"
        )
    if flat_gate:
        example = ", ".join(f"{name}={arguments[name]!r}" for name in flat_gate)
        replacements.append(f"the flat gate options {flat_gate}: pass gate=Gate({example}) (st_weince.functional.Gate)")
    if not replacements:
        return arguments
    warnings.warn(
        f"{owner}: {'; '.join(replacements)}. They are deprecated since 0.2 and go in 0.3",
        DeprecationWarning,
        stacklevel=3,
    )
    return fold_flat_options(arguments)


@dataclass(frozen=True)
class RBSigmoidOptions:
    """The options of :class:`RBSigmoidLoss` (and :class:`~st_weince.losses.CachedRBSigmoidLoss`): the one place of
    their defaults and their validation; the loss signatures read their defaults from here. Construction validates
    and resolves them: in the relative parametrization ``relative_bias`` is set (default
    ``RELATIVE_BIAS_START``) and ``bias`` is None; in the absolute one ``bias`` is set (default
    ``scale * relative_bias``) and ``relative_bias`` is None.

    The start values were chosen by measurement (``benchmarks/sigmoid_synthetic.py``, parts "init" and "bias"; see
    ``docs/rb-sigmoid.md``): ``t = 10`` is SigLIP's start, ``b_rel = 0.7`` reached the largest margins. The cap
    ``max_scale = 100`` is CLIP's and open_clip's cap on their logit scale (10x the start; see ``docs/rb-sigmoid.md``).
    """

    RELATIVE_BIAS_START: ClassVar[float] = 0.7

    scale: float = 10.0
    max_scale: float = 100.0
    parametrization: Parametrization = "relative"
    relative_bias: float | None = None
    bias: float | None = None
    trainable_scale: bool = True
    trainable_bias: bool = True
    gather_across_devices: bool = False
    exchange: Exchange = "all_gather"
    symmetric: bool = False
    columns: ColumnMode = "negatives"
    locked_adapter: bool = False
    adapter_logit: float = 0.0
    chunk_size: int | None = None
    check_inputs: bool = True
    false_negative_filter: FalseNegativeFilter | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("parametrization", choice_option("parametrization", self.parametrization, ("relative", "absolute")))
        put("columns", choice_option("columns", self.columns, ("negatives", "modalities")))
        put("exchange", choice_option("exchange", self.exchange, ("all_gather", "neighbour")))
        put("scale", stored_scale_option("scale", self.scale))
        put("max_scale", real_option("max_scale", self.max_scale, positive=True))
        if not self.max_scale < _FLOAT32_MAX:
            raise ValueError(f"max_scale must be finite in float32 (below {_FLOAT32_MAX:.4g}), got {self.max_scale!r}")
        if self.max_scale < self.scale:
            raise ValueError(
                f"max_scale must be >= scale (t starts at scale and never exceeds max_scale), got max_scale="
                f"{self.max_scale!r} < scale={self.scale!r}"
            )
        relative_bias = real_option("relative_bias", self.relative_bias, optional=True, dtype=torch.float32)
        bias = real_option("bias", self.bias, optional=True, dtype=torch.float32)
        start = self.RELATIVE_BIAS_START if relative_bias is None else relative_bias
        if self.parametrization == "relative":
            if bias is not None:
                raise ValueError(
                    "bias is the start of the absolute parametrization (z = t s - b); with parametrization="
                    "'relative' give relative_bias (z = t (s - b_rel))"
                )
            put("relative_bias", start)
        else:
            if bias is not None and relative_bias is not None:
                raise ValueError(
                    "give the absolute start either as bias or as relative_bias (then b = scale * relative_bias), "
                    "not both"
                )
            put("bias", self.scale * start if bias is None else bias)
            check_representable("bias", self.bias, torch.float32)  # scale * relative_bias may overflow
            put("relative_bias", None)
        for name in (
            "trainable_scale",
            "trainable_bias",
            "gather_across_devices",
            "symmetric",
            "locked_adapter",
            "check_inputs",
        ):
            put(name, flag_option(name, getattr(self, name)))
        if self.exchange == "neighbour" and not self.gather_across_devices:
            raise ValueError(
                "exchange='neighbour' passes candidate blocks between processes, so it needs "
                "gather_across_devices=True (without it every process scores only its own candidates)"
            )
        put("adapter_logit", real_option("adapter_logit", self.adapter_logit, dtype=torch.float32))
        put("chunk_size", positive_int_option("chunk_size", self.chunk_size, optional=True))
        put("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))
