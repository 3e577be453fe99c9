"""Candidate layouts as (scores, positive_index, valid_mask) triples, shared by text and vision."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    views = F.normalize(torch.cat([view_a, view_b], dim=0), dim=-1)
    scores = views @ views.T
    index = torch.arange(num_pairs, device=views.device)
    positive_index = torch.cat([index + num_pairs, index])
    valid_mask = ~torch.eye(2 * num_pairs, dtype=torch.bool, device=views.device)
    return scores, positive_index, valid_mask
