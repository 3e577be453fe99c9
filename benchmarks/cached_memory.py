"""Cached losses at large batches: time per training step and peak memory of the loss stage, CachedWEINCELoss
against sentence-transformers' CachedMultipleNegativesRankingLoss (CMNRL) in the same run, with a small encoder on
CPU and a fixed mini-batch.

    python benchmarks/cached_memory.py                       # batch 256 .. 16384, writes runs/benchmarks/
    python benchmarks/cached_memory.py --batch-sizes 256 1024 --repeats 1
    python benchmarks/cached_memory.py --output benchmarks/results/cached_memory_cpu.json   # the committed figures

- Step time: forward + backward of the whole cached step (embedding without gradient, loss stage, re-embedding with
  gradient) on (anchor, positive) pairs, CPU time of the process, median over repeats, losses interleaved.
- Peak memory of the loss stage (``calculate_loss`` with backward on the cached embeddings, where the B x B score
  matrix lives): the peak of live tensor memory replayed from the PyTorch profiler's allocation events, as in
  benchmarks/loss_overhead.py. The encoder's share (one mini-batch of activations at a time) is the mixin's and the
  same for every loss. Memory must grow linearly with B: the score matrix is processed in row chunks.
- CachedRBSigmoidLoss is included when st_weince.losses provides it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab, recipes.recipe_tools
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.profiling import cpu_peak_bytes  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "wiki" / "wiki1m_sample.txt"


def build_losses(model, mini_batch_size: int) -> dict:
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    import st_weince.losses as project_losses

    losses = {
        "cmnrl": CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size),
        "cached_weince": project_losses.CachedWEINCELoss(model, mini_batch_size=mini_batch_size),
    }
    if hasattr(project_losses, "CachedRBSigmoidLoss"):
        losses["cached_rb_sigmoid"] = project_losses.CachedRBSigmoidLoss(
            model, mini_batch_size=mini_batch_size
        ).mark_state_managed()  # this benchmark is the training loop
    return losses


def loss_stage_peak_bytes(loss, reps: list[list[torch.Tensor]]) -> int:
    leaves = [[r.detach().clone().requires_grad_() for r in column] for column in reps]
    return cpu_peak_bytes(lambda: loss.calculate_loss(leaves, None, with_backward=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--mini-batch-size", type=int, default=64)
    parser.add_argument("--max-seq-length", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per loss and batch size (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        default=scratch(__file__, "cached_memory_cpu.json"),
        help="JSON path (default in runs/benchmarks/; the committed one: benchmarks/results/cached_memory_cpu.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from sentence_transformers import SentenceTransformer

    from recipes.recipe_tools import build_tiny_bert

    sentences = [line.strip() for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    folder = tempfile.mkdtemp(prefix="cached-memory-")
    build_tiny_bert(folder, sentences=sentences[:2000])
    model = SentenceTransformer(folder, device="cpu")
    model.max_seq_length = args.max_seq_length
    model.train()
    dimension = model.get_embedding_dimension()
    losses = build_losses(model, args.mini_batch_size)
    load_before = os.getloadavg()
    rows = []
    for batch_size in args.batch_sizes:
        anchors = [sentences[i % len(sentences)] for i in range(batch_size)]
        positives = [sentences[(i + 7919) % len(sentences)] for i in range(batch_size)]
        features = [model.tokenize(anchors), model.tokenize(positives)]
        times: dict[str, list[float]] = {name: [] for name in losses}
        for _ in range(args.repeats):
            for name, loss in losses.items():
                model.zero_grad(set_to_none=True)
                start = time.process_time()
                loss(features, None).backward()
                times[name].append(time.process_time() - start)
        # cached embeddings of the batch, for the loss-stage memory (same for every loss)
        generator = torch.Generator().manual_seed(args.seed)
        reps = [
            list(torch.randn(batch_size, dimension, generator=generator).split(args.mini_batch_size)) for _ in range(2)
        ]
        for name, loss in losses.items():
            row = {
                "batch_size": batch_size,
                "loss": name,
                "step_seconds": statistics.median(times[name]),
                "step_seconds_all": times[name],
                "loss_stage_peak_bytes": loss_stage_peak_bytes(loss, reps),
            }
            rows.append(row)
            print(json.dumps(row))
    for row in rows:
        reference = next(r for r in rows if r["loss"] == "cmnrl" and r["batch_size"] == row["batch_size"])
        row["step_time_ratio_vs_cmnrl"] = row["step_seconds"] / reference["step_seconds"]
        row["memory_ratio_vs_cmnrl"] = row["loss_stage_peak_bytes"] / reference["loss_stage_peak_bytes"]
    result = {
        **provenance(),
        "encoder": f"recipes/recipe_tools.py build_tiny_bert (random init), embedding dimension {dimension}, "
        f"max_seq_length {args.max_seq_length}, train mode",
        "mini_batch_size": args.mini_batch_size,
        "clock": "process_cpu",
        "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())},
        "seed": args.seed,
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'batch':>7}  " + "  ".join(f"{name:>26}" for name in losses))
    for batch_size in args.batch_sizes:
        cells = []
        for name in losses:
            row = next(r for r in rows if (r["batch_size"], r["loss"]) == (batch_size, name))
            cells.append(f"{row['step_seconds']:.2f}s {row['loss_stage_peak_bytes'] / 2**20:.1f}MiB".rjust(26))
        print(f"{batch_size:>7}  " + "  ".join(cells))
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
