"""When a SimCLR run has collapsed: the rule of the studies, and the loss of a collapsed encoder.

A collapsed encoder maps every image to one point. The rule reads two things every run's checkpoint line records, and
flags an epoch when both hold:

- **geometry**: the 99.9 % quantile of the cosine similarity between the projections of distinct images (the POT
  threshold of ``pot_projection``, 4,000 images, about 8 million pairs) lies within ``SPREAD`` (1e-3) of 1. Every
  pair at 1 is the definition of collapse; 1e-3 is about 2.6 degrees. This part decides early: a collapsed run
  reaches it in its first epoch (0.99932 and 0.99979 for the scheduled arm at epoch 1), while no run that trained
  ever came within 0.0038 of 1 in any epoch of any committed run file.
- **probes**: k-NN accuracy below the run's own at initialisation (the epoch-0 checkpoint). A projection can tighten
  while the backbone, which the probes read, still learns; this part keeps such a run unflagged.

The earlier rules read the epoch's mean training loss near the collapsed encoder's value (:func:`collapse_loss`). That
value is where every run starts (the initial network maps all images close together), and an epoch's mean mixes the
steps before and after a collapse: the scheduled arm's epoch-1 mean, 8.2537, sat 0.052 above 8.202 and escaped a 0.05
band, while a run that trained (arm 10 seed 0, epoch 1) sat 0.047 below it. tests/benchmarks/test_simclr_ablation.py
applies this rule to every committed run file.

The scale probes (benchmarks/matched_scale_search.py) log each step's loss and rho0 but no probes, so this rule cannot
judge their steps. :func:`probe_step_near_collapse` only times how long a probe's loss stays near the collapsed value.
"""

from __future__ import annotations

import math
from typing import Any

SPREAD = 1e-3
LOSS_MARGIN = 0.05  # the scale probes only
PROBE_RHO0 = 0.005


def collapse_loss(arm: dict[str, Any], batch_size: int, top_m: int = 50) -> float | None:
    """The loss of a collapsed encoder for an arm (``{"loss", "options"}``), reported beside a collapsed run and the
    scale probes' reference: log(2N - 1) for InfoNCE over the 2N - 1 candidates of a SimCLR row plus weight x
    log(M + 1) for each top-M term; None for arms with a blend or another loss (no closed form here)."""
    options = arm.get("options", {})
    if arm["loss"] != "infonce" and options.get("mode") != "none":
        return None
    terms = options.get("top_m") or {}
    weight = terms.get("infonce_weight", 0.0) + terms.get("shortfall_weight", 0.0)
    return math.log(2 * batch_size - 1) + weight * math.log(terms.get("m", top_m) + 1)


def is_collapsed(projection_similarity_q999: float, knn: float, knn_at_start: float) -> bool:
    """An epoch is a collapsed run's: the 99.9 % quantile of the cosine between distinct images' projections within
    ``SPREAD`` of 1, and k-NN below the run's own at initialisation."""
    return 1.0 - projection_similarity_q999 <= SPREAD and knn < knn_at_start


def collapsed_epochs(records: list[dict[str, Any]]) -> list[int]:
    """The epochs of a run file (its checkpoint lines) that :func:`is_collapsed` flags; none without an epoch-0
    probe."""
    checkpoints = [r for r in records if r.get("type") == "checkpoint"]
    start = next((r["knn_top1"] for r in checkpoints if r["epoch"] == 0), None)
    if start is None:
        return []
    return [
        r["epoch"]
        for r in checkpoints
        if r["epoch"] > 0
        and (r.get("pot_projection") or {}).get("threshold") is not None
        and is_collapsed(r["pot_projection"]["threshold"], r["knn_top1"], start)
    ]


def collapsed_at_end(records: list[dict[str, Any]]) -> bool:
    """Whether a run file's last checkpoint epoch is one that :func:`collapsed_epochs` flags."""
    checkpoints = [r["epoch"] for r in records if r.get("type") == "checkpoint"]
    return bool(checkpoints) and max(checkpoints) in collapsed_epochs(records)


def probe_step_near_collapse(loss: float, rho0: float, collapsed_loss: float) -> bool:
    """A scale probe's step near the collapsed state: the loss within ``LOSS_MARGIN`` of the collapsed value, either
    side, and the batch pivot rho0 below ``PROBE_RHO0``. Not the collapse rule: a step has no k-NN, and the band's
    lower side also holds runs that train (arm 10 seed 0's epoch-1 mean, 8.1546, is 0.047 below 8.202)."""
    return abs(loss - collapsed_loss) < LOSS_MARGIN and rho0 < PROBE_RHO0
