"""The diagnostics' conclusion in one line: is the tail Weibull-type, do the winners want WEINCE's blended link,
what would WEINCE's gate do, do the hardest negatives look like false negatives, and which loss does that point to.
The rule, each step on one number the command measured: docs/diagnostics.md, "The verdict". Its link test reads the
data; WEINCE's gate does not (its pivot is the batch's ``q``-quantile, so about ``q`` of the anchors get a large
lambda on any fitted batch), so the gate is reported beside it as an effect size, not as evidence.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from st_weince.diagnostics.evt import PotFit
from st_weince.diagnostics.link import LinkFit
from st_weince.functional.effective_scale import blend_effective_scale
from st_weince.functional.options import WEINCEOptions
from st_weince.functional.weince import hardest_negatives, weince_logits, weince_statistics

# Level of the likelihood-ratio test of the blended link against the softmax (beta = 1: boundary mixture p-value).
LINK_ALPHA = 0.05
# A hardest negative's gradient "changes" when WEINCE's differs from InfoNCE's (same scale) by at least this fraction.
GRADIENT_CHANGE = 0.25
WEINCE_GATE_MEANING = "WEINCE's per-anchor gate lambda as WEINCELoss computes it on each batch (default options)"


@dataclass(frozen=True)
class WEINCEGate:
    """WEINCE's gate lambda on the batches of some choice data (:func:`weince_gate`)."""

    scale: float  # the training scale, 1 / temperature
    lam_mean: float  # over anchors
    lam_share_above_half: float
    effective_scale_mean: float  # the blend's secant slope over each row's scores, mean over anchors
    gradient_changed_share: float  # anchors whose hardest negative's gradient moves by >= GRADIENT_CHANGE
    gradient_ratio_median: float  # WEINCE's / InfoNCE's gradient on the hardest negative, median over anchors
    anchors: int
    batches: int
    options: dict  # the statistics' options (WEINCELoss's defaults)
    meaning: str = WEINCE_GATE_MEANING


@torch.no_grad()
def weince_gate(
    scores: Tensor, winner_index: Tensor, valid_mask: Tensor, *, rows_per_batch: int, scale: float
) -> WEINCEGate:
    """The gate lambda of WEINCELoss (default options at ``scale``) on choice data stacked batch after batch (as
    :func:`st_weince.diagnostics.collect.choice_data` returns it, ``rows_per_batch`` rows a batch): each batch gets
    its own pivot ``rho0``, as one training batch does."""
    options = WEINCEOptions(scale=scale)
    lam, effective, ratio = [], [], []
    for start in range(0, scores.shape[0], rows_per_batch):
        batch = slice(start, start + rows_per_batch)
        stats = weince_statistics(scores[batch], winner_index[batch], valid_mask[batch], options)
        lam.append(stats.lam)
        effective.append(
            blend_effective_scale(scores[batch], valid_mask[batch], stats.lam, stats.beta, scale=scale, eps=options.eps)
        )
        ratio.append(
            hardest_negative_gradient_ratio(
                scores[batch], winner_index[batch], valid_mask[batch], stats.lam, stats.beta, scale, options.eps
            )
        )
    lam_all, ratio_all = torch.cat(lam).double(), torch.cat(ratio)
    return WEINCEGate(
        scale=options.scale,
        lam_mean=float(lam_all.mean()),
        lam_share_above_half=float((lam_all > 0.5).double().mean()),
        effective_scale_mean=float(torch.cat(effective).double().mean()),
        gradient_changed_share=float(((ratio_all - 1.0).abs() >= GRADIENT_CHANGE).double().mean()),
        gradient_ratio_median=float(ratio_all.median()),
        anchors=int(lam_all.numel()),
        batches=len(lam),
        options=options.to_config(),
    )


@torch.enable_grad()
def hardest_negative_gradient_ratio(
    scores: Tensor, winner_index: Tensor, valid_mask: Tensor, lam: Tensor, beta: Tensor, scale: float, eps: float
) -> Tensor:
    """Per row: the gradient of the row's cross-entropy on its hardest negative's score under WEINCE's blended logit
    (gate ``lam``, ``beta`` held fixed, as the loss does) divided by the same gradient under InfoNCE's ``scale * s``
    (float64). 1 means the shortfall logit leaves that gradient as it is."""
    rows = torch.arange(scores.shape[0])
    hardest = hardest_negatives(scores, winner_index, valid_mask, 1).columns[:, 0]
    gradients = []
    for blended in (True, False):
        s = scores.detach().double().requires_grad_(True)
        if blended:
            logits = weince_logits(s, lam.double(), beta.double(), valid_mask, scale=scale, eps=eps)
        else:
            logits = (s * scale).masked_fill(~valid_mask, float("-inf"))
        loss = (torch.logsumexp(logits, dim=1) - logits[rows, winner_index]).sum()
        (gradient,) = torch.autograd.grad(loss, s)
        gradients.append(gradient[rows, hardest])
    return gradients[0] / gradients[1]


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
    link_prefers_blend: str  # "yes", "no" or "undecided" (separated data)
    link_loglik_gain_per_anchor: float  # blended link over the best softmax, natural log per anchor
    link_lr_statistic: float
    link_p_value: float
    link_lam: float  # the link's lambda with beta = 1 (tau fitted)
    link_lam_ci: tuple[float, float]
    lam_mean: float  # WEINCE's gate lambda at the scale, mean over anchors
    gradient_changed_share: float
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
        link = (
            f"winners prefer WEINCE's blended link to the softmax: {self.link_prefers_blend} (log-likelihood "
            f"{self.link_loglik_gain_per_anchor:+.4f} per anchor, LR {self.link_lr_statistic:.2f}, p = "
            f"{self.link_p_value:.2g}; lambda at beta = 1: {self.link_lam:.3f}, 95 % CI [{self.link_lam_ci[0]:.3f}, "
            f"{self.link_lam_ci[1]:.3f}])"
        )
        gate = (
            f"WEINCE at scale {self.scale:g} would change the hardest negative's gradient by >= "
            f"{GRADIENT_CHANGE:.0%} for {self.gradient_changed_share:.0%} of anchors (gate lambda mean "
            f"{self.lam_mean:.3f})"
        )
        order = ">" if self.false_negatives_likely else "<="
        negatives = (
            f"hardest negatives look like false negatives: {'yes' if self.false_negatives_likely else 'no'} "
            f"(hardest-negative mean {self.hardest_negative_mean:.3f} {order} positive mean {self.positive_mean:.3f}"
        )
        if self.hardest_negative_same_label_share is not None:
            negatives += f"; {self.hardest_negative_same_label_share:.0%} share the anchor's {self.label_column}"
        loss = f"loss: {self.loss}" + (f", with {self.guard}" if self.guard else "")
        return f"Verdict: {tail}; {link}; {gate}; {negatives}); {loss}."

    def to_dict(self) -> dict:
        out = asdict(self)
        out["xi_ci"] = list(self.xi_ci)
        out["link_lam_ci"] = list(self.link_lam_ci)
        out["link_alpha"] = LINK_ALPHA
        out["gradient_change"] = GRADIENT_CHANGE
        out["line"] = self.line()
        return out


def link_preference(link: LinkFit) -> str:
    """Whether the observed winners want the shortfall logit: "yes" when the LR test of the blended link (``beta``
    fixed) against the best softmax rejects at :data:`LINK_ALPHA`, "no" when not, "undecided" on separated data."""
    if link.separated:
        return "undecided"
    return "yes" if link.p_value < LINK_ALPHA else "no"


def decide(
    pot: PotFit,
    gate: WEINCEGate,
    link: LinkFit,
    positive_mean: float,
    hardest_negative_mean: float,
    *,
    label_column: str | None = None,
    hardest_negative_same_label_share: float | None = None,
) -> Verdict:
    """The verdict of the rule in the module docstring."""
    low, high = pot.xi_ci
    weibull_tail = "yes" if high < 0 else "no" if low > 0 else "undecided"
    if link.free != ("lambda", "tau"):
        raise ValueError(f"the verdict reads the link fitted with beta fixed (free=('lambda', 'tau')), got {link.free}")
    prefers_blend = link_preference(link)
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
        link_prefers_blend=prefers_blend,
        link_loglik_gain_per_anchor=(link.loglik - link.loglik_softmax) / link.num_anchors,
        link_lr_statistic=link.lr_statistic,
        link_p_value=link.p_value,
        link_lam=link.lam,
        link_lam_ci=link.lam_ci,
        lam_mean=gate.lam_mean,
        gradient_changed_share=gate.gradient_changed_share,
        positive_mean=positive_mean,
        hardest_negative_mean=hardest_negative_mean,
        false_negatives_likely=false_negatives,
        label_column=label_column,
        hardest_negative_same_label_share=hardest_negative_same_label_share,
        loss="WEINCE" if weibull_tail == "yes" and prefers_blend == "yes" else "MNRL/InfoNCE",
        guard=guard,
    )
