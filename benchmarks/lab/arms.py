"""The arms of the SimCLR studies: run-name prefix -> the objective (the loss of
:class:`~st_weince.vision.objectives.SimCLRObjective`, its options, and the temperature where not the study's), and
one run's model, objective and optimizer from a study configuration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from st_weince.vision.objectives import SIMCLR_BETA, SIMCLR_SCALE, SimCLRObjective

from simclr_tools.models import SimCLRModel
from simclr_tools.setups import RELEASED_TOP_M_OPTIONS, SETUPS
from simclr_tools.training import build_model, build_optimizer

# The top-M shortfall term's effective scale in the ablation's arm 3 (the mean of weince_effective_scale_top_m_shortfall
# over epoch 1, seeds 0 and 1: 28.35 and 33.39), the fixed scale of the matched arm's linear top-M term.
MATCHED_TOP_M_INFONCE_SCALE = 30.87

# The ablation of the released composite. Arms 2 and 3 are WEINCE with lambda = 0 (the blend IS InfoNCE) plus one term.
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


def build_run(arm: str, seed: int, config: Mapping[str, Any]) -> tuple[SimCLRModel, SimCLRObjective, torch.optim.Adam]:
    """Model, objective and optimizer of one run from a study configuration (keys ``setup``, ``backbone``,
    ``width``, ``hidden_dim``, ``projection_dim``, ``channels_last``, ``lr``, ``weight_decay`` and those of
    :func:`build_objective`); the network starts from ``torch.manual_seed(seed)``, the same for every arm."""
    torch.manual_seed(seed)
    model = build_model(
        SETUPS[config["setup"]],
        backbone=config["backbone"],
        width=config["width"],
        hidden_dim=config["hidden_dim"],
        projection_dim=config["projection_dim"],
        channels_last=config["channels_last"],
    )
    objective = build_objective(arm, config)
    return model, objective, build_optimizer(model, objective, config["lr"], config["weight_decay"])
