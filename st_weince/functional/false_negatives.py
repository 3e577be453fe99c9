"""The in-batch false-negative guard: candidates that score too close to the positive are not negatives.

In supervised pair data the hardest in-batch "negatives" are often other pairs of the same intent, paraphrases or
duplicates. WEINCE's shortfall logit acts on exactly those candidates (the ones nearest the cosine cap), so it would
push them away harder than InfoNCE does. The guard removes them from the candidate set through the layout's
``valid_mask``, before the tail statistics and before the softmax or sigmoid: a masked candidate is neither fitted nor
pushed away. A row's positive is never masked.

Rules, on the cosine score ``s`` of a candidate and ``s_pos`` of the row's positive:

- ``("absolute", m)``: mask when ``s > s_pos - m`` (``m >= 0``; ``m = 0`` masks candidates above the positive);
- ``("relative", r)``: mask when ``s > r * s_pos`` (``0 < r <= 1``), the "percentage of the positive" rule of
  retrieval fine-tuning (e.g. 0.95). Rows whose positive scores <= 0 mask nothing under this rule, since a share of a
  non-positive score is no meaningful threshold.

Everything here is branch-free tensor code (no host-device sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Literal

import torch
from torch import Tensor

FilterRule = Literal["absolute", "relative"]


@dataclass(frozen=True)
class FalseNegativeFilter:
    """A validated guard rule. Build it with :meth:`parse` from a ``(rule, value)`` pair (or ``None`` for off)."""

    rule: FilterRule
    value: float

    @classmethod
    def parse(cls, spec: FalseNegativeFilter | tuple | list | None) -> FalseNegativeFilter | None:
        """``None`` (off), a ``FalseNegativeFilter``, or ``("absolute", m)`` / ``("relative", r)``."""
        if spec is None or isinstance(spec, FalseNegativeFilter):
            return spec
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(
                f"false_negative_filter must be None, ('absolute', margin) or ('relative', ratio), got {spec!r}"
            )
        rule, value = spec
        if rule not in ("absolute", "relative"):
            raise ValueError(f"false_negative_filter rule must be 'absolute' or 'relative', got {rule!r}")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
            raise ValueError(f"false_negative_filter value must be a finite number, got {value!r}")
        value = float(value)
        if rule == "absolute" and value < 0:
            raise ValueError(f"false_negative_filter ('absolute', m) needs m >= 0, got {value}")
        if rule == "relative" and not 0.0 < value <= 1.0:
            raise ValueError(f"false_negative_filter ('relative', r) needs 0 < r <= 1, got {value}")
        return cls(rule, value)

    def to_config(self) -> list:
        """JSON form for ``get_config_dict`` (a list, which ``parse`` accepts back)."""
        return [self.rule, self.value]


@dataclass(frozen=True)
class FilterCounts:
    """What the guard removed, per row (long device tensors, no sync). Counts add up over candidate blocks
    (:meth:`plus`) and concatenate over row chunks (:meth:`cat`); shares do not, so a loss that computes its score
    matrix in pieces combines the counts and takes the shares once."""

    masked: Tensor  # [A] candidates the guard removed
    negatives: Tensor  # [A] valid negatives before the guard

    @property
    def masked_share(self) -> Tensor:
        """Masked candidates over valid negatives (0 when there are none), a float32 scalar."""
        return self.masked.sum().float() / self.negatives.sum().clamp_min(1).float()

    @property
    def anchors_share(self) -> Tensor:
        """Share of rows that lost at least one candidate, a float32 scalar."""
        return (self.masked > 0).float().mean()

    def plus(self, other: FilterCounts) -> FilterCounts:
        return FilterCounts(self.masked + other.masked, self.negatives + other.negatives)

    @staticmethod
    def cat(parts: list[FilterCounts]) -> FilterCounts:
        return FilterCounts(torch.cat([p.masked for p in parts]), torch.cat([p.negatives for p in parts]))


@torch.no_grad()
def false_negative_mask(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    spec: FalseNegativeFilter,
    positive_scores: Tensor | None = None,
) -> Tensor:
    """[A, C] bool, True at the candidates the guard removes (never a row's positive, never an invalid entry).

    ``positive_scores`` [A] overrides the threshold's ``s_pos`` (for a block whose rows have their positive in another
    block, e.g. MNRL's ``doc_to_doc`` direction without ``doc_to_query``, or a block of candidate columns that may
    not hold the positive); an override of ``+inf`` masks nothing in that row. Rows without a positive
    (``positive_index == -1`` and no override) mask nothing.
    """
    num_anchors, num_candidates = scores.shape
    scores = scores.detach()
    has_positive = positive_index >= 0
    if positive_scores is None:
        positive_scores = scores.gather(1, positive_index.clamp_min(0)[:, None]).squeeze(1)
    else:
        has_positive = torch.ones_like(has_positive)
    positive_scores = positive_scores.detach().to(scores.dtype)
    if spec.rule == "absolute":
        threshold = positive_scores - spec.value
        applies = has_positive
    else:
        threshold = positive_scores * spec.value
        applies = has_positive & (positive_scores > 0)
    masked = (scores > threshold[:, None]) & applies[:, None]
    columns = torch.arange(num_candidates, device=scores.device)
    masked = masked & (columns[None, :] != positive_index[:, None])
    if valid_mask is not None:
        masked = masked & valid_mask
    return masked


@torch.no_grad()
def filter_counts(masked: Tensor, positive_index: Tensor, valid_mask: Tensor | None) -> FilterCounts:
    """Per row: how many candidates the guard masked, and how many valid negatives the row had before. A positive
    index outside ``[0, C)`` (none, or in another candidate block) leaves every valid entry a negative."""
    num_candidates = masked.shape[1]
    valid = valid_mask.sum(1) if valid_mask is not None else torch.full_like(positive_index, num_candidates)
    has_positive = (positive_index >= 0) & (positive_index < num_candidates)
    return FilterCounts(masked.sum(1), (valid - has_positive.long()).clamp_min(0))


def apply_false_negative_filter(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    spec: FalseNegativeFilter | None,
    positive_scores: Tensor | None = None,
) -> tuple[Tensor | None, FilterCounts | None]:
    """The guard, applied: ``valid_mask`` with the guard's candidates removed, and what was removed per row.

    Every loss applies the guard through this function. With ``spec=None`` the mask comes back unchanged (and no
    counts): the filter is off. ``positive_scores`` as in :func:`false_negative_mask`.
    """
    if spec is None:
        return valid_mask, None
    masked = false_negative_mask(scores, positive_index, valid_mask, spec, positive_scores)
    counts = filter_counts(masked, positive_index, valid_mask)
    return (~masked if valid_mask is None else valid_mask & ~masked), counts
