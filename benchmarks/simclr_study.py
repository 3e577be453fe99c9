"""The long SimCLR study: InfoNCE, WEINCE and RB-Sigmoid (3 seeds each) on all of CIFAR-10.

One CPU core per run. The configuration (``STUDY``) is the largest that fits about 45 minutes per run on one core of
this machine (timings in docs/evidence.md): CIFAR-stem ResNet-18 of width 16, batch 256 pairs, 10 epochs over all
50,000 training images, channels_last, the vision defaults of the losses (temperature 0.5, WEINCE beta 1, RB-Sigmoid
from its class defaults), Adam lr 1e-3, weight decay 1e-6.

The loop, the checkpoints and the resume are those of the study runner (benchmarks/lab/simclr_runner.py): per
seed every loss sees the identical initialisation, batches and augmentations; each checkpoint (epoch 0 and every
epoch) appends one JSON line to ``<output-dir>/<loss>-seed<k>.jsonl`` with the probes on a fixed class-balanced
subset of ``probe_subset`` training images (``"type": "full"`` at ``full_eval_epochs`` and ``"final"`` at the end:
on all 50,000), weighted k-NN at k = 20, the loss's own statistics, WEINCE's statistics of the encoder on a fixed
batch, and the POT shape xi of the test projections and backbone features at the quantile 0.999 of
docs/diagnostics.md. Runs go in the order of ``RUN_ORDER``; consecutive runs of one seed (InfoNCE and WEINCE of seed
k) advance one epoch at a time in turn, so the paired comparison of a seed grows epoch by epoch.

    # the study, in the background, one core (runs in the order of RUN_ORDER)
    OMP_NUM_THREADS=1 setsid nohup python benchmarks/simclr_study.py > /work/st-weince-study.log 2>&1 &
    # tables, paired differences and curves from whatever has landed
    python benchmarks/simclr_study.py --summarize
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks.lab import plots, runlog, summaries  # noqa: E402
from benchmarks.lab import simclr_runner as runner  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

OUTPUT = REPO / "benchmarks" / "results" / "simclr_study"
STATE = Path("/work/st-weince-study-state")
STUDY = runner.STUDY  # study 1 is the runner's own configuration
# Most informative first: a complete InfoNCE/WEINCE pair per seed, RB-Sigmoid last.
RUN_ORDER = [
    ("infonce", 0),
    ("weince", 0),
    ("infonce", 1),
    ("weince", 1),
    ("infonce", 2),
    ("weince", 2),
    ("rb-sigmoid", 0),
    ("rb-sigmoid", 1),  # seeds 1 and 2 added after the first 7 runs: RB-Sigmoid's k-NN gain needed a spread
    ("rb-sigmoid", 2),
]
METRICS = ("linear_top1", "knn_top1")


def compare_full(records: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per loss mean +- std and paired (same seed) differences to InfoNCE of full evaluations at one epoch."""
    by_loss: dict[str, dict[int, dict[str, Any]]] = {}
    for name, record in records.items():
        by_loss.setdefault(runs[name]["loss"], {})[runs[name]["seed"]] = record
    per_loss: dict[str, Any] = {}
    for loss, done in ((loss, by_loss[loss]) for loss in runner.LOSSES if by_loss.get(loss)):
        per_loss[loss] = {
            "seeds": sorted(done),
            **{m: summaries.mean_std([r[m] for r in done.values()]) for m in METRICS},
            "xi_projection": summaries.mean_std([r["pot_projection"]["xi"] for r in done.values()]),
            "encoder_lambda_mean": summaries.mean_std(
                [r["encoder_weince_statistics"]["lambda_mean"] for r in done.values()]
            ),
            "train_seconds": summaries.mean_std([r["train_seconds"] for r in done.values()]),
        }
    paired: dict[str, Any] = {}
    for loss in ("weince", "rb-sigmoid"):
        difference = summaries.paired_difference(by_loss.get(loss, {}), by_loss.get("infonce", {}), METRICS)
        if difference is not None:
            paired[f"{loss}_minus_infonce"] = difference
    return {"per_loss": per_loss, "paired": paired}


def summarize(output_dir: Path) -> dict[str, Any]:
    """summary.json, summary.md and curves.png from the run files in ``output_dir``."""
    runs = {
        name: {
            "loss": records[0]["loss"],
            "seed": records[0]["seed"],
            "config": records[0]["config"],
            "header": {k: records[0].get(k) for k in runlog.HEADER_KEYS},
            "checkpoints": [r for r in records if r.get("type") == "checkpoint"],
            "final": runlog.final_record(records),
            "full": [r for r in records if r.get("type") in ("full", "final")],
            "resumes": sum(r.get("type") == "resume" for r in records),
        }
        for name, records in runlog.run_files(output_dir).items()
    }
    finals = {name: run for name, run in runs.items() if run["final"] is not None}
    full_epochs = sorted({r["epoch"] for run in runs.values() for r in run["full"]})
    full_evaluations = {
        str(epoch): compare_full(
            {
                name: next(r for r in run["full"] if r["epoch"] == epoch)
                for name, run in runs.items()
                if any(r["epoch"] == epoch for r in run["full"])
            },
            runs,
        )
        for epoch in full_epochs
    }
    last = full_evaluations.get(str(max(run["config"]["epochs"] for run in runs.values()))) if runs else None
    per_loss, paired = (last["per_loss"], last["paired"]) if last else ({}, {})
    # Curves along training (subset probes), per run and mean per loss at every epoch reached by all its runs.
    curves: dict[str, Any] = {}
    for name, run in sorted(runs.items()):
        curves[name] = {
            "epoch": [c["epoch"] for c in run["checkpoints"]],
            "linear_top1": [c["linear_top1"] for c in run["checkpoints"]],
            "knn_top1": [c["knn_top1"] for c in run["checkpoints"]],
            "xi_projection": [c["pot_projection"]["xi"] for c in run["checkpoints"]],
            "xi_backbone": [c["pot_backbone"]["xi"] for c in run["checkpoints"]],
            "encoder_lambda_mean": [c["encoder_weince_statistics"]["lambda_mean"] for c in run["checkpoints"]],
            "train_lambda_mean": [c["loss_statistics"].get("weince_lambda_mean") for c in run["checkpoints"]],
            "train_loss": [c["train_loss"] for c in run["checkpoints"]],
            "train_seconds": [c["train_seconds"] for c in run["checkpoints"]],
        }
    paired_curves: dict[str, Any] = {}
    for run in runs.values():
        if run["loss"] != "weince" or runlog.run_name("infonce", run["seed"]) not in runs:
            continue
        base = {c["epoch"]: c for c in runs[runlog.run_name("infonce", run["seed"])]["checkpoints"]}
        mine = {c["epoch"]: c for c in run["checkpoints"]}
        epochs = sorted(set(base) & set(mine))
        paired_curves[f"seed{run['seed']}"] = {
            "epoch": epochs,
            **{f"{m}_difference": [mine[e][m] - base[e][m] for e in epochs] for m in METRICS},
        }
    # Mean +- std over the seeds that reached each epoch with both losses (subset probes).
    paired_along_training: list[dict[str, Any]] = []
    for epoch in sorted({e for curve in paired_curves.values() for e in curve["epoch"]}):
        seeds = [key for key, curve in sorted(paired_curves.items()) if epoch in curve["epoch"]]
        row: dict[str, Any] = {"epoch": epoch, "seeds": seeds}
        for m in METRICS:
            values = [paired_curves[k][f"{m}_difference"][paired_curves[k]["epoch"].index(epoch)] for k in seeds]
            row[m] = summaries.mean_std(values)
            row[f"{m}_per_seed"] = values
        paired_along_training.append(row)
    any_run = next(iter(runs.values()), None)
    summary = {
        "description": (
            "issue 14 study 1: SimCLR on CIFAR-10 (JPEG copy), CPU, one thread per run; accuracies in percent on "
            "the 10,000 test images; final metrics with probes trained on all 50,000 training images, curves with "
            "probes on the fixed class-balanced subset of config.probe_subset images; k-NN weighted, k = 20, "
            "temperature 0.1; mean +- sample std over seeds; paired = same seed (same init, batches, views)."
        ),
        "config": any_run["config"] if any_run else STUDY,
        "runs_present": sorted(runs),
        "runs_finished": sorted(finals),
        "runs_missing": [runlog.run_name(loss, s) for loss, s in RUN_ORDER if runlog.run_name(loss, s) not in finals],
        "per_loss_final": per_loss,
        "paired_final": paired,
        "full_evaluations": full_evaluations,
        "paired_curves": paired_curves,
        "paired_along_training": paired_along_training,
        "curves": curves,
        "finals": {
            name: {
                "linear_top1": run["final"]["linear_top1"],
                "knn_top1": run["final"]["knn_top1"],
                "xi_projection": run["final"]["pot_projection"]["xi"],
                "xi_backbone": run["final"]["pot_backbone"]["xi"],
                "encoder_weince_statistics": run["final"]["encoder_weince_statistics"],
                "loss_statistics": run["final"]["loss_statistics"],
                "train_seconds": run["final"]["train_seconds"],
                "elapsed_seconds": run["final"]["elapsed_seconds"],
                "resumes": run["resumes"],
            }
            for name, run in sorted(finals.items())
        },
        "provenance_of_runs": {name: run["header"] for name, run in sorted(runs.items())},
        "summary_provenance": provenance(),
    }
    summaries.write_summary(output_dir, summary, markdown(summary))
    plots.plot_curves(runs, output_dir / "curves.png")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    lines: list[str] = []
    if not summary["full_evaluations"]:
        lines += ["No full evaluation yet (they come at the epochs in config.full_eval_epochs and at the end).", ""]
    for epoch, block in summary["full_evaluations"].items():
        lines += [
            f"Epoch {epoch}: probes on all training images, 10,000 test images; mean +- sample std over seeds",
            "",
            "| loss | seeds | linear top-1 (%) | k-NN top-1, k=20 (%) | xi (projections) | encoder mean lambda |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for loss, stats in block["per_loss"].items():
            lines.append(
                f"| {loss} | {', '.join(map(str, stats['seeds']))} | {summaries.format_stat(stats['linear_top1'])} "
                f"| {summaries.format_stat(stats['knn_top1'])} | {summaries.format_stat(stats['xi_projection'], 3)} "
                f"| {summaries.format_stat(stats['encoder_lambda_mean'], 3)} |"
            )
        lines += ["", f"Epoch {epoch}, paired by seed (same initialisation, batches and augmentations), points", ""]
        lines += summaries.paired_table(block["paired"])
        lines.append("")
    lines += ["WEINCE - InfoNCE along training, paired by seed (probes on the fixed subset), points", ""]
    lines += [
        "| epoch | seeds | linear top-1 | k-NN top-1 | per seed (linear / k-NN) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in summary["paired_along_training"]:
        per_seed = "; ".join(
            f"{seed}: {lin:+.2f} / {knn:+.2f}"
            for seed, lin, knn in zip(row["seeds"], row["linear_top1_per_seed"], row["knn_top1_per_seed"])
        )
        lines.append(
            f"| {row['epoch']} | {len(row['seeds'])} | {summaries.format_stat(row['linear_top1'], sign=True)} "
            f"| {summaries.format_stat(row['knn_top1'], sign=True)} | {per_seed} |"
        )
    lines += ["", "Along training, per run (probes on the fixed subset; lambda: WEINCE's statistics)", ""]
    lines += [
        "| run | epoch | linear top-1 | k-NN top-1 | xi projections | xi backbone | lambda encoder (fixed batch) "
        "| lambda in training | train loss | train s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    for name, curve in summary["curves"].items():
        for i, epoch in enumerate(curve["epoch"]):
            lines.append(
                f"| {name} | {epoch} | {curve['linear_top1'][i]:.2f} | {curve['knn_top1'][i]:.2f} "
                f"| {summaries.number(curve['xi_projection'][i], 3)} | {summaries.number(curve['xi_backbone'][i], 3)} "
                f"| {curve['encoder_lambda_mean'][i]:.3f} | {summaries.number(curve['train_lambda_mean'][i], 3)} "
                f"| {summaries.number(curve['train_loss'][i], 4)} | {curve['train_seconds'][i]:.0f} |"
            )
    if summary["runs_missing"]:
        lines += ["", f"Not finished yet: {', '.join(summary['runs_missing'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    runner.main(argv, sys.modules[__name__], STUDY, runner.LOSSES, block="simclr_study", summarize_each_epoch=True)


if __name__ == "__main__":
    main()
