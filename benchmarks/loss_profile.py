"""Where a loss's own time goes: ``torch.profiler`` on CPU, one thread, forward + backward of each loss on the leaf
embeddings of benchmarks/loss_overhead.py (the similarity matmul included), attributed two ways.

- By st-weince function: each profiled operator's CPU time (self time, so nothing counts twice) goes to the innermost
  st_weince function around it; backward operators run in the autograd engine, outside any Python function, and go
  to their autograd node ("backward: MmBackward0"; a custom ``autograd.Function``'s backward is named after it).
- By operator: the largest self CPU times (``aten::topk``, ``aten::sort``, ``aten::mm`` ...).

One warm-up call, then ``--repeats`` profiled calls; times are the sum over them, shares of the loss's total. The
profiler adds a constant cost per operator, so a loss of many small operators is inflated more than one of few
large ones: read the shares, and the ratios of benchmarks/loss_overhead.py for the cost.

    OMP_NUM_THREADS=1 python benchmarks/loss_profile.py            # batch 1,024, d 768, into runs/benchmarks/
    OMP_NUM_THREADS=1 python benchmarks/loss_profile.py --output benchmarks/results/loss_profile_cpu_b1024_d768.json
                                                                   # the committed table (.json and .md)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.loss_overhead import build_loss, make_embeddings  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

LOSSES = ("mnrl", "weince", "weince_composite", "rb_sigmoid")
OUTPUT = scratch(__file__, "loss_profile_cpu_b1024_d768.json")
PACKAGE = "st_weince/"
TOP_OPERATORS = 12
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "


def where(event) -> str:
    """Where an operator ran: its innermost enclosing st_weince function (``st_weince/functional/weince.py(90):
    hardest_negatives``, the profiler's Python-function events are its ancestors), else the autograd node it
    runs in (``backward: MmBackward0``), else "other" (sentence-transformers' or torch's own code)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PACKAGE) or f"/{PACKAGE}" in parent.name:
            return PACKAGE + parent.name.split(PACKAGE, 1)[1]
        if parent.name.startswith(BACKWARD_PREFIX):
            return f"backward: {parent.name.removeprefix(BACKWARD_PREFIX)}"
        parent = parent.cpu_parent
    return "other (outside st_weince: sentence-transformers, torch)"


def profile_loss(name: str, batch_size: int, dim: int, repeats: int, seed: int) -> dict:
    loss = build_loss(name)
    embeddings = make_embeddings(batch_size, 2, dim, "cpu", seed)

    def step() -> None:
        for embedding in embeddings:
            embedding.grad = None
        loss.compute_loss_from_embeddings(embeddings, None).backward()

    step()  # warm-up: first-call costs (allocations, dispatch caches) are not the loss's
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(repeats):
            step()
    by_function: dict[str, float] = defaultdict(float)
    by_operator: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if not event.name.startswith("aten::"):  # the operators; the profiler's Python-function events are not time
            continue
        self_us = event.self_cpu_time_total
        by_operator[event.name] += self_us
        by_function[where(event)] += self_us
    total = sum(by_operator.values())

    def table(values: dict[str, float], limit: int | None = None) -> list[dict]:
        rows = sorted(values.items(), key=lambda item: -item[1])[:limit]
        return [{"name": k, "ms_per_call": v / 1000 / repeats, "share": v / total} for k, v in rows]

    return {
        "total_ms_per_call": total / 1000 / repeats,
        "by_function": table(by_function),
        "top_operators": table(by_operator, TOP_OPERATORS),
    }


def markdown(results: dict) -> str:
    lines = []
    for name, result in results["losses"].items():
        lines += [f"### {name}: {result['total_ms_per_call']:.1f} ms of operator self time per call", ""]
        lines += ["| where (st_weince function or backward node) | ms / call | share |", "| --- | ---: | ---: |"]
        for row in result["by_function"][:15]:
            lines.append(f"| `{row['name']}` | {row['ms_per_call']:.2f} | {100 * row['share']:.1f} % |")
        lines += ["", "| operator | ms / call | share |", "| --- | ---: | ---: |"]
        for row in result["top_operators"]:
            lines.append(f"| `{row['name']}` | {row['ms_per_call']:.2f} | {100 * row['share']:.1f} % |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES))
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = list(os.getloadavg())
    results = {
        "description": (
            "torch.profiler self CPU time of one forward + backward per loss on leaf embeddings (two columns, "
            f"batch {args.batch_size}, d {args.dim}), one thread, summed over {args.repeats} calls after a warm-up"
        ),
        "settings": vars(args) | {"output": str(args.output)},
        "losses": {},
    }
    for name in args.losses:
        results["losses"][name] = profile_loss(name, args.batch_size, args.dim, args.repeats, args.seed)
        print(f"{name}: {results['losses'][name]['total_ms_per_call']:.1f} ms per call", flush=True)
    results["load_average_before_after"] = [load_before, list(os.getloadavg())]
    results.update(provenance(argv))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    args.output.with_suffix(".md").write_text(markdown(results))
    return results


if __name__ == "__main__":
    main()
