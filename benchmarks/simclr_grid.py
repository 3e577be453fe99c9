"""Do WEINCE's settings matter for SimCLR, and are the defaults right?

The released code tuned (aic_margin, kappa_rho, kappa_aic) on the 27-point grid {0, 2, 6} x {5, 10, 20} x
{0.5, 1, 2}. Measured before training (benchmarks/weince_grid_statistics.py), aic_margin and kappa_aic do not move
lambda on these encoders: the AIC differences are far above any margin of that grid, so the geometry gate is 1.
The 9 points trained here are therefore a Latin square (every level of every factor three times, every pair of
levels of two factors once, the defaults among the points) of the factors that do act: q {0.1, 0.2, 0.4} (rho0, the
pivot of the hardness gate, is the q-quantile of the batch's shortfalls: it sets which share of the anchors is
blended), kappa_rho {5, 10, 20} (that gate's sharpness) and beta {0.5, 1, 2} (the slope of the shortfall logit, 1 in
the reference code). ``--square released`` trains the released factors instead.

Short configuration of the study runner (benchmarks/lab/simclr_runner.py): CIFAR-stem ResNet-18 of width 8,
batch 256 pairs, 1 epoch, temperature 0.5. The settings are chosen on a held-out part of the training images:
``holdout`` class-balanced training images are never trained on and stand in for the test set; the probes train on
the remaining 45,000. InfoNCE at the same seed (identical batches and augmentations) is the reference. The test set is
not touched here; the best point is then rerun at the full length of study 1 with ``--rerun-best`` (test set,
``--rerun-seeds`` as many seeds as study 1, each paired with study 1's InfoNCE and default WEINCE of that seed).

Output: ``<output-dir>/<point>/<loss>-seed<k>.jsonl`` (the study loop's run files, resumable), and
``<output-dir>/summary.json`` / ``summary.md``: per point the held-out linear and k-NN top-1, the difference to
InfoNCE, WEINCE's mean lambda in training and the POT shape xi; the chosen point (best held-out linear top-1); the
rerun's paired differences to study 1 (final, every full evaluation, the subset-probe curve), plotted in
``<output-dir>/rerun-best/difference.png``.

    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py               # the grid (about 4 minutes a point here)
    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py --summarize
    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py --rerun-best  # the chosen point at study 1's full length
    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py --rerun-best --rerun-seeds 1 2  # (about 45 minutes a seed)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks.lab import simclr_runner as runner  # noqa: E402
from benchmarks.lab.plots import figure  # noqa: E402
from benchmarks.lab.runlog import final_line, final_record, read_lines, run_name  # noqa: E402
from benchmarks.lab.simclr_eval import load_data  # noqa: E402
from benchmarks.lab.summaries import format_stat, mean_std, number, update_docs, write_summary  # noqa: E402
from benchmarks.lab.weince_grid import SQUARES, TRAINED_SQUARE, is_default, latin_square, point_name  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

OUTPUT = REPO / "benchmarks" / "results" / "simclr_grid"
STATE = Path("/work/st-weince-grid-state")
STUDY_OUTPUT = REPO / "benchmarks" / "results" / "simclr_study"  # study 1's run files, the rerun's reference
SHORT: dict[str, Any] = {
    "width": 8,
    "epochs": 1,
    "holdout": 5000,
    "eval_at_start": False,
    "full_eval_epochs": [],
    "pot_images": 2000,
}
METRICS = ("linear_top1", "knn_top1")
REFERENCES = ("infonce", "weince")  # study 1's runs the rerun is paired with: InfoNCE and WEINCE at its defaults


def by_epoch(records: list[dict[str, Any]], types: tuple[str, ...]) -> dict[int, dict[str, Any]]:
    return {r["epoch"]: r for r in records if r.get("type") in types}


def paired_rows(
    mine: dict[int, dict[str, Any]], references: dict[tuple[str, int], dict[int, dict[str, Any]]], seed: int, epoch: int
) -> dict[str, Any]:
    """One seed's accuracies at ``epoch`` and their differences to each study-1 reference that reached it."""
    row: dict[str, Any] = {m: mine[epoch][m] for m in METRICS}
    for loss in REFERENCES:
        base = references[(loss, seed)].get(epoch)
        if base is not None:
            row[f"minus_study_{loss}"] = {m: mine[epoch][m] - base[m] for m in METRICS}
    return row


def aggregate(per_seed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mean +- sample std over seeds of the accuracies and of each paired difference."""
    out: dict[str, Any] = {"seeds": sorted(int(s) for s in per_seed), "per_seed": per_seed}
    out.update({m: mean_std([row[m] for row in per_seed.values()]) for m in METRICS})
    for loss in REFERENCES:
        diffs = [row[f"minus_study_{loss}"] for row in per_seed.values() if f"minus_study_{loss}" in row]
        if diffs:
            out[f"minus_study_{loss}"] = {m: mean_std([d[m] for d in diffs]) for m in METRICS}
    return out


def rerun_comparison(output_dir: Path, study_output: Path) -> dict[str, Any] | None:
    """The chosen point at study 1's full length, every seed run so far, paired by seed with study 1's InfoNCE and
    default WEINCE (identical initialisation, batches and augmentations): the final evaluation per seed and mean +-
    sample std (top level), every full evaluation (probes on all training images) and the subset-probe curve."""
    runs: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((output_dir / "rerun-best").glob("weince-seed*.jsonl")):
        records = read_lines(path)
        if records and records[0].get("type") == "header":
            runs[records[0]["seed"]] = records
    if not runs:
        return None
    study_records = {
        (loss, seed): read_lines(study_output / f"{run_name(loss, seed)}.jsonl") for loss in REFERENCES for seed in runs
    }
    full = {key: by_epoch(records, ("full", "final")) for key, records in study_records.items()}
    curve = {key: by_epoch(records, ("checkpoint",)) for key, records in study_records.items()}
    mine_full = {seed: by_epoch(records, ("full", "final")) for seed, records in runs.items()}
    mine_curve = {seed: by_epoch(records, ("checkpoint",)) for seed, records in runs.items()}

    full_evaluations = {
        str(epoch): aggregate(
            {
                str(seed): paired_rows(mine_full[seed], full, seed, epoch)
                for seed in sorted(runs)
                if epoch in mine_full[seed]
            }
        )
        for epoch in sorted({e for evaluations in mine_full.values() for e in evaluations})
    }
    along_training = [
        {
            "epoch": epoch,
            **aggregate(
                {str(s): paired_rows(mine_curve[s], curve, s, epoch) for s in sorted(runs) if epoch in mine_curve[s]}
            ),
        }
        for epoch in sorted({e for checkpoints in mine_curve.values() for e in checkpoints})
    ]
    finals = {seed: final_record(records) for seed, records in runs.items()}
    final_epochs = {record["epoch"] for record in finals.values() if record is not None}
    final = full_evaluations[str(max(final_epochs))] if final_epochs else {"seeds": [], "per_seed": {}}
    return {
        "options": next(iter(runs.values()))[0]["config"]["weince_options"],
        "seeds_started": sorted(runs),
        **final,
        "full_evaluations": full_evaluations,
        "along_training": along_training,
    }


def plot_rerun(rerun: dict[str, Any], path: Path) -> None:
    """The paired differences along training (subset probes), per seed: the chosen point and study 1's default
    WEINCE, each minus study 1's InfoNCE of the same seed."""
    styles = {
        "chosen": ("tab:purple", f"WEINCE {point_name(rerun['options'])}"),
        "weince": ("tab:red", "WEINCE defaults"),
    }
    with figure(path, 2, (9, 3.4), sharex=True) as axes:
        for ax, metric in zip(axes, METRICS):
            for index, seed in enumerate(rerun["seeds_started"]):
                rows = [r for r in rerun["along_training"] if str(seed) in r["per_seed"]]
                chosen = [(r["epoch"], r["per_seed"][str(seed)].get("minus_study_infonce")) for r in rows]
                chosen = [(e, d[metric]) for e, d in chosen if d is not None]
                # the default WEINCE's difference at the same epoch: (chosen - InfoNCE) - (chosen - default WEINCE)
                default = [
                    (
                        r["epoch"],
                        r["per_seed"][str(seed)]["minus_study_infonce"][metric]
                        - r["per_seed"][str(seed)]["minus_study_weince"][metric],
                    )
                    for r in rows
                    if {"minus_study_infonce", "minus_study_weince"} <= set(r["per_seed"][str(seed)])
                ]
                for key, points in (("chosen", chosen), ("weince", default)):
                    if points:
                        color, label = styles[key]
                        style = ("-", "--", ":", "-.")[index % 4]  # colour: the loss, line style: the seed
                        ax.plot(*zip(*points), color=color, linestyle=style, marker=".", label=f"{label}, seed {seed}")
            ax.axhline(0.0, color="black", linewidth=0.8)
            name = {"linear_top1": "linear", "knn_top1": "k-NN"}[metric]
            ax.set_title(f"{name} top-1 minus InfoNCE of the same seed (points, subset probe)", fontsize=9)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        if axes[0].get_legend_handles_labels()[0]:  # no seed has a paired epoch yet early in the rerun
            axes[0].legend(fontsize=6)


def summarize(
    output_dir: Path, seed: int, study_output: Path = STUDY_OUTPUT, square: str = TRAINED_SQUARE
) -> dict[str, Any]:
    reference = final_line(output_dir / "infonce" / f"{run_name('infonce', seed)}.jsonl")
    rows = []
    for options in latin_square(square):
        record = final_line(output_dir / point_name(options) / f"{run_name('weince', seed)}.jsonl")
        if record is None:
            continue
        row = {
            "point": point_name(options),
            "options": options,
            "default": is_default(options),
            "linear_top1": record["linear_top1"],
            "knn_top1": record["knn_top1"],
            "train_lambda_mean": record["loss_statistics"].get("weince_lambda_mean"),
            "train_lambda_gt_half": record["loss_statistics"].get("weince_lambda_gt_half"),
            "xi_projection": record["pot_projection"]["xi"],
        }
        if reference is not None:
            row["linear_minus_infonce"] = record["linear_top1"] - reference["linear_top1"]
            row["knn_minus_infonce"] = record["knn_top1"] - reference["knn_top1"]
        rows.append(row)
    best = max(rows, key=lambda r: (r["linear_top1"], r["knn_top1"])) if rows else None
    default = next((r for r in rows if r["default"]), None)
    summary = {
        "description": (
            f"issue 14 item 3: WEINCE settings on a 9-point Latin square ({square}: {', '.join(SQUARES[square])}), "
            "SimCLR short configuration, evaluated on held-out training images (never the test set); "
            "accuracies in percent; probes on the other training images; seed "
            f"{seed} for every point (identical batches and augmentations); one seed, so differences below the "
            "seed spread of study 1 (docs/evidence.md) are not evidence"
        ),
        "config": {**runner.STUDY, **SHORT},
        "seed": seed,
        "square": square,
        "infonce": None
        if reference is None
        else {"linear_top1": reference["linear_top1"], "knn_top1": reference["knn_top1"]},
        "points": rows,
        "points_missing": [
            point_name(o) for o in latin_square(square) if point_name(o) not in {r["point"] for r in rows}
        ],
        "best": best,
        "best_minus_default": None
        if best is None or default is None
        else {m: best[m] - default[m] for m in ("linear_top1", "knn_top1")},
        "rerun_best": rerun_comparison(output_dir, study_output),
        "provenance": provenance(),
    }
    write_summary(output_dir, summary, markdown(summary))
    if summary["rerun_best"] is not None:
        plot_rerun(summary["rerun_best"], output_dir / "rerun-best" / "difference.png")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    reference = summary["infonce"]
    keys = list(SQUARES[summary["square"]])
    lines = [
        f"Held-out training images, seed {summary['seed']}; InfoNCE: linear "
        f"{number(reference and reference['linear_top1'])}, k-NN {number(reference and reference['knn_top1'])}",
        "",
        f"| {' | '.join(keys)} | linear top-1 | k-NN top-1 | linear - InfoNCE | k-NN - InfoNCE "
        "| lambda in training | share lambda > 0.5 | xi (projections) |",
        "| --- " * (len(keys) + 7) + "|",
    ]
    for row in summary["points"]:
        o = row["options"]
        mark = " (default)" if row["default"] else ""
        lines.append(
            f"| {' | '.join(f'{o[k]:g}' for k in keys)}{mark} | {number(row['linear_top1'])} "
            f"| {number(row['knn_top1'])} | {number(row.get('linear_minus_infonce'), sign=True)} "
            f"| {number(row.get('knn_minus_infonce'), sign=True)} | {number(row['train_lambda_mean'], 3)} "
            f"| {number(row['train_lambda_gt_half'], 3)} | {number(row['xi_projection'], 3)} |"
        )
    if summary["best"] is not None:
        lines += ["", f"Best held-out linear top-1: {summary['best']['point']}"]
        if summary["best_minus_default"] is not None:
            diff = summary["best_minus_default"]
            lines[-1] += f" (best - default: linear {diff['linear_top1']:+.2f}, k-NN {diff['knn_top1']:+.2f})"
    rerun = summary["rerun_best"]
    if rerun is not None:
        fmt = format_stat
        lines += [
            "",
            f"Rerun of the chosen point ({point_name(rerun['options'])}) at study 1's full length, test set, paired "
            f"by seed with study 1 (identical batches and augmentations); seeds started: "
            f"{', '.join(map(str, rerun['seeds_started']))}, finished: {', '.join(map(str, rerun['seeds'])) or 'none'}",
        ]
    if rerun is not None and rerun["seeds"]:
        lines += [
            "",
            "| seed | linear top-1 | k-NN top-1 | linear - InfoNCE | k-NN - InfoNCE | linear - default WEINCE "
            "| k-NN - default WEINCE |",
            "| --- " * 7 + "|",
        ]
        for seed, row in sorted(rerun["per_seed"].items(), key=lambda item: int(item[0])):
            cells = [number(row["linear_top1"]), number(row["knn_top1"])]
            for loss in ("infonce", "weince"):
                diff = row.get(f"minus_study_{loss}", {})
                cells += [number(diff.get("linear_top1"), sign=True), number(diff.get("knn_top1"), sign=True)]
            lines.append(f"| {seed} | {' | '.join(cells)} |")
        cells = [fmt(rerun["linear_top1"]), fmt(rerun["knn_top1"])]
        for loss in ("infonce", "weince"):
            diff = rerun.get(f"minus_study_{loss}")
            cells += ["-", "-"] if diff is None else [fmt(diff[m], sign=True) for m in ("linear_top1", "knn_top1")]
        lines.append(f"| mean +- std ({len(rerun['seeds'])} seeds) | {' | '.join(cells)} |")
    if rerun is not None:
        lines += [
            "",
            "The chosen point minus study 1's runs of the same seed, mean +- std over the seeds (full: probes on all "
            "training images; curve: probes on the fixed subset):",
            "",
            "| evaluation | epoch | seeds | linear - InfoNCE | k-NN - InfoNCE | linear - default WEINCE "
            "| k-NN - default WEINCE |",
            "| --- " * 7 + "|",
        ]
        rows = [("full", int(epoch), row) for epoch, row in rerun["full_evaluations"].items()]
        rows += [("curve", row["epoch"], row) for row in rerun["along_training"]]
        for kind, epoch, row in rows:
            cells = []
            for loss in ("infonce", "weince"):
                diff = row.get(f"minus_study_{loss}")
                cells += ["-", "-"] if diff is None else [fmt(diff[m], sign=True) for m in ("linear_top1", "knn_top1")]
            lines.append(f"| {kind} | {epoch} | {', '.join(map(str, row['seeds']))} | {' | '.join(cells)} |")
    if summary["points_missing"]:
        lines += ["", f"Not run yet: {', '.join(summary['points_missing'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = runner.study_parser(__doc__, OUTPUT, STATE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--square", choices=sorted(SQUARES), default=TRAINED_SQUARE, help="the factors of the grid")
    parser.add_argument("--study-output", type=Path, default=STUDY_OUTPUT, help="study 1's run files (the reference)")
    parser.add_argument(
        "--rerun-best",
        action="store_true",
        help="run the chosen point with study 1's configuration on the test set (into <output-dir>/rerun-best/)",
    )
    parser.add_argument(
        "--rerun-seeds",
        type=int,
        nargs="+",
        default=None,
        help="seeds of the rerun (default: --seed); the point is always the one chosen at --seed",
    )
    args = parser.parse_args(argv)
    config = runner.start(parser, args, {**runner.STUDY, **({} if args.rerun_best else SHORT)})
    argv = runner.command_line(argv)

    def summary() -> dict[str, Any]:
        return summarize(args.output_dir, args.seed, args.study_output, args.square)

    if args.summarize:
        if args.docs is not None:
            update_docs(args.docs, markdown(summary()), block="simclr_grid")
        else:
            summary()
        return
    if args.rerun_best:
        best = summary()["best"]
        if best is None:
            parser.error("no grid point has finished yet")
        config["weince_options"] = best["options"]
        seeds = [args.seed] if args.rerun_seeds is None else args.rerun_seeds
        out, state = args.output_dir / "rerun-best", args.state_dir / "rerun-best"
        data = load_data(config, args.data_dir)
        runner.StudyRuns(config, data, out, state, argv).run_all([("weince", s) for s in seeds], after_epoch=summary)
        return
    data = load_data(config, args.data_dir)
    for loss, options in [("infonce", {}), *(("weince", options) for options in latin_square(args.square))]:
        name = "infonce" if loss == "infonce" else point_name(options)
        point = {**config, "weince_options": options}
        runner.StudyRuns(point, data, args.output_dir / name, args.state_dir / name, argv).run_all([(loss, args.seed)])
        summary()


if __name__ == "__main__":
    main()
