"""The options of the loss classes: one frozen object a loss, the one home of its defaults and of their validation.
The loss signatures read their defaults from here; ``get_config_dict`` writes them out."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

import torch

from st_weince.functional.composite import TOP_M_DEFAULTS, TopMOptions
from st_weince.functional.false_negatives import FalseNegativeFilter
from st_weince.functional.layouts import Direction, PartitionMode, check_directions
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
    them out. The nine options of the math default to the released implementation's
    (:class:`~st_weince.functional.WeinceOptions`), except ``beta``: "auto" here, because the released 1.0 was tuned
    at temperature 0.5 and is 10-20x too soft at SimCSE's 0.05 (``docs/weince.md``). The scale is MNRL's
    (temperature 0.05)."""

    scale: float = 20.0
    gather_across_devices: bool = False
    directions: tuple[Direction, ...] = ("query_to_doc",)
    partition_mode: PartitionMode = "joint"
    beta: float | str = "auto"
    mode: WeinceMode = DEFAULTS.mode
    q: float = DEFAULTS.q
    kappa_rho: float = DEFAULTS.kappa_rho
    kappa_aic: float = DEFAULTS.kappa_aic
    aic_margin: float = DEFAULTS.aic_margin
    tail_frac: float = DEFAULTS.tail_frac
    min_tail_points: int = DEFAULTS.min_tail_points
    eps: float = DEFAULTS.eps
    false_negative_filter: FalseNegativeFilter | None = None
    check_inputs: bool = True
    # The released vision composite's two top-M terms and the batch tail index of the shortfall term: off by default
    # (weights 0); the other defaults are the released implementation's (TopMOptions).
    top_m: int = TOP_M_DEFAULTS.top_m
    top_m_shortfall_weight: float = TOP_M_DEFAULTS.top_m_shortfall_weight
    top_m_infonce_weight: float = TOP_M_DEFAULTS.top_m_infonce_weight
    # The top-M InfoNCE term's own inverse temperature (None: ``scale``, as released); a study knob, to run that term
    # at the sharpness of the shortfall term (docs/weince.md, "How sharp is the loss?").
    top_m_infonce_scale: float | None = None
    beta_ema_start: float = TOP_M_DEFAULTS.beta_ema_start
    beta_ema_momentum: float = TOP_M_DEFAULTS.beta_ema_momentum
    beta_min_r_squared: float = TOP_M_DEFAULTS.beta_min_r_squared
    beta_min: float = TOP_M_DEFAULTS.beta_min
    beta_max: float = TOP_M_DEFAULTS.beta_max
    beta_tail_min_points: int = TOP_M_DEFAULTS.beta_tail_min_points
    beta_tail_frac: float = TOP_M_DEFAULTS.beta_tail_frac
    # The options of the statistics (:mod:`st_weince.functional.weince`), derived from the fields above.
    math: WeinceOptions = field(init=False, repr=False, compare=False)
    # The options of the top-M terms (:mod:`st_weince.functional.composite`), derived from the fields above.
    top_m_options: TopMOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("scale", check_scale(self.scale))
        if self.top_m_infonce_scale is not None:
            put("top_m_infonce_scale", check_scale(self.top_m_infonce_scale, "top_m_infonce_scale"))
        for name in ("gather_across_devices", "check_inputs"):
            put(name, flag_option(name, getattr(self, name)))
        check_directions(self.directions, self.partition_mode)
        put("directions", tuple(self.directions))
        put("math", WeinceOptions(**{f.name: getattr(self, f.name) for f in fields(WeinceOptions)}))
        for name in self.math.as_dict():  # validated and normalised there (NumPy numbers -> Python numbers)
            put(name, getattr(self.math, name))
        put("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))
        # validated and normalised there; eps is the blend's (one floor of the shortfall for every term)
        put("top_m_options", TopMOptions(**{f.name: getattr(self, f.name) for f in fields(TopMOptions)}))
        for name in self.top_m_options.as_dict():
            put(name, getattr(self.top_m_options, name))

    @property
    def top_m_infonce_logit_scale(self) -> float:
        """The inverse temperature of the top-M InfoNCE term's logits: ``top_m_infonce_scale``, else ``scale``."""
        return self.scale if self.top_m_infonce_scale is None else self.top_m_infonce_scale

    @property
    def has_top_m_terms(self) -> bool:
        """Whether either top-M term is on (a weight > 0)."""
        return self.top_m_shortfall_weight > 0 or self.top_m_infonce_weight > 0


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
