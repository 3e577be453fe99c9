"""How many operators one loss call runs: top-level ATen operators in one forward + backward, host syncs, and what
``torch._dynamo.explain`` sees, for MNRL, WEINCE, the released composite and RB-Sigmoid.

On a GPU in eager mode every operator is at least one kernel launch, so the count is a fixed cost per step that does
not shrink with the batch. A top-level operator is a profiler event named ``aten::...`` with no ``aten::`` event among
its parents (an operator that calls others counts once); forward and backward of ``compute_loss_from_embeddings`` on
given embeddings, after two warm-up calls. The count does not depend on the batch (it is the same at 64 and 1,024).

    python benchmarks/operator_count.py --output benchmarks/results/operator_count.json
    git worktree add /tmp/before 107712d
    python benchmarks/operator_count.py --before /tmp/before --output benchmarks/results/operator_count.json

``--before`` counts another checkout's losses too (a subprocess with that checkout's package), side by side.
Each loss is counted on a step that logs its statistics and on one that does not (``log_statistics``: the trainer
integration computes them at its logging steps only); a checkout without that switch logs on every step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LOSSES = ("mnrl", "weince", "weince_composite", "rb_sigmoid")
#: the issue's bounds, as multiples of MNRL's count
TARGETS = {"weince": 3.0, "weince_composite": 5.0, "rb_sigmoid": 2.0}


def build_loss(name: str, **options):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from st_weince.losses import RBSigmoidLoss, WEINCELoss

    if name == "mnrl":
        return MultipleNegativesRankingLoss(None)
    if name == "weince":
        return WEINCELoss(None, **options)
    if name == "weince_composite":
        return WEINCELoss.released(None, **options)
    return RBSigmoidLoss(None, **options)


def embeddings(batch: int, columns: int, dim: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(batch, dim, generator=generator)
    return [(base + 0.7 * torch.randn(batch, dim, generator=generator)).requires_grad_() for _ in range(columns)]


def call(loss, columns: list[torch.Tensor]) -> None:
    for column in columns:
        column.grad = None
    loss.compute_loss_from_embeddings(columns, None).backward()


def top_level_operators(loss, columns: list[torch.Tensor]) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        call(loss, columns)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        call(loss, columns)
    counts: Counter = Counter()
    for event in profiler.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            counts[event.name] += 1
    return counts


def count(batch_sizes: list[int]) -> dict:
    """Every loss, layout and batch of this process's ``st_weince``."""
    results: dict = {}
    for batch in batch_sizes:
        for layout, columns in (("pairs", 2), ("hard_negatives", 3)):
            for name in LOSSES:
                for logged in (True, False):
                    if name == "mnrl" and not logged:
                        continue
                    loss = build_loss(name)
                    loss.log_statistics = logged  # an attribute the loss ignores where it has no such switch
                    operators = top_level_operators(loss, embeddings(batch, columns))
                    key = f"{layout}/b{batch}/{name}" + ("" if logged or name == "mnrl" else "/no_statistics")
                    results[key] = {"total": sum(operators.values()), "by_operator": dict(operators.most_common())}
    return results


def hot_path_checks() -> dict:
    """Host syncs of one forward + backward (with and without the input checks) and ``torch._dynamo.explain`` of the
    forward without them, for each loss at batch 64."""
    from st_weince.utils.hotpath import count_host_syncs

    checks: dict = {}
    for name in LOSSES[1:]:
        entry = {}
        for check_inputs in (True, False):
            loss, columns = build_loss(name, check_inputs=check_inputs), embeddings(64, 2)
            call(loss, columns)
            with count_host_syncs() as syncs:
                call(loss, columns)
            entry[f"host_syncs_check_inputs_{check_inputs}"] = syncs.total
        torch._dynamo.reset()
        loss, columns = build_loss(name, check_inputs=False), embeddings(64, 2)
        explanation = torch._dynamo.explain(loss.compute_loss_from_embeddings)(columns, None)
        entry["dynamo_graphs"] = explanation.graph_count
        entry["dynamo_graph_breaks"] = explanation.graph_break_count
        entry["dynamo_operators"] = sum(len(ops) for ops in explanation.ops_per_graph)
        checks[name] = entry
    return checks


def commit_of(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def counted_elsewhere(checkout: Path, batch_sizes: list[int]) -> dict:
    """:func:`count` in a subprocess whose ``st_weince`` is ``checkout``'s."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, __file__, "--count-only", "--batch-sizes", *map(str, batch_sizes)]
    done = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(counts: dict) -> dict:
    """Per layout and batch: each loss's count, and its multiple of MNRL's."""
    table: dict = {}
    for key, value in counts.items():
        layout, batch, name, *rest = key.split("/")
        mnrl = counts[f"{layout}/{batch}/mnrl"]["total"]
        table[key] = {"total": value["total"], "times_mnrl": round(value["total"] / mnrl, 2)}
        if name in TARGETS:
            table[key]["target_times_mnrl"] = TARGETS[name]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--before", type=Path, help="another checkout to count beside this one")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--count-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.count_only:
        print(json.dumps(count(args.batch_sizes)))
        return
    sys.path.insert(0, str(REPO))
    from st_weince.utils.provenance import provenance

    after = count(args.batch_sizes)
    document = {
        "what": "top-level ATen operators in one forward + backward of compute_loss_from_embeddings (d 64)",
        "after": {"commit": commit_of(REPO), "summary": summary(after), "counts": after},
        "hot_path": hot_path_checks(),
        "provenance": provenance(),
    }
    if args.before is not None:
        before = counted_elsewhere(args.before, args.batch_sizes)
        document["before"] = {"commit": commit_of(args.before), "summary": summary(before), "counts": before}
    for label in ("before", "after"):
        if label in document:
            print(f"{label} ({document[label]['commit'][:7]}):")
            for key, row in document[label]["summary"].items():
                print(f"  {key:45s} {row['total']:5d}  {row['times_mnrl']:5.2f}x MNRL")
    print(json.dumps(document["hot_path"], indent=1))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
