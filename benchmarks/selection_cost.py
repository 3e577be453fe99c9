"""Where the composite's batch tail takes its values from: what each way of selecting them costs.

The batch tail needs the ``keep = max(1024, 5 % of K_all)`` largest negative scores of the whole batch. They lie
within the rows' own top entries only if each row's sort holds every negative the row could contribute: with
``keep`` above a row's count of negatives (any batch of 20 rows or more), that is a full sort of every row. This
times, per batch size (pairs: as many columns as rows), on order-preserving integer keys as the losses select on CPU:

- ``row_top_k``: the rows' shared sort, the top ``max(tail size, M) + 1`` of each row;
- ``row_full_sort``: a sort of every whole row, from which the batch tail would be exact;
- ``flat_top_k``: one top-``keep`` of the flat matrix, what the batch tail does beside the rows' sort.

    python benchmarks/selection_cost.py --output benchmarks/results/selection_cost_cpu.json

Process CPU time, one thread, the three interleaved in each repeat; the median per batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.timing import Clock  # noqa: E402
from st_weince.functional.batch_tail import batch_tail_size  # noqa: E402
from st_weince.functional.checks import order_keys  # noqa: E402
from st_weince.functional.options import RELEASED_COMPOSITE  # noqa: E402
from st_weince.functional.top_m import top_m_width  # noqa: E402
from st_weince.functional.weince import max_tail_size  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--output",
        type=Path, default=scratch(__file__, "selection_cost_cpu.json"),
        help="JSON path (default in runs/benchmarks/; the docstring names the committed one)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = RELEASED_COMPOSITE
    clock = Clock("cpu")
    rows = []
    for batch in args.batch_sizes:
        keys = order_keys(torch.rand(batch, batch, generator=torch.Generator().manual_seed(batch)) * 2 - 1)
        width = max(max_tail_size(batch, options), top_m_width(batch, options.top_m.m)) + 1
        keep = min(keys.numel(), batch_tail_size(batch * (batch - 1), options.top_m))
        ways = {
            "row_top_k": lambda keys=keys, width=width: keys.topk(width, dim=1, sorted=True),
            "row_full_sort": lambda keys=keys: keys.sort(dim=1, descending=True),
            "flat_top_k": lambda keys=keys, keep=keep: keys.reshape(-1).topk(keep, sorted=True),
        }
        for way in ways.values():
            way()  # warm-up
        samples = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():
                samples[name].append(clock(way))
        row = {"batch": batch, "row_width": width, "keep": keep}
        row.update({f"{name}_ms": 1e3 * statistics.median(values) for name, values in samples.items()})
        rows.append(row)
        print(row)
    result = {**provenance(), "repeats": args.repeats, "clock": "process CPU time, one thread", "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
