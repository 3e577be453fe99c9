"""Half-precision embeddings: each loss's accuracy on bf16 / fp16 inputs against the float64 computation on the same
values, and the cost of computing in float32 (benchmarks/low_precision.py, gpu_check.py's section low_precision)."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks.lab.timing import Clock

LOSS_NAMES = ("weince", "rb_sigmoid")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def build_loss(name: str, scale: float | None = None) -> torch.nn.Module:
    from st_weince.functional import RBSigmoidOptions
    from st_weince.losses import RBSigmoidLoss, WEINCELoss

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
    clock = Clock(device)

    def run(loss: torch.nn.Module, columns: list[torch.Tensor]) -> float:
        leaves = [column.detach().requires_grad_() for column in columns]
        return clock(lambda: loss.compute_loss_from_embeddings(leaves, None).backward())

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
                    "clock": "process_cpu" if not clock.cuda else "wall",
                }
            )
    return rows


def measure(device: str, batch: int, dim: int, repeats: int, seed: int, accuracy_batch: int = 256) -> dict[str, Any]:
    return {
        "accuracy": accuracy(device, accuracy_batch, 64, seed),
        "cost": cost(device, batch, dim, repeats, seed),
        "seed": seed,
    }
