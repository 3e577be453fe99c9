"""Reduced-scale CIFAR-10 comparison of InfoNCE, WEINCE and RB-Sigmoid with recipes/simclr.py (CPU, offline).

Every run gets the identical budget (same backbone, width, batch, steps, data subset, evaluation); only the loss and
the seed change. Runs go one after another (one CPU thread each, so another job can share the machine), each in
its own process, logging to ``<runs-dir>/<loss>-seed<k>/log.txt``; a finished run (``results.json`` present) is not
repeated, so the script can be re-started to add seeds. InfoNCE and WEINCE run first (seed-major), then RB-Sigmoid.

    OMP_NUM_THREADS=1 python benchmarks/simclr_compare.py            # run what is missing, then summarise
    python benchmarks/simclr_compare.py --summarize-only             # only rebuild the summary

Outputs: ``benchmarks/results/simclr/summary.json`` (scale, command, machine, versions, per-run metrics, mean and
sample std per loss, per-seed differences to InfoNCE), ``summary.csv`` (one row per run), ``summary.md`` (table) and
``runs/<loss>-seed<k>.json`` (each run's results.json). Trained encoders stay in ``<runs-dir>`` (git-ignored).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks.lab.summaries import mean_std  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results" / "simclr"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "cifar10" / "cifar10-jpg.zip"
LOSSES = ("infonce", "weince", "rb-sigmoid")

# The reduced scale (see docs/vision.md for what it can and cannot show).
SCALE: dict[str, Any] = {
    "dataset": "cifar10",
    "backbone": "resnet18",
    "width": 8,
    "hidden_dim": 512,
    "projection_dim": 64,
    "batch_size": 64,
    "max_steps": 400,
    "lr": 1e-3,
    "weight_decay": 1e-6,
    "temperature": 0.5,
    "beta": 1.0,
    "limit_train": 10000,
    "limit_eval": 2000,
    "probe_epochs": 100,
}


# summary name -> the recipe's throughput key
THROUGHPUT = {
    "data_pipeline_source_images_per_second": "source_images_per_second_data_pipeline",
    "augmented_views_per_second": "augmented_views_per_second",
    "train_pairs_per_second": "train_pairs_per_second",
    "seconds_per_step": "seconds_per_step",
}


def run_command(loss: str, seed: int, output_dir: Path, data_dir: Path, scale: dict[str, Any]) -> list[str]:
    command = [sys.executable, str(REPO / "recipes" / "simclr.py"), "--loss", loss, "--seed", str(seed)]
    command += ["--data-dir", str(data_dir), "--output-dir", str(output_dir), "--threads", "1", "--log-every", "20"]
    for key, value in scale.items():
        if key == "temperature":  # the recipe's flag is the scale, 1 / temperature
            if loss != "rb-sigmoid":  # for RB-Sigmoid --scale is its starting t; the committed runs used its default
                command += ["--scale", str(1.0 / value)]
        elif key == "beta":  # a WEINCE option
            command += ["--loss-option", f"beta={value}"]
        else:
            command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def run_one(loss: str, seed: int, runs_dir: Path, data_dir: Path, scale: dict[str, Any]) -> bool:
    output_dir = runs_dir / f"{loss}-seed{seed}"
    if (output_dir / "results.json").exists():
        print(f"[skip] {output_dir.name}: results.json exists", flush=True)
        return True
    output_dir.mkdir(parents=True, exist_ok=True)
    command = run_command(loss, seed, output_dir, data_dir, scale)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    print(f"[run ] {output_dir.name}: {shlex.join(command)}", flush=True)
    started = time.time()
    with open(output_dir / "log.txt", "w") as log:
        process = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False)
    print(f"[done] {output_dir.name}: exit {process.returncode} after {time.time() - started:.0f} s", flush=True)
    return process.returncode == 0


def summarize(runs_dir: Path, seeds: list[int], command: str, missing: list[str]) -> dict[str, Any]:
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    (RESULTS_DIR / "runs").mkdir(parents=True, exist_ok=True)
    for loss in LOSSES:
        for seed in seeds:
            path = runs_dir / f"{loss}-seed{seed}" / "results.json"
            if path.exists():
                result = json.loads(path.read_text())
                runs.setdefault(loss, {})[seed] = result
                (RESULTS_DIR / "runs" / f"{loss}-seed{seed}.json").write_text(json.dumps(result, indent=2) + "\n")
    per_loss: dict[str, Any] = {}
    for loss, by_seed in runs.items():
        results = list(by_seed.values())
        ks = sorted(results[0]["knn"]["top1"], key=int)
        per_loss[loss] = {
            "seeds": sorted(by_seed),
            "linear_top1": mean_std([r["linear_top1"] for r in results]),
            "knn_top1": mean_std([r["knn_top1"] for r in results]),
            "knn_top1_by_k": {k: mean_std([r["knn"]["top1"][k] for r in results]) for k in ks},
            "knn_recall_by_k": {k: mean_std([r["knn"]["recall"][k] for r in results]) for k in ks},
            "final_loss": mean_std([r["final_loss"] for r in results]),
            **{
                name: mean_std([r["throughput"][key] for r in results])
                for name, key in THROUGHPUT.items()
                if all(key in r["throughput"] for r in results)  # earlier recipe runs also timed the views
            },
        }
    # Paired by seed: same initialisation seed and same augmentation stream seed, different loss.
    differences: dict[str, Any] = {}
    for loss in runs:
        if loss == "infonce" or "infonce" not in runs:
            continue
        common = sorted(set(runs[loss]) & set(runs["infonce"]))
        differences[f"{loss}_minus_infonce"] = {
            "seeds": common,
            **{
                metric: mean_std([runs[loss][s][metric] - runs["infonce"][s][metric] for s in common])
                for metric in ("linear_top1", "knn_top1")
            },
        }
    any_result = next((r for by_seed in runs.values() for r in by_seed.values()), None)
    summary = {
        "description": (
            "Reduced-scale SimCLR comparison on CIFAR-10 (JPEG copy, offline), CPU, one thread per run. "
            "Accuracies in percent on a class-balanced test subset; k-NN = weighted vote, temperature 0.1, "
            "knn_top1 at k = 20; linear probe on frozen, standardised features. Mean and sample std over seeds."
        ),
        "scale": SCALE,
        "seeds": seeds,
        **provenance(shlex.split(command)[1:]),  # command, machine, versions, git commit of this summary
        "environment_of_runs": any_result["environment"] if any_result else None,
        "missing_runs": missing,
        "per_loss": per_loss,
        "paired_differences": differences,
        "runs": {
            f"{loss}-seed{seed}": {
                "linear_top1": r["linear_top1"],
                "knn_top1": r["knn_top1"],
                "final_loss": r["final_loss"],
                "train_seconds": r["train_seconds"],
                "loss_parameters": r.get("loss_parameters", {}),
            }
            for loss, by_seed in runs.items()
            for seed, r in sorted(by_seed.items())
        },
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(RESULTS_DIR / "summary.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        ks = ["1", "2", "5", "10", "20", "50"]
        writer.writerow(
            [
                "loss",
                "seed",
                "linear_top1",
                "knn_top1_k20",
                *[f"knn_top1_k{k}" for k in ks],
                *[f"recall_at_{k}" for k in ks],
            ]
            + ["final_loss", "seconds_per_step", "data_pipeline_images_per_second"]
        )
        for loss, by_seed in runs.items():
            for seed, r in sorted(by_seed.items()):
                writer.writerow(
                    [loss, seed, f"{r['linear_top1']:.2f}", f"{r['knn_top1']:.2f}"]
                    + [f"{r['knn']['top1'].get(k, float('nan')):.2f}" for k in ks]
                    + [f"{r['knn']['recall'].get(k, float('nan')):.2f}" for k in ks]
                    + [
                        f"{r['final_loss']:.4f}",
                        f"{r['throughput']['seconds_per_step']:.3f}",
                        f"{r['throughput']['source_images_per_second_data_pipeline']:.0f}",
                    ]
                )
    lines = [
        "| loss | seeds | linear top-1 (%) | k-NN top-1, k=20 (%) | k-NN recall@1 / @5 / @20 (%) "
        "| s/step | pipeline img/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for loss, stats in per_loss.items():
        recall = stats["knn_recall_by_k"]
        lines.append(
            f"| {loss} | {len(stats['seeds'])}"
            f" | {stats['linear_top1']['mean']:.2f} +- {stats['linear_top1']['std']:.2f}"
            f" | {stats['knn_top1']['mean']:.2f} +- {stats['knn_top1']['std']:.2f}"
            f" | {recall['1']['mean']:.1f} / {recall['5']['mean']:.1f} / {recall['20']['mean']:.1f}"
            f" | {stats['seconds_per_step']['mean']:.2f}"
            f" | {stats['data_pipeline_source_images_per_second']['mean']:.0f} |"
        )
    for name, diff in differences.items():
        lines.append(
            f"\n{name} (paired by seed, n={diff['linear_top1']['n']}): linear {diff['linear_top1']['mean']:+.2f} +- "
            f"{diff['linear_top1']['std']:.2f}, k-NN {diff['knn_top1']['mean']:+.2f} +- {diff['knn_top1']['std']:.2f}"
        )
    if missing:
        lines.append(f"\nMissing runs: {', '.join(missing)}")
    (RESULTS_DIR / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "simclr-compare")
    parser.add_argument("--summarize-only", action="store_true")
    args = parser.parse_args()
    command = shlex.join([sys.executable, *sys.argv])
    missing: list[str] = []
    if not args.summarize_only:
        # InfoNCE and WEINCE first (seed-major, so partial results stay balanced), then RB-Sigmoid's seeds.
        queue = [(loss, seed) for seed in args.seeds for loss in args.losses if loss != "rb-sigmoid"]
        queue += [("rb-sigmoid", seed) for seed in args.seeds if "rb-sigmoid" in args.losses]
        for loss, seed in queue:
            if not run_one(loss, seed, args.runs_dir, args.data_dir, SCALE):
                missing.append(f"{loss}-seed{seed} (failed, see its log.txt)")
            summarize(args.runs_dir, args.seeds, command, missing)
    else:
        for loss in args.losses:
            for seed in args.seeds:
                if not (args.runs_dir / f"{loss}-seed{seed}" / "results.json").exists():
                    missing.append(f"{loss}-seed{seed} (not run)")
    summarize(args.runs_dir, args.seeds, command, missing)


if __name__ == "__main__":
    main()
