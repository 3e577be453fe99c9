"""The released WEINCE composite's two top-M terms (docs/algorithms.md 1.2b) as pure functions on score matrices:
per anchor, cross-entropies over the positive and the M hardest negatives only, with shortfall logits
``-beta_t log(1 - min(x, 1 - eps))`` (no temperature) and InfoNCE logits ``scale * x``. The composite of a batch is
assembled in :func:`st_weince.functional.weince_step.weince_step`. Conventions and hot-path rules as in
:mod:`st_weince.functional.weince` (every row needs a positive here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from st_weince.functional.batch_tail import negative_mask
from st_weince.functional.checks import check_score_shapes, compute_dtype
from st_weince.functional.effective_scale import selection_shortfall_scale
from st_weince.functional.options import TopM, require_options
from st_weince.functional.weince import HardestNegatives, count_negatives


def top_m_width(num_candidates: int, top_m: int) -> int:
    """``M' = min(M, C - 2)`` (at least 0): how many hardest negatives a row of ``num_candidates`` columns can use."""
    return max(min(top_m, num_candidates - 2), 0)


def top_m_selection(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None = None,
    *,
    top_m: int,
    hardest: HardestNegatives | None = None,
    has_positive: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``[A, 1 + M']``: each row's positive score, then its hardest negative scores (descending), with the mask of the
    entries used: the positive and ``min(M, K - 1)`` negatives of a row with K negatives. ``M' = min(M, C - 2)`` comes
    from the shape; unused positions hold 0. The mask is None where every row uses all, which the shapes show (no
    ``valid_mask`` and ``has_positive``: every row has ``K - 1 = C - 2`` candidates). Gradient flows to the selected
    scores. In the scores' dtype (half: float32).

    ``hardest``: the rows' :func:`~st_weince.functional.weince.hardest_negatives`, at least M' wide, when the caller
    shares that sort with the tail fit (the scores are then gathered at its columns); one top-k here otherwise.
    """
    s = scores.to(compute_dtype(scores))
    positive_column = positive_index.clamp_min(0)[:, None]
    width = top_m_width(s.shape[1], top_m)
    if hardest is None:
        negative = negative_mask(s, positive_index, valid_mask)
        columns = s.detach().masked_fill(~negative, float("-inf")).topk(width, dim=1, sorted=True).indices
    else:
        if hardest.columns is None or hardest.columns.shape[0] != s.shape[0] or hardest.columns.shape[1] < width:
            raise ValueError(
                f"hardest has shape {tuple(hardest.values.shape)}: the top-M terms of {tuple(s.shape)} scores need "
                f"[{s.shape[0]}, >= {width}] with its columns (hardest_negatives(..., with_columns=True))"
            )
        columns = hardest.columns if hardest.columns.shape[1] == width else hardest.columns[:, :width]
    # one gather of the positive and the negatives: its backward scatters into one [A, C] gradient
    picked = s.gather(1, torch.cat([positive_column, columns], dim=1))
    if valid_mask is None and has_positive:
        return picked, None
    num_negatives = count_negatives(positive_index, valid_mask, s.shape, s.device)
    used = torch.arange(width + 1, device=s.device) <= (num_negatives - 1).clamp(0, top_m)[:, None]
    return torch.where(used, picked, 0.0), used


def shortfall_logits(scores: Tensor, beta: Tensor | float, eps: float) -> Tensor:
    """``-beta * log(1 - min(s, 1 - eps))``: the pure shortfall ("Weibit") logit, no temperature."""
    return torch.log(torch.rsub(scores.clamp(max=1.0 - eps), 1.0)) * -beta


class _TopMTerms(torch.autograd.Function):
    """Both top-M cross-entropies ``[2, A]`` (shortfall, InfoNCE) of a selection ``[A, 1 + M']`` whose first column is
    the target, fused: one log-sum-exp over both terms' logits side by side, and a backward of a few passes over the
    small selection (autograd's chain of the two logits, the masking and the log-sum-exp takes about 45 operators).

    The loss is ``logsumexp(l) - l[0]`` per row; the gradient ``(softmax(l) - e_0) dl/dx``, with ``dl/dx`` equal to
    ``beta / (1 - x)`` for the shortfall logit below the cap (0 where the clamp at ``1 - eps`` holds) and to
    ``scale`` for the InfoNCE one."""

    @staticmethod
    def forward(ctx, picked: Tensor, used: Tensor | None, beta: Tensor, scale: float, eps: float) -> Tensor:
        logits = torch.stack([shortfall_logits(picked, beta, eps), picked * scale])
        if used is not None:
            logits.masked_fill_(~used, float("-inf"))
        log_normaliser = torch.logsumexp(logits, dim=2, keepdim=True)
        ctx.save_for_backward(picked, logits, log_normaliser, beta)
        ctx.scale, ctx.eps = scale, eps
        return (log_normaliser - logits[:, :, :1]).squeeze(2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        picked, logits, log_normaliser, beta = ctx.saved_tensors
        # in autograd's order of operations, so that the gradient is the unfused chain's bit for bit
        grad_logits = torch.sub(logits, log_normaliser).exp_().mul_(grad[:, :, None])
        grad_logits[:, :, 0] -= grad
        # the shortfall logit's slope beta / (1 - x), 0 where the clamp holds (the shortfall set to +inf)
        shortfall = torch.threshold_(torch.rsub(picked, 1.0), ctx.eps, float("inf"))
        grad_picked = grad_logits[0].mul_(beta).div_(shortfall)
        return grad_picked.add_(grad_logits[1].mul_(ctx.scale)), None, None, None, None


def top_m_terms(
    scores: Tensor,
    positive_index: Tensor,
    valid_mask: Tensor | None,
    options: TopM,
    *,
    beta: Tensor | float,
    scale: float,
    eps: float,
    hardest: HardestNegatives | None = None,
    has_positive: bool | None = None,
    effective_scale: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(shortfall [A], infonce [A], shortfall effective scale [A])`` from one selection of the hardest negatives:
    per row, the cross-entropy of the shortfall logits over [positive] + the M hardest negatives
    (``L_weibit_topM`` of docs/algorithms.md 1.2b, tail index ``beta``: the batch's ``beta_t``, no gradient), the
    InfoNCE over the same set at ``scale`` (``L_infonce_topM``), each with the positive as the target, and the secant
    slope of the shortfall logit over the set (:mod:`st_weince.functional.effective_scale`; the InfoNCE term's is
    ``scale``; None without ``effective_scale``). ``hardest``, ``has_positive``: as in :func:`top_m_selection`."""
    require_options(options, TopM)
    check_score_shapes(scores, positive_index, valid_mask)
    if positive_index.dtype != torch.long:  # any integer dtype, as in torch's losses
        positive_index = positive_index.long()
    picked, used = top_m_selection(
        scores, positive_index, valid_mask, top_m=options.m, hardest=hardest, has_positive=has_positive
    )
    beta = torch.as_tensor(beta, device=picked.device).detach()
    if beta.dtype != picked.dtype:
        beta = beta.to(picked.dtype)
    shortfall, infonce = _TopMTerms.apply(picked, used, beta, float(scale), float(eps))
    shortfall_scale = selection_shortfall_scale(picked.detach(), used, beta, eps) if effective_scale else None
    return shortfall, infonce, shortfall_scale
