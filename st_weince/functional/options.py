"""The options of the WEINCE functions (:class:`WeinceOptions`), of their gate lambda (:class:`Gate`) and of the
released composite's top-M terms and batch tail index (:class:`TopM`): the one source of their defaults and of their
validation.

Each field declares its default and its range (:class:`Within`); construction checks every field, with an error
naming it. Numbers may be any real (Python or NumPy) number and are stored as Python ``float`` / ``int``; bools,
strings and non-finite values are refused.
"""

from __future__ import annotations

import math
import numbers
import typing
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import torch

from st_weince.utils.options import check_representable, real_option

WeinceMode = Literal["both", "rho", "aic", "none"]
# "none": lambda = 0 for every anchor, i.e. exactly InfoNCE / MNRL through the same code path (the control arm of a
# comparison that keeps everything else, e.g. the false-negative guard, identical).
WEINCE_MODES = ("both", "rho", "aic", "none")
BETA_AUTO_RANGE = (0.5, 16.0)

OptionsT = TypeVar("OptionsT", bound="_Options")


@dataclass(frozen=True)
class Within:
    """The range of a numeric option (``Annotated[float, Within(...)]``), written as in its error message:
    ``interval`` "[0, 1)" (either end open or closed; "[0, inf)" reads "must be >= 0"), ``positive`` a number > 0;
    ``note`` follows the range in the message. For an option whose default is an ``int``, the interval's low end is
    its minimum."""

    interval: str = ""
    positive: bool = False
    note: str = ""


def integer_option(name: str, value: Any, minimum: int) -> int:
    """An integer (Python or NumPy; not a bool) of at least ``minimum``, as an int; the error names the option."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


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


def _options(cls: type) -> type:
    """A frozen dataclass whose ``Annotated[..., Within(...)]`` fields are checked at construction."""
    cls = dataclass(frozen=True)(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    cls._ranges = {
        spec.name: (spec.default, meta)
        for spec in fields(cls)
        for meta in getattr(hints[spec.name], "__metadata__", ())
        if isinstance(meta, Within)
    }
    return cls


class _Options:
    """Validation, ``as_dict``, ``replace`` and ``resolve`` of an options dataclass built by :func:`_options`
    (fields without a :class:`Within` are checked by the subclass's ``_check_other_fields``)."""

    label: ClassVar[str]
    dtype: ClassVar[torch.dtype | None] = None  # each number must also be finite in this dtype
    _ranges: ClassVar[dict[str, tuple[Any, Within]]]

    def __post_init__(self) -> None:
        for name, (default, spec) in self._ranges.items():
            self._store(name, _checked(name, getattr(self, name), default, spec, self.dtype))
        self._check_other_fields()

    def _store(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_other_fields(self) -> None:
        pass

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self: OptionsT, **changes: Any) -> OptionsT:
        """A copy with ``changes`` applied (validated like the constructor)."""
        names = [spec.name for spec in fields(self)]
        unknown = set(changes) - set(names)
        if unknown:
            raise TypeError(f"unknown {self.label} option(s) {sorted(unknown)}; valid: {names}")
        return type(self)(**{**self.as_dict(), **changes})

    @classmethod
    def resolve(cls: type[OptionsT], options: OptionsT | None, overrides: dict[str, Any]) -> OptionsT:
        """``options`` (default: the defaults) with keyword ``overrides`` applied."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
        options = options or _DEFAULTS[cls]
        return options.replace(**overrides) if overrides else options


@_options
class Gate(_Options):
    """The gate ``lambda(a) = sigmoid(kappa_rho (log rho0 - log rho(a))) * sigmoid(kappa_aic (dAIC(a) - aic_margin))``
    that weights each anchor's shortfall logit (docs/algorithms.md 1.1): the one source of its four defaults (the
    released implementation's) and of their validation. ``WEINCELoss(model, gate=Gate(q=0.4))`` moves the pivot;
    the other fields keep their defaults. Which factors are on is the loss's ``mode``.

    Args:
        q: quantile of the hardest-negative shortfalls that defines the batch pivot ``rho0``, in [0, 1].
        kappa_rho: slope of the hardness gate, >= 0.
        kappa_aic: slope of the geometry (AIC) gate, >= 0.
        aic_margin: AIC difference at which the geometry gate is one half (any finite number).
    """

    label: ClassVar[str] = "gate"
    dtype: ClassVar[torch.dtype | None] = torch.float32

    q: Annotated[float, Within("[0, 1]")] = 0.2
    kappa_rho: Annotated[float, Within("[0, inf)")] = 10.0
    kappa_aic: Annotated[float, Within("[0, inf)")] = 1.0
    aic_margin: Annotated[float, Within()] = 2.0

    def to_config(self) -> dict[str, Any]:
        """The JSON form a loss's ``get_config_dict`` writes (``Gate(**config)`` rebuilds it)."""
        return self.as_dict()


GATE_FIELDS = tuple(spec.name for spec in fields(Gate))


@_options
class WeinceOptions(_Options):
    """The nine WEINCE options: the one source of their defaults (the released implementation's; the gate's four
    are :class:`Gate`'s) and validation.

    Built once (by the loss classes in ``__init__``); every field is checked here, also finite in float32 (the dtype
    the statistics and logits are computed in for float32 and half-precision inputs).

    Args:
        q: quantile of the hardest-negative shortfalls that defines the batch pivot ``rho0``, in [0, 1].
        kappa_rho: slope of the hardness gate, >= 0.
        kappa_aic: slope of the geometry (AIC) gate, >= 0.
        aic_margin: AIC difference at which the geometry gate is one half (any finite number).
        tail_frac: share of an anchor's negatives used for the tail fit, in (0, 1].
        min_tail_points: minimum tail size, an integer >= 1.
        eps: floor of the shortfall ``1 - s``, in (0, 0.5).
        mode: "both" (hardness x geometry), "rho" (hardness only), "aic" (geometry only) or "none" (lambda = 0:
            exactly InfoNCE / MNRL through the same code path, the control arm of a comparison).
        beta: tail index of the shortfall logit, a finite number > 0, or "auto" (each anchor's estimate, clamped
            to [0.5, 16]). The reference implementation uses 1.0.
    """

    label: ClassVar[str] = "WEINCE"
    dtype: ClassVar[torch.dtype | None] = torch.float32

    # the gate's four, defaults and checks in Gate (the loss classes take them as one ``gate``)
    q: float = Gate.q
    kappa_rho: float = Gate.kappa_rho
    kappa_aic: float = Gate.kappa_aic
    aic_margin: float = Gate.aic_margin
    tail_frac: Annotated[float, Within("(0, 1]")] = 0.10
    min_tail_points: Annotated[int, Within("[1, inf)")] = 32
    eps: Annotated[float, Within("(0, 0.5)")] = 1e-6
    mode: WeinceMode = "both"
    beta: float | str = 1.0

    def _check_other_fields(self) -> None:
        gate = Gate(**{name: getattr(self, name) for name in GATE_FIELDS})
        for name in GATE_FIELDS:
            self._store(name, getattr(gate, name))
        check_representable("eps", self.eps, torch.float32, positive=True)  # log(eps) must stay finite
        if not isinstance(self.mode, str):
            raise TypeError(f"mode must be 'both', 'rho', 'aic' or 'none', got {type(self.mode).__name__}")
        if self.mode not in WEINCE_MODES:
            raise ValueError(f"mode must be 'both', 'rho', 'aic' or 'none', got {self.mode!r}")
        if isinstance(self.beta, str):
            if self.beta != "auto":
                raise ValueError(f"beta must be a positive number or 'auto', got {self.beta!r}")
            return
        try:
            beta = real_option("beta", self.beta, dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{error} (beta must be a finite number > 0 or 'auto')") from None
        if not beta > 0:
            raise ValueError(f"beta must be a positive number or 'auto', got {beta}")
        check_representable("beta", beta, torch.float32, positive=True)
        self._store("beta", beta)


@_options
class TopM(_Options):
    """The released composite's two top-M terms and the batch tail index of the shortfall term: the one source of
    their defaults (the released implementation's, docs/algorithms.md 1.2b) and of their validation, with errors
    naming the option. ``WEINCELoss(model, top_m=TopM(shortfall_weight=0.5, infonce_weight=0.5))`` turns both on (the
    released composite, :meth:`~st_weince.losses.WEINCELoss.released`); a term whose weight is 0 is off.

    Args:
        m: M, the number of hardest negatives per anchor (an integer >= 1); a row with K negatives uses
            ``min(M, K - 1)`` of them.
        shortfall_weight: weight of the top-M shortfall term (>= 0; 0 = off; released: 0.5): a shortfall softmax,
            logits ``-beta_t log(1 - s)``, over the positive and the M hardest negatives, with ``beta_t`` the batch
            tail index below.
        infonce_weight: weight of the top-M InfoNCE term (>= 0; 0 = off; released: 0.5): InfoNCE (logits
            ``scale * s``) over the positive and the M hardest negatives only.
        infonce_scale: the top-M InfoNCE term's own inverse temperature (None: the loss's ``scale``, as released),
            e.g. the shortfall term's logged ``weince_effective_scale_top_m_shortfall``, to compare the two links at
            matched sharpness (docs/weince.md, "How sharp is the loss?").
        beta_ema_start: start value of the moving average of the batch tail index (> 0).
        beta_ema_momentum: weight of the previous value in the moving average, in [0, 1).
        beta_min_r_squared: a fit is trusted only when its R^2 reaches this, in [0, 1].
        beta_min, beta_max: a trusted slope is clamped to [beta_min, beta_max] before it enters the average.
        beta_tail_min_points, beta_tail_frac: the tail size ``k = min(K_all, max(beta_tail_min_points,
            floor(beta_tail_frac * K_all)))`` over the batch's K_all negative scores.
        eps: floor of the shortfall ``1 - s``, in (0, 0.5). A loss class sets it to its own ``eps`` (one floor for
            every term), so it is not a loss option here.
    """

    label: ClassVar[str] = "top-M"

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
    eps: Annotated[float, Within("(0, 0.5)")] = WeinceOptions.eps

    def _check_other_fields(self) -> None:
        if self.beta_min > self.beta_max:
            raise ValueError(f"beta_min ({self.beta_min}) must not exceed beta_max ({self.beta_max})")
        if self.infonce_scale is not None:
            self._store("infonce_scale", check_scale(self.infonce_scale, "infonce_scale"))

    @property
    def has_terms(self) -> bool:
        """Whether either term is on (a weight > 0)."""
        return self.shortfall_weight > 0 or self.infonce_weight > 0

    def infonce_logit_scale(self, scale: float) -> float:
        """The inverse temperature of the top-M InfoNCE term's logits: ``infonce_scale``, else the loss's ``scale``."""
        return scale if self.infonce_scale is None else self.infonce_scale

    def to_config(self) -> dict[str, Any]:
        """The JSON form a loss's ``get_config_dict`` writes (``TopM(**config)`` rebuilds it); without ``eps``, which
        is the loss's own."""
        return {name: value for name, value in self.as_dict().items() if name != "eps"}


DEFAULTS = WeinceOptions()
TOP_M_DEFAULTS = TopM()
GATE_DEFAULTS = Gate()
_DEFAULTS: dict[type, _Options] = {WeinceOptions: DEFAULTS, TopM: TOP_M_DEFAULTS, Gate: GATE_DEFAULTS}


def check_scale(scale: Any, name: str = "scale") -> float:
    """``scale = 1 / temperature`` as a float: a number > 0, finite and nonzero in float32 (the error names
    ``name``)."""
    value = real_option(name, scale)
    if not value > 0:
        raise ValueError(f"{name} must be > 0 ({name} = 1 / temperature), got {value}")
    return real_option(name, value, positive=True, dtype=torch.float32)
