"""Run by tests/losses/test_weince_distributed.py in 2 processes with torchrun's environment (gloo, CPU).

Each rank takes its slice of one global batch of embeddings, computes WEINCELoss with gather_across_devices=True,
back-propagates, and writes its loss and the gradients of its own rows to OUTPUT_DIR/rank{r}.pt; then the same with
CachedWEINCELoss's loss stage (``calculate_loss`` on mini-batches of the rank's rows, with backward); and both again
with the false-negative guard ``GUARD`` (keys prefixed ``guarded_``); then the released composite (both top-M terms,
the batch tail index carried across ``COMPOSITE_STEPS`` steps of different batches), uncached and cached, to
OUTPUT_DIR/composite-rank{r}.pt.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from st_weince.losses import CachedWEINCELoss, WEINCELoss


def global_batch(batch_size: int, num_columns: int, dim: int = 16, seed: int = 1234) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, dim, generator=generator)
    # the two halves differ in spread, so the local pivots of the ranks differ from the global one
    spread = torch.cat([torch.full((batch_size // 2, 1), 0.3), torch.full((batch_size - batch_size // 2, 1), 1.2)])
    return [base + spread * torch.randn(batch_size, dim, generator=generator) for _ in range(num_columns)]


# (directions, partition_mode, number of columns): one launch runs them all, since starting processes is slow.
SETTINGS = [
    (("query_to_doc",), "joint", 3),
    (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint", 2),
    (("query_to_doc", "doc_to_query"), "per_direction", 2),
]
GUARD = ("absolute", 0.2)  # masks candidates in the high-spread half of global_batch (checked by the test)
# The composite: the settings with one softmax per row and with one per direction; a new global batch each step.
COMPOSITE_SETTINGS = [SETTINGS[0], SETTINGS[2]]
COMPOSITE_STEPS = 3


def composite_step_batch(step: int, num_columns: int) -> list[torch.Tensor]:
    return global_batch(64, num_columns, seed=2000 + step)


def composite_results(rank: int, world_size: int) -> list[dict]:
    """Per setting and step: this rank's loss, the gradients of its rows and the tail index after the step, for
    WEINCELoss.released and CachedWEINCELoss.released (mini-batches of 5), both with gather_across_devices."""
    results = []
    for directions, partition_mode, num_columns in COMPOSITE_SETTINGS:
        options = {"gather_across_devices": True, "directions": directions, "partition_mode": partition_mode}
        plain = WEINCELoss.released(None, **options)
        cached = CachedWEINCELoss.released(None, mini_batch_size=5, **options)
        steps = []
        for step in range(COMPOSITE_STEPS):
            local = 64 // world_size
            columns = composite_step_batch(step, num_columns)
            mine = [c[rank * local : (rank + 1) * local].clone().requires_grad_(True) for c in columns]
            loss = plain.compute_loss_from_embeddings(mine, None)
            loss.backward()
            reps = [[part.detach().clone().requires_grad_() for part in m.detach().split(5)] for m in mine]
            cached_loss = cached.calculate_loss(reps, None, with_backward=True)
            steps.append(
                {
                    "loss": loss.detach(),
                    "grads": [m.grad for m in mine],
                    "beta": plain.batch_beta_ema.clone(),
                    "cached_loss": cached_loss,
                    "cached_grads": [torch.cat([part.grad for part in column]) for column in reps],
                    "cached_beta": cached.batch_beta_ema.clone(),
                }
            )
        results.append(steps)
    return results


def main() -> None:
    output_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for directions, partition_mode, num_columns in SETTINGS:
        columns = global_batch(64, num_columns)
        local = 64 // world_size
        mine = [c[rank * local : (rank + 1) * local].clone().requires_grad_(True) for c in columns]
        loss_fn = WEINCELoss(None, gather_across_devices=True, directions=directions, partition_mode=partition_mode)
        loss = loss_fn.compute_loss_from_embeddings(mine, None)
        loss.backward()
        statistics = loss_fn.last_statistics
        result = {
            "loss": loss.detach(),
            "grads": [m.grad for m in mine],
            "lam": statistics.lam,
            "rho0": statistics.rho0,
        }
        cached = CachedWEINCELoss(
            None, gather_across_devices=True, directions=directions, partition_mode=partition_mode, mini_batch_size=5
        )
        reps = [[part.detach().clone().requires_grad_() for part in m.detach().split(5)] for m in mine]
        result["cached_loss"] = cached.calculate_loss(reps, None, with_backward=True)
        result["cached_grads"] = [torch.cat([part.grad for part in column]) for column in reps]
        result["cached_lam"] = cached.last_statistics.lam
        result["cached_rho0"] = cached.last_statistics.rho0
        guarded = WEINCELoss(
            None,
            gather_across_devices=True,
            directions=directions,
            partition_mode=partition_mode,
            false_negative_filter=GUARD,
        )
        guarded_rows = [m.detach().clone().requires_grad_(True) for m in mine]
        guarded_loss = guarded.compute_loss_from_embeddings(guarded_rows, None)
        guarded_loss.backward()
        result["guarded_loss"] = guarded_loss.detach()
        result["guarded_grads"] = [m.grad for m in guarded_rows]
        guarded_cached = CachedWEINCELoss(
            None,
            gather_across_devices=True,
            directions=directions,
            partition_mode=partition_mode,
            mini_batch_size=5,
            false_negative_filter=GUARD,
        )
        reps = [[part.detach().clone().requires_grad_() for part in m.detach().split(5)] for m in mine]
        result["guarded_cached_loss"] = guarded_cached.calculate_loss(reps, None, with_backward=True)
        result["guarded_cached_grads"] = [torch.cat([part.grad for part in column]) for column in reps]
        results.append(result)
    torch.save(results, f"{output_dir}/rank{rank}.pt")
    torch.save(composite_results(rank, world_size), f"{output_dir}/composite-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
