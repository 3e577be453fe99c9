"""When a SimCLR run has collapsed: the rule of the studies, and the loss of a collapsed encoder.

A collapsed encoder maps every image to one point: every logit of a row is equal, so each term's loss sits at the
log of its number of candidates (:func:`collapse_loss`). Every run starts near that state (the initial network maps
all images close together), so being near it says little; what separates a collapsed run from one that trains is
the direction and the probes:

- its mean training loss approaches the collapsed value from above (within ``LOSS_MARGIN`` of it, not below it: a
  run that trains passes below it, as arm 10 seed 0 did at epoch 1, 8.1546 against 8.202);
- and its k-NN accuracy stays below the untrained network's of the same seed (the epoch-0 checkpoint).

The earlier rule (the loss within 0.05 of the collapsed value either way, and the batch pivot rho0 below 0.005)
flagged arm 10 seed 0 at epoch 1, which then trained to k-NN 45.86. tests/test_simclr_ablation.py applies this rule to
every committed run file.

The scale probes (benchmarks/matched_scale_search.py) log each step's loss and rho0 but no k-NN, so this rule cannot
judge their steps. :func:`probe_step_near_collapse` only times how long a probe's loss stays near the collapsed value.
"""

from __future__ import annotations

import math
from typing import Any

LOSS_MARGIN = 0.05
PROBE_RHO0 = 0.005


def collapse_loss(arm: dict[str, Any], batch_size: int, top_m: int = 50) -> float | None:
    """The loss of a collapsed encoder for an arm (``{"loss", "options"}``): log(2N - 1) for InfoNCE over the 2N - 1
    candidates of a SimCLR row plus weight x log(M + 1) for each top-M term; None for arms with a blend or another
    loss (their collapsed value has no closed form here)."""
    options = arm.get("options", {})
    if arm["loss"] != "infonce" and options.get("mode") != "none":
        return None
    terms = options.get("top_m") or {}
    weight = terms.get("infonce_weight", 0.0) + terms.get("shortfall_weight", 0.0)
    return math.log(2 * batch_size - 1) + weight * math.log(terms.get("m", top_m) + 1)


def is_collapsed(loss: float, knn: float, knn_at_start: float, collapsed_loss: float) -> bool:
    """An epoch's mean training loss and k-NN accuracy are a collapsed run's: the loss at or just above the
    collapsed encoder's, and k-NN below the run's own at initialisation."""
    return 0.0 <= loss - collapsed_loss <= LOSS_MARGIN and knn < knn_at_start


def collapsed_epochs(records: list[dict[str, Any]], arm: dict[str, Any], batch_size: int) -> list[int]:
    """The epochs of a run file (its checkpoint lines) that :func:`is_collapsed` flags; none for arms without a
    closed-form collapsed loss."""
    collapsed = collapse_loss(arm, batch_size)
    checkpoints = [r for r in records if r.get("type") == "checkpoint"]
    start = next((r["knn_top1"] for r in checkpoints if r["epoch"] == 0), None)
    if collapsed is None or start is None:
        return []
    return [
        r["epoch"]
        for r in checkpoints
        if r.get("train_loss") is not None and is_collapsed(r["train_loss"], r["knn_top1"], start, collapsed)
    ]


def collapsed_at_end(records: list[dict[str, Any]], arm: dict[str, Any], batch_size: int) -> bool:
    """Whether a run file's last checkpoint epoch is one that :func:`collapsed_epochs` flags."""
    checkpoints = [r["epoch"] for r in records if r.get("type") == "checkpoint"]
    return bool(checkpoints) and max(checkpoints) in collapsed_epochs(records, arm, batch_size)


def probe_step_near_collapse(loss: float, rho0: float, collapsed_loss: float) -> bool:
    """A scale probe's step near the collapsed state: the loss within ``LOSS_MARGIN`` of the collapsed value, either
    side, and the batch pivot rho0 below ``PROBE_RHO0``. Not the collapse rule: a step has no k-NN, and the band's
    lower side also holds runs that train (arm 10 seed 0's epoch-1 mean, 8.1546, is 0.047 below 8.202)."""
    return abs(loss - collapsed_loss) < LOSS_MARGIN and rho0 < PROBE_RHO0
