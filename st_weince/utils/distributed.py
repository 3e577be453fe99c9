"""Small torch.distributed helpers; every one is a no-op without an initialised process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather_rows_no_grad(tensor: Tensor) -> Tensor:
    """Concatenate the first-axis rows of ``tensor`` from every rank (in rank order), without gradient.

    Ranks may hold different numbers of rows (an uneven last batch): sizes are exchanged first and the
    rows padded for the collective, then trimmed.
    """
    if not is_distributed():
        return tensor.detach()
    tensor = tensor.detach().contiguous()
    world_size = dist.get_world_size()
    size = torch.tensor([tensor.shape[0]], device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    max_rows = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[: int(s.item())] for g, s in zip(gathered, sizes)], dim=0)
