"""The released WEINCE composite (docs/algorithms.md 1.2b) as pure functions on score matrices.

``L = L_blend + w_shortfall * L_shortfall_topM + w_infonce * L_infonce_topM``, where per anchor the two top-M terms
are cross-entropies over the positive and the M hardest negatives only:

- shortfall ("Weibit") term: logits ``-beta_t * log(1 - min(x, 1 - eps))``, no temperature;
- InfoNCE term: logits ``scale * x`` (``scale = 1 / tau``).

``beta_t``, the batch tail index, is a moving average carried across steps (:mod:`st_weince.functional.batch_tail`).
The composite of a batch (the blend, the batch tail index and these terms over row chunks) is assembled in one place,
:func:`st_weince.functional.weince_step.weince_step`.

Conventions as in :mod:`st_weince.functional.weince`: ``scores`` [A, C], ``positive_index`` [A] long (every row needs
a positive for the top-M terms), ``valid_mask`` [A, C] bool or None. Negatives of a row: its valid entries other than
its positive. Every default lives in :class:`~st_weince.functional.options.TopM`; ``eps`` is WEINCE's one floor of
the shortfall.

Hot path: shapes decide every Python branch, nothing here reads a device value on the host (the functions check
shapes only; the values are checked where a loss receives its inputs, and a direct caller checks them with
:func:`st_weince.functional.check_scores` and ``every_row_has_positive=True``), so a step compiles with
``torch.compile(fullgraph=True)``. Computed in the scores' dtype, float16/bfloat16 in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from st_weince.functional.batch_tail import negative_mask
from st_weince.functional.checks import check_score_shapes, compute_dtype
from st_weince.functional.effective_scale import top_m_shortfall_effective_scale
from st_weince.functional.options import TopM
from st_weince.functional.weince import HardestNegatives, count_negatives


def top_m_width(num_candidates: int, top_m: int) -> int:
    """``M' = min(M, C - 2)`` (at least 0): how many hardest negatives a row of ``num_candidates`` columns can use."""
    return max(min(top_m, num_candidates - 2), 0)


def top_m_negatives(
    scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None, *, top_m: int,
    hardest: HardestNegatives | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The positive score [A] and the M hardest negative scores [A, M'] of each row (descending) with a mask
    [A, M'] of the ones used: ``min(M, K - 1)`` per row with K negatives. ``M' = min(M, C - 2)`` comes from the
    shape; unused positions hold 0. Gradient flows to the selected scores. In the scores' dtype (half: float32).

    ``hardest``: the rows' :func:`~st_weince.functional.weince.hardest_negatives`, at least M' wide, when the caller
    shares that sort with the tail fit (the scores are then gathered at its columns); one top-k here otherwise.
    """
    s = scores.to(compute_dtype(scores))
    positive_column = positive_index.clamp_min(0)[:, None]
    width = top_m_width(s.shape[1], top_m)
    if width == 0:  # at most one negative per row: K - 1 = 0 hard negatives
        empty = s.new_zeros((s.shape[0], 0))
        return s.gather(1, positive_column).squeeze(1), empty, empty.bool()
    if hardest is None:
        positive = s.gather(1, positive_column).squeeze(1)
        negative = negative_mask(s, positive_index, valid_mask)
        values = s.masked_fill(~negative, float("-inf")).topk(width, dim=1, sorted=True).values
        num_negatives = negative.sum(1)
    else:
        if hardest.columns is None or hardest.columns.shape[0] != s.shape[0] or hardest.columns.shape[1] < width:
            raise ValueError(
                f"hardest has shape {tuple(hardest.values.shape)}: the top-M terms of {tuple(s.shape)} scores need "
                f"[{s.shape[0]}, >= {width}] with its columns (hardest_negatives(..., with_columns=True))"
            )
        # one gather of the positive and the negatives: its backward scatters into one [A, C] gradient, not two
        picked = s.gather(1, torch.cat([positive_column, hardest.columns[:, :width]], dim=1))
        positive, values = picked[:, 0], picked[:, 1:]
        num_negatives = count_negatives(positive_index, valid_mask, s.shape, s.device)
    per_row = (num_negatives - 1).clamp(0, top_m)
    used = torch.arange(width, device=s.device)[None, :] < per_row[:, None]
    return positive, torch.where(used, values, torch.zeros_like(values)), used


def _cross_entropy_first(positive_logit: Tensor, negative_logits: Tensor, used: Tensor) -> Tensor:
    """Per-row cross-entropy with the first logit (the positive) as the target; unused negatives excluded."""
    negative_logits = negative_logits.masked_fill(~used, float("-inf"))
    logits = torch.cat([positive_logit[:, None], negative_logits], dim=1)
    return torch.logsumexp(logits, dim=1) - positive_logit


def shortfall_logits(scores: Tensor, beta: Tensor | float, eps: float) -> Tensor:
    """``-beta * log(1 - min(s, 1 - eps))``: the pure shortfall ("Weibit") logit, no temperature."""
    return torch.log(torch.rsub(scores.clamp(max=1.0 - eps), 1.0)) * -beta


def _shortfall_term(selection: tuple[Tensor, Tensor, Tensor], beta: Tensor | float, eps: float) -> Tensor:
    positive, negatives, used = selection
    beta = torch.as_tensor(beta, device=positive.device).detach().to(positive.dtype)
    return _cross_entropy_first(shortfall_logits(positive, beta, eps), shortfall_logits(negatives, beta, eps), used)


def _infonce_term(selection: tuple[Tensor, Tensor, Tensor], scale: float) -> Tensor:
    positive, negatives, used = selection
    return _cross_entropy_first(positive * scale, negatives * scale, used)


def top_m_terms(
    scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None, options: TopM,
    *, beta: Tensor | float, scale: float, eps: float, hardest: HardestNegatives | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(shortfall [A], infonce [A], shortfall effective scale [A])`` from one selection of the hardest negatives:
    per row, the cross-entropy of the shortfall logits over [positive] + the M hardest negatives
    (``L_weibit_topM`` of docs/algorithms.md 1.2b, tail index ``beta``: the batch's ``beta_t``, no gradient), the
    InfoNCE over the same set at ``scale`` (``L_infonce_topM``), each with the positive as the target, and the secant
    slope of the shortfall logit over the set (:mod:`st_weince.functional.effective_scale`; the InfoNCE term's is
    ``scale``). ``hardest``: the rows' shared sort (:func:`top_m_negatives`)."""
    check_score_shapes(scores, positive_index, valid_mask)
    positive_index = positive_index.long()  # any integer dtype, as in torch's losses
    selection = top_m_negatives(scores, positive_index, valid_mask, top_m=options.m, hardest=hardest)
    shortfall_scale = top_m_shortfall_effective_scale(*selection, beta, eps)
    return _shortfall_term(selection, beta, eps), _infonce_term(selection, scale), shortfall_scale


# --------------------------------------------------------------------------------------------- the composite


@dataclass(frozen=True)
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


def composite_loss(
    blend: Tensor, top_m_shortfall: Tensor | None, top_m_infonce: Tensor | None, options: TopM
) -> CompositeLoss:
    """``blend + shortfall_weight * top_m_shortfall + infonce_weight * top_m_infonce`` (the weights of ``options``).

    A term whose weight is 0 is left out (not multiplied by 0), so with both weights 0 the total IS ``blend``.
    A term with a positive weight must be given.
    """
    total = blend
    terms = {}
    for name, term, weight_name in (
        ("top_m_shortfall", top_m_shortfall, "shortfall_weight"),
        ("top_m_infonce", top_m_infonce, "infonce_weight"),
    ):
        weight = getattr(options, weight_name)
        if weight == 0.0:
            terms[name] = None
            continue
        if term is None:
            raise ValueError(f"{weight_name} is {weight}, but no {name} term was given")
        terms[name] = term
        total = total + weight * term
    return CompositeLoss(
        total=total,
        blend=blend,
        top_m_shortfall=terms["top_m_shortfall"],
        top_m_infonce=terms["top_m_infonce"],
        top_m_shortfall_weight=options.shortfall_weight,
        top_m_infonce_weight=options.infonce_weight,
    )
