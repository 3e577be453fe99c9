"""One WEINCE step over the rows of an MNRL layout: the one place where the loss of a batch is assembled, the blend
and the released composite's top-M terms alike (docs/weince.md). A first pass fits every row's tail (the pivot
``rho0`` needs them all before any row's loss) and the batch's negative tail; a second pass computes each chunk's
loss. :class:`~st_weince.losses.CachedWEINCELoss` takes many chunks, each chunk's layout made again and
back-propagated at once, so that one chunk of scores is alive at a time."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

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
from st_weince.functional.effective_scale import blend_effective_scale
from st_weince.functional.false_negatives import FilterCounts
from st_weince.functional.layouts import CandidateGroup, MNRLColumns, MNRLLayout, mnrl_cross_entropy
from st_weince.functional.options import TopM, WEINCEOptions, require_options
from st_weince.functional.top_m import top_m_terms, top_m_width
from st_weince.functional.weince import (
    HardestNegatives,
    TailFit,
    WEINCEStatistics,
    blended_cross_entropy,
    hardest_negatives,
    max_tail_size,
    statistics_from_fit,
    weince_logits,
    weince_tail_fit,
)

# The per-row fields of WEINCEStatistics (a row chunk's are sliced; the pivot rho0 is the batch's).
_PER_ROW = ("lam", "beta", "rho", "delta_aic", "beta_hat", "fitted")


#: A softmax the top-M terms pick from, and its rows' sort where the tail fit made it (else None).
Unit = tuple[CandidateGroup, HardestNegatives | None]


def top_m_units(layout: MNRLLayout, hardest: list[HardestNegatives | None]) -> list[Unit]:
    """The softmaxes of the layout's rows, over which the top-M terms pick a row's hardest negatives: under
    ``"joint"`` one, every group's candidates of the row side by side (the query_to_doc positive the target, as in
    the blend's softmax); under ``"per_direction"`` (or with one group) one per group, each with its group's sort
    ``hardest``."""
    groups = layout.groups
    if layout.partition_mode == "per_direction" or len(groups) == 1:
        return list(zip(groups, hardest))
    valid_mask = None
    if any(g.valid_mask is not None for g in groups):
        masks = [torch.ones_like(g.scores, dtype=torch.bool) if g.valid_mask is None else g.valid_mask for g in groups]
        valid_mask = torch.cat(masks, dim=1)
    scores = torch.cat([g.scores for g in groups], dim=1)
    directions, widths = sum((g.directions for g in groups), ()), sum((g.widths for g in groups), ())
    first = groups[0]
    return [(CandidateGroup(directions, scores, widths, first.positive_index, valid_mask, first.has_positive), None)]


def top_m_rows(
    units: list[Unit], beta_t: Tensor | None, options: WEINCEOptions, *, effective_scale: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-row [R] top-M shortfall and top-M InfoNCE terms and the shortfall term's effective scale (each the mean
    over the units of a row; the scale None without ``effective_scale``)."""
    beta = beta_t if beta_t is not None else 1.0  # only the shortfall term reads it, and it is off then
    terms = [
        top_m_terms(
            g.scores,
            g.positive_index,
            g.valid_mask,
            options.top_m,
            beta=beta,
            scale=options.top_m_infonce_scale,
            eps=options.eps,
            hardest=hardest,
            has_positive=g.has_positive,
            effective_scale=effective_scale,
        )
        for g, hardest in units
    ]
    if len(terms) == 1:
        return terms[0]
    shortfall, infonce = (torch.stack([t[i] for t in terms], 1).mean(1) for i in range(2))
    return shortfall, infonce, torch.stack([t[2] for t in terms], 1).mean(1) if effective_scale else None


def batch_tail(units: list[Unit], step_rows: int, options: WEINCEOptions, gathered: bool) -> BatchTail:
    """The smallest negative shortfalls of these rows (no gradient), as many as the global batch's tail can need:
    ``step_rows`` is the number of rows of this process's whole step (a cached loss passes one row chunk at a time),
    so that every chunk and process keeps at least the global tail's size (``gathered``: across processes)."""
    world = dist.get_world_size() if gathered and dist.is_initialized() else 1
    global_entries = step_rows * world * sum(g.scores.shape[1] for g, _ in units)
    return BatchTail.cat(
        [
            batch_negative_tail(
                g.scores,
                g.positive_index,
                g.valid_mask,
                options.top_m,
                eps=options.eps,
                global_entries=global_entries,
                hardest=hardest,
                has_positive=g.has_positive,
            )
            for g, hardest in units
        ]
    )


def batch_beta_step(
    tail: BatchTail, beta_ema: Tensor, options: TopM, gather: Callable[[Tensor], Tensor] | None = None
) -> tuple[Tensor, BatchTailFit]:
    """This step's ``beta_t`` (the moving average ``beta_ema`` updated with the batch tail's fit; the caller stores it
    on training steps) and the fit; ``gather`` joins the processes' tails (None: this process's alone)."""
    if gather is not None:
        if isinstance(tail.num_negatives, int):  # every process's rows alike: the same count
            num_negatives = tail.num_negatives * (dist.get_world_size() if dist.is_initialized() else 1)
        else:
            num_negatives = gather(tail.num_negatives[None]).sum()
        tail = BatchTail(shortfalls=gather(tail.shortfalls), num_negatives=num_negatives)
    fit = batch_tail_fit(tail, options)
    return update_beta_ema(beta_ema, fit, options), fit


@dataclasses.dataclass(frozen=True)
class CompositeLoss:
    """The composite's total and its terms (each a mean over anchors; None where its weight is 0)."""

    total: Tensor
    blend: Tensor
    top_m_shortfall: Tensor | None
    top_m_infonce: Tensor | None
    top_m_shortfall_weight: float
    top_m_infonce_weight: float

    def shares(self) -> dict[str, Tensor]:
        """Each weighted term's share of the total (detached device tensors: no host sync)."""
        total = self.total.detach()
        shares = {"blend": self.blend.detach() / total}
        if self.top_m_shortfall is not None:
            shares["top_m_shortfall"] = self.top_m_shortfall_weight * self.top_m_shortfall.detach() / total
        if self.top_m_infonce is not None:
            shares["top_m_infonce"] = self.top_m_infonce_weight * self.top_m_infonce.detach() / total
        return shares


@dataclasses.dataclass(frozen=True)
class WEINCEStep:
    """A step's loss (the mean over this process's rows; detached where its chunks were back-propagated) and what the
    step logs and keeps: the query-anchored rows' statistics and guard counts, the composite's terms (means over the
    rows; None without the top-M terms), ``beta_t`` and its batch tail fit (the shortfall term on), and the effective
    scales (means over the rows)."""

    loss: Tensor
    statistics: WEINCEStatistics
    guard_counts: FilterCounts | None
    terms: CompositeLoss | None
    beta_t: Tensor | None
    fit: BatchTailFit | None
    effective_scales: dict[str, Tensor]


def weince_step(
    batch: MNRLColumns | MNRLLayout,
    options: WEINCEOptions,
    beta_ema: Tensor | None,
    *,
    chunk_rows: int | None = None,
    gather: Callable[[Tensor], Tensor] | None = None,
    backward: bool = False,
    effective_scales: bool = True,
    progress: Callable[[Iterable], Iterable] = iter,
) -> WEINCEStep:
    """WEINCE (the blend, and the top-M terms when ``options.top_m``) of this process's rows of ``batch``: the
    columns, whose layout is made here for each chunk of ``chunk_rows`` rows (None: one chunk, whose layout is made
    once), or one layout already made (e.g. the SimCLR one; one chunk).

    ``beta_ema``: the moving average of the batch tail index (with the top-M shortfall term; the caller stores the
    returned ``beta_t`` on training steps). ``gather``: a per-anchor tensor of this process -> the global batch's,
    for the pivot and the batch tail (None: this process's batch is the batch). ``backward``: back-propagate each
    chunk's share of the loss as it is computed (a cached loss's loss stage), and return the loss detached.
    ``effective_scales``: compute the terms' effective scales (logged values, off where nobody reads them).
    ``progress`` wraps the second pass's chunks (a progress bar)."""
    require_options(options, WEINCEOptions)
    top_m = options.top_m
    num_rows = batch.num_rows
    step = num_rows if chunk_rows is None else chunk_rows
    chunks = [(begin, min(begin + step, num_rows)) for begin in range(0, num_rows, step)]
    one_chunk = len(chunks) == 1
    if isinstance(batch, MNRLLayout) and not one_chunk:
        raise ValueError("a layout is taken in one chunk: pass MNRLColumns to take the rows in chunks")

    # First pass: each group's tail fit from one sort of its rows (no gradient with several chunks), the sorts the
    # second pass's top-M terms need (their M' per row only) and, with the shortfall term, the batch's negative tail.
    chunk_fits, chunk_sorts, chunk_counts, chunk_tails = [], [], [], []
    with contextlib.nullcontext() if one_chunk else torch.no_grad():
        for begin, end in chunks:
            layout = batch if isinstance(batch, MNRLLayout) else batch.layout(begin, end)
            # the top-M terms pick from the groups' own softmaxes (one per group), so each group's sort serves them;
            # under "joint" with several groups they pick from the groups side by side (sorted there)
            shared_sort = layout.partition_mode == "per_direction" or len(layout.groups) == 1
            sort_top_m = top_m if shared_sort else None
            keep_selection = sort_top_m is not None and sort_top_m.shortfall_weight > 0  # the batch tail's too
            fits, sorts = [], []
            for group in layout.groups:
                width = max(max_tail_size(group.scores.shape[1], options), 1)  # the tail fit's largest tail, M'
                if sort_top_m is not None:
                    width = max(width, top_m_width(group.scores.shape[1], sort_top_m.m))
                rows = (group.scores, group.positive_index, group.valid_mask)
                hardest = hardest_negatives(
                    *rows,
                    width,
                    with_columns=sort_top_m is not None,
                    has_positive=group.has_positive,
                    keep_selection=keep_selection,
                )
                fits.append(weince_tail_fit(*rows, options, hardest=hardest, has_positive=group.has_positive))
                sorts.append(hardest)
            del group, rows, hardest  # this chunk's scores: not kept into the next one
            chunk_fits.append(fits)
            chunk_counts.append(layout.guard_counts)
            if beta_ema is not None:
                units = top_m_units(layout, sorts)
                chunk_tails.append(batch_tail(units, num_rows, options, gathered=gather is not None))
                del units  # its scores are this chunk's: not kept into the next one
            if sort_top_m is None:
                chunk_sorts.append([None] * len(sorts))
            elif one_chunk:  # without the selection the batch tail took its values from
                chunk_sorts.append([dataclasses.replace(hardest, selection=None) for hardest in sorts])
            else:  # at most M hardest per row, not the tail fit's width
                chunk_sorts.append([hardest.first(min(top_m.m, hardest.values.shape[1])) for hardest in sorts])
            del sorts
    if not one_chunk:  # the second pass makes each chunk's layout again
        del layout
    if one_chunk:
        fits, guard_counts = chunk_fits[0], chunk_counts[0]
    else:
        guard_counts = FilterCounts.cat(chunk_counts) if chunk_counts[0] is not None else None
        fits = [TailFit.cat([fits[group] for fits in chunk_fits]) for group in range(len(chunk_fits[0]))]
    statistics = [statistics_from_fit(fit, options, gather=gather) for fit in fits]
    beta_t = beta_fit = None
    if beta_ema is not None:
        beta_t, beta_fit = batch_beta_step(BatchTail.cat(chunk_tails), beta_ema, top_m, gather)

    # Second pass: each chunk's rows, the blend and the top-M terms, and the chunk's share of the loss.
    loss = terms = term_sums = scale_sums = None
    for (begin, end), sorts in zip(progress(chunks), chunk_sorts):
        chunk_statistics = statistics
        if not one_chunk:  # the chunk's rows of the statistics (the pivot is the batch's)
            layout = batch.layout(begin, end)
            chunk_statistics = [
                dataclasses.replace(s, **{name: getattr(s, name)[begin:end] for name in _PER_ROW}) for s in statistics
            ]
        pairs = list(zip(layout.groups, chunk_statistics))
        if len(pairs) == 1 or layout.partition_mode == "per_direction":
            # every group is its own softmax: the fused cross-entropy (mean over directions for per_direction)
            rows = [
                blended_cross_entropy(
                    g.scores, s.lam, s.beta, g.positive_index, g.valid_mask, scale=options.scale, eps=options.eps
                )
                for g, s in pairs
            ]
            rows = rows[0] if len(rows) == 1 else torch.stack(rows, dim=1).mean(dim=1)
        else:
            kwargs = {"scale": options.scale, "eps": options.eps, "check_inputs": False}
            rows = mnrl_cross_entropy(
                layout, [weince_logits(g.scores, s.lam, s.beta, g.valid_mask, **kwargs) for g, s in pairs]
            )
        scales = []
        if effective_scales:  # of the query-anchored rows (not named: a name would keep the chunk's scores alive)
            scales.append(
                blend_effective_scale(
                    layout.groups[0].scores,
                    layout.groups[0].valid_mask,
                    chunk_statistics[0].lam,
                    chunk_statistics[0].beta,
                    scale=options.scale,
                    eps=options.eps,
                )
            )
        if top_m is not None:
            shortfall, infonce, scale_top_m = top_m_rows(
                top_m_units(layout, sorts), beta_t, options, effective_scale=effective_scales
            )
            rows = torch.stack([rows, shortfall, infonce])
            scales += [scale_top_m] if effective_scales else []
        chunk_sums = rows.sum(dim=-1)  # the blend's, or [blend, top-M shortfall, top-M InfoNCE]
        chunk_loss, terms = (chunk_sums / num_rows, None) if top_m is None else _composite(chunk_sums, num_rows, top_m)
        if backward:
            chunk_loss.backward()
            chunk_loss, chunk_sums = chunk_loss.detach(), chunk_sums.detach()
        loss = chunk_loss if loss is None else loss + chunk_loss
        term_sums = chunk_sums if term_sums is None else term_sums + chunk_sums
        if scales:
            chunk_scale_sums = torch.stack(scales).sum(dim=1)
            scale_sums = chunk_scale_sums if scale_sums is None else scale_sums + chunk_scale_sums
        del layout, rows, pairs  # (no name for a chunk's scores: they would stay alive into the next chunk's forward)

    if not one_chunk and top_m is not None:  # the terms of the whole step (each chunk's are its share only)
        terms = _composite(term_sums, num_rows, top_m)[1]
    scales = {}
    if scale_sums is not None:  # the logged effective scales by term, from their means over the rows
        means = scale_sums / num_rows
        scales["blend"] = means[0]
        if top_m is not None and top_m.shortfall_weight > 0:
            scales["top_m_shortfall"] = means[1]
        if top_m is not None and top_m.infonce_weight > 0:
            scales["top_m_infonce"] = torch.full_like(means[0], options.top_m_infonce_scale)
    return WEINCEStep(loss, statistics[0], guard_counts, terms, beta_t, beta_fit, scales)


def _composite(sums: Tensor, num_rows: int, top_m: TopM) -> tuple[Tensor, CompositeLoss]:
    """Rows' term sums [blend, top-M shortfall, top-M InfoNCE] -> their share of the step's loss, each sum over the
    step's ``num_rows``: ``blend + shortfall_weight * top_m_shortfall + infonce_weight * top_m_infonce``, a term whose
    weight is 0 left out (not multiplied by 0); and the terms."""
    blend, shortfall, infonce = (sums / num_rows).unbind()
    shortfall = shortfall if top_m.shortfall_weight != 0.0 else None
    infonce = infonce if top_m.infonce_weight != 0.0 else None
    total = blend
    if shortfall is not None:
        total = total + top_m.shortfall_weight * shortfall
    if infonce is not None:
        total = total + top_m.infonce_weight * infonce
    return total, CompositeLoss(total, blend, shortfall, infonce, top_m.shortfall_weight, top_m.infonce_weight)
