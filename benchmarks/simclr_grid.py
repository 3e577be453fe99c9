"""Issue 14 item 3: do WEINCE's (margin, kappa_rho, kappa_aic) matter for SimCLR, and are the defaults right?

The released code tuned the three on the 27-point grid margin {0, 2, 6} x kappa_rho {5, 10, 20} x kappa_aic
{0.5, 1, 2} (docs/weince.md). Here a 9-point Latin square of that grid (every level of every factor three times,
the defaults (2, 10, 1) among the points) runs on a short configuration of the study loop
(benchmarks/simclr_study.py): CIFAR-stem ResNet-18 of width 8, batch 256 pairs, 1 epoch, temperature 0.5, beta 1.
The settings are chosen on a held-out part of the training images: ``holdout`` class-balanced training images are
never trained on and stand in for the test set; the probes train on the remaining 45,000. InfoNCE at the same seed
(identical batches and augmentations) is the reference. The test set is not touched here; the best point is then
rerun at the full length of study 1 with ``--rerun-best`` (test set, seed 0, paired with study 1's InfoNCE seed 0).

Output: ``<output-dir>/<point>/<loss>-seed<k>.jsonl`` (the study loop's run files, resumable), and
``<output-dir>/summary.json`` / ``summary.md``: per point the held-out linear and k-NN top-1, the difference to
InfoNCE, WEINCE's mean lambda in training and the POT shape xi; the chosen point (best held-out linear top-1).

    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py               # the grid (about 4 minutes a point here)
    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py --summarize
    OMP_NUM_THREADS=1 python benchmarks/simclr_grid.py --rerun-best  # the chosen point at study 1's full length
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import simclr_study as study  # noqa: E402
from st_weince.functional.weince import DEFAULTS  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

OUTPUT = REPO / "benchmarks" / "results" / "simclr_grid"
STATE = Path("/work/st-weince-grid-state")
SHORT: dict[str, Any] = {
    "width": 8,
    "epochs": 1,
    "holdout": 5000,
    "eval_at_start": False,
    "full_eval_epochs": [],
    "pot_images": 2000,
}
MARGINS, KAPPA_RHOS, KAPPA_AICS = (0.0, 2.0, 6.0), (5.0, 10.0, 20.0), (0.5, 1.0, 2.0)


def latin_square() -> list[dict[str, float]]:
    """9 of the 27 points: kappa_aic's level is (i + j + 2) mod 3 for margin level i and kappa_rho level j, so each
    level of each factor appears three times and (i, j) = (1, 1) gives the defaults (2, 10, 1)."""
    return [
        {"aic_margin": m, "kappa_rho": kr, "kappa_aic": KAPPA_AICS[(i + j + 2) % 3]}
        for i, m in enumerate(MARGINS)
        for j, kr in enumerate(KAPPA_RHOS)
    ]


def point_name(options: dict[str, float]) -> str:
    return f"margin{options['aic_margin']:g}-krho{options['kappa_rho']:g}-kaic{options['kappa_aic']:g}"


def is_default(options: dict[str, float]) -> bool:
    return all(getattr(DEFAULTS, key) == value for key, value in options.items())


def final_line(path: Path) -> dict[str, Any] | None:
    return next((r for r in study.read_lines(path) if r.get("type") == "final"), None)


def rerun_comparison(output_dir: Path, seed: int, study_output: Path) -> dict[str, Any] | None:
    """The chosen point at study 1's full length against study 1's InfoNCE and default WEINCE of the same seed."""
    rerun = final_line(output_dir / "rerun-best" / f"{study.run_name('weince', seed)}.jsonl")
    if rerun is None:
        return None
    out: dict[str, Any] = {
        "options": study.read_lines(output_dir / "rerun-best" / f"{study.run_name('weince', seed)}.jsonl")[0]["config"][
            "weince_options"
        ],
        "linear_top1": rerun["linear_top1"],
        "knn_top1": rerun["knn_top1"],
    }
    for loss in ("infonce", "weince"):
        base = final_line(study_output / f"{study.run_name(loss, seed)}.jsonl")
        if base is not None:
            out[f"minus_study_{loss}"] = {m: rerun[m] - base[m] for m in ("linear_top1", "knn_top1")}
    return out


def summarize(output_dir: Path, seed: int, study_output: Path = study.DEFAULT_OUTPUT) -> dict[str, Any]:
    reference = final_line(output_dir / "infonce" / f"{study.run_name('infonce', seed)}.jsonl")
    rows = []
    for options in latin_square():
        record = final_line(output_dir / point_name(options) / f"{study.run_name('weince', seed)}.jsonl")
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
            "issue 14 item 3: WEINCE (margin, kappa_rho, kappa_aic) on a 9-point Latin square of the released 27-point"
            " grid, SimCLR short configuration, evaluated on held-out training images (never the test set); "
            "accuracies in percent; probes on the other training images; seed "
            f"{seed} for every point (identical batches and augmentations); one seed, so differences below the "
            "seed spread of study 1 (docs/evidence.md) are not evidence"
        ),
        "config": {**study.STUDY, **SHORT},
        "seed": seed,
        "infonce": None
        if reference is None
        else {"linear_top1": reference["linear_top1"], "knn_top1": reference["knn_top1"]},
        "points": rows,
        "points_missing": [point_name(o) for o in latin_square() if point_name(o) not in {r["point"] for r in rows}],
        "best": best,
        "best_minus_default": None
        if best is None or default is None
        else {m: best[m] - default[m] for m in ("linear_top1", "knn_top1")},
        "rerun_best": rerun_comparison(output_dir, seed, study_output),
        "provenance": provenance(),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "summary.md").write_text(markdown(summary) + "\n")
    print(markdown(summary), flush=True)
    return summary


def markdown(summary: dict[str, Any]) -> str:
    def number(value: float | None, digits: int = 2, sign: bool = False) -> str:
        if value is None:
            return "-"
        return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"

    reference = summary["infonce"]
    lines = [
        f"Held-out training images, seed {summary['seed']}; InfoNCE: linear "
        f"{number(reference and reference['linear_top1'])}, k-NN {number(reference and reference['knn_top1'])}",
        "",
        "| aic_margin | kappa_rho | kappa_aic | linear top-1 | k-NN top-1 | linear - InfoNCE | k-NN - InfoNCE "
        "| lambda in training | share lambda > 0.5 | xi (projections) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["points"]:
        o = row["options"]
        mark = " (default)" if row["default"] else ""
        lines.append(
            f"| {o['aic_margin']:g}{mark} | {o['kappa_rho']:g} | {o['kappa_aic']:g} | {number(row['linear_top1'])} "
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
        lines += [
            "",
            f"Rerun of the best point at study 1's full length (test set, seed {summary['seed']}): "
            f"linear {rerun['linear_top1']:.2f}, k-NN {rerun['knn_top1']:.2f}",
        ]
        for loss in ("infonce", "weince"):
            diff = rerun.get(f"minus_study_{loss}")
            if diff is not None:
                lines[-1] += f"; minus study 1 {loss}: {diff['linear_top1']:+.2f} / {diff['knn_top1']:+.2f}"
    if summary["points_missing"]:
        lines += ["", f"Not run yet: {', '.join(summary['points_missing'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=study.DEFAULT_DATA)
    parser.add_argument("--output-dir", type=Path, default=OUTPUT)
    parser.add_argument("--state-dir", type=Path, default=STATE)
    parser.add_argument("--override", default="{}", help="JSON of study keys to change on top of the short setup")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--study-output", type=Path, default=study.DEFAULT_OUTPUT, help="study 1's run files (the rerun's reference)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summarize", action="store_true")
    parser.add_argument(
        "--rerun-best",
        action="store_true",
        help="run the chosen point with study 1's configuration on the test set (into <output-dir>/rerun-best/)",
    )
    args = parser.parse_args(argv)
    full_argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    override = json.loads(args.override)
    unknown = sorted(set(override) - set(study.STUDY))
    if unknown:
        parser.error(f"--override has unknown keys {unknown}")
    torch.set_num_threads(args.threads)
    if args.summarize:
        summarize(args.output_dir, args.seed, args.study_output)
        return
    if args.rerun_best:
        best = summarize(args.output_dir, args.seed, args.study_output)["best"]
        if best is None:
            parser.error("no grid point has finished yet")
        config = {**study.STUDY, **override, "weince_options": best["options"]}
        data = study.load_data(config, args.data_dir)
        out = args.output_dir / "rerun-best"
        study.run_all([("weince", args.seed)], config, data, out, args.state_dir / "rerun-best", full_argv)
        return
    config = {**study.STUDY, **SHORT, **override}
    data = study.load_data(config, args.data_dir)
    plan = [("infonce", {}), *(("weince", options) for options in latin_square())]
    for loss, options in plan:
        name = "infonce" if loss == "infonce" else point_name(options)
        run_config = {**config, "weince_options": options}
        study.run_all(
            [(loss, args.seed)],
            run_config,
            data,
            args.output_dir / name,
            args.state_dir / name,
            full_argv,
            summarize_each_epoch=False,
        )
        summarize(args.output_dir, args.seed, args.study_output)


if __name__ == "__main__":
    main()
