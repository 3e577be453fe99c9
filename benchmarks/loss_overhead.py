"""Loss overhead: forward + backward time and peak memory of WEINCELoss and RBSigmoidLoss against
MultipleNegativesRankingLoss (InfoNCE) on identical embeddings.

Only the loss is measured (embeddings are given leaf tensors), so the ratio is the loss's own cost; a training
step adds the encoder's forward and backward, which dwarfs both at realistic model sizes.

    python benchmarks/loss_overhead.py                        # CPU, batch 64..4096, writes runs/benchmarks/
    python benchmarks/loss_overhead.py --batch-sizes 1024 --dim 768 --repeats 15 --threads 1 --no-memory \
        --output benchmarks/results/loss_overhead_cpu_b1024_d768.json   # the speed target at SimCSE's size
    python benchmarks/loss_overhead.py --device cuda          # on a GPU

Time: the losses run interleaved within each repeat, so machine load hits all of them alike; each repeat gives a
paired ratio (loss time / MNRL time of the same repeat), and a row reports the median seconds and the median and
minimum of the paired ratios. On CPU the clock is the process's CPU time (all its threads; other processes' load
barely moves it, which keeps ratios stable on a shared machine); on CUDA it is wall time around synchronised calls.
The load average before and after is recorded with the result.
Peak memory: on CUDA torch.cuda.max_memory_allocated; on CPU the peak of live tensor memory during one forward +
backward, replayed from the PyTorch profiler's allocation and free events in time order (deterministic, unlike the
process's resident size, which the allocator's caching blurs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.profiling import cpu_peak_bytes  # noqa: E402
from benchmarks.lab.timing import Clock  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

#: ``weince_composite`` is the released vision composite (``WEINCELoss.released``: the blend + both top-M terms).
LOSSES = ("mnrl", "weince", "weince_beta1", "weince_unchecked", "weince_composite", "rb_sigmoid")
# "<loss>_unlogged": the same loss at a training step the trainer does not log (LossState.log_statistics = False):
# no logged statistics are computed, which measures what they cost (issue 47 item 3)
UNLOGGED = tuple(f"{name}_unlogged" for name in ("weince", "weince_composite", "rb_sigmoid"))


def build_loss(name: str):
    if name.endswith("_unlogged"):
        loss = build_loss(name.removesuffix("_unlogged"))
        loss.log_statistics = False
        return loss
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from st_weince.losses import WEINCELoss

    if name == "mnrl":
        return MultipleNegativesRankingLoss(None)
    if name == "weince":
        return WEINCELoss(None)
    if name == "weince_beta1":
        return WEINCELoss(None, beta=1.0)
    if name == "weince_unchecked":
        return WEINCELoss(None, check_inputs=False)
    if name == "weince_composite":
        return WEINCELoss.released(None)
    if name == "rb_sigmoid":
        from st_weince.losses import RBSigmoidLoss

        return RBSigmoidLoss(None)
    raise ValueError(f"unknown loss {name!r}")


def make_embeddings(batch_size: int, num_columns: int, dim: int, device: str, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, dim, generator=generator)
    return [
        (base + 0.7 * torch.randn(batch_size, dim, generator=generator)).to(device).requires_grad_(True)
        for _ in range(num_columns)
    ]


def run_once(loss, embeddings: list[torch.Tensor]) -> None:
    for embedding in embeddings:
        embedding.grad = None
    loss.compute_loss_from_embeddings(embeddings, None).backward()


def time_losses(names, batch_size, num_columns, dim, device, repeats, seed) -> dict[str, list[float]]:
    embeddings = make_embeddings(batch_size, num_columns, dim, device, seed)
    losses = {name: build_loss(name).to(device) for name in names}
    for loss in losses.values():  # warm-up
        run_once(loss, embeddings)
    clock = Clock(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name, loss in losses.items():
            samples[name].append(clock(lambda loss=loss: run_once(loss, embeddings)))
    return samples


def peak_memory(name: str, batch_size: int, num_columns: int, dim: int, device: str, seed: int) -> int:
    embeddings = make_embeddings(batch_size, num_columns, dim, device, seed)
    loss = build_loss(name).to(device)
    run_once(loss, embeddings)  # the embeddings' gradients exist from here on, as in training
    if not device.startswith("cuda"):
        return cpu_peak_bytes(lambda: run_once(loss, embeddings))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_once(loss, embeddings)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--dim", type=int, default=384, help="embedding size (384 = all-MiniLM-L6-v2)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES + UNLOGGED)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        default=scratch(__file__, "loss_overhead_cpu.json"),
        help="JSON path (default in runs/benchmarks/; the docstring names the committed one)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    layouts = {"pairs": 2, "hard_negatives": 3}  # (anchor, positive) and (anchor, positive, negative)
    load_before = os.getloadavg()
    rows = []
    jobs = [(layout, batch) for layout in layouts for batch in args.batch_sizes]
    for layout, batch_size in tqdm(jobs, desc="loss overhead"):
        num_columns = layouts[layout]
        samples = time_losses(args.losses, batch_size, num_columns, args.dim, args.device, args.repeats, args.seed)
        for name in args.losses:
            paired = [t / m for t, m in zip(samples[name], samples["mnrl"])] if "mnrl" in samples else None
            row = {
                "layout": layout,
                "batch_size": batch_size,
                "loss": name,
                "seconds": statistics.median(samples[name]),
                "clock": "wall" if args.device.startswith("cuda") else "process_cpu",
                "time_ratio_vs_mnrl": statistics.median(paired) if paired else None,
                "time_ratio_vs_mnrl_min": min(paired) if paired else None,
            }
            if not args.no_memory:
                row["peak_bytes"] = peak_memory(name, batch_size, num_columns, args.dim, args.device, args.seed)
            rows.append(row)
    if not args.no_memory and "mnrl" in args.losses:
        for row in rows:
            reference = next(
                r
                for r in rows
                if r["loss"] == "mnrl" and (r["layout"], r["batch_size"]) == (row["layout"], row["batch_size"])
            )
            row["memory_ratio_vs_mnrl"] = (
                row["peak_bytes"] / reference["peak_bytes"] if reference["peak_bytes"] else None
            )

    result = {
        **provenance(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())},
        "seed": args.seed,
        "dim": args.dim,
        "repeats": args.repeats,
        "rows": rows,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'layout':<15}{'batch':>7}  " + "  ".join(f"{name:>14}" for name in args.losses))
    for layout, batch_size in jobs:
        cells = []
        for name in args.losses:
            row = next(r for r in rows if (r["layout"], r["batch_size"], r["loss"]) == (layout, batch_size, name))
            memory = f" m{row['memory_ratio_vs_mnrl']:.2f}" if row.get("memory_ratio_vs_mnrl") else ""
            cells.append(f"t{row['time_ratio_vs_mnrl']:.2f}{memory}".rjust(14))
        print(f"{layout:<15}{batch_size:>7}  " + "  ".join(cells))
    print(f"written to {output}")


if __name__ == "__main__":
    main()
