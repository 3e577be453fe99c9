"""The WEINCE loss over a block of rows of the MNRL layout, shared by WEINCELoss and CachedWEINCELoss (which takes
the rows a chunk at a time): the false-negative guard on the layout, the blended cross-entropy of the rows, the
softmaxes the top-M terms pick from, and the logged values."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from st_weince.functional.batch_tail import BatchTail, BatchTailFit, batch_negative_tail
from st_weince.functional.composite import top_m_terms, top_m_width
from st_weince.functional.false_negatives import FalseNegativeFilter, FilterCounts, apply_false_negative_filter
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
from st_weince.losses._common import guard_share_values


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


def guarded_layout(
    layout: MNRLLayout, spec: FalseNegativeFilter | None, keys: list[Tensor] | None = None, row_start: int = 0
) -> tuple[MNRLLayout, FilterCounts | None]:
    """The layout with the false-negative guard's candidates removed from every group's ``valid_mask``, and the
    per-row counts (masked, negatives before) of the query-anchored group; the layout itself when the guard is off.
    ``keys``: the (gathered) columns' input keys for the ``"identical"`` rule, with the layout's first row
    ``row_start``."""
    if spec is None:
        return layout, None
    query_group = layout.groups[0]
    # The row's own positive pair score: query i against document i (query_to_doc, the first block of group 0).
    pair_scores = query_group.scores.gather(1, query_group.positive_index[:, None]).squeeze(1)
    groups, counts = [], None
    for group in layout.groups:
        key_arguments = _identical_rule_keys(group, keys, row_start, layout.num_rows) if spec.needs_keys else {}
        valid_mask, group_counts = apply_false_negative_filter(
            group.scores,
            group.positive_index,
            group.valid_mask,
            spec,
            positive_scores=None if group.has_positive else pair_scores,
            **key_arguments,
        )
        counts = group_counts if counts is None else counts
        groups.append(dataclasses.replace(group, valid_mask=valid_mask))
    return MNRLLayout(groups=tuple(groups), partition_mode=layout.partition_mode, num_rows=layout.num_rows), counts


def _identical_rule_keys(group: Any, keys: list[Tensor] | None, row_start: int, num_rows: int) -> dict[str, Tensor]:
    """The candidates' input keys of one MNRL group (its directions' candidate sets side by side) and each row's
    reference keys: the positive document's for rows anchored at queries, the row's query for rows anchored at
    documents (its pair partner)."""
    if keys is None:
        raise ValueError("false_negative_filter='identical' needs the inputs' keys")
    query_keys, doc_keys = keys[0], keys[1:]
    all_doc_keys = torch.cat(doc_keys) if len(doc_keys) > 1 else doc_keys[0]
    per_direction = {
        "query_to_doc": all_doc_keys,
        "query_to_query": query_keys,
        "doc_to_query": query_keys,
        "doc_to_doc": all_doc_keys,
    }
    candidate_keys = torch.cat([per_direction[direction] for direction in group.directions])
    rows = slice(row_start, row_start + num_rows)
    anchored_at_queries = group.directions[0] in ("query_to_doc", "query_to_query")
    reference_keys = doc_keys[0][rows] if anchored_at_queries else query_keys[rows]
    return {"candidate_keys": candidate_keys, "reference_keys": reference_keys}


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


def composite_values(
    shares: dict[str, Tensor],
    beta_t: Tensor | None,
    fit: BatchTailFit | None,
    effective_scales: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """The logged values of the composite: each term's share, the batch tail index and its fit's R^2, and the top-M
    terms' effective scales (mean over rows, :mod:`st_weince.functional.effective_scale`)."""
    values = {f"weince_share_{name}": share for name, share in shares.items()}
    for name, value in (effective_scales or {}).items():
        values[f"weince_effective_scale_{name}"] = value.detach()
    if beta_t is not None and fit is not None:
        values["weince_batch_beta"] = beta_t.detach()
        values["weince_batch_beta_r2"] = fit.r_squared
    return values


def logged_values(
    stats: WeinceStatistics,
    guard_counts: FilterCounts | None,
    composite: dict[str, Tensor] | None,
    blend_scale: Tensor | None = None,
) -> dict[str, Tensor]:
    """The logged statistics of the query rows (device tensors: no step reads them on the host); ``blend_scale``:
    the blend's effective scale, mean over those rows."""
    fitted = stats.fitted.to(stats.lam.dtype)
    scale = {} if blend_scale is None else {"weince_effective_scale_blend": blend_scale.detach()}
    return {
        **scale,
        "weince_lambda_mean": stats.lam.mean(),
        "weince_lambda_gt_half": (stats.lam > 0.5).to(stats.lam.dtype).mean(),
        "weince_rho0": stats.rho0,
        "weince_delta_aic_mean": (stats.delta_aic * fitted).sum() / fitted.sum().clamp_min(1.0),
        "weince_beta_mean": stats.beta.mean(),
        **guard_share_values("weince", guard_counts),  # of the query-anchored rows, like the statistics above
        **(composite or {}),
    }
