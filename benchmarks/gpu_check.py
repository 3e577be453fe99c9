"""One GPU check of the scale work: loss-level and whole-step cost ratios, compiled and eager, and host syncs.

A single command that finishes in at most about 8 minutes on one GPU and writes one JSON:

    python benchmarks/gpu_check.py                                   # CUDA, writes runs/benchmarks/gpu_check/
    python benchmarks/gpu_check.py --output benchmarks/results/gpu_check.json   # a record to commit
    python benchmarks/gpu_check.py --device cpu --quick              # the same code paths on CPU in under 2 minutes

Sections (each one writes its results into the JSON as soon as it ends, and a failing section records its error
instead of stopping the check; sections past the time budget are recorded as skipped):

1. ``syncs``: host-device syncs of one forward + backward for every loss, with ``check_inputs`` on and off, counted
   by ``st_weince.utils.hotpath.count_host_syncs`` and, on CUDA, by ``torch.cuda.set_sync_debug_mode("warn")``.
2. ``loss_level``: the loss alone (similarity matmul included) on identical bf16 embeddings of dimension 768, batch
   1,024 to 16,384: WEINCE and RB-Sigmoid against MNRL, eager and ``torch.compile(fullgraph=True)``; and the cached
   variants against CMNRL with an embedding-table "model", so the figure is the cached loss's own cost.
3. ``low_precision``: the losses on bf16 / fp16 embeddings (computed in float32): their relative difference from the
   float64 computation on the same values, their gradients' error against the rounding of the exact ones, and the
   time on half-precision against float32 embeddings (the cost of the casts), batch 1,024 and 16,384, dimension
   768 (``benchmarks/low_precision.py``).
4. ``whole_step``: one optimizer step of a BERT-base-sized encoder built from a config (random init, no download),
   bf16 autocast, sequences of 32 tokens: batch 64 uncached (MNRL, WEINCE, RB-Sigmoid) and batch 4,096 cached
   (CMNRL, CachedWEINCE, CachedRBSigmoid, mini-batch 512).

Timing: median of interleaved repeats (every loss once per repeat, so drift hits all alike), CUDA-synchronised
wall time; on CPU, process CPU time. Ratios are against the baseline measured in the same repeat loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.lab.half_precision import accuracy, cost  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.timing import (  # noqa: E402
    Clock,
    build_encoder,
    interleaved_medians,
    losses_cached,
    losses_uncached,
    time_optimizer_steps,
    token_features,
)
from st_weince.utils.hotpath import count_host_syncs  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402


class _TableLookup(nn.Module):
    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, dim, device=device, dtype=dtype))

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"sentence_embedding": self.table[features["input_ids"][:, 0]]}


class EmbeddingTable(nn.Sequential):
    """A stand-in "model" for cached losses: row ``input_ids[:, 0]`` of a trainable table is the embedding.

    The cached losses call ``model(features)["sentence_embedding"]`` on mini-batches (and look at ``model[0]``, as in
    a SentenceTransformer); with a lookup the encoder costs nothing, so a loss-level timing of a cached loss measures
    the loss and the cache machinery only.
    """

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: str) -> None:
        super().__init__(_TableLookup(rows, dim, dtype, device))

    @property
    def table(self) -> nn.Parameter:
        return self[0].table


def table_features(batch_size: int, num_columns: int, device: str) -> list[dict[str, torch.Tensor]]:
    """Feature dicts whose column ``c`` looks up rows ``c * B .. (c + 1) * B - 1`` of an :class:`EmbeddingTable`."""
    rows = torch.arange(batch_size * num_columns, device=device).view(num_columns, batch_size, 1)
    return [{"input_ids": rows[c], "attention_mask": torch.ones_like(rows[c])} for c in range(num_columns)]


def section_syncs(device: str, dtype: torch.dtype) -> dict:
    batch, dim = 256, 64
    generator = torch.Generator().manual_seed(0)
    embeddings = [torch.randn(batch, dim, generator=generator).to(device, dtype) for _ in range(2)]
    out: dict[str, Any] = {}
    for check_inputs in (True, False):
        model = EmbeddingTable(2 * batch, dim, dtype, device)
        named = {
            **losses_uncached(None, check_inputs),
            **losses_cached(model, mini_batch_size=64, check_inputs=check_inputs),
        }
        features = table_features(batch, 2, device)
        for name, loss in named.items():
            loss.to(device)
            if name in ("mnrl", "cmnrl") and not check_inputs:
                continue

            def step(loss=loss, name=name, features=features):
                if name.startswith("c"):
                    loss(features, None).backward()
                else:
                    leaves = [e.detach().requires_grad_() for e in embeddings]
                    loss.compute_loss_from_embeddings(leaves, None).backward()

            step()  # warm-up: lazy initialisation is not a per-step sync
            with count_host_syncs() as syncs:
                step()
            record: dict[str, Any] = {"dispatch_count": syncs.total, "by_op": dict(syncs.by_op)}
            if device.startswith("cuda"):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        step()
                        torch.cuda.current_stream().synchronize()  # not counted: outside the mode's ops
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                record["cuda_sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
            out[f"{name}/check_inputs={check_inputs}"] = record
    return out


def section_loss_level(
    device: str, dtype: torch.dtype, batches: list[int], repeats: int, compile_backend: str | None, deadline: float
) -> dict:
    dim = 768
    clock = Clock(device)
    rows: list[dict[str, Any]] = []
    compiled: dict[str, Callable] = {}
    uncached = {name: loss.to(device) for name, loss in losses_uncached(None, check_inputs=False).items()}
    if compile_backend is not None:
        for name, loss in uncached.items():
            compiled[name] = torch.compile(loss.compute_loss_from_embeddings, fullgraph=True, backend=compile_backend)
    for batch in tqdm(batches, desc="loss level"):
        if time.monotonic() > deadline:
            rows.append({"batch": batch, "skipped": "time budget"})
            continue
        generator = torch.Generator().manual_seed(batch)
        base = torch.randn(batch, dim, generator=generator)
        embeddings = [(base + 0.7 * torch.randn(batch, dim, generator=generator)).to(device, dtype) for _ in range(2)]

        def call(fn, embeddings=embeddings):
            def run():
                leaves = [e.detach().requires_grad_() for e in embeddings]
                fn(leaves, None).backward()

            return run

        calls = {f"{name}/eager": call(loss.compute_loss_from_embeddings) for name, loss in uncached.items()}
        calls.update({f"{name}/compiled": call(fn) for name, fn in compiled.items()})
        model = EmbeddingTable(2 * batch, dim, dtype, device)
        with torch.no_grad():
            model.table.copy_(torch.cat(embeddings))
        features = table_features(batch, 2, device)
        for name, loss in losses_cached(model, mini_batch_size=min(batch, 1024), check_inputs=False).items():
            loss.to(device)
            calls[f"{name}/eager"] = lambda loss=loss, features=features: loss(features, None).backward()
        medians = interleaved_medians(calls, clock, repeats=repeats, warmup=2)
        row: dict[str, Any] = {"batch": batch, "dim": dim, "seconds": medians}
        row["ratio"] = {
            key: value / medians[("cmnrl" if key.startswith("cached") else "mnrl") + "/" + key.split("/")[1]]
            for key, value in medians.items()
            if key.split("/")[0] not in ("mnrl", "cmnrl")
        }
        if compiled:
            for name in ("weince", "rb_sigmoid"):
                leaves = [e.detach().requires_grad_() for e in embeddings]
                eager = uncached[name].compute_loss_from_embeddings(leaves, None)
                traced = compiled[name]([e.detach().requires_grad_() for e in embeddings], None)
                row.setdefault("compiled_minus_eager", {})[name] = float((traced.float() - eager.float()).abs())
        rows.append(row)
    return {"rows": rows, "dtype": str(dtype), "compile_backend": compile_backend}


def section_low_precision(device: str, batches: list[int], repeats: int, deadline: float) -> dict:
    out: dict[str, Any] = {"accuracy": accuracy(device, batch=256, dim=64, seed=0), "cost": []}
    for batch in batches:
        if time.monotonic() > deadline:
            out["cost"].append({"batch": batch, "skipped": "time budget"})
            continue
        out["cost"].extend(cost(device, batch=batch, dim=768, repeats=repeats, seed=0))
    return out


def section_whole_step(
    device: str,
    size: str,
    batch: int,
    cached_batch: int,
    mini_batch: int,
    repeats: int,
    deadline: float,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> dict:
    """Optimizer-step time of each loss from the same weights on the same batch (also used by step_overhead.py)."""
    clock = Clock(device)
    autocast = torch.autocast(
        device_type="cuda" if device.startswith("cuda") else "cpu",
        dtype=autocast_dtype or torch.bfloat16,
        enabled=autocast_dtype is not None,
    )
    out: dict[str, Any] = {"encoder": size, "seq_len": 32, "autocast": str(autocast_dtype)}
    for label, batch_size, build in (
        ("uncached", batch, lambda m: losses_uncached(m, check_inputs=True)),
        ("cached", cached_batch, lambda m: losses_cached(m, mini_batch_size=mini_batch, check_inputs=True)),
    ):
        if time.monotonic() > deadline:
            out[label] = {"skipped": "time budget"}
            continue
        torch.manual_seed(0)
        model = build_encoder(size, device)
        features = token_features(batch_size, 2, 32, model[0].auto_model.config.vocab_size, device, seed=1)
        medians = time_optimizer_steps(model, build(model), features, autocast, clock, repeats)
        baseline = "mnrl" if label == "uncached" else "cmnrl"
        out[label] = {
            "batch": batch_size,
            "mini_batch": mini_batch if label == "cached" else None,
            "seconds": medians,
            "ratio": {name: medians[name] / medians[baseline] for name in medians if name != baseline},
        }
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (CPU smoke run)")
    parser.add_argument("--budget-seconds", type=float, default=450.0, help="sections past it are skipped")
    parser.add_argument("--output", type=Path, default=scratch(__file__, "gpu_check.json"), help="JSON path")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --quick for the CPU run)")
    output = args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.budget_seconds
    if args.quick:
        plan = {
            "batches": [128, 512],
            "repeats": 3,
            "encoder": "tiny",
            "batch": 16,
            "cached_batch": 64,
            "mini_batch": 16,
            "step_repeats": 2,
            "compile_backend": "aot_eager",
            "low_precision_batches": [256],
        }
    else:
        plan = {
            "batches": [1024, 4096, 16384],
            "repeats": 10,
            "encoder": "base",
            "batch": 64,
            "cached_batch": 4096,
            "mini_batch": 512,
            "step_repeats": 5,
            "compile_backend": "inductor",
            "low_precision_batches": [1024, 16384],
        }
    dtype = torch.bfloat16
    report: dict[str, Any] = {"plan": plan, "device": args.device, "provenance": provenance(argv)}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()

    def run_section(name: str, fn: Callable[[], dict]) -> None:
        section_start = time.monotonic()
        try:
            report[name] = fn()
        except Exception as error:  # record and go on: one JSON with everything that worked
            report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        report[name]["seconds_taken"] = time.monotonic() - section_start
        report["total_seconds"] = time.monotonic() - started
        output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[gpu_check] {name}: {report[name].get('error', 'ok')} ({report[name]['seconds_taken']:.1f} s)")

    run_section("syncs", lambda: section_syncs(args.device, dtype))
    run_section(
        "loss_level",
        lambda: section_loss_level(
            args.device, dtype, plan["batches"], plan["repeats"], plan["compile_backend"], deadline
        ),
    )
    run_section(
        "low_precision",
        lambda: section_low_precision(args.device, plan["low_precision_batches"], plan["repeats"], deadline),
    )
    run_section(
        "whole_step",
        lambda: section_whole_step(
            args.device,
            plan["encoder"],
            plan["batch"],
            plan["cached_batch"],
            plan["mini_batch"],
            plan["step_repeats"],
            deadline,
        ),
    )
    print(f"[gpu_check] wrote {output} in {report['total_seconds']:.0f} s")
    return report


if __name__ == "__main__":
    main()
