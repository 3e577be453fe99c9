"""WEINCE over the rows of an MNRL layout (:mod:`st_weince.functional.layouts`): each group's tail fit, made from one
sort of its rows that the top-M terms share; the blended cross-entropy of the rows; the softmaxes the top-M terms pick
from, their terms and the batch tail. :class:`~st_weince.losses.WEINCELoss` takes them over the batch's rows,
:class:`~st_weince.losses.CachedWEINCELoss` a row chunk at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from st_weince.functional.batch_tail import (
    BatchTail,
    BatchTailFit,
    batch_negative_tail,
    batch_tail_fit,
    update_beta_ema,
)
from st_weince.functional.composite import composite_loss, top_m_terms, top_m_width
from st_weince.functional.layouts import MNRLLayout, mnrl_cross_entropy
from st_weince.functional.options import TopM, WeinceOptions
from st_weince.functional.weince import (
    HardestNegatives,
    TailFit,
    WeinceStatistics,
    blended_cross_entropy,
    hardest_negatives,
    max_tail_size,
    weince_logits,
    weince_tail_fit,
)


class Unit(NamedTuple):
    """One softmax of the top-M terms, and its rows' shared sort where the tail fit made it (else None)."""

    scores: Tensor
    positive_index: Tensor
    valid_mask: Tensor | None
    hardest: HardestNegatives | None = None


def shares_the_sort(layout: MNRLLayout) -> bool:
    """Whether the top-M terms pick from the groups' own softmaxes (one per group), so that each group's sort for its
    tail fit also serves them; under ``"joint"`` with several groups they pick from the groups side by side."""
    return layout.partition_mode == "per_direction" or len(layout.groups) == 1


def sort_width(num_candidates: int, options: WeinceOptions, top_m: TopM | None) -> int:
    """How many hardest negatives a row's one sort keeps: the tail fit's largest tail, and the top-M terms' M'."""
    width = max(max_tail_size(num_candidates, options), 1)
    return width if top_m is None else max(width, top_m_width(num_candidates, top_m.m))


def sorted_tail_fit(
    scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None, options: WeinceOptions,
    top_m: TopM | None,
) -> tuple[TailFit, HardestNegatives]:
    """The rows' tail fit and the one sort it is made from, wide enough for the top-M terms when ``top_m``."""
    width = sort_width(scores.shape[1], options, top_m)
    hardest = hardest_negatives(scores, positive_index, valid_mask, width, with_columns=top_m is not None)
    return weince_tail_fit(scores, positive_index, valid_mask, options, hardest=hardest), hardest


def layout_tail_fits(
    layout: MNRLLayout, options: WeinceOptions, top_m: TopM | None
) -> tuple[list[TailFit], list[Unit]]:
    """Each group's tail fit, and the softmaxes the top-M terms pick from (none when ``top_m`` is None), each with the
    one sort of its rows the tail fit was made from where they pick from the same softmax (:func:`shares_the_sort`)."""
    sort_for = top_m if shares_the_sort(layout) else None
    pairs = [sorted_tail_fit(g.scores, g.positive_index, g.valid_mask, options, sort_for) for g in layout.groups]
    units = [] if top_m is None else top_m_units(layout, [hardest for _, hardest in pairs])
    return [fit for fit, _ in pairs], units


def rows_loss(layout: MNRLLayout, statistics: list[WeinceStatistics], scale: float, eps: float) -> Tensor:
    """Per-row blended cross-entropy [R] of the layout's rows, given each group's statistics of those rows."""
    pairs = list(zip(layout.groups, statistics))
    if len(pairs) == 1 or layout.partition_mode == "per_direction":
        # every group is its own softmax: the fused cross-entropy (mean over directions for per_direction)
        rows = [
            blended_cross_entropy(g.scores, s.lam, s.beta, g.positive_index, g.valid_mask, scale=scale, eps=eps)
            for g, s in pairs
        ]
        return rows[0] if len(rows) == 1 else torch.stack(rows, dim=1).mean(dim=1)
    logits = [
        weince_logits(g.scores, s.lam, s.beta, g.valid_mask, scale=scale, eps=eps, check_inputs=False)
        for g, s in pairs
    ]
    return mnrl_cross_entropy(layout, logits)


def statistics_rows(stats: WeinceStatistics, rows: slice) -> WeinceStatistics:
    """The statistics of a block of rows (the pivot is the batch's)."""
    per_row = ("lam", "beta", "rho", "delta_aic", "beta_hat", "fitted")
    return dataclasses.replace(stats, **{name: getattr(stats, name)[rows] for name in per_row})


def top_m_units(layout: MNRLLayout, hardest: list[HardestNegatives] | None = None) -> list[Unit]:
    """The softmaxes of the layout's rows, over which the top-M terms pick a row's hardest negatives: under
    ``"joint"`` one, every group's candidates of the row side by side (the query_to_doc positive the target, as in
    the blend's softmax); under ``"per_direction"`` one per group, each with its group's sort ``hardest``."""
    groups = layout.groups
    if shares_the_sort(layout):
        sorts = hardest if hardest is not None else [None] * len(groups)
        return [Unit(g.scores, g.positive_index, g.valid_mask, h) for g, h in zip(groups, sorts)]
    masks = [g.valid_mask for g in groups]
    valid_mask = None
    if any(m is not None for m in masks):
        valid_mask = torch.cat(
            [m if m is not None else torch.ones_like(g.scores, dtype=torch.bool) for m, g in zip(masks, groups)], dim=1
        )
    return [Unit(torch.cat([g.scores for g in groups], dim=1), groups[0].positive_index, valid_mask)]


def top_m_rows(
    units: list[Unit], beta_t: Tensor | None, options: TopM, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row [R] top-M shortfall and top-M InfoNCE terms and the shortfall term's effective scale (each the mean
    over the units of a row)."""
    beta = beta_t if beta_t is not None else 1.0  # only the shortfall term reads it, and it is off then
    terms = [
        top_m_terms(u.scores, u.positive_index, u.valid_mask, options, beta=beta, scale=scale, hardest=u.hardest)
        for u in units
    ]
    if len(terms) == 1:
        return terms[0]
    shortfall, infonce, shortfall_scale = (torch.stack([t[i] for t in terms], 1).mean(1) for i in range(3))
    return shortfall, infonce, shortfall_scale


def batch_tail(units: list[Unit], step_rows: int, options: TopM, gathered: bool) -> BatchTail:
    """The smallest negative shortfalls of these rows (no gradient), as many as the global batch's tail can need:
    ``step_rows`` is the number of rows of this process's whole step (a cached loss passes one row chunk at a time),
    so that every chunk and process keeps at least the global tail's size (``gathered``: across processes)."""
    world = dist.get_world_size() if gathered and dist.is_initialized() else 1
    global_entries = step_rows * world * sum(u.scores.shape[1] for u in units)
    return BatchTail.cat(
        [
            batch_negative_tail(u.scores, u.positive_index, u.valid_mask, options, global_entries=global_entries)
            for u in units
        ]
    )


def top_m_effective_scales(shortfall_scale: Tensor, scale: float, options: TopM) -> dict[str, Tensor]:
    """The effective scales of the top-M terms that are on: the shortfall term's secant slope (mean over rows) and
    the top-M InfoNCE term's ``scale`` (its logit is linear)."""
    scales = {}
    if options.shortfall_weight > 0:
        scales["top_m_shortfall"] = shortfall_scale
    if options.infonce_weight > 0:
        scales["top_m_infonce"] = torch.full_like(shortfall_scale, scale)
    return scales


def batch_beta_step(
    tail: BatchTail, beta_ema: Tensor, options: TopM, gather: Callable[[Tensor], Tensor] | None = None
) -> tuple[Tensor, BatchTailFit]:
    """This step's ``beta_t`` (the moving average ``beta_ema`` updated with the batch tail's fit; the caller stores it
    on training steps) and the fit; ``gather`` joins the processes' tails (None: this process's alone)."""
    if gather is not None:
        tail = BatchTail(shortfalls=gather(tail.shortfalls), num_negatives=gather(tail.num_negatives[None]).sum())
    fit = batch_tail_fit(tail, options)
    return update_beta_ema(beta_ema, fit, options), fit


@dataclasses.dataclass(frozen=True)
class TopMStep:
    """The blend with the top-M terms added (the blend alone without them), and what the step logs and keeps of the
    terms: each term's share, ``beta_t`` and its batch tail fit (the shortfall term on), the effective scales."""

    total: Tensor
    shares: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    beta_t: Tensor | None = None
    fit: BatchTailFit | None = None
    effective_scales: dict[str, Tensor] = dataclasses.field(default_factory=dict)


def top_m_step(
    blend: Tensor,
    units: list[Unit],
    options: TopM | None,
    beta_ema: Tensor | None,
    *,
    scale: float,
    step_rows: int,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> TopMStep:
    """The composite of one step: ``blend`` (the blend's mean over rows) plus the top-M terms over the softmaxes
    ``units`` (``step_rows`` rows), with ``beta_t`` the moving average ``beta_ema`` updated from these rows' batch tail
    (gathered over processes by ``gather``); ``blend`` itself when ``options`` is None."""
    if options is None:
        return TopMStep(total=blend)
    beta_t = fit = None
    if beta_ema is not None:
        tail = batch_tail(units, step_rows, options, gathered=gather is not None)
        beta_t, fit = batch_beta_step(tail, beta_ema, options, gather)
    infonce_scale = options.infonce_logit_scale(scale)
    shortfall, infonce, shortfall_scale = top_m_rows(units, beta_t, options, infonce_scale)
    composite = composite_loss(blend, shortfall.mean(), infonce.mean(), options)
    scales = top_m_effective_scales(shortfall_scale.mean(), infonce_scale, options)
    return TopMStep(composite.total, composite.shares(), beta_t, fit, scales)
