"""Candidate layouts as (scores, positive_index, valid_mask) triples, shared by text and vision: SimCLR's
(:func:`nt_xent_layout`) and MultipleNegativesRankingLoss's (:func:`mnrl_layout`, for any block of rows, with the
false-negative guard: :func:`guard_layout`), and :func:`normalize_rows`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from st_weince.functional.checks import compute_dtype, full_precision, upcast
from st_weince.functional.false_negatives import FalseNegativeFilter, FilterCounts, apply_false_negative_filter
from st_weince.utils.hotpath import DeferredChecks

Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
PartitionMode = Literal["joint", "per_direction"]
DIRECTIONS: tuple[Direction, ...] = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
QUERY_ANCHORED: tuple[Direction, ...] = ("query_to_doc", "query_to_query")
DOC_ANCHORED: tuple[Direction, ...] = ("doc_to_query", "doc_to_doc")


def normalize_rows(
    embeddings: Tensor,
    checks: DeferredChecks | None = None,
    name: str = "embeddings",
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Rows scaled to unit L2 norm, exactly ``torch.nn.functional.normalize`` (as ``cos_sim``), in ``dtype``
    (default :func:`~st_weince.functional.checks.compute_dtype`: half precision becomes float32).

    The upcast comes first: in float16 the norm's floor ``1e-12`` is 0 and norms overflow above about 256. Its
    backward saturates at the input dtype's largest value (:func:`~st_weince.functional.checks.upcast`). A finite row
    whose norm overflows (above about 1e19 in float32) would become a zero vector silently, as in ``cos_sim``: with
    ``checks`` such rows, and NaN/Inf ones, are refused with an error naming ``name``, from the norms the normalisation
    computes anyway (a scale-safe normalisation would cost two passes a step, for what only a diverged model feeds)."""
    dtype = dtype or compute_dtype(embeddings)
    if embeddings.dtype != dtype:
        embeddings = upcast(embeddings, dtype)
    if embeddings.requires_grad and torch.is_grad_enabled():
        unit, norms = _UnitRows.apply(embeddings)
    else:
        norms = torch.linalg.vector_norm(embeddings, dim=-1, keepdim=True)
        unit = embeddings / norms.clamp_min(_MIN_NORM)
    if checks is not None:
        checks.require(
            torch.isfinite(norms),
            f"{name} has NaN or Inf embeddings, or finite ones whose L2 norm overflows {embeddings.dtype} (above "
            f"about {math.sqrt(torch.finfo(embeddings.dtype).max):.0e}, which would normalise to a zero vector); "
            "the model diverged or its input is broken",
        )
    return unit


_MIN_NORM = 1e-12  # the floor of torch.nn.functional.normalize


class _UnitRows(torch.autograd.Function):
    """``x / max(||x||, 1e-12)`` row-wise (the same forward values as ``torch.nn.functional.normalize``) and the
    norms (no gradient), with a fused backward: ``(g - y (y . g)) / max(||x||, 1e-12)``, and ``g / 1e-12`` for a row
    at the floor, the gradient of the division, the clamp and the norm that autograd would chain (about ten passes
    over the rows and their temporaries) in four passes. It equals autograd's to float rounding. Like autograd's
    division it keeps the input for backward (alive anyway), not the unit rows, which backward divides again: the
    peak memory does not grow where a loss frees the unit rows before its backward."""

    @staticmethod
    def forward(ctx, embeddings: Tensor) -> tuple[Tensor, Tensor]:
        norms = torch.linalg.vector_norm(embeddings, dim=-1, keepdim=True)
        floored = norms.clamp_min(_MIN_NORM)
        ctx.save_for_backward(embeddings, floored, norms >= _MIN_NORM)
        ctx.mark_non_differentiable(norms)
        return embeddings / floored, norms

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_norms: Tensor | None) -> Tensor:
        embeddings, floored, above_floor = ctx.saved_tensors
        unit = embeddings / floored
        along = (grad * unit).sum(-1, keepdim=True).mul_(above_floor)  # the norm's share (none below the floor)
        return torch.addcmul(grad, unit, along, value=-1.0).div_(floored)


def nt_xent_layout(view_a: Tensor, view_b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """SimCLR's NT-Xent layout for N pairs of views: 2N anchors, each view's positive is its other view, the other
    2N - 2 views are negatives, the self-pair is excluded.

    Returns cosine ``scores`` [2N, 2N], ``positive_index`` [2N] and ``valid_mask`` [2N, 2N] (False on the diagonal).
    """
    if view_a.shape != view_b.shape or view_a.dim() != 2:
        raise ValueError(
            f"both views must be [N, D] with the same shape, got {tuple(view_a.shape)} and {tuple(view_b.shape)}"
        )
    num_pairs = view_a.shape[0]
    if num_pairs < 2:
        raise ValueError(f"the NT-Xent layout needs at least 2 pairs, got {num_pairs}")
    with full_precision(view_a):  # the cosines in float32 also under autocast
        views = normalize_rows(torch.cat([view_a, view_b], dim=0))
        scores = views @ views.T
    index = torch.arange(num_pairs, device=views.device)
    positive_index = torch.cat([index + num_pairs, index])
    valid_mask = ~torch.eye(2 * num_pairs, dtype=torch.bool, device=views.device)
    return scores, positive_index, valid_mask


def check_directions(directions: tuple[str, ...], partition_mode: str) -> tuple[Direction, ...]:
    """MultipleNegativesRankingLoss's rules for ``directions`` and ``partition_mode`` (same messages)."""
    if isinstance(directions, str) or not isinstance(directions, (tuple, list)):
        raise TypeError(f"directions must be a non-empty tuple of direction names, got {directions!r}")
    if not directions:
        raise ValueError(f"directions must be a non-empty tuple of direction names, got {directions!r}")
    directions = tuple(directions)
    valid = set(DIRECTIONS)
    if not set(directions) <= valid:
        raise ValueError(f"Invalid directions: {set(directions) - valid}. Valid: {valid}")
    if len(set(directions)) != len(directions):
        raise ValueError(f"directions must not repeat a direction, got {directions}")
    if "query_to_doc" not in directions:
        raise ValueError("'query_to_doc' direction is required (contains the positive pair).")
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError(
            "partition_mode='per_direction' requires every direction to contain the positive pair; "
            "'query_to_query' and 'doc_to_doc' do not. Use partition_mode='joint'."
        )
    # canonical order, so the blocks of a group sit side by side as in MNRL
    return tuple(d for d in DIRECTIONS if d in directions)


@dataclass(frozen=True)
class CandidateGroup:
    """One anchor set's candidate rows: the score blocks of its directions side by side."""

    directions: tuple[Direction, ...]
    scores: Tensor  # [R, sum(widths)]
    widths: tuple[int, ...]
    positive_index: Tensor  # [R] long: the positive's column, or -1 for rows without one (e.g. doc_to_doc only)
    valid_mask: Tensor | None  # [R, sum(widths)] bool, or None when every entry is a candidate
    has_positive: bool  # whether positive_index is >= 0 (every row alike)


@dataclass(frozen=True)
class MNRLLayout:
    """The MNRL layout of a block of rows: the candidate groups and how their logits form the softmax."""

    groups: tuple[CandidateGroup, ...]
    partition_mode: PartitionMode
    num_rows: int
    # the false-negative guard's per-row counts of the query-anchored rows (None: no guard)
    guard_counts: FilterCounts | None = None


@dataclass(frozen=True)
class MNRLColumns:
    """A batch's unit-length columns, as MNRL lays out their rows: ``queries`` [B, D] and ``docs`` (positives, then
    hard-negative columns), gathered across processes or not, the ``directions`` and ``partition_mode``, the
    false-negative ``guard`` with the columns' ``keys`` (its ``"identical"`` and ``"same_label"`` rules), and this
    process's ``num_rows`` rows from row ``offset``. :meth:`layout` makes any block of them, so that a cached loss
    holds one block of scores at a time."""

    queries: Tensor
    docs: list[Tensor]
    directions: tuple[Direction, ...]
    partition_mode: PartitionMode
    num_rows: int
    offset: int = 0
    guard: FalseNegativeFilter | None = None
    keys: list[Tensor] | None = None

    def layout(self, begin: int, end: int) -> MNRLLayout:
        """The guarded layout of this process's rows ``begin:end`` (the directions checked when the options were
        built; :func:`mnrl_layout` for the layout's rows)."""
        row_start, row_end = self.offset + begin, self.offset + end
        queries, docs, directions = self.queries, self.docs, self.directions
        num_queries, device = queries.shape[0], queries.device
        rows = torch.arange(row_start, row_end, device=device)
        docs_all = torch.cat(docs, dim=0) if len(docs) > 1 else docs[0]
        row_queries = queries[row_start:row_end]
        row_docs = docs[0][row_start:row_end]

        blocks: dict[str, tuple[Tensor, Tensor | None]] = {"query_to_doc": (row_queries @ docs_all.T, None)}
        if "query_to_query" in directions:
            not_self = torch.arange(num_queries, device=device)[None, :] != rows[:, None]
            blocks["query_to_query"] = (row_queries @ queries.T, not_self)
        if "doc_to_query" in directions:
            blocks["doc_to_query"] = (row_docs @ queries.T, None)
        if "doc_to_doc" in directions:
            other_query = (torch.arange(docs_all.shape[0], device=device) % num_queries)[None, :] != rows[:, None]
            blocks["doc_to_doc"] = (row_docs @ docs_all.T, other_query)

        if self.partition_mode == "joint":
            grouped = [tuple(d for d in QUERY_ANCHORED if d in blocks), tuple(d for d in DOC_ANCHORED if d in blocks)]
        else:
            grouped = [(d,) for d in blocks]
        groups = []
        for group in filter(None, grouped):
            scores = torch.cat([blocks[d][0] for d in group], dim=1) if len(group) > 1 else blocks[group[0]][0]
            valid_mask = None  # all valid: no mask tensor, no masked copies
            if any(blocks[d][1] is not None for d in group):
                ones = {d: torch.ones_like(blocks[d][0], dtype=torch.bool) for d in group if blocks[d][1] is None}
                valid_mask = torch.cat([blocks[d][1] if d not in ones else ones[d] for d in group], dim=1)
            has_positive = group[0] in ("query_to_doc", "doc_to_query")
            widths = tuple(blocks[d][0].shape[1] for d in group)
            positive_index = rows if has_positive else torch.full_like(rows, -1)
            groups.append(CandidateGroup(group, scores, widths, positive_index, valid_mask, has_positive))
        layout = MNRLLayout(tuple(groups), self.partition_mode, row_end - row_start)
        return layout if self.guard is None else guard_layout(layout, self.guard, self.keys, row_start)


def mnrl_layout(
    queries: Tensor,
    docs: list[Tensor],
    directions: tuple[Direction, ...] = ("query_to_doc",),
    partition_mode: PartitionMode = "joint",
    *,
    row_start: int = 0,
    row_end: int | None = None,
) -> MNRLLayout:
    """MultipleNegativesRankingLoss's candidate layout for the rows ``row_start:row_end`` of the (gathered) batch of
    unit-length ``queries`` [B, D] and ``docs`` (positives, then hard-negative columns, each [B, D]). Row ``i``:
    query_to_doc, query ``i`` against every document (positive: doc ``i``); query_to_query, against every other query;
    doc_to_query, document ``i`` against every query (positive: query ``i``); doc_to_doc, against every document but
    those of query ``i``. ``"joint"`` gives a query-anchored and a doc-anchored group (each its own statistics),
    ``"per_direction"`` one group per direction. Invalid entries are marked in ``valid_mask``, not set to -inf, so the
    statistics see only real candidates."""
    directions = check_directions(directions, partition_mode)
    num_queries = queries.shape[0]
    row_end = num_queries if row_end is None else row_end
    if not 0 <= row_start < row_end <= num_queries:
        raise ValueError(f"rows {row_start}:{row_end} must be a non-empty range within the {num_queries} queries")
    return MNRLColumns(queries, docs, directions, partition_mode, num_queries).layout(row_start, row_end)


def guard_layout(
    layout: MNRLLayout, spec: FalseNegativeFilter | None, keys: list[Tensor] | None = None, row_start: int = 0
) -> MNRLLayout:
    """The layout with the false-negative guard's candidates removed from every group's ``valid_mask``, with the
    per-row counts (masked, negatives before) of the query-anchored group; the layout itself when the guard is off.
    ``keys``: the (gathered) columns' keys for the ``"identical"`` and ``"same_label"`` rules, the layout's first row
    ``row_start``."""
    if spec is None:
        return layout
    query_group = layout.groups[0]
    # The row's own positive pair score: query i against document i (query_to_doc, the first block of group 0).
    pair_scores = query_group.scores.gather(1, query_group.positive_index[:, None]).squeeze(1)
    if spec.needs_keys:  # the candidates' keys by direction; a row's reference: its positive document's or its query's
        if keys is None:
            raise ValueError("the false-negative guard's rules 'identical' and 'same_label' need the rows' keys")
        query_keys, doc_keys = keys[0], torch.cat(keys[1:]) if len(keys) > 2 else keys[1]
        by_direction = dict(zip(DIRECTIONS, (doc_keys, query_keys, query_keys, doc_keys)))
        rows = slice(row_start, row_start + layout.num_rows)
    groups, counts = [], None
    for group in layout.groups:
        key_arguments = {}
        if spec.needs_keys:
            key_arguments = {
                "candidate_keys": torch.cat([by_direction[direction] for direction in group.directions]),
                "reference_keys": (keys[1] if group.directions[0] in QUERY_ANCHORED else query_keys)[rows],
            }
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
    return MNRLLayout(tuple(groups), layout.partition_mode, layout.num_rows, guard_counts=counts)


def mnrl_cross_entropy(layout: MNRLLayout, group_logits: list[Tensor]) -> Tensor:
    """Per-row loss [R] from the logits of each group of ``layout`` (invalid entries at -inf), as MNRL does:
    ``"joint"``, one softmax over every direction of the row, with the query_to_doc positive as the target;
    ``"per_direction"``, the mean over directions of each direction's own cross-entropy."""
    if len(group_logits) != len(layout.groups):
        raise ValueError(f"need one logits tensor per group ({len(layout.groups)}), got {len(group_logits)}")
    # The logits are shifted by their row maximum (no gradient: the loss does not depend on the shift) before the
    # log-sum-exp and the positive's logit are subtracted: at an extreme scale both are huge and their difference
    # would lose the log K of a row of equal logits to rounding; shifted, equal logits are exactly 0.
    if layout.partition_mode == "joint":
        query_group = layout.groups[0]
        row_max = torch.stack([logits.detach().amax(dim=1) for logits in group_logits], dim=1).amax(dim=1)
        shifted = [logits - row_max[:, None] for logits in group_logits]
        positive = shifted[0].gather(1, query_group.positive_index[:, None]).squeeze(1)
        # log-sum-exp per group, then across groups: no concatenated copy of the rows
        log_z = torch.stack([logits.logsumexp(dim=1) for logits in shifted], dim=1).logsumexp(dim=1)
        return log_z - positive
    losses = []
    for group, logits in zip(layout.groups, group_logits):
        shifted = logits - logits.detach().amax(dim=1, keepdim=True)
        losses.append(shifted.logsumexp(dim=1) - shifted.gather(1, group.positive_index[:, None]).squeeze(1))
    return torch.stack(losses, dim=1).mean(dim=1)
