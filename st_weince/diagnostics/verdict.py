"""The diagnostics' conclusion in one line: is the tail Weibull-type, what lambda would WEINCE apply, do the hardest
negatives look like false negatives, and which loss does that point to (docs/diagnostics.md, "The verdict").

The rule, each step on one number the command has measured:

1. **Weibull-type tail**: the (95 %) profile-likelihood interval of the pooled POT shape ``xi`` lies below 0 ("yes");
   above 0: "no"; containing 0: "undecided".
2. **WEINCE's lambda**: the per-anchor gate lambda exactly as :class:`~st_weince.losses.WEINCELoss` computes it
   (:func:`st_weince.functional.weince_statistics` with the loss's default options, one batch of the choice data at a
   time, as the loss sees one training batch), averaged over anchors; it is *non-negligible* at a mean of at least
   :data:`LAMBDA_NEGLIGIBLE`. The gate does not depend on the scale; the scale sets how sharp the blend is (its
   effective scale, :func:`st_weince.functional.effective_scale.blend_effective_scale`, reported beside it).
3. **False negatives**: the rows' hardest negatives score above their positives on average.
4. **Loss**: WEINCE when 1 says "yes" and 2 "non-negligible", MNRL / InfoNCE otherwise. When 3 holds, a guard
   comes with it: ``false_negative_filter="same_label"`` when the pairs have labels, else a threshold guard or
   cleaning the data.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from st_weince.diagnostics.evt import PotFit
from st_weince.functional.effective_scale import blend_effective_scale
from st_weince.functional.options import WEINCEOptions
from st_weince.functional.weince import hardest_negatives, weince_statistics

# Below this mean gate lambda the blend is InfoNCE up to a 10 % shortfall term: too little to choose WEINCE for.
LAMBDA_NEGLIGIBLE = 0.1
WEINCE_GATE_MEANING = "WEINCE's per-anchor gate lambda as WEINCELoss computes it on each batch (default options)"


@dataclass(frozen=True)
class WeinceGate:
    """WEINCE's gate lambda on the batches of some choice data (:func:`weince_gate`)."""

    scale: float  # the training scale, 1 / temperature
    lam_mean: float  # over anchors
    lam_share_above_half: float
    effective_scale_mean: float  # the blend's secant slope over each row's scores, mean over anchors
    anchors: int
    batches: int
    options: dict  # the statistics' options (WEINCELoss's defaults)
    meaning: str = WEINCE_GATE_MEANING


@torch.no_grad()
def weince_gate(
    scores: Tensor, winner_index: Tensor, valid_mask: Tensor, *, rows_per_batch: int, scale: float
) -> WeinceGate:
    """The gate lambda of WEINCELoss (default options at ``scale``) on choice data stacked batch after batch (as
    :func:`st_weince.diagnostics.collect.choice_data` returns it, ``rows_per_batch`` rows a batch): each batch gets
    its own pivot ``rho0``, as one training batch does."""
    options = WEINCEOptions(scale=scale)
    lam, effective = [], []
    for start in range(0, scores.shape[0], rows_per_batch):
        batch = slice(start, start + rows_per_batch)
        stats = weince_statistics(scores[batch], winner_index[batch], valid_mask[batch], options)
        lam.append(stats.lam)
        effective.append(
            blend_effective_scale(scores[batch], valid_mask[batch], stats.lam, stats.beta, scale=scale, eps=options.eps)
        )
    lam_all = torch.cat(lam).double()
    return WeinceGate(
        scale=options.scale,
        lam_mean=float(lam_all.mean()),
        lam_share_above_half=float((lam_all > 0.5).double().mean()),
        effective_scale_mean=float(torch.cat(effective).double().mean()),
        anchors=int(lam_all.numel()),
        batches=len(lam),
        options=options.to_config(),
    )


def same_label_share(scores: Tensor, winner_index: Tensor, valid_mask: Tensor, labels: Sequence[Hashable]) -> float:
    """Share of rows whose hardest negative has the row's label, in the ``pairs`` layout (row ``r`` of batch ``k``
    is pair ``k B + r`` and so is candidate ``r``; ``labels`` one per pair, in order)."""
    batch_size = scores.shape[1]
    columns = hardest_negatives(scores, winner_index, valid_mask, 1).columns[:, 0]
    rows = torch.arange(scores.shape[0])
    candidates = (rows // batch_size) * batch_size + columns
    same = [labels[int(r)] == labels[int(c)] for r, c in zip(rows, candidates)]
    return sum(same) / len(same)


@dataclass(frozen=True)
class Verdict:
    """The conclusion of one diagnostics run (module docstring: the rule); :meth:`line` is the printed sentence."""

    weibull_tail: str  # "yes", "no" or "undecided"
    xi: float
    xi_ci: tuple[float, float]
    ci_level: float
    scale: float
    lam_mean: float
    lam_non_negligible: bool
    positive_mean: float
    hardest_negative_mean: float
    false_negatives_likely: bool
    label_column: str | None
    hardest_negative_same_label_share: float | None
    loss: str  # "WEINCE" or "MNRL/InfoNCE"
    guard: str | None  # what to add against false negatives, None when they do not look likely

    def line(self) -> str:
        tail = f"tail Weibull-type: {self.weibull_tail} (xi = {self.xi:.3f}, {self.ci_level * 100:g} % CI "
        tail += f"[{self.xi_ci[0]:.3f}, {self.xi_ci[1]:.3f}])"
        weight = "non-negligible" if self.lam_non_negligible else "negligible"
        lam = f"WEINCE's lambda at scale {self.scale:g}: mean {self.lam_mean:.3f} ({weight}, threshold "
        lam += f"{LAMBDA_NEGLIGIBLE:g})"
        order = ">" if self.false_negatives_likely else "<="
        negatives = (
            f"hardest negatives look like false negatives: {'yes' if self.false_negatives_likely else 'no'} "
            f"(hardest-negative mean {self.hardest_negative_mean:.3f} {order} positive mean {self.positive_mean:.3f}"
        )
        if self.hardest_negative_same_label_share is not None:
            negatives += f"; {self.hardest_negative_same_label_share:.0%} share the anchor's {self.label_column}"
        loss = f"loss: {self.loss}" + (f", with {self.guard}" if self.guard else "")
        return f"Verdict: {tail}; {lam}; {negatives}); {loss}."

    def to_dict(self) -> dict:
        out = asdict(self)
        out["xi_ci"] = list(self.xi_ci)
        out["lambda_negligible_below"] = LAMBDA_NEGLIGIBLE
        out["line"] = self.line()
        return out


def decide(
    pot: PotFit,
    gate: WeinceGate,
    positive_mean: float,
    hardest_negative_mean: float,
    *,
    label_column: str | None = None,
    hardest_negative_same_label_share: float | None = None,
) -> Verdict:
    """The verdict of the rule in the module docstring."""
    low, high = pot.xi_ci
    weibull_tail = "yes" if high < 0 else "no" if low > 0 else "undecided"
    lam_non_negligible = gate.lam_mean >= LAMBDA_NEGLIGIBLE
    false_negatives = hardest_negative_mean > positive_mean
    guard = None
    if false_negatives and label_column is not None:
        # the guard reads integer class ids from the column sentence-transformers passes as labels ("label")
        rename = "" if label_column == "label" else f'dataset.rename_column("{label_column}", "label"), then '
        guard = (
            f'false_negative_filter="same_label" (labels: {label_column}; it reads integer class ids from a column '
            f'named "label": {rename}dataset.class_encode_column("label") if they are names)'
        )
    elif false_negatives:
        guard = 'a threshold guard (false_negative_filter=("absolute", m) or ("relative", r)) or cleaned data'
    return Verdict(
        weibull_tail=weibull_tail,
        xi=pot.xi,
        xi_ci=(low, high),
        ci_level=pot.ci_level,
        scale=gate.scale,
        lam_mean=gate.lam_mean,
        lam_non_negligible=lam_non_negligible,
        positive_mean=positive_mean,
        hardest_negative_mean=hardest_negative_mean,
        false_negatives_likely=false_negatives,
        label_column=label_column,
        hardest_negative_same_label_share=hardest_negative_same_label_share,
        loss="WEINCE" if weibull_tail == "yes" and lam_non_negligible else "MNRL/InfoNCE",
        guard=guard,
    )
