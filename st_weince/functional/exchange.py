"""The exchanges between processes, all through torch's functional collectives
(``torch.distributed._functional_collectives``), which torch keeps (``torch.distributed.nn.all_gather`` and the
``*_tensor`` aliases warn from torch 2.13/2.14 on) and which ``torch.compile(fullgraph=True)`` traces with a live
process group (``dist.P2POp`` does not):

- :func:`all_gather_with_grad`: every process's rows, the gradient of each block sent back to its owner (the backward
  is a sum reduce-scatter), for the candidates of both losses;
- :func:`all_gather`: every process's rows without gradient, this process's own rows as given (sentence-transformers'
  ``all_gather`` semantics), for input keys, labels and per-anchor statistics;
- the neighbour exchange: candidate blocks passed around the ring of processes instead of all-gathered (SigLIP, Zhai et
  al., ICCV 2023; open_clip's ``SigLipLoss(dist_impl="bidir")``), for a loss that is a sum over candidate blocks, as the
  sigmoid loss is. docs/rb-sigmoid.md ("Many processes") describes the scheme and what was tested.

Each process scores its anchors against its own block, then against its neighbours' blocks as they arrive around the
ring in both directions; no process holds the global candidate matrix. Gradients travel back the way the blocks came:
each shift is an ``all_to_all_single`` with one non-empty split each way, whose backward sends the received block's
gradient to its sender. A collective's result is waited on at its first use: with NCCL that orders the current CUDA
stream after the transfer, without a host-device sync; with gloo (CPU) it blocks until the transfer is done. Every
process must pass blocks of the same shape and dtype (as ``all_gather`` also needs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch import Tensor

from st_weince.functional.false_negatives import FilterCounts, positive_keys

ProcessGroup = dist.ProcessGroup | None
BlockLoss = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor, FilterCounts | None]]


def process_count(group: ProcessGroup = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _group(group: ProcessGroup) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def _gathered(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """Every process's ``tensor`` concatenated along dim 0, in rank order; differentiable (the backward is a sum
    reduce-scatter: each block's gradient summed over the processes goes to its owner). ``all_gather_single_autograd``
    (torch 2.14) is ``all_gather_tensor_autograd`` of torch 2.13, which 2.14 deprecates."""
    gather = getattr(functional_collectives, "all_gather_single_autograd", None)
    if gather is None:  # torch 2.13
        gather = functional_collectives.all_gather_tensor_autograd
    return gather(tensor.contiguous(), 0, _group(group))


def all_gather_with_grad(tensor: Tensor, group: ProcessGroup = None) -> Tensor:
    """Every process's rows of ``tensor`` (same shape on all), concatenated in rank order; the gradient of each
    process's rows goes back to that process. ``tensor`` itself without an initialized process group."""
    if process_count(group)[1] == 1:
        return tensor
    return _gathered(tensor, group)


def all_gather(tensor: Tensor, group: ProcessGroup = None) -> Tensor:
    """Every process's rows of ``tensor`` concatenated in rank order, the others' without gradient and this process's
    own rows as given (with their gradient), as sentence-transformers' ``all_gather``; for integer keys, labels and
    per-anchor statistics. ``tensor`` itself without an initialized process group."""
    rank, world_size = process_count(group)
    if world_size == 1:
        return tensor
    gathered = _gathered(tensor.detach(), group)
    rows = tensor.shape[0]
    return torch.cat([gathered[: rank * rows], tensor, gathered[(rank + 1) * rows :]])


def _shift_one(tensor: Tensor, shift: int, group: ProcessGroup) -> Tensor:
    """Send ``tensor`` to ``rank + shift``, receive the tensor of ``rank - shift``: an ``all_to_all_single`` with one
    non-empty split each way, differentiable (its backward sends the gradient back to the sender)."""
    rank, world_size = process_count(group)
    send_to, receive_from = (rank + shift) % world_size, (rank - shift) % world_size
    rows = tensor.shape[0]
    sent = [rows if peer == send_to else 0 for peer in range(world_size)]
    received = [rows if peer == receive_from else 0 for peer in range(world_size)]
    return functional_collectives.all_to_all_single_autograd(tensor.contiguous(), received, sent, _group(group))


def ring_shift(tensors: Sequence[Tensor], shifts: Sequence[int], group: ProcessGroup = None) -> tuple[Tensor, ...]:
    """Each process sends ``tensors[i]`` to ``rank + shifts[i]`` and returns what ``rank - shifts[i]`` sent
    (shifts modulo the world size; every process must call it with the same shifts and shapes). Differentiable."""
    if len(tensors) != len(shifts) or not tensors:
        raise ValueError(f"give one shift per tensor (and at least one), got {len(tensors)} and {len(shifts)}")
    return tuple(_shift_one(tensor, int(shift), group) for tensor, shift in zip(tensors, shifts))


def ring_blocks(local: Tensor, group: ProcessGroup = None) -> Iterator[tuple[int, Tensor]]:
    """``(source rank, block)`` for every process's block: first ``local``, then the others as they arrive around
    the ring in both directions (``rank - 1`` and ``rank + 1``, ``rank - 2`` and ``rank + 2``, ...), each passed on
    one step further by the process that received it. Lazy: a block is received when the previous one has been
    used, so a caller that scores each block before taking the next holds one block of scores at a time. Every
    process must consume the whole iterator. Differentiable through the shifts."""
    rank, world_size = process_count(group)
    yield rank, local
    from_left = from_right = local
    for distance in range(1, (world_size - 1) // 2 + 1):
        from_left, from_right = ring_shift((from_left, from_right), (1, -1), group)
        yield (rank - distance) % world_size, from_left
        yield (rank + distance) % world_size, from_right
    if world_size > 1 and world_size % 2 == 0:
        # An odd number of other processes: the block opposite on the ring comes one step further from the left.
        (from_left,) = ring_shift((from_left,), (1,), group)
        yield (rank - world_size // 2) % world_size, from_left


def ring_block_losses(
    anchors: Tensor,
    candidates: Tensor,
    positive_index: Tensor,
    block_loss: BlockLoss,
    *,
    weight: float = 1.0,
    anchor_chunk: int | None = None,
    backward: bool = False,
    group: ProcessGroup = None,
    candidate_keys: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, FilterCounts | None]:
    """A loss that is a sum over candidate blocks, with the candidates of every process, by neighbour exchange.

    Args:
        anchors: [A, D] the local anchors.
        candidates: [C, D] the local candidates (one process's block; hard-negative rows travel with it).
        positive_index: [A] each anchor's positive row in the local ``candidates`` (-1: none); no anchor has a
            positive in another process's block.
        block_loss: ``(anchor rows, candidate block, positive index of the rows in the block, positive scores)`` ->
            ``(mean loss over the rows, smallest matching score, largest non-matching score, what the false-negative
            guard removed per row as FilterCounts, or None without a guard)``. ``positive scores`` [rows] are the rows'
            matching-pair cosine scores (``+inf`` without a positive), the guard's threshold also in blocks that do
            not hold the positive.
        weight: factor on the loss (applied before a chunk's backward).
        anchor_chunk: score this many anchors at a time against each block (None: all at once).
        backward: back-propagate each chunk's loss at once (the cached loss's stage 2) and return the loss detached;
            each received block's accumulated gradient is then sent back to its owner through the exchange, so
            ``anchors`` and ``candidates`` (leaves, or any tensors requiring grad) receive their full gradients.
        candidate_keys: [C, K] the local candidates' input keys (the false-negative guard's ``"identical"`` rule):
            they travel around the ring with their block, and ``block_loss`` is then called with two more
            arguments, the block's keys and the rows' positives' keys (-1 rows: no positive).

    Returns:
        ``weight`` times the mean over the anchors of their loss against every process's candidates, the extremes
        over all blocks and what the guard removed per anchor summed over all blocks (FilterCounts; None without a
        guard).
    """
    num_anchors = anchors.shape[0]
    step = num_anchors if anchor_chunk is None else anchor_chunk
    with torch.no_grad():
        pairs = candidates.detach()[positive_index.clamp_min(0)]
        pair_scores = (anchors.detach() * pairs).sum(-1)
        positive_scores = torch.where(positive_index >= 0, pair_scores, float("inf"))
    key_blocks = reference_keys = None
    if candidate_keys is not None:
        reference_keys = positive_keys(candidate_keys, positive_index, candidates.shape[0])
        # integers, without gradient: shifted beside the candidate blocks, in the same order on every process
        key_blocks = ring_blocks(candidate_keys, group)
    elsewhere = torch.full_like(positive_index, -1)
    total = anchors.new_zeros(())
    min_positive = anchors.new_tensor(float("inf"))
    max_negative = anchors.new_tensor(float("-inf"))
    guard_counts: FilterCounts | None = None
    received, leaves = [], []
    rank, _ = process_count(group)
    for source, block in ring_blocks(candidates, group):
        keys = () if key_blocks is None else (next(key_blocks)[1],)
        index = positive_index if source == rank else elsewhere
        if backward and block is not candidates and block.requires_grad:
            # The chunks' backward stops at this leaf; its gradient goes back through the exchange at the end.
            received.append(block)
            block = block.detach().requires_grad_()
            leaves.append(block)
        counts = []
        for begin in range(0, num_anchors, step):
            rows = slice(begin, min(begin + step, num_anchors))
            key_arguments = () if not keys else (keys[0], reference_keys[rows])
            value, low, high, masked = block_loss(
                anchors[rows], block, index[rows], positive_scores[rows], *key_arguments
            )
            value = value * (weight * (rows.stop - rows.start) / num_anchors)
            if backward:
                value.backward()
                value = value.detach()
            total = total + value
            min_positive, max_negative = torch.minimum(min_positive, low), torch.maximum(max_negative, high)
            if masked is not None:
                counts.append(masked)
        if counts:
            block_counts = FilterCounts.cat(counts)
            guard_counts = block_counts if guard_counts is None else guard_counts.plus(block_counts)
    if received:
        # A zero gradient rather than none: every process must run the same backward transfers.
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        torch.autograd.backward(received, grads)
    return total, min_positive, max_negative, guard_counts
