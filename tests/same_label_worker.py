"""Run by tests/losses/test_false_negative_same_label.py in 2 processes with torchrun's environment (gloo, CPU): each
rank takes its half of one global batch whose labels repeat across the halves and computes all four losses with
``false_negative_filter="same_label"`` and ``gather_across_devices=True`` (the cached ones through their loss stage,
in mini-batches; RB-Sigmoid also with ``exchange="neighbour"``, where the labels travel with the candidate blocks);
records each loss and its masked share in OUTPUT_DIR/rank{r}.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.identical_guard_worker import GLOBAL_BATCH, LOSSES  # the same losses and batch as the "identical" run

# rank 0 holds rows 0-5, rank 1 rows 6-11: labels 0, 1 and 2 appear on both ranks; as 64-bit ids above 2^53, where
# neighbouring ids are equal as float64 (2^53 + 1 rounds to 2^53): they must travel and compare as int64
LABELS = torch.tensor([0, 1, 2, 3, 0, 4, 1, 5, 2, 6, 0, 7]) + 2**53


def global_batch() -> list[torch.Tensor]:
    """(anchor, positive) embeddings of the global batch, float64."""
    generator = torch.Generator().manual_seed(12)
    anchors = torch.randn(GLOBAL_BATCH, 8, dtype=torch.float64, generator=generator)
    return [anchors, anchors + 0.6 * torch.randn(GLOBAL_BATCH, 8, dtype=torch.float64, generator=generator)]


def main(output_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    columns = [column[local] for column in global_batch()]
    labels = LABELS[local]
    results = {}
    with torch.no_grad():
        for name, (cls, statistic, distributed) in LOSSES.items():
            options = {"mini_batch_size": 3, **distributed} if name.startswith("Cached") else distributed
            loss_fn = cls(None, gather_across_devices=True, false_negative_filter="same_label", **options).double()
            if name.startswith("Cached"):
                value = loss_fn.calculate_loss([list(column.split(3)) for column in columns], labels)
            else:
                value = loss_fn.compute_loss_from_embeddings(columns, labels)
            results[name] = {"loss": value, "masked_share": loss_fn.pop_logged_statistics()[statistic]}
    torch.save(results, output_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
