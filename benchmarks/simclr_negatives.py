"""Does WEINCE's effect grow with the number of negatives?

WEINCE against InfoNCE at 128, 512 and 2,048 pairs per step (254 to 4,094 negatives per anchor in the NT-Xent
layout) with the same number of images seen: one epoch of all 50,000 CIFAR-10 training images, so the larger
batches take fewer steps (390, 97, 24). The study runner (benchmarks/lab/simclr_runner.py) at a reduced setting:
CIFAR-stem ResNet-18 of width 8, Adam lr 1e-3 for every batch size (no learning-rate scaling with the batch),
temperature 0.5, beta 1, evaluated on the 10,000 test images with probes on all training images. The uncached loss
at every size: 2 x 2,048 views of 32x32 images fit in this machine's memory, and the cached variants give the same
loss and gradients (tests/test_cached_*.py), so caching would change memory only. Per seed both losses see the
identical batches and augmentations; two seeds.

Output: ``<output-dir>/batch<B>/<loss>-seed<k>.jsonl`` (the study loop's run files, resumable) and
``<output-dir>/summary.json`` / ``summary.md`` / ``difference.png``: per batch size and seed the paired difference
WEINCE - InfoNCE (linear and k-NN top-1), its mean and spread, WEINCE's mean lambda in training and the POT shape xi.

    OMP_NUM_THREADS=1 python benchmarks/simclr_negatives.py
    OMP_NUM_THREADS=1 python benchmarks/simclr_negatives.py --summarize
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks.lab import simclr_runner as runner  # noqa: E402
from benchmarks.lab.plots import figure  # noqa: E402
from benchmarks.lab.runlog import final_line, run_name  # noqa: E402
from benchmarks.lab.simclr_eval import EvalData, load_data  # noqa: E402
from benchmarks.lab.summaries import format_stat, mean_std, update_docs, write_summary  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

OUTPUT = REPO / "benchmarks" / "results" / "simclr_negatives"
STATE = Path("/work/st-weince-negatives-state")
BATCH_SIZES = (128, 512, 2048)
SEEDS = (0, 1)
REDUCED: dict[str, Any] = {
    "width": 8,
    "epochs": 1,
    "eval_at_start": False,
    "full_eval_epochs": [],
    "pot_images": 2000,
}
METRICS = ("linear_top1", "knn_top1")


def summarize(output_dir: Path, batch_sizes: tuple[int, ...], seeds: tuple[int, ...]) -> dict[str, Any]:
    rows = []
    for batch in batch_sizes:
        per_seed = {}
        for seed in seeds:
            finals = {
                loss: final_line(output_dir / f"batch{batch}" / f"{run_name(loss, seed)}.jsonl")
                for loss in ("infonce", "weince")
            }
            if None in finals.values():
                continue
            mine, base = finals["weince"], finals["infonce"]
            per_seed[str(seed)] = {
                **{f"infonce_{m}": base[m] for m in METRICS},
                **{f"weince_{m}": mine[m] for m in METRICS},
                **{f"{m}_difference": mine[m] - base[m] for m in METRICS},
                "steps": mine["step"],
                "images_seen": mine["images_seen"],
                "weince_train_lambda_mean": mine["loss_statistics"].get("weince_lambda_mean"),
                "weince_train_lambda_gt_half": mine["loss_statistics"].get("weince_lambda_gt_half"),
                "xi_projection": {"infonce": base["pot_projection"]["xi"], "weince": mine["pot_projection"]["xi"]},
                "train_seconds": {"infonce": base["train_seconds"], "weince": mine["train_seconds"]},
            }
        if per_seed:
            rows.append(
                {
                    "batch_pairs": batch,
                    "negatives_per_anchor": 2 * batch - 2,
                    "seeds": sorted(int(s) for s in per_seed),
                    "per_seed": per_seed,
                    **{f"{m}_difference": mean_std([d[f"{m}_difference"] for d in per_seed.values()]) for m in METRICS},
                    **{
                        f"{loss}_{m}": mean_std([d[f"{loss}_{m}"] for d in per_seed.values()])
                        for loss in ("infonce", "weince")
                        for m in METRICS
                    },
                }
            )
    summary = {
        "description": (
            "issue 14 item 2: WEINCE - InfoNCE at several batch sizes with the same images seen (1 epoch of the "
            "50,000 CIFAR-10 training images), ResNet-18 width 8; accuracies in percent on the 10,000 test images, "
            "probes on all training images; paired = same seed (same initialisation, batches, augmentations); "
            "mean +- sample std over seeds"
        ),
        "config": {**runner.STUDY, **REDUCED},
        "batch_sizes": list(batch_sizes),
        "seeds": list(seeds),
        "rows": rows,
        "provenance": provenance(),
    }
    write_summary(output_dir, summary, markdown(summary))
    plot(summary, output_dir / "difference.png")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    fmt = format_stat
    lines = [
        "| pairs per step | steps | seeds | InfoNCE linear | WEINCE linear | linear WEINCE - InfoNCE "
        "| k-NN WEINCE - InfoNCE | per seed (linear / k-NN) | WEINCE lambda in training |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in summary["rows"]:
        per_seed = "; ".join(
            f"seed {s}: {d['linear_top1_difference']:+.2f} / {d['knn_top1_difference']:+.2f}"
            for s, d in row["per_seed"].items()
        )
        lambdas = ", ".join(f"{d['weince_train_lambda_mean']:.3f}" for d in row["per_seed"].values())
        steps = next(iter(row["per_seed"].values()))["steps"]
        lines.append(
            f"| {row['batch_pairs']} | {steps} | {len(row['seeds'])} | {fmt(row['infonce_linear_top1'])} "
            f"| {fmt(row['weince_linear_top1'])} | {fmt(row['linear_top1_difference'], sign=True)} "
            f"| {fmt(row['knn_top1_difference'], sign=True)} | {per_seed} | {lambdas} |"
        )
    done = {(row["batch_pairs"], s) for row in summary["rows"] for s in row["seeds"]}
    missing = [f"batch {b} seed {s}" for b in summary["batch_sizes"] for s in summary["seeds"] if (b, s) not in done]
    if missing:
        lines += ["", f"Not finished yet: {', '.join(missing)}"]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    with figure(path, 2, (8.4, 3.4)) as axes:
        for ax, metric in zip(axes, METRICS):
            for row in summary["rows"]:
                values = [d[f"{metric}_difference"] for d in row["per_seed"].values()]
                ax.scatter([row["batch_pairs"]] * len(values), values, color="tab:red", alpha=0.6)
            if summary["rows"]:
                means = [row[f"{metric}_difference"]["mean"] for row in summary["rows"]]
                ax.plot([row["batch_pairs"] for row in summary["rows"]], means, color="tab:red")
            ax.axhline(0.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("pairs per step (same images seen)")
            ax.set_title(f"WEINCE - InfoNCE, {metric.replace('_', ' ')} (points)", fontsize=9)
            ax.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> None:
    parser = runner.study_parser(__doc__, OUTPUT, STATE)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=list(BATCH_SIZES))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    args = parser.parse_args(argv)
    batch_sizes, seeds = tuple(args.batch_sizes), tuple(args.seeds)
    config = runner.start(parser, args, {**runner.STUDY, **REDUCED})
    if args.summarize:
        summary = summarize(args.output_dir, batch_sizes, seeds)
        if args.docs is not None:
            update_docs(args.docs, markdown(summary), block="simclr_negatives")
        return
    argv = runner.command_line(argv)
    loaded = load_data(config, args.data_dir)  # the same images for every batch size
    for seed in seeds:  # a complete seed (every batch size) before the next
        for batch in batch_sizes:
            run_config = {**config, "batch_size": batch}
            # The fixed batch of the encoder's WEINCE statistics has the run's batch size.
            data = EvalData(loaded.train, loaded.test, run_config)
            out, state = args.output_dir / f"batch{batch}", args.state_dir / f"batch{batch}"
            runner.StudyRuns(run_config, data, out, state, argv).run_all([("infonce", seed), ("weince", seed)])
            summarize(args.output_dir, batch_sizes, seeds)


if __name__ == "__main__":
    main()
