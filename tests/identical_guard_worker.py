"""Run by tests/losses/test_false_negative_identical.py in 2 processes with torchrun's environment (gloo, CPU): each
rank takes its half of one global batch with duplicated inputs across the halves and computes all four losses with
``false_negative_filter="identical"`` and ``gather_across_devices=True`` (the cached ones through their loss stage,
in mini-batches; RB-Sigmoid also with ``exchange="neighbour"``, where the keys travel with the candidate blocks);
records each loss and its masked share in OUTPUT_DIR/rank{r}.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss

GLOBAL_BATCH = 12
# name: (class, its logged masked share, options of the distributed run)
LOSSES = {
    "RBSigmoidLoss": (RBSigmoidLoss, "rb_sigmoid_fn_masked_share", {}),
    "CachedRBSigmoidLoss": (CachedRBSigmoidLoss, "rb_sigmoid_fn_masked_share", {}),
    "RBSigmoidLoss/neighbour": (RBSigmoidLoss, "rb_sigmoid_fn_masked_share", {"exchange": "neighbour"}),
    "CachedRBSigmoidLoss/neighbour": (CachedRBSigmoidLoss, "rb_sigmoid_fn_masked_share", {"exchange": "neighbour"}),
    "WEINCELoss": (WEINCELoss, "weince_fn_masked_share", {}),
    "CachedWEINCELoss": (CachedWEINCELoss, "weince_fn_masked_share", {}),
}


def global_batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(anchor, positive) embeddings and token ids in which positive 9 (rank 1) repeats positive 2 (rank 0) and
    positive 5 repeats positive 4: identical inputs, identical embeddings, as a model gives them."""
    generator = torch.Generator().manual_seed(11)
    ids = [torch.randint(5, 50, (GLOBAL_BATCH, 6), generator=generator) for _ in range(2)]
    ids[1][9], ids[1][5] = ids[1][2], ids[1][4]
    table = torch.randn(50, 8, dtype=torch.float64, generator=generator)
    embeddings = [table[column].sum(1) for column in ids]  # a "model": the same input gives the same embedding
    return embeddings, ids


def run(loss_fn, columns: list[torch.Tensor], keys: list[torch.Tensor]) -> torch.Tensor:
    if hasattr(loss_fn, "calculate_loss"):
        loss_fn._pending_row_keys = keys
        reps = [list(column.split(4)) for column in columns]
        return loss_fn.calculate_loss(reps, None)
    return loss_fn.compute_loss_from_embeddings(columns, row_keys=keys)


def main(output_dir: Path) -> None:
    from st_weince.functional import input_keys

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    embeddings, ids = global_batch()
    local = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    columns = [column[local] for column in embeddings]
    keys = [input_keys(column[local]) for column in ids]
    results = {}
    with torch.no_grad():
        for name, (cls, statistic, distributed) in LOSSES.items():
            options = {"mini_batch_size": 4, **distributed} if name.startswith("Cached") else distributed
            loss_fn = cls(None, gather_across_devices=True, false_negative_filter="identical", **options)
            value = run(loss_fn, columns, keys)
            results[name] = {"loss": value, "masked_share": loss_fn.pop_logged_statistics()[statistic]}
    torch.save(results, output_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
