"""Old code beside new code: the loss-cost ratios of two checkouts, measured in alternating processes.

Each round runs ``benchmarks/loss_overhead.py`` once with each checkout's own copy of the script (so each imports its
own ``st_weince``), the two in alternating order, on the same machine one after the other. Within a process every
loss is timed against MNRL in the same interleaved repeats, so a ratio does not depend on how fast the machine was
during that process; across rounds the median of the rounds' ratios is reported, with the rounds' range.

    git worktree add /tmp/before <commit before the change>
    python benchmarks/loss_cost_before_after.py --before /tmp/before --rounds 3 \
        --output benchmarks/results/loss_cost_before_after_b1024_d768.json

Writes the JSON (per layout, batch and loss: the ratio vs MNRL before and after, each round's, the peak of live
tensor memory before and after unless ``--no-memory``; both commits, the machine, the versions, the load average
before and after) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

LOSSES = ("mnrl", "weince", "weince_composite", "rb_sigmoid")


def commit_of(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def measure(checkout: Path, arguments: list[str]) -> dict:
    """One run of ``checkout``'s loss_overhead.py with its own package; its JSON."""
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "result.json"
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        script = checkout / "benchmarks" / "loss_overhead.py"
        command = [sys.executable, str(script), *arguments, "--output", str(output)]
        subprocess.run(command, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(output.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the old code")
    parser.add_argument("--after", type=Path, default=REPO, help="a checkout of the new code (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1024])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES))
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--output", type=Path, default=scratch(__file__, "loss_cost_before_after.json"))
    args = parser.parse_args(argv)
    if "mnrl" not in args.losses:
        raise SystemExit("--losses must include mnrl, the baseline of every ratio")

    shared = ["--batch-sizes", *map(str, args.batch_sizes), "--dim", str(args.dim), "--repeats", str(args.repeats)]
    shared += ["--threads", "1", "--losses", *args.losses] + (["--no-memory"] if args.no_memory else [])
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    order = [("before", "after") if r % 2 == 0 else ("after", "before") for r in range(args.rounds)]
    for first, second in tqdm(order, desc="rounds (old and new code, alternating)"):
        for side in (first, second):
            runs[side].append(measure(sides[side], shared))

    rows = []
    for reference in runs["after"][0]["rows"]:
        key = (reference["layout"], reference["batch_size"], reference["loss"])
        row = {"layout": key[0], "batch_size": key[1], "loss": key[2]}
        for side in ("before", "after"):
            matches = [
                next(r for r in run["rows"] if (r["layout"], r["batch_size"], r["loss"]) == key) for run in runs[side]
            ]
            ratios = [m["time_ratio_vs_mnrl"] for m in matches]
            row[f"{side}_ratio_vs_mnrl"] = statistics.median(ratios)
            row[f"{side}_ratio_rounds"] = ratios
            row[f"{side}_seconds"] = statistics.median(m["seconds"] for m in matches)
            if "peak_bytes" in matches[0]:
                row[f"{side}_peak_bytes"] = matches[0]["peak_bytes"]  # deterministic: the same in every round
        if "before_peak_bytes" in row and row["before_peak_bytes"]:
            row["peak_bytes_change"] = row["after_peak_bytes"] / row["before_peak_bytes"] - 1
        rows.append(row)

    result = {
        **provenance(),
        "before_commit": commit_of(sides["before"]),
        "after_commit": commit_of(sides["after"]),
        "load_average_1_5_15min": {"before": list(load_before), "after": list(os.getloadavg())},
        "rounds": args.rounds,
        "measurement": runs["after"][0]["command"] if "command" in runs["after"][0] else shared,
        "seed": runs["after"][0]["seed"],
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown_table(result))
    return result


def markdown_table(result: dict) -> str:
    lines = [
        "| layout | batch | loss | before vs MNRL | after vs MNRL | rounds after | peak memory change |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for row in result["rows"]:
        if row["loss"] == "mnrl":
            continue
        rounds = ", ".join(f"{r:.2f}" for r in row["after_ratio_rounds"])
        memory = f"{row['peak_bytes_change']:+.1%}" if "peak_bytes_change" in row else "-"
        lines.append(
            f"| {row['layout']} | {row['batch_size']} | {row['loss']} | {row['before_ratio_vs_mnrl']:.2f}x | "
            f"{row['after_ratio_vs_mnrl']:.2f}x | {rounds} | {memory} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
