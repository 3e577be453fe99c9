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
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from st_weince.utils.provenance import provenance

LOSS_NAMES = ("weince", "rb_sigmoid")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def build_loss(name: str, scale: float | None = None) -> torch.nn.Module:
    from st_weince.losses import RBSigmoidLoss, RBSigmoidOptions, WEINCELoss

    if scale is None:
        return {"weince": WEINCELoss, "rb_sigmoid": RBSigmoidLoss}[name](None)
    if name == "rb_sigmoid":  # t is capped at max_scale (default 100): an extreme start raises the cap with it
        return RBSigmoidLoss(None, scale=scale, max_scale=max(scale, RBSigmoidOptions.max_scale))
    return WEINCELoss(None, scale=scale)


def make_columns(batch: int, dim: int, seed: int) -> list[torch.Tensor]:
    """An anchor and a noisy positive column in float32 (losses of order 1)."""
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randn(batch, dim, generator=generator)
    return [anchors, anchors + 1.5 * torch.randn(batch, dim, generator=generator)]


def _loss_and_gradients(loss: torch.nn.Module, columns: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    leaves = [column.detach().clone().requires_grad_() for column in columns]
    value = loss.compute_loss_from_embeddings(leaves, None)
    value.backward()
    return float(value.detach()), [leaf.grad for leaf in leaves]


def accuracy(device: str, batch: int, dim: int, seed: int, scales: tuple[float, ...] = (20.0, 1e4)) -> list[dict]:
    rows = []
    columns = [column.to(device) for column in make_columns(batch, dim, seed)]
    for name in LOSS_NAMES:
        for scale in scales:
            loss = build_loss(name, scale).to(device)
            for dtype_name, dtype in HALF_DTYPES.items():
                low = [column.to(dtype) for column in columns]
                value, gradients = _loss_and_gradients(loss, low)
                exact, exact_gradients = _loss_and_gradients(loss, [column.double() for column in low])
                ratios = []
                for gradient, reference in zip(gradients, exact_gradients):
                    rounding = (reference.to(dtype).double() - reference).norm()
                    ratios.append(float((gradient.double() - reference).norm() / rounding))
                rows.append(
                    {
                        "loss": name,
                        "scale": scale,
                        "input_dtype": dtype_name,
                        "loss_value": value,
                        "relative_loss_error_vs_float64": abs(value - exact) / abs(exact),
                        "gradient_error_over_rounding_error": ratios,
                    }
                )
    return rows


def cost(device: str, batch: int, dim: int, repeats: int, seed: int) -> list[dict]:
    base = [column.to(device) for column in make_columns(batch, dim, seed)]
    inputs = {"float32": base, **{name: [c.to(dtype) for c in base] for name, dtype in HALF_DTYPES.items()}}
    losses = {name: build_loss(name).to(device) for name in LOSS_NAMES}
    cuda = device.startswith("cuda")

    def run(loss: torch.nn.Module, columns: list[torch.Tensor]) -> float:
        leaves = [column.detach().requires_grad_() for column in columns]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter() if cuda else time.process_time()
        loss.compute_loss_from_embeddings(leaves, None).backward()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() if cuda else time.process_time()) - start

    for loss in losses.values():  # warm-up
        for columns in inputs.values():
            run(loss, columns)
    samples: dict[tuple[str, str], list[float]] = {(n, d): [] for n in losses for d in inputs}
    for _ in range(repeats):
        for name, loss in losses.items():
            for dtype_name, columns in inputs.items():
                samples[(name, dtype_name)].append(run(loss, columns))
    rows = []
    for name in losses:
        reference = samples[(name, "float32")]
        for dtype_name in inputs:
            paired = [t / r for t, r in zip(samples[(name, dtype_name)], reference)]
            rows.append(
                {
                    "loss": name,
                    "input_dtype": dtype_name,
                    "batch": batch,
                    "dim": dim,
                    "seconds": statistics.median(samples[(name, dtype_name)]),
                    "time_ratio_vs_float32_inputs": statistics.median(paired),
                    "time_ratio_vs_float32_inputs_min": min(paired),
                    "clock": "wall" if cuda else "process_cpu",
                }
            )
    return rows


def measure(device: str, batch: int, dim: int, repeats: int, seed: int, accuracy_batch: int = 256) -> dict[str, Any]:
    return {
        "accuracy": accuracy(device, accuracy_batch, 64, seed),
        "cost": cost(device, batch, dim, repeats, seed),
        "seed": seed,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/low_precision_cpu.json")
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
