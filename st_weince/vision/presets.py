"""The SimCLR setups (released, batchnorm-head) and the objectives of the ablation arms: the one home of these settings.

A :class:`Setup` is everything the two setups set differently; what they share (batch 256 pairs, scale 2 =
temperature 0.5, WEINCE beta 1, 64-d projections, 100 epochs) is in :mod:`.objectives` and the callers' defaults.

- ``batchnorm-head``: head Linear(f, 512) - BatchNorm - ReLU - Linear(512, 64), Adam lr 1e-3 with weight decay 1e-6,
  colour jitter 0.4/0.4/0.4/0.1, normalised inputs, the standardized probe protocol (named ``previous`` in
  0.1: :func:`resolve_setup` takes that name until 0.3, with a ``DeprecationWarning``).
- ``released``: the released WEINCE setup (docs/algorithms.md 1.2b) for both arms: head Linear(f, f, no bias) - ReLU -
  Linear(f, 64, no bias), Adam lr 3e-4 without weight decay, colour jitter 0.8/0.8/0.8/0.2, no normalisation, the
  released probe protocol; ``weince`` is the released composite (both top-M terms at weight 0.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from st_weince.losses.weince import RELEASED_TOP_M
from st_weince.utils.options import current_name
from st_weince.vision.augment import RELEASED_AUGMENT, SimCLRAugmentConfig
from st_weince.vision.evaluation import RELEASED_PROTOCOL, STANDARDIZED_PROTOCOL, ProbeProtocol
from st_weince.vision.objectives import SIMCLR_BETA, SIMCLR_SCALE, SimCLRObjective

STL10_MEAN, STL10_STD = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)


@dataclass(frozen=True)
class Setup:
    """The settings that differ between the SimCLR setups.

    Args:
        augment: the augmentations (their mean/std also normalise the evaluation images).
        head_batch_norm, head_output_bias: the projection head's BatchNorm and output bias.
        probe: the frozen-feature evaluation protocol.
        lr, weight_decay: Adam's (no decay on a loss's own parameters).
        hidden_dim: the head's hidden width; None: as wide as the backbone features.
        loss_options: per loss name, the loss options the setup adds (the released composite for ``weince``).
    """

    augment: SimCLRAugmentConfig
    head_batch_norm: bool
    head_output_bias: bool
    probe: ProbeProtocol
    lr: float
    weight_decay: float
    hidden_dim: int | None
    loss_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def augment_for(self, dataset: str) -> SimCLRAugmentConfig:
        """The augmentations on ``dataset``: a setup that normalises uses STL-10's own mean and std there."""
        if dataset == "stl10" and self.augment.std != (1.0, 1.0, 1.0):
            return replace(self.augment, mean=STL10_MEAN, std=STL10_STD)
        return self.augment


# The released composite's top-M terms as loss options in their JSON form (M: TopM's default 50; the study configs
# record them); its scale and beta are the vision defaults.
RELEASED_TOP_M_OPTIONS = {
    "top_m": {"shortfall_weight": RELEASED_TOP_M.shortfall_weight, "infonce_weight": RELEASED_TOP_M.infonce_weight}
}

# Names the setups had before they were named after their content: old -> new. They resolve, with a
# DeprecationWarning, until 0.3.
RENAMED_SETUPS = {"previous": "batchnorm-head"}


def setup_name(name: str, *, warn: bool = True) -> str:
    """The current name of setup ``name``: a renamed one (:data:`RENAMED_SETUPS`) gives its new name, with a
    ``DeprecationWarning`` naming it unless ``warn`` is False (reading a run file that recorded the old name);
    any other name is returned as it is (``argparse``'s ``choices`` then refuses an unknown one)."""
    return current_name(name, RENAMED_SETUPS, "the SimCLR setup", warn=warn)


def resolve_setup(name: str, *, warn: bool = True) -> Setup:
    """The setup named ``name`` (:data:`SETUPS`; an old name through :func:`setup_name`, with its warning).

    Raises:
        KeyError: ``name`` is no setup; the message lists the setups.
    """
    key = setup_name(name, warn=warn)
    if key not in SETUPS:
        raise KeyError(f"unknown SimCLR setup {name!r}; the setups are {', '.join(sorted(SETUPS))}")
    return SETUPS[key]


class _Setups(dict):
    """The setups by name; looking up an old name (``SETUPS["previous"]``) resolves it with a DeprecationWarning."""

    def __missing__(self, name: str) -> Setup:
        return resolve_setup(name)


SETUPS: dict[str, Setup] = _Setups(
    {
        "batchnorm-head": Setup(
            SimCLRAugmentConfig(),
            head_batch_norm=True,
            head_output_bias=True,
            probe=STANDARDIZED_PROTOCOL,
            lr=1e-3,
            weight_decay=1e-6,
            hidden_dim=512,
        ),
        "released": Setup(
            RELEASED_AUGMENT,
            head_batch_norm=False,
            head_output_bias=False,
            probe=RELEASED_PROTOCOL,
            lr=3e-4,
            weight_decay=0.0,
            hidden_dim=None,
            loss_options={"weince": RELEASED_TOP_M_OPTIONS},
        ),
    }
)

# The top-M shortfall term's effective scale in the ablation's arm 3 (the mean of weince_effective_scale_top_m_shortfall
# over epoch 1, seeds 0 and 1: 28.35 and 33.39), the fixed scale of the matched arm's linear top-M term.
MATCHED_TOP_M_INFONCE_SCALE = 30.87

# The ablation of the released composite: run name -> the objective (SimCLRObjective's loss, its options, and the
# temperature where not the run's). Arms 2 and 3 are WEINCE with lambda = 0 (the blend IS InfoNCE) plus one term.
ARMS: dict[str, dict[str, Any]] = {
    "infonce": {"loss": "infonce"},
    "infonce-topm-infonce": {"loss": "weince", "options": {"mode": "none", "top_m": {"infonce_weight": 0.5}}},
    "infonce-topm-shortfall": {"loss": "weince", "options": {"mode": "none", "top_m": {"shortfall_weight": 0.5}}},
    "blend": {"loss": "weince", "options": {}},
    "composite": {"loss": "weince", "options": dict(RELEASED_TOP_M_OPTIONS)},
    "infonce-tau0.2": {"loss": "infonce", "temperature": 0.2},
    # Added after the six above: the composite at the control's temperature. Against the control it asks whether the
    # composite's terms add anything once InfoNCE's temperature is lowered as well.
    "composite-tau0.2": {"loss": "weince", "options": dict(RELEASED_TOP_M_OPTIONS), "temperature": 0.2},
    # Added after the seven: InfoNCE plus both top-M terms without the blend (lambda = 0), the missing cell between
    # arms 2-3 and the composite: does the composite's negative interaction come from the blend or from the two
    # top-M terms acting on the same hardest negatives?
    "infonce-topm-both": {"loss": "weince", "options": {"mode": "none", **RELEASED_TOP_M_OPTIONS}},
    # Link or temperature (added after the eight): arm 2 with its top-M InfoNCE term at the top-M shortfall term's
    # effective scale, measured in arm 3's runs (benchmarks/simclr_ablation.py, matched_scale()).
    "infonce-topm-infonce-matched": {
        "loss": "weince",
        "options": {"mode": "none", "top_m": {"infonce_weight": 0.5, "infonce_scale": MATCHED_TOP_M_INFONCE_SCALE}},
    },
    # ... which collapsed the encoder; the sharpest fixed scale whose one-epoch probe left the collapsed state
    # (benchmarks/matched_scale_search.py: 3 left it at step 126, 4 had not by step 195).
    "infonce-topm-infonce-scale3": {
        "loss": "weince",
        "options": {"mode": "none", "top_m": {"infonce_weight": 0.5, "infonce_scale": 3.0}},
    },
}


def arm_objective(arm: str, config: Mapping[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """(loss name of SimCLRObjective, temperature, loss options) of run prefix ``arm``: its entry in
    ``config["arms"]`` when there is one, else the loss of that name at ``config["temperature"]`` (WEINCE with
    ``config["weince_options"]``)."""
    temperature = config.get("temperature", 1.0 / SIMCLR_SCALE)
    entry = config.get("arms", {}).get(arm)
    if entry is not None:
        return entry["loss"], entry.get("temperature", temperature), dict(entry.get("options", {}))
    return arm, temperature, dict(config.get("weince_options", {})) if arm == "weince" else {}


def build_objective(arm: str, config: Mapping[str, Any]) -> SimCLRObjective:
    """The objective of run prefix ``arm`` (:func:`arm_objective`); an arm's options may set WEINCE's beta too,
    else ``config["beta"]`` (default: the vision beta)."""
    name, temperature, options = arm_objective(arm, config)
    beta = options.pop("beta", config.get("beta", SIMCLR_BETA))
    return SimCLRObjective(name, scale=1.0 / temperature, beta=beta, loss_kwargs=options)
