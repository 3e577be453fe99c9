"""RB-Sigmoid's memory for backward, time and communication by exchange and number of processes (gloo, CPU).

    python benchmarks/rb_sigmoid_ring_memory.py            # the sweep: launches torchrun for 1, 2 and 4 processes
    python benchmarks/rb_sigmoid_ring_memory.py --output benchmarks/results/rb_sigmoid_ring_memory_cpu.json  # committed

For each world size W in 1, 2, 4 and each exchange, a fresh ``torchrun --nproc_per_node W`` (so that the peak RSS is
that exchange's) runs RBSigmoidLoss (pairs, ``gather_across_devices=True``, ``check_inputs=False``, float32) on an
equal per-process batch of random embeddings:

- ``all_gather``: the candidates all-gathered with gradient;
- ``neighbour-kept``: the neighbour exchange as in dc2955f and before: gradients flow back through the shifts, so every
  received block and its graph are kept for backward (``exchange.RECOMPUTE_IN_BACKWARD = False``);
- ``neighbour``: the ring run again in backward (``_RecomputedRing``): only the own anchors, candidates and loss
  parameters are kept.

Measured per process (the largest over processes is recorded): ``saved_for_backward_bytes`` (the bytes of the tensors
autograd saves in one forward, ``torch.autograd.graph.saved_tensors_hooks``), ``peak_rss_bytes`` (``ru_maxrss`` of the
process after warm-up and the timed steps), ``step_seconds`` (median of forward + backward), ``bytes_sent_forward`` /
``bytes_sent_backward`` (the payload of the functional collectives, counted at dispatch: all_to_all_single its
non-own splits, all_gather (W - 1) x the input, reduce_scatter (W - 1) / W x the input), and the largest relative
difference of the gradients (embeddings, t, b_rel) from ``neighbour-kept`` on the same inputs. On this 2-core machine
more processes than cores time the scheduler too: compare exchanges at the same W, not across W.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.functional import exchange  # noqa: E402
from st_weince.losses import RBSigmoidLoss  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

EXCHANGES = ("all_gather", "neighbour-kept", "neighbour")
WORLD_SIZES = (1, 2, 4)


class CollectiveBytes(TorchDispatchMode):
    """The payload this process sends through torch's functional collectives, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("_c10d_functional::"):
            tensor = args[0]
            row_bytes = tensor.nbytes // max(tensor.shape[0], 1) if tensor.dim() else tensor.nbytes
            world_size, rank = dist.get_world_size(), dist.get_rank()
            if "all_to_all_single" in name:
                self.count += sum(size for peer, size in enumerate(args[2]) if peer != rank) * row_bytes
            elif "all_gather_into_tensor" in name:
                self.count += (world_size - 1) * tensor.nbytes
            elif "reduce_scatter_tensor" in name:
                self.count += (world_size - 1) * tensor.nbytes // world_size
        return func(*args, **(kwargs or {}))


def make_columns(local_batch: int, dim: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    base = torch.randn(local_batch, dim, generator=generator)
    return [(base + 0.8 * torch.randn(local_batch, dim, generator=generator)).requires_grad_() for _ in range(2)]


def one_step(name: str, args: argparse.Namespace, hooks: bool = False, counter: CollectiveBytes | None = None):
    """Forward and backward; returns (saved bytes, bytes sent forward, bytes sent backward, gradients)."""
    exchange.RECOMPUTE_IN_BACKWARD = name != "neighbour-kept"
    loss_fn = RBSigmoidLoss(
        None,
        gather_across_devices=True,
        exchange="all_gather" if name == "all_gather" else "neighbour",
        check_inputs=False,
    )
    columns = make_columns(args.local_batch, args.dim, args.seed)
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    sent_forward = sent_backward = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor) if hooks else _nothing():
        if counter is not None:
            with counter:
                loss = loss_fn.compute_loss_from_embeddings(columns)
            sent_forward = counter.count
        else:
            loss = loss_fn.compute_loss_from_embeddings(columns)
    if counter is not None:
        with counter:
            loss.backward()
        sent_backward = counter.count - sent_forward
    else:
        loss.backward()
    grads = [column.grad for column in columns] + [loss_fn.log_t.grad, loss_fn.b_rel.grad]
    return saved, sent_forward, sent_backward, grads


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_one(args: argparse.Namespace) -> None:
    """Inside torchrun: one exchange at this world size; rank 0 writes the JSON row."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    name = args.exchange
    saved, sent_forward, sent_backward, grads = one_step(name, args, hooks=True, counter=CollectiveBytes())
    _, _, _, reference = one_step("neighbour-kept", args)  # the scheme of dc2955f on the same inputs
    difference = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference))
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        one_step(name, args)
        times.append(time.perf_counter() - start)
    row = {
        "exchange": name,
        "world_size": dist.get_world_size(),
        "saved_for_backward_bytes": saved,
        "bytes_sent_forward": sent_forward,
        "bytes_sent_backward": sent_backward,
        "step_seconds": statistics.median(times),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "grad_max_relative_difference_vs_neighbour_kept": difference,
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        merged = dict(rows[0])
        for key in (
            "saved_for_backward_bytes",
            "step_seconds",
            "peak_rss_bytes",
            "bytes_sent_forward",
            "bytes_sent_backward",
            "grad_max_relative_difference_vs_neighbour_kept",
        ):
            merged[key] = max(entry[key] for entry in rows)
        Path(args.row_output).write_text(json.dumps(merged))
    dist.barrier()
    dist.destroy_process_group()


def sweep(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for world_size in WORLD_SIZES:
            for name in EXCHANGES:
                row_output = Path(scratch) / f"{name}-{world_size}.json"
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    str(world_size),
                    __file__,
                    "--run-one",
                    "--exchange",
                    name,
                    "--row-output",
                    str(row_output),
                    "--local-batch",
                    str(args.local_batch),
                    "--dim",
                    str(args.dim),
                    "--seed",
                    str(args.seed),
                    "--repeats",
                    str(args.repeats),
                ]
                environment = {**os.environ, "OMP_NUM_THREADS": "1"}
                subprocess.run(command, check=True, env=environment, stdout=subprocess.DEVNULL)
                rows.append(json.loads(row_output.read_text()))
                print(rows[-1], flush=True)
    by_key = {(row["exchange"], row["world_size"]): row for row in rows}
    for row in rows:
        one = by_key[(row["exchange"], 1)]
        row["saved_for_backward_vs_one_process"] = row["saved_for_backward_bytes"] / one["saved_for_backward_bytes"]
        kept = by_key[("neighbour-kept", row["world_size"])]
        row["step_seconds_vs_neighbour_kept"] = row["step_seconds"] / kept["step_seconds"]
        sent, kept_sent = (r["bytes_sent_forward"] + r["bytes_sent_backward"] for r in (row, kept))
        row["bytes_sent_vs_neighbour_kept"] = sent / kept_sent if kept_sent else None
    result = {
        **provenance(),
        "backend": "gloo",
        "device": "cpu",
        "cpu": _cpu_model(),
        "seed": args.seed,
        "local_batch": args.local_batch,
        "dim": args.dim,
        "dtype": "float32",
        "repeats": args.repeats,
        "torch_threads_per_process": 1,
        "rows": rows,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'exchange':<16}{'W':>3}{'saved KiB':>11}{'x W=1':>7}{'RSS MiB':>9}{'step ms':>9}{'sent KiB':>10}")
    for row in rows:
        sent = (row["bytes_sent_forward"] + row["bytes_sent_backward"]) / 1024
        print(
            f"{row['exchange']:<16}{row['world_size']:>3}{row['saved_for_backward_bytes'] / 1024:>11.1f}"
            f"{row['saved_for_backward_vs_one_process']:>7.2f}{row['peak_rss_bytes'] / 2**20:>9.1f}"
            f"{row['step_seconds'] * 1000:>9.1f}{sent:>10.1f}"
        )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local-batch", type=int, default=1024, help="anchors per process")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (median)")
    parser.add_argument(
        "--output",
        default=scratch(__file__, "rb_sigmoid_ring_memory_cpu.json"),
        help="JSON path (default in runs/benchmarks/; the docstring names the committed one)",
    )
    parser.add_argument("--run-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exchange", choices=EXCHANGES, help=argparse.SUPPRESS)
    parser.add_argument("--row-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_one:
        run_one(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
