"""Run by tests/functional/test_collectives.py in 1 and 4 processes with torchrun's environment (gloo, CPU): what
RBSigmoidLoss keeps for backward (the bytes of the tensors autograd saves, ``torch.autograd.graph.saved_tensors_hooks``)
in one forward at an equal per-process batch, by exchange: ``"neighbour"`` (the ring run again in backward),
``"neighbour-kept"`` (the scheme it replaced: every received block kept for backward) and ``"all_gather"``; and the
recomputing ring's gradients against the kept scheme's, float32. Written to OUTPUT_DIR/rank{r}.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from st_weince.functional import exchange
from st_weince.losses import RBSigmoidLoss

LOCAL_BATCH, DIM = 256, 64  # the measurement


def columns(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11 + rank)
    base = torch.randn(LOCAL_BATCH, DIM, generator=generator)
    return [(base + 0.8 * torch.randn(LOCAL_BATCH, DIM, generator=generator)).requires_grad_() for _ in range(2)]


def saved_bytes_and_grads(name: str, rank: int) -> tuple[int, list[torch.Tensor]]:
    exchange_name = "all_gather" if name == "all_gather" else "neighbour"
    exchange.RECOMPUTE_IN_BACKWARD = name != "neighbour-kept"
    loss_fn = RBSigmoidLoss(None, gather_across_devices=True, exchange=exchange_name, check_inputs=False)
    inputs = columns(rank)
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_fn.compute_loss_from_embeddings(inputs)
        loss.backward()
    finally:
        exchange.RECOMPUTE_IN_BACKWARD = True
    grads = [column.grad for column in inputs] + [loss_fn.log_t.grad, loss_fn.b_rel.grad]
    return saved, grads


def main() -> None:
    output_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {name: saved_bytes_and_grads(name, rank) for name in ("neighbour", "neighbour-kept", "all_gather")}
    torch.save(
        {name: {"saved_bytes": saved, "grads": grads} for name, (saved, grads) in results.items()},
        output_dir / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
