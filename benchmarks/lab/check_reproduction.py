"""Do the study scripts on benchmarks/lab's runner write the lines the scripts before it wrote?

Runs study 1 (``simclr_study.py``: InfoNCE, WEINCE, RB-Sigmoid, previous setup) and the released-setup ablation
(``simclr_ablation.py``: InfoNCE and the composite) at one short configuration on CIFAR-10, once from an older
checkout (``--old-checkout``: a git worktree of the commit before the runner, with its own ``PYTHONPATH``) and once
from this one, same seeds, and compares every JSON line field by field: equal means bit for bit (the same JSON
number). Timings, dates, commits, commands and the script hash are left out; they differ by nature.

    git worktree add /tmp/lab-main d3e8479
    OMP_NUM_THREADS=1 python benchmarks/lab/check_reproduction.py --old-checkout /tmp/lab-main
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "benchmarks" / "results" / "lab_reproduction.json"
SHORT = dict(width=4, limit_train=1024, limit_test=512, batch_size=128, epochs=2, probe_subset=256, probe_epochs=10)
SHORT.update(full_eval_epochs=[1], pot_images=200, pot_quantile=0.99)  # 200 images: 199 exceedances of all pairs
STUDIES = {  # script -> (configuration changes, runs)
    "simclr_study.py": ({}, ["infonce-seed0", "weince-seed0", "rb-sigmoid-seed0"]),
    "simclr_ablation.py": ({"full_eval_epochs": []}, ["infonce-seed0", "composite-seed0"]),
}
VARYING = {"train_seconds", "eval_seconds", "elapsed_seconds", "load_average", "date_utc", "git_commit", "command"}
VARYING |= {"script_sha256", "machine"}


def run(checkout: Path, script: str, out: Path, data: Path, override: dict[str, Any], runs: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(checkout / "benchmarks" / script), "--data-dir", str(data)]
    command += ["--output-dir", str(out / "results"), "--state-dir", str(out / "state"), "--runs", *runs]
    subprocess.run([*command, "--override", json.dumps({**SHORT, **override})], env=env, cwd=checkout, check=True)


def differences(old: Any, new: Any, where: str) -> tuple[int, list[str]]:
    """(number of leaf fields compared, the paths where old and new differ)."""
    if isinstance(old, dict) and isinstance(new, dict):
        count, out = 0, [f"{where}.{k}: only in one" for k in sorted(set(old) ^ set(new))]
        for key in sorted(set(old) & set(new) - VARYING):
            n, diff = differences(old[key], new[key], f"{where}.{key}")
            count, out = count + n, out + diff
        return count, out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = [differences(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(old, new))]
        return sum(n for n, _ in pairs), [d for _, diff in pairs for d in diff]
    return 1, [] if old == new else [f"{where}: {old!r} != {new!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old-checkout", type=Path, required=True)
    parser.add_argument(
        "--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "cifar10" / "cifar10-jpg.zip"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lab-reproduction"))
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    old_commit = subprocess.run(["git", "-C", str(args.old_checkout), "rev-parse", "HEAD"], capture_output=True)
    report: dict[str, Any] = {"configuration": SHORT, "old_commit": old_commit.stdout.decode().strip(), "runs": {}}
    for script, (override, runs) in STUDIES.items():
        for side, checkout in (("old", args.old_checkout), ("new", REPO)):
            run(checkout, script, args.work_dir / script / side, args.data_dir, override, runs)
        for name in runs:
            lines = {
                side: (args.work_dir / script / side / "results" / f"{name}.jsonl").read_text().splitlines()
                for side in ("old", "new")
            }
            old, new = ([json.loads(line) for line in lines[side]] for side in ("old", "new"))
            count, diff = differences(old, new, name) if len(old) == len(new) else (0, ["line count"])
            report["runs"][f"{script} {name}"] = {
                "lines": [r["type"] for r in new],
                "fields_compared": count,
                "fields_different": diff,
                "final_linear_top1": new[-1]["linear_top1"],
                "final_knn_top1": new[-1]["knn_top1"],
                "final_train_loss": new[-1]["train_loss"],
            }
            print(f"{script} {name}: {count} fields, {len(diff)} different", flush=True)
    from st_weince.utils.provenance import provenance

    report["provenance"] = provenance()
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
