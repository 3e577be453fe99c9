"""The exchanges between processes, all through torch's functional collectives, which torch keeps (the
``torch.distributed.nn`` ones warn from 2.13/2.14 on) and which ``torch.compile(fullgraph=True)`` traces:
:func:`all_gather_with_grad` (candidates, each block's gradient back to its owner), :func:`all_gather` (keys, labels,
statistics; sentence-transformers' semantics) and the neighbour exchange (:func:`ring_block_losses`: SigLIP's
candidate blocks passed around the ring of processes in both directions, for a loss that is a sum over candidate
blocks; the scheme and its tests: docs/rb-sigmoid.md, "Many processes"). A collective's result is waited on at its
first use, so with NCCL there is no host-device sync. Every process must pass blocks of the same shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch import Tensor

from st_weince.functional.false_negatives import FilterCounts, pair_scores, positive_keys

#: Whether the neighbour exchange's backward runs the ring again (:class:`_RecomputedRing`); False keeps every received
#: block and its graph for backward instead, the scheme it replaced, which benchmarks/rb_sigmoid_exchange.py measures
#: against it in the same run.
RECOMPUTE_IN_BACKWARD = True
# (loss parameters by name, anchor rows, candidate block, positive index, positive scores[, block keys, reference keys])
BlockLoss = Callable[..., tuple[Tensor, Tensor, Tensor, FilterCounts | None]]


def process_count() -> tuple[int, int]:
    """``(rank, world_size)`` in the default process group; ``(0, 1)`` without an initialized one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_gather_with_grad(tensor: Tensor) -> Tensor:
    """Every process's rows of ``tensor`` (same shape on all), concatenated in rank order; the backward is a sum
    reduce-scatter, so each process's rows get their gradient summed over the processes. ``tensor`` itself without
    an initialized process group."""
    if process_count()[1] == 1:
        return tensor
    # all_gather_single_autograd (torch 2.14) is torch 2.13's all_gather_tensor_autograd, which 2.14 deprecates
    gather = getattr(functional_collectives, "all_gather_single_autograd", None)
    if gather is None:
        gather = functional_collectives.all_gather_tensor_autograd
    return gather(tensor.contiguous(), 0, dist.group.WORLD)


def all_gather(tensor: Tensor) -> Tensor:
    """Every process's rows of ``tensor`` concatenated in rank order, the others' without gradient and this process's
    own rows as given (with their gradient), as sentence-transformers' ``all_gather``; for integer keys, labels and
    per-anchor statistics. ``tensor`` itself without an initialized process group."""
    rank, world_size = process_count()
    if world_size == 1:
        return tensor
    gathered = all_gather_with_grad(tensor.detach())
    rows = tensor.shape[0]
    return torch.cat([gathered[: rank * rows], tensor, gathered[(rank + 1) * rows :]])


def ring_shift(tensors: Sequence[Tensor], shifts: Sequence[int]) -> tuple[Tensor, ...]:
    """Each process sends ``tensors[i]`` to ``rank + shifts[i]`` and returns what ``rank - shifts[i]`` sent
    (shifts modulo the world size; every process must call it with the same shifts and shapes): one
    ``all_to_all_single`` per tensor with one non-empty split each way, differentiable (its backward sends the
    gradient back to the sender)."""
    if len(tensors) != len(shifts) or not tensors:
        raise ValueError(f"give one shift per tensor (and at least one), got {len(tensors)} and {len(shifts)}")
    rank, world_size = process_count()
    shifted = []
    for tensor, shift in zip(tensors, shifts):
        send_to, receive_from = (rank + int(shift)) % world_size, (rank - int(shift)) % world_size
        sent = [tensor.shape[0] if peer == send_to else 0 for peer in range(world_size)]
        received = [tensor.shape[0] if peer == receive_from else 0 for peer in range(world_size)]
        shifted.append(
            functional_collectives.all_to_all_single_autograd(tensor.contiguous(), received, sent, dist.group.WORLD)
        )
    return tuple(shifted)


def ring_blocks(local: Tensor) -> Iterator[tuple[int, Tensor]]:
    """``(source rank, block)`` for every process's block: first ``local``, then the others as they arrive around
    the ring in both directions (``rank - 1`` and ``rank + 1``, ``rank - 2`` and ``rank + 2``, ...). Lazy, so a
    caller that scores each block before taking the next holds one block of scores at a time; every process must
    consume the whole iterator. Differentiable through the shifts."""
    rank, world_size = process_count()
    yield rank, local
    from_left = from_right = local
    for distance in range(1, (world_size - 1) // 2 + 1):
        from_left, from_right = ring_shift((from_left, from_right), (1, -1))
        yield (rank - distance) % world_size, from_left
        yield (rank + distance) % world_size, from_right
    if world_size > 1 and world_size % 2 == 0:
        # An odd number of other processes: the block opposite on the ring comes one step further from the left.
        (from_left,) = ring_shift((from_left,), (1,))
        yield (rank - world_size // 2) % world_size, from_left


@dataclass
class _Ring:
    """What a ring pass needs besides the differentiable tensors (anchors, candidates, loss parameters)."""

    block_loss: BlockLoss
    names: tuple[str, ...]
    positive_index: Tensor
    positive_scores: Tensor
    weight: float
    anchor_chunk: int | None
    candidate_keys: Tensor | None
    reference_keys: Tensor | None
    guarded: bool = False  # set by the forward: whether the block loss returned guard counts

    def chunks(self) -> Iterator[slice]:
        """The anchors' row chunks."""
        num_anchors = self.positive_index.shape[0]
        step = num_anchors if self.anchor_chunk is None else self.anchor_chunk
        for begin in range(0, num_anchors, step):
            yield slice(begin, min(begin + step, num_anchors))

    def block_value(self, params: dict[str, Tensor], row_anchors: Tensor, block: Tensor, own: bool, keys, rows: slice):
        """The weighted loss of the anchors ``row_anchors`` (rows ``rows`` of all) against one process's block
        (``own``: this process's), with the block's extremes and guard counts."""
        num_anchors = self.positive_index.shape[0]
        index = self.positive_index[rows] if own else torch.full_like(self.positive_index[rows], -1)
        key_arguments = () if keys is None else (keys, self.reference_keys[rows])
        value, low, high, masked = self.block_loss(
            params, row_anchors, block, index, self.positive_scores[rows], *key_arguments
        )
        return value * (self.weight * (rows.stop - rows.start) / num_anchors), low, high, masked

    def forward_pass(self, anchors: Tensor, candidates: Tensor, params: dict[str, Tensor]):
        """The loss over every process's block, received around the ring in both directions (:func:`ring_blocks`);
        differentiable through the shifts when its inputs require grad."""
        key_blocks = None if self.candidate_keys is None else ring_blocks(self.candidate_keys)
        total = anchors.new_zeros(())
        min_positive = anchors.new_tensor(float("inf"))
        max_negative = anchors.new_tensor(float("-inf"))
        guard_counts: FilterCounts | None = None
        rank, _ = process_count()
        for source, block in ring_blocks(candidates):
            keys = None if key_blocks is None else next(key_blocks)[1]
            counts = []
            for rows in self.chunks():
                value, low, high, masked = self.block_value(params, anchors[rows], block, source == rank, keys, rows)
                total = total + value
                min_positive, max_negative = torch.minimum(min_positive, low), torch.maximum(max_negative, high)
                if masked is not None:
                    counts.append(masked)
            if counts:
                block_counts = FilterCounts.cat(counts)
                guard_counts = block_counts if guard_counts is None else guard_counts.plus(block_counts)
        return total, min_positive, max_negative, guard_counts


class _RecomputedRing(torch.autograd.Function):
    """The ring's loss, keeping for backward only this process's anchors, candidates and the loss parameters: the
    backward runs the ring again, one direction, each block travelling with the gradient accumulated for it so far
    until it is home (as ring attention does; docs/rb-sigmoid.md). Memory for backward is one block at a time."""

    @staticmethod
    def forward(ctx, ring: _Ring, anchors: Tensor, candidates: Tensor, *values: Tensor):
        total, low, high, counts = ring.forward_pass(anchors, candidates, dict(zip(ring.names, values)))
        ring.guarded = counts is not None
        masked, negatives = (counts.masked, counts.negatives) if counts is not None else (low.new_empty(0),) * 2
        ctx.ring = ring
        ctx.save_for_backward(anchors, candidates, *values)
        ctx.mark_non_differentiable(low, high, masked, negatives)
        return total, low, high, masked, negatives

    @staticmethod
    def backward(ctx, grad_total: Tensor, *_: Tensor):
        ring: _Ring = ctx.ring
        anchors, candidates, *values = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        grad_anchors = torch.zeros_like(anchors) if needs[0] else None
        grad_values = [torch.zeros_like(value) if need else None for value, need in zip(values, needs[2:])]
        params = {name: value.detach().requires_grad_(need) for name, value, need in zip(ring.names, values, needs[2:])}

        def block_gradient(block: Tensor, keys: Tensor | None, own: bool) -> Tensor | None:
            """Accumulate this block's part of the anchors' and parameters' gradients; return the block's."""
            block = block.detach().requires_grad_(needs[1])
            block_grad = None
            for rows in ring.chunks():
                with torch.enable_grad():
                    row_anchors = anchors[rows].detach().requires_grad_(needs[0])
                    value = ring.block_value(params, row_anchors, block, own, keys, rows)[0]
                    inputs = [row_anchors, block, *params.values()]
                    wanted = [tensor for tensor in inputs if tensor.requires_grad]
                    grads = iter(torch.autograd.grad(value, wanted, grad_total, allow_unused=True))
                got = [next(grads) if tensor.requires_grad else None for tensor in inputs]
                if got[0] is not None:
                    grad_anchors[rows] += got[0]
                block_grad = _plus(block_grad, got[1])
                for index, grad in enumerate(got[2:]):
                    if grad is not None and grad_values[index] is not None:
                        grad_values[index] += grad
            return block_grad

        world_size = process_count()[1]
        grad_candidates = block_gradient(candidates, ring.candidate_keys, own=True)
        block, keys, carried = candidates, ring.candidate_keys, None
        for _ in range(1, world_size):
            # One step along the ring: the block of rank - step arrives with its gradient so far (none at step 1).
            moving = [block] + ([] if keys is None else [keys]) + ([] if carried is None else [carried])
            moved = ring_shift(moving, [1] * len(moving))
            block = moved[0]
            keys = None if keys is None else moved[1]
            grad = block_gradient(block, keys, own=False)
            carried = grad if carried is None else moved[-1] + grad
        if carried is not None:  # one step further: home to the block's owner
            grad_candidates = _plus(grad_candidates, ring_shift((carried,), (1,))[0])
        if not needs[1]:
            grad_candidates = None
        return None, grad_anchors, grad_candidates, *grad_values


def _plus(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    if part is None:
        return total
    return part if total is None else total + part


def ring_block_losses(
    anchors: Tensor,
    candidates: Tensor,
    positive_index: Tensor,
    block_loss: BlockLoss,
    *,
    params: dict[str, Tensor] | None = None,
    weight: float = 1.0,
    anchor_chunk: int | None = None,
    backward: bool = False,
    candidate_keys: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, FilterCounts | None]:
    """``weight`` times the mean over the local ``anchors`` [A, D] of their loss against every process's block of
    ``candidates`` [C, D] (received around the ring), with the extremes over all blocks and what the guard removed
    per anchor summed over the blocks (FilterCounts; None without a guard).

    Args:
        positive_index: [A] each anchor's positive row in the local ``candidates`` (-1: none).
        block_loss: ``(params, anchor rows, candidate block, the rows' positive index in the block, the rows'
            matching-pair scores[, the block's keys, the rows' positives' keys])`` -> ``(mean loss over the rows,
            smallest matching score, largest non-matching score, FilterCounts or None)``; the scores (``+inf``
            without a positive) are the guard's threshold also in blocks that do not hold the positive.
        params: the loss parameters by name, which ``block_loss`` reads (stand-ins in backward); they get gradients.
        anchor_chunk: score this many anchors at a time against each block (None: all at once).
        backward: back-propagate at once (the cached loss's stage 2) and return the loss detached.
        candidate_keys: [C, K] the candidates' input keys (the ``"identical"`` rule), which travel with their block.

    In eager mode with gradients the loss is a :class:`_RecomputedRing`: what backward keeps does not grow with the
    number of processes. Under ``torch.compile`` (which cannot trace a backward that calls autograd) gradients flow
    through the shifts instead.
    """
    params = {} if params is None else params
    positive_scores = pair_scores(anchors, candidates, positive_index)
    num_candidates = candidates.shape[0]
    reference_keys = None if candidate_keys is None else positive_keys(candidate_keys, positive_index, num_candidates)
    ring = _Ring(
        block_loss,
        tuple(params),
        positive_index,
        positive_scores,
        weight,
        anchor_chunk,
        candidate_keys,
        reference_keys,
    )
    differentiable = torch.is_grad_enabled() and any(
        tensor.requires_grad for tensor in (anchors, candidates, *params.values())
    )
    if differentiable and RECOMPUTE_IN_BACKWARD and not torch.compiler.is_compiling():
        total, low, high, masked, negatives = _RecomputedRing.apply(ring, anchors, candidates, *params.values())
        guard_counts = FilterCounts(masked, negatives) if ring.guarded else None
    else:
        total, low, high, guard_counts = ring.forward_pass(anchors, candidates, params)
    if backward:
        total.backward()
        total = total.detach()
    return total, low, high, guard_counts
