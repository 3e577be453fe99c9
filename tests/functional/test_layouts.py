"""MNRL's per-row loss on a layout (:func:`st_weince.functional.layouts.mnrl_cross_entropy`), against cross-entropies
written out from the embeddings with torch alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from st_weince.functional import mnrl_layout
from st_weince.functional.layouts import mnrl_cross_entropy


def _unit(rows: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=generator, dtype=torch.float64), dim=1)


def test_per_direction_is_the_mean_of_each_directions_cross_entropy_and_joint_is_one_softmax() -> None:
    queries, docs, scale = _unit(6, 8, 0), _unit(6, 8, 1), 20.0
    directions = ("query_to_doc", "doc_to_query")
    query_to_doc = scale * queries @ docs.T  # row i: query i against every document, positive doc i
    doc_to_query = scale * docs @ queries.T  # row i: document i against every query, positive query i
    target = torch.arange(6)

    layout = mnrl_layout(queries, [docs], directions, "per_direction")
    per_direction = mnrl_cross_entropy(layout, [scale * group.scores for group in layout.groups])
    expected = (
        F.cross_entropy(query_to_doc, target, reduction="none")
        + F.cross_entropy(doc_to_query, target, reduction="none")
    ) / 2
    torch.testing.assert_close(per_direction, expected, rtol=1e-12, atol=0)

    layout = mnrl_layout(queries, [docs], directions, "joint")
    joint = mnrl_cross_entropy(layout, [scale * group.scores for group in layout.groups])
    # one softmax over both directions of row i, the query_to_doc positive as the target
    expected = torch.cat([query_to_doc, doc_to_query], dim=1).logsumexp(dim=1) - query_to_doc.diagonal()
    torch.testing.assert_close(joint, expected, rtol=1e-12, atol=0)
    assert not torch.allclose(joint, per_direction)
