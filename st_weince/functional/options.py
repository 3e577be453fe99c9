"""The options of the two losses, one frozen dataclass each: :class:`WEINCEOptions` (with :class:`Gate` and
:class:`TopM` nested in it) and :class:`RBSigmoidOptions`. Each is the one home of its defaults and their checks: the
loss signatures read the defaults (:func:`defaults_of`), checkpoints and model cards record the object
(:meth:`Options.to_config`), and every field is checked once, at construction, with an error naming it. The fields,
defaults and ranges are tabled in docs/options.md (a test holds the tables to the fields); docs/conventions.md says how
to add one.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import torch

from st_weince.functional.false_negatives import FalseNegativeFilter
from st_weince.functional.layouts import Direction, PartitionMode, check_directions
from st_weince.utils.options import (
    check_representable,
    choice_option,
    flag_option,
    integer_option,
    positive_int_option,
    real_option,
    stored_scale_option,
)

WEINCEMode = Literal["both", "rho", "aic", "none"]
WEINCE_MODES = ("both", "rho", "aic", "none")
BETA_AUTO_RANGE = (0.5, 16.0)  # the clamp of an estimated tail index ("auto"), as released
Parametrization = Literal["relative", "absolute"]
ColumnMode = Literal["negatives", "modalities"]
Exchange = Literal["all_gather", "neighbour"]


@dataclasses.dataclass(frozen=True)
class Within:
    """The range of a numeric option (``Annotated[float, Within(...)]``), written as in its error message:
    ``interval`` "[0, 1)" (either end open or closed; "[0, inf)" reads "must be >= 0"), ``positive`` a number > 0;
    ``note`` follows the range in the message. For an option whose default is an ``int``, the interval's low end is
    its minimum."""

    interval: str = ""
    positive: bool = False
    note: str = ""


def _checked(name: str, value: Any, default: Any, spec: Within, dtype: torch.dtype | None) -> float | int:
    """``value`` of the option ``name`` validated and converted, or an error naming the option."""
    interval = spec.interval
    low_text, high_text = (part.strip(" [()]") for part in interval.split(",")) if interval else ("-inf", "inf")
    low, high = float(low_text), float(high_text)
    if type(default) is int:
        return integer_option(name, value, int(low))
    number = real_option(name, value, positive=spec.positive, dtype=dtype)
    above = number >= low if interval.startswith("[") else number > low
    below = number <= high if interval.endswith("]") else number < high
    if interval and not (above and below):
        expected = f"be >= {low_text}" if math.isinf(high) else f"lie in {interval}"
        raise ValueError(f"{name} must {expected}{spec.note}, got {number}")
    return number


def operational(default: Any) -> Any:
    """A field (``check_inputs: bool = operational(True)``) that changes only how the loss is computed (memory, checks,
    progress bars), not what it computes: a resume accepts a checkpoint written with another value of it."""
    return dataclasses.field(default=default, metadata={"operational": True})


def defaults_of(options_class: type[Options]) -> types.SimpleNamespace:
    """The fields' defaults of an options class as attributes (``defaults_of(WEINCEOptions).scale``), as written in
    the class (before construction resolves any of them): what the loss constructors' signatures read, so that each
    default is written once."""
    return types.SimpleNamespace(**{field.name: field.default for field in dataclasses.fields(options_class)})


class Options:
    """A frozen options dataclass (made by :func:`options`): its :class:`Within` fields and its flags (the fields with
    a bool default) are checked at construction, the others by the subclass's ``_check_other_fields``. A field made
    with :func:`operational` changes only how the loss is computed; every other one changes what it computes."""

    #: each number must also be finite in this dtype (the one the statistics and logits are computed in)
    dtype: ClassVar[torch.dtype | None] = None
    _ranges: ClassVar[dict[str, tuple[Any, Within]]]

    def __post_init__(self) -> None:
        for name, (default, spec) in self._ranges.items():
            self._store(name, _checked(name, getattr(self, name), default, spec, self.dtype))
        for field in dataclasses.fields(self):
            if type(field.default) is bool:  # a flag: True or False, nothing else
                self._store(field.name, flag_option(field.name, getattr(self, field.name)))
        self._check_other_fields()

    def _store(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_other_fields(self) -> None:
        pass

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied, checked like the constructor."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def operational_fields(cls) -> frozenset[str]:
        """The names of the fields that change only how the loss is computed (made with :func:`operational`)."""
        return frozenset(field.name for field in dataclasses.fields(cls) if field.metadata.get("operational"))

    def to_config(self) -> dict[str, Any]:
        """The JSON form of the options (``type(options)(**config)`` rebuilds them; so does the loss class): nested
        options and the false-negative guard as their own JSON form, tuples as lists."""
        config: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if hasattr(value, "to_config"):
                value = value.to_config()
            elif isinstance(value, tuple):
                value = list(value)
            config[field.name] = value
        return config


def checked_field(options_class: type[Options], name: str, value: Any) -> float | int:
    """``value`` for the field ``name`` of ``options_class``, checked against that field's range as the constructor
    checks it (for a function that takes one option as an argument of its own, e.g. ``batch_pivot``'s ``q``)."""
    default, spec = options_class._ranges[name]
    return _checked(name, value, default, spec, options_class.dtype)


def require_options(value: Any, options_class: type, name: str = "options") -> None:
    """Refuse with a TypeError naming the parameter a ``value`` that is not an ``options_class`` (``None``, a dict,
    another options class): at the entry of a public function, before an attribute is read deep inside. An
    ``isinstance`` check, free."""
    if not isinstance(value, options_class):
        hint = f" (build it with {options_class.__name__}(**d))" if isinstance(value, Mapping) else ""
        raise TypeError(f"{name} must be a {options_class.__name__}, got {type(value).__name__} {value!r}{hint}")


def options(cls: type) -> type:
    """A frozen dataclass of :class:`Options` whose ``Annotated[..., Within(...)]`` fields are checked at
    construction."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    cls._ranges = {
        spec.name: (spec.default, meta)
        for spec in dataclasses.fields(cls)
        for meta in getattr(hints[spec.name], "__metadata__", ())
        if isinstance(meta, Within)
    }
    return cls


def _nested(name: str, value: Any, options_class: type[Options], optional: bool = False) -> Any:
    """A nested options field: an instance of ``options_class`` or its JSON form (a mapping), or None if optional."""
    if value is None and optional:
        return None
    if isinstance(value, Mapping):
        value = options_class(**value)
    if not isinstance(value, options_class):
        expected = f"a {options_class.__name__}, its dict" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    return value


def check_scale(scale: Any, name: str = "scale") -> float:
    """``scale = 1 / temperature`` as a float: a number > 0, finite and nonzero in float32 (the error names
    ``name``)."""
    value = real_option(name, scale)
    if not value > 0:
        raise ValueError(f"{name} must be > 0 ({name} = 1 / temperature), got {value}")
    return real_option(name, value, positive=True, dtype=torch.float32)


@options
class Gate(Options):
    """The gate ``lambda(a) = sigmoid(kappa_rho (log rho0 - log rho(a))) * sigmoid(kappa_aic (dAIC(a) - aic_margin))``
    that weights each anchor's shortfall logit (docs/algorithms.md 1.1; fields: docs/options.md); the defaults are the
    released implementation's. Which factors are on is WEINCE's ``mode``."""

    dtype: ClassVar[torch.dtype | None] = torch.float32

    q: Annotated[float, Within("[0, 1]")] = 0.2
    kappa_rho: Annotated[float, Within("[0, inf)")] = 10.0
    kappa_aic: Annotated[float, Within("[0, inf)")] = 1.0
    aic_margin: Annotated[float, Within()] = 2.0


@options
class TopM(Options):
    """The released composite's two top-M terms and the batch tail index of the shortfall term (docs/algorithms.md
    1.2b; fields: docs/options.md); the defaults are the released implementation's, with both terms off.
    ``TopM(shortfall_weight=0.5, infonce_weight=0.5)`` is the released pair."""

    m: Annotated[int, Within("[1, inf)")] = 50
    shortfall_weight: Annotated[float, Within("[0, inf)", note=" (0 turns the term off)")] = 0.0
    infonce_weight: Annotated[float, Within("[0, inf)", note=" (0 turns the term off)")] = 0.0
    infonce_scale: float | None = None
    beta_ema_start: Annotated[float, Within(positive=True)] = 4.0
    beta_ema_momentum: Annotated[float, Within("[0, 1)")] = 0.9
    beta_min_r_squared: Annotated[float, Within("[0, 1]")] = 0.85
    beta_min: Annotated[float, Within(positive=True)] = BETA_AUTO_RANGE[0]
    beta_max: Annotated[float, Within(positive=True)] = BETA_AUTO_RANGE[1]
    beta_tail_min_points: Annotated[int, Within("[1, inf)")] = 1024
    beta_tail_frac: Annotated[float, Within("(0, 1]")] = 0.05

    def _check_other_fields(self) -> None:
        if self.beta_min > self.beta_max:
            raise ValueError(f"beta_min ({self.beta_min}) must not exceed beta_max ({self.beta_max})")
        if self.infonce_scale is not None:
            self._store("infonce_scale", check_scale(self.infonce_scale, "infonce_scale"))


@options
class WEINCEOptions(Options):
    """The options of WEINCE (:class:`~st_weince.losses.WEINCELoss`, its cached variant and the functions of
    :mod:`st_weince.functional.weince`; fields: docs/options.md, and the loss's Args). The gate's and the top-M
    terms' defaults are the released implementation's; ``beta`` is "auto" because the released 1.0 was tuned at
    temperature 0.5 and is 10-20x too soft at SimCSE's 0.05 (``docs/weince.md``); ``scale`` and the layout options are
    MultipleNegativesRankingLoss's. ``top_m`` with both weights 0 is stored as None: the loss is the blend alone."""

    dtype: ClassVar[torch.dtype | None] = torch.float32

    scale: float = 20.0
    gather_across_devices: bool = False
    directions: tuple[Direction, ...] = ("query_to_doc",)
    partition_mode: PartitionMode = "joint"
    beta: float | str = "auto"
    mode: WEINCEMode = "both"
    gate: Gate = Gate()
    tail_frac: Annotated[float, Within("(0, 1]")] = 0.10
    min_tail_points: Annotated[int, Within("[1, inf)")] = 32
    eps: Annotated[float, Within("(0, 0.5)")] = 1e-6
    false_negative_filter: FalseNegativeFilter | None = None
    check_inputs: bool = operational(True)
    top_m: TopM | None = None

    def _check_other_fields(self) -> None:
        self._store("scale", check_scale(self.scale))
        check_directions(self.directions, self.partition_mode)
        self._store("directions", tuple(self.directions))
        if not isinstance(self.mode, str):
            raise TypeError(f"mode must be 'both', 'rho', 'aic' or 'none', got {type(self.mode).__name__}")
        if self.mode not in WEINCE_MODES:
            raise ValueError(f"mode must be 'both', 'rho', 'aic' or 'none', got {self.mode!r}")
        self._store("gate", _nested("gate", self.gate, Gate))
        check_representable("eps", self.eps, torch.float32, positive=True)  # log(eps) must stay finite
        self._store("beta", _beta_option(self.beta))
        self._store("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))
        top_m = _nested("top_m", self.top_m, TopM, optional=True)
        has_terms = top_m is not None and (top_m.shortfall_weight > 0 or top_m.infonce_weight > 0)
        self._store("top_m", top_m if has_terms else None)

    @property
    def top_m_infonce_scale(self) -> float:
        """The inverse temperature of the top-M InfoNCE term's logits: ``top_m.infonce_scale``, else ``scale``."""
        return self.scale if self.top_m is None or self.top_m.infonce_scale is None else self.top_m.infonce_scale


def _beta_option(value: Any) -> float | str:
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"beta must be a positive number or 'auto', got {value!r}")
        return value
    try:
        beta = real_option("beta", value, dtype=torch.float32)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{error} (beta must be a finite number > 0 or 'auto')") from None
    if not beta > 0:
        raise ValueError(f"beta must be a positive number or 'auto', got {beta}")
    check_representable("beta", beta, torch.float32, positive=True)
    return beta


@options
class RBSigmoidOptions(Options):
    """The options of RB-Sigmoid (:class:`~st_weince.losses.RBSigmoidLoss` and its cached variant; fields:
    docs/options.md, and the loss's Args). Construction resolves the bias: exactly one of ``relative_bias`` (relative
    parametrization, default 0.7) and ``bias`` (absolute, default ``scale * relative_bias``) is set, the other None.
    ``t = 10`` is SigLIP's start, ``b_rel = 0.7`` reached the largest margins (``benchmarks/sigmoid_synthetic.py``,
    docs/rb-sigmoid.md), ``max_scale = 100`` is CLIP's and open_clip's cap on their logit scale."""

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
    chunk_size: int | None = operational(None)
    check_inputs: bool = operational(True)
    false_negative_filter: FalseNegativeFilter | None = None

    def _check_other_fields(self) -> None:
        put = self._store
        put("parametrization", choice_option("parametrization", self.parametrization, ("relative", "absolute")))
        put("columns", choice_option("columns", self.columns, ("negatives", "modalities")))
        put("exchange", choice_option("exchange", self.exchange, ("all_gather", "neighbour")))
        put("scale", stored_scale_option("scale", self.scale))
        put("max_scale", real_option("max_scale", self.max_scale, positive=True))
        float32_max = float(torch.finfo(torch.float32).max)
        if not self.max_scale < float32_max:
            raise ValueError(f"max_scale must be finite in float32 (below {float32_max:.4g}), got {self.max_scale!r}")
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
        if self.exchange == "neighbour" and not self.gather_across_devices:
            raise ValueError(
                "exchange='neighbour' passes candidate blocks between processes, so it needs "
                "gather_across_devices=True (without it every process scores only its own candidates)"
            )
        put("adapter_logit", real_option("adapter_logit", self.adapter_logit, dtype=torch.float32))
        put("chunk_size", positive_int_option("chunk_size", self.chunk_size, optional=True))
        put("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))


DEFAULTS = WEINCEOptions()
#: The released vision composite (docs/algorithms.md, "the released recipe"): temperature 0.5 (scale 2), beta 1 in the
#: blend, and both top-M terms at weight 0.5 with M = 50 (:meth:`~st_weince.losses.WEINCELoss.released`).
RELEASED_COMPOSITE = WEINCEOptions(scale=2.0, beta=1.0, top_m=TopM(shortfall_weight=0.5, infonce_weight=0.5))
