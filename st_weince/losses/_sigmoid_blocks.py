"""How RBSigmoidLoss and CachedRBSigmoidLoss lay a batch out: which anchors are scored against which candidates
(the directional blocks), the candidates gathered across processes, their input keys, and MNRL's ``directions`` in
these terms."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import torch
from torch import Tensor

from st_weince.functional.exchange import all_gather, all_gather_with_grad, process_count

_ONE_DIRECTION = frozenset({"query_to_doc"})
_BOTH_DIRECTIONS = frozenset({"query_to_doc", "doc_to_query"})


def symmetric_from_directions(directions: tuple[str, ...] | None, symmetric: bool, owner: str) -> bool:
    """MultipleNegativesRankingLoss's ``directions`` in RB-Sigmoid's terms: ``("query_to_doc",)`` or
    ``("query_to_doc", "doc_to_query")`` (= ``symmetric=True``); None keeps ``symmetric``."""
    if directions is None:
        return symmetric
    if isinstance(directions, str) or not isinstance(directions, (tuple, list)):
        raise TypeError(f"directions must be a tuple of direction names, got {directions!r}")
    chosen = frozenset(directions)
    if chosen not in (_ONE_DIRECTION, _BOTH_DIRECTIONS) or len(chosen) != len(directions):
        raise ValueError(
            f"{owner} supports directions ('query_to_doc',) and ('query_to_doc', 'doc_to_query') "
            f"(= symmetric=True), got {tuple(directions)!r}: query_to_query and doc_to_doc would score "
            "anchors against anchors and documents against documents, which hold no positive pair here "
            "(for every column pair use columns='modalities')"
        )
    if symmetric is True and chosen != _BOTH_DIRECTIONS:
        raise ValueError(f"symmetric=True contradicts directions={tuple(directions)!r}")
    return chosen == _BOTH_DIRECTIONS


def all_gathers(options: Any) -> bool:
    """Whether the candidates are all-gathered into one global matrix (else they stay local, and with the
    neighbour exchange every block loss passes them around the ring of processes)."""
    return options.gather_across_devices and options.exchange == "all_gather"


def candidate_columns(
    columns: list[Tensor], row_keys: list[Tensor] | None, options: Any
) -> tuple[list[Tensor], list[Tensor] | None, Tensor]:
    """The candidate columns and their input keys (the local ones, or all-gathered: the columns with gradient), and the
    row of each local anchor's positive among them. With the neighbour exchange the keys travel with their candidate
    blocks instead."""
    batch_size = columns[0].shape[0]
    if not all_gathers(options):
        return columns, row_keys, torch.arange(batch_size, device=columns[0].device)
    offset = process_count()[0] * batch_size
    # Only the columns that some block scores against are gathered (all but the first, which only ``symmetric``
    # reads), so that no collective's result is left unused (and unwaited).
    gathered = [
        all_gather_with_grad(column) if i > 0 or options.symmetric else column for i, column in enumerate(columns)
    ]
    if row_keys is not None:
        row_keys = [all_gather(keys) if i > 0 or options.symmetric else keys for i, keys in enumerate(row_keys)]
    return gathered, row_keys, torch.arange(offset, offset + batch_size, device=columns[0].device)


def directional_blocks(num_columns: int, options: Any) -> list[tuple[int, tuple[int, ...], float]]:
    """``(anchor column, candidate columns, weight)`` of every anchors-against-candidates block whose weighted sum is
    the loss (the candidate columns are concatenated, :func:`joined`). The first block's margin is the one logged."""
    if options.columns == "negatives":
        pairs, reverse = [(0, tuple(range(1, num_columns)))], [(1, (0,))]
    else:
        index_pairs = list(combinations(range(num_columns), 2))
        pairs, reverse = [(i, (j,)) for i, j in index_pairs], [(j, (i,)) for i, j in index_pairs]
    if not options.symmetric:
        return [(column, sources, 1.0) for column, sources in pairs]
    # Each direction of a pair gets half the weight: the symmetric loss is the mean of both directions.
    return [(column, sources, 0.5) for column, sources in pairs + reverse]


def joined(tensors: list[Tensor], sources: tuple[int, ...]) -> Tensor:
    """The rows of ``tensors[i]`` for ``i`` in ``sources``, one after the other."""
    return tensors[sources[0]] if len(sources) == 1 else torch.cat([tensors[i] for i in sources], dim=0)
