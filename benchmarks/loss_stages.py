"""Wall-clock time and minor page faults per stage of WEINCELoss's forward + backward (the steps of
``WEINCELoss._loss_from_embeddings``, replayed one by one), and the page faults per call of each loss in the
interleaved run of benchmarks/loss_overhead.py: where the loss's time goes without the profiler.

torch.profiler's operator self times are wall time per operator, and an operator that writes a freshly allocated
[A, C] tensor pays for the first touch of its pages (a page fault per 4 KiB); how many pages are fresh depends on the
allocator's heap (glibc trims and maps large blocks), which the profiler's own allocations change. This script
counts them (``getrusage`` minor faults) beside the time of each stage.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/loss_stages.py   # batch 1,024, d 768: the committed JSON
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.loss_overhead import build_loss, make_embeddings, run_once  # noqa: E402
from st_weince.functional import weince as functional  # noqa: E402
from st_weince.functional.checks import full_precision  # noqa: E402
from st_weince.functional.composite import composite_loss  # noqa: E402
from st_weince.losses import _weince_rows as rows  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def staged_step(loss, embeddings: list[torch.Tensor], mark) -> None:
    """One forward + backward of ``loss`` (WEINCELoss, one candidate group), ``mark(stage)`` after each stage."""
    for embedding in embeddings:
        embedding.grad = None
    options = loss.options
    with full_precision(*embeddings):
        queries, docs, offset, keys = loss._columns(embeddings, None)
        mark("columns: normalise, the checks' one sync")
        layout, counts = loss._layout(queries, docs, keys, offset, 0, embeddings[0].shape[0])
        mark("layout: the similarity matmul")
        group = layout.groups[0]
        top_m = options.top_m if rows.shares_the_sort(layout) else None
        width = rows.sort_width(group.scores.shape[1], options.math, top_m)
        hardest = functional.hardest_negatives(
            group.scores, group.positive_index, group.valid_mask, width, with_columns=top_m is not None
        )
        mark("hardest_negatives: the one top-k per row")
        fit = functional.weince_tail_fit(
            group.scores, group.positive_index, group.valid_mask, options.math, hardest=hardest
        )
        mark("weince_tail_fit (after the sort)")
        stats = [functional.statistics_from_fit(fit, options.math, gather=loss._gather)]
        mark("statistics_from_fit: pivot, lambda")
        blend = rows.rows_loss(layout, stats, options.scale, options.math.eps).mean()
        mark("blended cross-entropy, forward")
        blend_scale = loss._blend_scale(group.scores, group.valid_mask, stats[0])
        mark("blend effective scale (logged)")
        if options.top_m is None:
            loss._record(stats[0], counts, blend_scale=blend_scale)
            mark("record the statistics")
            total = blend
        else:
            units = rows.top_m_units(layout, [hardest])
            tail = rows.batch_tail(units, embeddings[0].shape[0], options.top_m, False)
            mark("batch_negative_tail: the flat top-k")
            beta_t, batch_fit = loss._advance_batch_beta(tail)
            mark("batch_tail_fit, moving average")
            infonce_scale = options.top_m.infonce_logit_scale(options.scale)
            shortfall, infonce, shortfall_scale = rows.top_m_rows(units, beta_t, options.top_m, infonce_scale)
            mark("top-M terms, forward")
            composite = composite_loss(blend, shortfall.mean(), infonce.mean(), options.top_m)
            scales = rows.top_m_effective_scales(shortfall_scale.mean(), infonce_scale, options.top_m)
            values = rows.composite_values(composite.shares(), beta_t, batch_fit, scales)
            loss._record(stats[0], counts, values, blend_scale)
            mark("composite total, record the statistics")
            total = composite.total
    total.backward()
    mark("backward (all of it)")


def stage_table(name: str, batch_size: int, dim: int, repeats: int) -> dict:
    loss = build_loss(name)
    embeddings = make_embeddings(batch_size, 2, dim, "cpu", 0)
    seconds, faults = defaultdict(list), defaultdict(list)
    for record in [False] * 3 + [True] * repeats:
        last = [time.perf_counter(), minor_faults()]

        def mark(stage: str, record: bool = record, last: list = last) -> None:
            now, now_faults = time.perf_counter(), minor_faults()
            if record:
                seconds[stage].append(now - last[0])
                faults[stage].append(now_faults - last[1])
            last[:] = [now, now_faults]

        staged_step(loss, embeddings, mark)
    return {
        stage: {"ms": 1e3 * statistics.median(seconds[stage]), "minor_faults": statistics.median(faults[stage])}
        for stage in seconds
    }


def interleaved_faults(names: list[str], batch_size: int, dim: int, repeats: int) -> dict:
    """Per loss: median process CPU time, the median paired ratio vs MNRL and the minor faults per call, in
    loss_overhead.py's interleaved order."""
    result = {}
    for layout, num_columns in (("pairs", 2), ("hard_negatives", 3)):
        embeddings = make_embeddings(batch_size, num_columns, dim, "cpu", 0)
        losses = {name: build_loss(name) for name in names}
        for loss in losses.values():
            run_once(loss, embeddings)
        samples = {name: [] for name in names}
        for _ in range(repeats):
            for name, loss in losses.items():
                faults, start = minor_faults(), time.process_time()
                run_once(loss, embeddings)
                samples[name].append((time.process_time() - start, minor_faults() - faults))
        result[layout] = {
            name: {
                "ms": 1e3 * statistics.median(t for t, _ in samples[name]),
                "ratio_vs_mnrl": statistics.median(a[0] / b[0] for a, b in zip(samples[name], samples["mnrl"])),
                "minor_faults_median": statistics.median(f for _, f in samples[name]),
                "minor_faults_max": max(f for _, f in samples[name]),
            }
            for name in names
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks/results/loss_stages_cpu_b1024_d768.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = list(os.getloadavg())
    result = {
        "stages": {
            name: stage_table(name, args.batch_size, args.dim, args.repeats) for name in ("weince", "weince_composite")
        },
        "interleaved": interleaved_faults(
            ["mnrl", "weince", "weince_composite", "rb_sigmoid"], args.batch_size, args.dim, args.repeats
        ),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "load_average_before_after": [load_before, list(os.getloadavg())],
        **provenance(argv),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for name, table in result["stages"].items():
        print(f"\n{name}: {sum(row['ms'] for row in table.values()):.1f} ms (sum of the stages' medians)")
        for stage, row in table.items():
            print(f"  {stage:44s} {row['ms']:7.2f} ms  {row['minor_faults']:6.0f} faults")
    for layout, table in result["interleaved"].items():
        for name, row in table.items():
            print(
                f"{layout:15s} {name:18s} {row['ms']:7.1f} ms  {row['ratio_vs_mnrl']:.3f}x  faults median "
                f"{row['minor_faults_median']:.0f} max {row['minor_faults_max']}"
            )
    return result


if __name__ == "__main__":
    main()
