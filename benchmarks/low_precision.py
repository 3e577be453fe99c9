"""Half-precision embeddings: how exact the losses are on them, and what computing them in float32 costs.

Both losses upcast float16 / bfloat16 embeddings to float32 before normalising and scoring (and switch autocast off
inside the loss), so their loss is the float64 computation on the same low-precision values to float32 accuracy and
their input gradients are that computation's rounded to the input dtype. This script measures both claims and the
price:

- ``accuracy``: per loss, input dtype and scale, the relative difference of the loss from the float64 computation
  on the same bf16/fp16 values, and for each column the norm of the gradient's error over the norm of the error of
  rounding the float64 gradient to the input dtype (1.0: the rounding itself; the tests require at most 2);
- ``cost``: forward + backward seconds of each loss on float32, bfloat16 and float16 embeddings of the same values
  (batch 1,024, dimension 768, pairs), interleaved within each repeat; the paired ratio half / float32 of a repeat
  is the cost of the casts (the upcast of the embeddings, the cast of their gradients back), since everything else
  runs in float32 in both cases.

    python benchmarks/low_precision.py --threads 1 --output benchmarks/results/low_precision_cpu.json
    python benchmarks/low_precision.py --device cuda --output benchmarks/results/low_precision_cuda.json

``benchmarks/gpu_check.py`` runs the same two measurements as its section ``low_precision``.
Clock: process CPU time on CPU, synchronised wall time on CUDA; medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lab.half_precision import measure  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        default=scratch(__file__, "low_precision.json"),
        help="JSON path (default in runs/benchmarks/; the docstring names the committed one)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    result = measure(args.device, args.batch, args.dim, args.repeats, args.seed)
    report = {
        **provenance(argv),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())},
        "repeats": args.repeats,
        **result,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    for row in report["accuracy"]:
        ratios = ", ".join(f"{r:.2f}" for r in row["gradient_error_over_rounding_error"])
        print(
            f"{row['loss']:<11}{row['input_dtype']:<9} scale {row['scale']:<8g} loss rel. error "
            f"{row['relative_loss_error_vs_float64']:.1e}  gradient error / rounding error {ratios}"
        )
    for row in report["cost"]:
        print(
            f"{row['loss']:<11}{row['input_dtype']:<9} {row['seconds'] * 1e3:7.1f} ms  "
            f"x{row['time_ratio_vs_float32_inputs']:.3f} of float32 inputs"
        )
    print(f"written to {output}")
    return report


if __name__ == "__main__":
    main()
