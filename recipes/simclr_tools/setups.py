"""The two SimCLR setups, ``released`` and ``batchnorm-head``: the one home of what they set differently.

A :class:`Setup` is everything the two setups set differently; what they share (batch 256 pairs, scale 2 =
temperature 0.5, WEINCE beta 1, 64-d projections, 100 epochs) is in :mod:`.objectives` and the callers' defaults.

- ``batchnorm-head``: head Linear(f, 512) - BatchNorm - ReLU - Linear(512, 64), Adam lr 1e-3 with weight decay 1e-6,
  colour jitter 0.4/0.4/0.4/0.1, normalised inputs, the standardized probe protocol.
- ``released``: the released WEINCE setup (docs/algorithms.md 1.2b) for both arms: head Linear(f, f, no bias) - ReLU -
  Linear(f, 64, no bias), Adam lr 3e-4 without weight decay, colour jitter 0.8/0.8/0.8/0.2, no normalisation, the
  released probe protocol; ``weince`` is the released composite (both top-M terms at weight 0.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from st_weince.functional.options import RELEASED_COMPOSITE

from simclr_tools.augment import RELEASED_AUGMENT, SimCLRAugmentConfig
from simclr_tools.evaluation import RELEASED_PROTOCOL, STANDARDIZED_PROTOCOL, ProbeProtocol

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


# The released composite's top-M terms as loss options in their JSON form (the study configs record them).
_RELEASED_TOP_M = RELEASED_COMPOSITE.top_m
RELEASED_TOP_M_OPTIONS = {
    "top_m": {"shortfall_weight": _RELEASED_TOP_M.shortfall_weight, "infonce_weight": _RELEASED_TOP_M.infonce_weight}
}

SETUPS: dict[str, Setup] = {
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
