"""Geometry of paired embeddings (U_i, V_i) after sigmoid-loss training (Bangachev et al., NeurIPS 2025), for
benchmarks/sigmoid_synthetic.py (the paper's synthetic experiments):

- :func:`margin`: ``(min_i <U_i, V_i> - max_{i != j} <U_i, V_j>) / 2`` and its centre;
- :func:`constellation_test`: is the configuration an ``(m, b_rel)``-constellation (every matching pair at least
  ``b_rel + m``, every non-matching pair at most ``b_rel - m``), how many pairs violate it for a given ``b_rel``, and
  nearest-neighbour retrieval accuracy (perfect on any constellation with ``m > 0``);
- :func:`modality_gap_separability`: is there a hyperplane that separates the U's from the V's (the modality gap the
  paper proves necessary for zero loss when ``N >= d + 2`` and ``|b_rel| < m``)? Solved exactly as a linear program.

The margin formula itself lives in :mod:`st_weince.functional.sigmoid`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from st_weince.functional.sigmoid import constellation_margin


def _paired_scores(u: Tensor, v: Tensor, normalize: bool) -> Tensor:
    if u.dim() != 2 or u.shape != v.shape:
        raise ValueError(
            f"u and v must be paired [N, D] embeddings of the same shape, got {tuple(u.shape)} and {tuple(v.shape)}"
        )
    if u.shape[0] < 2:
        raise ValueError(f"need at least 2 pairs, got {u.shape[0]}")
    u, v = _finite_doubles(u, v, normalize)
    return u @ v.T


def _finite_doubles(u: Tensor, v: Tensor, normalize: bool) -> tuple[Tensor, Tensor]:
    """Detached float64 copies of two embedding matrices, L2-normalised if asked; NaN or Inf is refused."""
    if not (torch.isfinite(u).all() and torch.isfinite(v).all()):
        raise ValueError("u and v must be finite (NaN or Inf embeddings)")
    u, v = u.detach().double(), v.detach().double()
    if normalize:
        u, v = F.normalize(u, dim=-1), F.normalize(v, dim=-1)
    return u, v


def margin(u: Tensor, v: Tensor, *, normalize: bool = True) -> tuple[float, float]:
    """``(margin, centre)`` of paired embeddings: ``m = (min_i s_ii - max_{i != j} s_ij) / 2`` and
    ``(min_i s_ii + max_{i != j} s_ij) / 2``, with ``s = U V^T`` (cosine if ``normalize``)."""
    scores = _paired_scores(u, v, normalize)
    m, centre = constellation_margin(scores, torch.eye(scores.shape[0], dtype=scores.dtype))
    return float(m), float(centre)


@dataclass(frozen=True)
class ConstellationReport:
    margin: float  # best margin over all b_rel, (min matching - max non-matching) / 2
    centre: float  # the b_rel that attains it
    is_constellation: bool  # margin > 0: zero loss is reachable at b_rel = centre by letting t grow
    b_rel: float | None  # the b_rel tested, if one was given
    margin_at_b_rel: float | None  # min(min s_ii - b_rel, b_rel - max s_ij): the margin of an (m, b_rel)-constellation
    matching_violations: int | None  # pairs with s_ii < b_rel (on the wrong side of b_rel)
    non_matching_violations: int | None  # pairs i != j with s_ij > b_rel
    retrieval_u_to_v: float  # share of i whose nearest V (by inner product) is V_i
    retrieval_v_to_u: float


def constellation_test(
    u: Tensor, v: Tensor, *, b_rel: float | None = None, normalize: bool = True
) -> ConstellationReport:
    """Check the ``(m, b_rel)``-constellation conditions of paired embeddings; see :class:`ConstellationReport`."""
    scores = _paired_scores(u, v, normalize)
    n = scores.shape[0]
    eye = torch.eye(n, dtype=torch.bool)
    best, centre = constellation_margin(scores, eye.double())
    diagonal = scores.diagonal()
    off = scores[~eye]
    margin_at = matching = non_matching = None
    if b_rel is not None:
        margin_at = float(min(diagonal.min() - b_rel, b_rel - off.max()))
        matching = int((diagonal < b_rel).sum())
        non_matching = int((off > b_rel).sum())
    index = torch.arange(n)
    return ConstellationReport(
        margin=float(best),
        centre=float(centre),
        is_constellation=bool(best > 0),
        b_rel=b_rel,
        margin_at_b_rel=margin_at,
        matching_violations=matching,
        non_matching_violations=non_matching,
        retrieval_u_to_v=float((scores.argmax(dim=1) == index).double().mean()),
        retrieval_v_to_u=float((scores.argmax(dim=0) == index).double().mean()),
    )


@dataclass(frozen=True)
class SeparabilityReport:
    separable: bool  # a hyperplane separates all U's from all V's
    accuracy: float  # share of the 2N points on their side of the best soft-margin hyperplane found
    normal: np.ndarray  # unit normal w of that hyperplane (U side: <w, x> > offset)
    offset: float
    centroid_gap: float  # || mean(U) - mean(V) || (the usual "modality gap" size)


def modality_gap_separability(u: Tensor, v: Tensor, *, normalize: bool = True) -> SeparabilityReport:
    """Linear separability of the two modalities, solved as a linear program (scipy's HiGHS).

    Minimises the total hinge slack ``sum xi`` subject to ``<w, u_i> - c >= 1 - xi_i``,
    ``-(<w, v_j> - c) >= 1 - xi_j`` and ``xi >= 0``. The optimum is 0 exactly when the U's and the V's are strictly
    linearly separable; otherwise the solution's hyperplane still gives the share of points on the right side.
    """
    from scipy.optimize import linprog

    if u.dim() != 2 or v.dim() != 2 or u.shape[1] != v.shape[1]:
        raise ValueError(f"u and v must be [N, D] and [M, D], got {tuple(u.shape)} and {tuple(v.shape)}")
    uu, vv = _finite_doubles(u, v, normalize)
    points = torch.cat([uu, vv]).numpy()
    labels = np.concatenate([np.ones(uu.shape[0]), -np.ones(vv.shape[0])])
    count, dim = points.shape
    # variables: w (dim), c, xi (count); constraint: -y (<w, x> - c) - xi <= -1
    cost = np.concatenate([np.zeros(dim + 1), np.ones(count)])
    a_ub = np.hstack([-labels[:, None] * points, labels[:, None], -np.eye(count)])
    b_ub = -np.ones(count)
    bounds = [(None, None)] * (dim + 1) + [(0, None)] * count
    solution = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if not solution.success:
        raise RuntimeError(f"the separability linear program failed: {solution.message}")
    w, c = solution.x[:dim], solution.x[dim]
    side = labels * (points @ w - c)
    norm = float(np.linalg.norm(w))
    return SeparabilityReport(
        separable=bool(solution.fun <= 1e-7),
        accuracy=float((side > 0).mean()),
        normal=w / norm if norm > 0 else w,
        offset=float(c / norm) if norm > 0 else 0.0,
        centroid_gap=float(torch.linalg.vector_norm(uu.mean(0) - vv.mean(0))),
    )
