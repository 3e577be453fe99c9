"""RB-Sigmoid across processes: ``exchange="neighbour"`` against ``exchange="all_gather"`` (the default), per process.

Run under ``torchrun --nproc_per_node 4`` (gloo on CPU; NCCL on GPUs works the same way)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 benchmarks/rb_sigmoid_exchange.py

Rank 0 writes ``--output`` (default in runs/benchmarks/; the committed record,
``benchmarks/results/rb_sigmoid_exchange_cpu.json``, only when named).

For each layout (pairs; one hard-negative column) and loss (RBSigmoidLoss; the loss stage of CachedRBSigmoidLoss,
``calculate_loss(..., with_backward=True)`` as the mixin calls it), one training step (forward and backward) of every
process on its own random float32 embeddings, measured on every process:

- ``largest_score_tensor``: the largest output of a matrix product whose last dimension is not the embedding size,
  i.e. the largest anchors x candidates score block (recorded by a ``TorchDispatchMode`` on every op of the step);
- ``largest_embedding_matrix_rows``: the most rows of any [rows, dim] tensor an op produced: the all-gathered
  candidate matrix with all-gather, one process's candidate block with the neighbour exchange;
- ``peak_live_tensor_bytes``: the peak of live tensor memory during the step (PyTorch profiler events,
  :func:`benchmarks.lab.profiling.cpu_peak_bytes`), after a warm-up step;
- ``bytes_sent``: the payload this process sends, counted at the functional collectives' dispatch: a shift's
  ``all_to_all_single`` exactly; an all-gather as (W - 1) x its block, its backward's reduce-scatter as (W - 1) / W x
  its input; forward and backward separately for the uncached loss (results before 2026-12-06 were counted at the
  ``torch.distributed`` calls of the scheme then, point-to-point sends and the gloo all-gather's scatter);
- ``global_loss``: the mean of the processes' losses, equal for both exchanges (both computed the same loss).

Timings are left out: four processes on a shared two-core machine time the scheduler, not the exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.lab
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.profiling import cpu_peak_bytes  # noqa: E402
from benchmarks.rb_sigmoid_ring_memory import CollectiveBytes  # noqa: E402
from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

LOSS_CLASSES = {"uncached": "RBSigmoidLoss", "cached": "CachedRBSigmoidLoss"}
MATRIX_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class TensorSizes(TorchDispatchMode):
    """Records the largest score block (matrix-product output not ending in ``dim``) and the most rows of any
    [rows, dim] tensor produced by the ops it sees."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.score_shape: tuple[int, ...] = (0, 0)
        self.embedding_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
                continue
            if tensor.shape[-1] == self.dim:
                self.embedding_rows = max(self.embedding_rows, tensor.shape[0])
            elif func in MATRIX_PRODUCTS and tensor.numel() > self.score_shape[0] * self.score_shape[1]:
                self.score_shape = tuple(tensor.shape)
        return output


class SentBytes:
    """Counts the payload this process sends through torch's functional collectives (which the losses call), at
    dispatch, forward and backward (:class:`benchmarks.rb_sigmoid_ring_memory.CollectiveBytes`)."""

    def __init__(self) -> None:
        self.count = 0

    @contextmanager
    def counting(self):
        counter = CollectiveBytes()
        try:
            with counter:
                yield self
        finally:
            self.count += counter.count


def make_columns(local_batch: int, num_columns: int, dim: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    base = torch.randn(local_batch, dim, generator=generator)
    return [
        (base + 0.8 * torch.randn(local_batch, dim, generator=generator)).requires_grad_() for _ in range(num_columns)
    ]


def step_function(kind: str, exchange: str, columns: list[torch.Tensor], mini_batch: int) -> Callable[[], torch.Tensor]:
    """One forward and backward of the loss on ``columns``; returns the loss."""
    if kind == "uncached":
        loss_fn = RBSigmoidLoss(None, gather_across_devices=True, exchange=exchange, check_inputs=False)

        def forward() -> torch.Tensor:
            return loss_fn.compute_loss_from_embeddings(columns)

        def step() -> torch.Tensor:
            loss = forward()
            loss.backward()
            return loss.detach()

        step.forward = forward  # type: ignore[attr-defined]
        return step
    cached_fn = CachedRBSigmoidLoss(
        None, gather_across_devices=True, exchange=exchange, check_inputs=False, mini_batch_size=mini_batch
    )

    def cached_step() -> torch.Tensor:
        reps = [[piece.detach().requires_grad_() for piece in column.detach().split(mini_batch)] for column in columns]
        loss = cached_fn.calculate_loss(reps, with_backward=True)
        loss.backward()
        return loss.detach()

    return cached_step


def measure(kind: str, exchange: str, num_columns: int, args: argparse.Namespace) -> dict:
    columns = make_columns(args.local_batch, num_columns, args.dim, args.seed)
    step = step_function(kind, exchange, columns, args.mini_batch)
    loss = step()  # warm-up; the embeddings' gradients exist from here on, as in training
    sizes = TensorSizes(args.dim)
    with sizes:
        step()
    sent = SentBytes()
    result: dict = {}
    if kind == "uncached":
        with sent.counting():
            forward_loss = step.forward()  # type: ignore[attr-defined]
        result["bytes_sent_forward"] = sent.count
        with sent.counting():
            forward_loss.backward()
        result["bytes_sent_backward"] = sent.count - result["bytes_sent_forward"]
    else:
        with sent.counting():
            step()
    result["bytes_sent"] = sent.count
    dist.barrier()
    result["peak_live_tensor_bytes"] = cpu_peak_bytes(step)
    dist.barrier()
    global_loss = loss.clone()
    dist.all_reduce(global_loss)
    result.update(
        {
            "global_loss": float(global_loss) / dist.get_world_size(),
            "largest_score_tensor": list(sizes.score_shape),
            "largest_score_tensor_bytes": sizes.score_shape[0] * sizes.score_shape[1] * 4,
            "largest_embedding_matrix_rows": sizes.embedding_rows,
        }
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-batch", type=int, default=512, help="anchors per process")
    parser.add_argument("--dim", type=int, default=384, help="embedding size (384 = all-MiniLM-L6-v2)")
    parser.add_argument("--mini-batch", type=int, default=64, help="CachedRBSigmoidLoss's mini_batch_size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        default=scratch(__file__, "rb_sigmoid_exchange_cpu.json"),
        help="JSON path (default in runs/benchmarks/; the docstring names the committed one)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layouts = {"pairs": 2, "hard_negatives": 3}
    rows = []
    for layout, num_columns in layouts.items():
        for kind in ("uncached", "cached"):
            measured = {
                exchange: measure(kind, exchange, num_columns, args) for exchange in ("all_gather", "neighbour")
            }
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, measured)
            for exchange in ("all_gather", "neighbour"):
                ranks = [entry[exchange] for entry in per_rank]
                row = {"layout": layout, "loss_class": LOSS_CLASSES[kind], "exchange": exchange, **ranks[0]}
                # Every process sends and holds the same amounts; the peak memory is the largest over processes.
                row["peak_live_tensor_bytes"] = max(entry["peak_live_tensor_bytes"] for entry in ranks)
                row["same_on_every_process"] = all(
                    entry["bytes_sent"] == ranks[0]["bytes_sent"]
                    and entry["largest_score_tensor"] == ranks[0]["largest_score_tensor"]
                    for entry in ranks
                )
                rows.append(row)
            gathered, neighbour = rows[-2], rows[-1]
            neighbour["ratios_vs_all_gather"] = {
                key: neighbour[key] / gathered[key]
                for key in (
                    "largest_score_tensor_bytes",
                    "largest_embedding_matrix_rows",
                    "peak_live_tensor_bytes",
                    "bytes_sent",
                )
            }
            difference = abs(neighbour["global_loss"] - gathered["global_loss"])
            neighbour["global_loss_relative_difference"] = difference / abs(gathered["global_loss"])
    if rank == 0:
        result = {
            **provenance(),
            "backend": "gloo",
            "device": "cpu",
            "seed": args.seed,
            "local_batch": args.local_batch,
            "dim": args.dim,
            "mini_batch": args.mini_batch,
            "dtype": "float32",
            "rows": rows,
        }
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
        header = ("layout", "loss", "exchange", "score tensor", "cand. rows", "peak MiB", "sent MiB")
        print("{:<15}{:<22}{:<12}{:>14}{:>11}{:>10}{:>10}".format(*header))
        for row in rows:
            print(
                f"{row['layout']:<15}{row['loss_class']:<22}{row['exchange']:<12}"
                f"{'x'.join(map(str, row['largest_score_tensor'])):>14}{row['largest_embedding_matrix_rows']:>11}"
                f"{row['peak_live_tensor_bytes'] / 2**20:>10.1f}{row['bytes_sent'] / 2**20:>10.2f}"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
