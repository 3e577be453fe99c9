"""The in-batch false-negative guard: candidates that score too close to the row's positive (or share its input or
label) are not negatives, so they leave the row's candidate set through the layout's ``valid_mask``, before the tail
statistics and before the softmax or sigmoid. A row's positive never is. The rules (``("absolute", m)``,
``("relative", r)``, ``"identical"``, ``"same_label"``) and their measurements: docs/false-negatives.md. Everything
here is branch-free tensor code (no host-device sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Literal

import torch
from torch import Tensor

FilterRule = Literal["absolute", "relative", "identical", "same_label"]
KEY_RULES = ("identical", "same_label")  # the rules that compare keys of the rows, not scores

#: A prime modulus and the number of independent hashes of :func:`input_keys` (4 x 31 bits; a fifth column holds the
#: number of tokens).
_KEY_PRIME = 2**31 - 1
_KEY_MULTIPLIERS = ((1_103_515_245, 12_345), (69_069, 1_013_904_223), (1_664_525, 7_777_777), (22_695_477, 999_331))


def input_keys(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """[B, 5] int64 keys of a batch of token-id rows: two rows have equal keys iff they hold the same tokens (up to
    hash collisions of probability about 2^-124 per pair), whatever their padding side or padded length: four
    polynomial hashes modulo 2^31 - 1 of the tokens at their positions among the row's real tokens, with fixed
    pseudo-random position weights (the same in every process and on every device), and the number of tokens."""
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(
            f"input_ids must be a 2-D integer [batch, tokens] tensor, got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    ids = input_ids.long()
    mask = torch.ones_like(ids) if attention_mask is None else (attention_mask != 0).long()
    positions = (mask.cumsum(1) - 1).clamp_min(0)  # index among the row's real tokens: padding-side independent
    tokens = ((ids + 1) % _KEY_PRIME) * mask
    keys = []
    for multiplier, increment in _KEY_MULTIPLIERS:
        root = ((positions + 1) * multiplier + increment) % _KEY_PRIME
        weight = (root * root) % _KEY_PRIME
        keys.append(((tokens * weight) % _KEY_PRIME).sum(1) % _KEY_PRIME)
    keys.append(mask.sum(1))
    return torch.stack(keys, dim=1)


def positive_keys(candidate_keys: Tensor | None, positive_index: Tensor, num_candidates: int) -> Tensor:
    """[A, K] the keys of each row's positive among ``candidate_keys`` [C, K] (one row per candidate, checked), -1
    (matching no key) for rows without a positive (``positive_index`` outside ``[0, C)``)."""
    if candidate_keys is None or candidate_keys.shape[0] != num_candidates:
        raise ValueError(
            "false_negative_filter='identical' needs the candidates' input keys (st_weince.functional.input_keys of "
            f"their token ids), one row per candidate ({num_candidates}), got "
            f"{None if candidate_keys is None else tuple(candidate_keys.shape)}"
        )
    inside = (positive_index >= 0) & (positive_index < num_candidates)
    keys = candidate_keys[positive_index.clamp(0, max(num_candidates - 1, 0))]
    return keys.masked_fill(~inside[:, None], -1)


@torch.no_grad()
def pair_scores(anchors: Tensor, candidates: Tensor, positive_index: Tensor) -> Tensor:
    """[A] each row's matching-pair score ``anchors[a] . candidates[positive_index[a]]``, the guard's threshold score,
    ``+inf`` for a row without a positive (it then masks nothing)."""
    pairs = candidates.detach()[positive_index.clamp_min(0)]
    return torch.where(positive_index >= 0, (anchors.detach() * pairs).sum(-1), float("inf"))


def label_keys(labels: Tensor, num_columns: int, hard_negative_columns: bool = True) -> list[Tensor]:
    """The ``"same_label"`` rule's keys of every column, [B, 2] each: ``(label, 0)`` for the anchor and positive
    columns (their rows' label), ``(label, 1)`` for the hard-negative columns (``hard_negative_columns``), which
    therefore match no row's reference (taken from an anchor or positive column): mined negatives are never
    masked. ``labels``: a 1-D integer (or bool) tensor, compared exactly as int64 (64-bit ids never merge, as they
    would as float64 above 2^53); :func:`check_labels` checks them."""
    labels = labels.detach().reshape(-1).to(torch.int64)
    flags = [1 if hard_negative_columns and column >= 2 else 0 for column in range(num_columns)]
    return [torch.stack([labels, torch.full_like(labels, flag)], dim=1) for flag in flags]


def check_labels(labels: object, num_rows: int, owner: str) -> None:
    """The ``"same_label"`` rule's labels are a 1-D integer (or bool) tensor with one class or group id per row; the
    errors name the problem and the fix. Type, shape and dtype only (free: no device value is read). Floating-point
    labels are refused, not compared: class ids are integers, a float column is either scores (no classes) or ids
    already rounded (float32 merges ids above 2^24), and an integer tensor cannot hold NaN, so no value needs reading
    on the hot path."""
    rule = "false_negative_filter='same_label'"
    if not isinstance(labels, Tensor):
        raise TypeError(
            f"{owner}: {rule} needs the labels as a torch tensor of integer class ids (one per row), got "
            f"{type(labels).__name__}: convert them with torch.as_tensor(labels)"
        )
    if labels.dim() != 1 or labels.shape[0] != num_rows:
        raise ValueError(
            f"{owner}: {rule} needs one label per row, a 1-D tensor of {num_rows} class ids, got "
            f"{labels.numel()} labels of shape {tuple(labels.shape)} for {num_rows} rows"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(
            f"{owner}: {rule} compares class or group ids, which are integers, and the labels are {labels.dtype}: "
            "a float column is either similarity scores (which have no classes: choose another "
            "false_negative_filter) or ids that were rounded (float32 merges ids above 2^24) and may hold NaN. Give "
            "integer ids: dataset.class_encode_column('label') for names, "
            "dataset.cast_column('label', datasets.Value('int64')) for whole numbers"
        )


def feature_keys(features: dict[str, Tensor], owner: str) -> Tensor:
    """:func:`input_keys` of one column's tokenized features (sentence-transformers' ``sentence_features`` entry)."""
    if "input_ids" not in features:
        raise ValueError(
            f"{owner}: false_negative_filter='identical' compares the inputs' token ids, and this column has none "
            f"(its features are {sorted(features)}); use a score rule ('absolute', m) or ('relative', r) instead"
        )
    return input_keys(features["input_ids"], features.get("attention_mask"))


@dataclass(frozen=True)
class FalseNegativeFilter:
    """A validated guard rule. Build it with :meth:`parse` from a ``(rule, value)`` pair (or ``None`` for off)."""

    rule: FilterRule
    value: float

    @classmethod
    def parse(cls, spec: FalseNegativeFilter | tuple | list | str | None) -> FalseNegativeFilter | None:
        """``None`` (off), a ``FalseNegativeFilter``, ``("absolute", m)`` / ``("relative", r)``, ``"identical"`` or
        ``"same_label"``."""
        if spec is None or isinstance(spec, FalseNegativeFilter):
            return spec
        if spec in KEY_RULES:
            return cls(spec, 0.0)
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(
                "false_negative_filter must be None, ('absolute', margin), ('relative', ratio), 'identical' or "
                f"'same_label', got {spec!r}"
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

    @property
    def needs_keys(self) -> bool:
        """Whether the rule compares keys of the rows (inputs or labels) instead of scores."""
        return self.rule in KEY_RULES

    @property
    def uses_labels(self) -> bool:
        """Whether the rule reads the rows' labels."""
        return self.rule == "same_label"

    def to_config(self) -> list | str:
        """JSON form for ``get_config_dict`` (a list, or the rule's name, which ``parse`` accepts back)."""
        return self.rule if self.needs_keys else [self.rule, self.value]


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
        if len(parts) == 1:
            return parts[0]
        return FilterCounts(torch.cat([p.masked for p in parts]), torch.cat([p.negatives for p in parts]))


@torch.no_grad()
def false_negative_mask(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    spec: FalseNegativeFilter,
    positive_scores: Tensor | None = None,
    *,
    candidate_keys: Tensor | None = None,
    reference_keys: Tensor | None = None,
) -> Tensor:
    """[A, C] bool, True at the candidates the guard removes (never a row's positive, never an invalid entry).

    ``positive_scores`` [A] overrides the threshold's ``s_pos``, for rows whose positive is in another block of
    candidates (``+inf`` masks nothing in that row); rows without a positive and no override mask nothing. The
    ``"identical"`` rule compares ``candidate_keys`` [C, K] (:func:`input_keys` of the candidates) with
    ``reference_keys`` [A, K], by default ``candidate_keys[positive_index]`` (a reference row of -1 matches nothing).
    """
    num_anchors, num_candidates = scores.shape
    has_positive = positive_index >= 0
    if spec.needs_keys:
        if reference_keys is None:
            reference_keys = positive_keys(candidate_keys, positive_index, num_candidates)
        elif candidate_keys is None or candidate_keys.shape[0] != num_candidates:
            positive_keys(candidate_keys, positive_index, num_candidates)  # its error
        masked = (candidate_keys[None, :, :] == reference_keys[:, None, :]).all(-1)
    else:
        scores = scores.detach()
        if positive_scores is None:
            positive_scores = scores.gather(1, positive_index.clamp_min(0)[:, None]).squeeze(1)
        else:
            has_positive = torch.ones_like(has_positive)
        positive_scores = positive_scores.detach().to(scores.dtype)
        if spec.rule == "absolute":
            threshold = positive_scores - spec.value
        else:  # sign-safe: never above s_pos, (1 - r) |s_pos| below it
            threshold = positive_scores - (1.0 - spec.value) * positive_scores.abs()
        masked = (scores > threshold[:, None]) & has_positive[:, None]
    columns = torch.arange(num_candidates, device=scores.device)
    masked = masked & (columns[None, :] != positive_index[:, None])
    if valid_mask is not None:
        masked = masked & valid_mask
    return masked


def apply_false_negative_filter(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    spec: FalseNegativeFilter | None,
    positive_scores: Tensor | None = None,
    *,
    candidate_keys: Tensor | None = None,
    reference_keys: Tensor | None = None,
) -> tuple[Tensor | None, FilterCounts | None]:
    """The guard, applied: ``valid_mask`` with the guard's candidates removed, and per row how many candidates it
    masked and how many valid negatives the row had before (a positive index outside ``[0, C)`` leaves every valid
    entry a negative). Every loss applies the guard through this function; ``spec=None`` (off) gives the mask back
    unchanged and no counts. ``positive_scores``, ``candidate_keys``, ``reference_keys`` as in
    :func:`false_negative_mask`.
    """
    if spec is None:
        return valid_mask, None
    keys = {"candidate_keys": candidate_keys, "reference_keys": reference_keys}
    masked = false_negative_mask(scores, positive_index, valid_mask, spec, positive_scores, **keys)
    with torch.no_grad():
        num_candidates = masked.shape[1]
        valid = valid_mask.sum(1) if valid_mask is not None else torch.full_like(positive_index, num_candidates)
        has_positive = (positive_index >= 0) & (positive_index < num_candidates)
        counts = FilterCounts(masked.sum(1), (valid - has_positive.long()).clamp_min(0))
    return (~masked if valid_mask is None else valid_mask & ~masked), counts
