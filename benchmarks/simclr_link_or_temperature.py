"""Link or temperature, settled at one commit: does the top-M shortfall term's gain come from its logit's shape, or
from its sharpness and how that sharpness moves during training?

Six arms of the released-setup ablation (benchmarks/simclr_ablation.py: CIFAR-10, ResNet-18 width 16, batch 256
pairs, 5 epochs, the released probes), seeds 0, 1, 2, every run at one commit and on one CPU family:

1. ``infonce``: NT-Xent at temperature 0.5;
2. ``infonce-topm-shortfall`` (the ablation's arm 3): InfoNCE + 0.5 x the top-M shortfall term. Its effective scale
   (the secant slope of its logit over each row's positive and M hardest negatives, logged as
   ``weince_effective_scale_top_m_shortfall``) is logged at every step;
3. ``infonce-tau0.2``: InfoNCE at temperature 0.2, the temperature control;
4. ``infonce-topm-infonce-scale3``: InfoNCE + 0.5 x the linear top-M InfoNCE term at the fixed scale 3;
5. ``infonce-topm-infonce-scheduled``: InfoNCE + 0.5 x the linear top-M InfoNCE term whose scale at step i is arm
   2's logged effective scale at step i, of the same seed, at this commit. The schedule is fixed from arm 2's
   finished run before this arm starts (``--fix-schedules``), and committed;
6. ``infonce-topm-infonce-scheduled-warm``: arm 2 for its first epoch (bit for bit its run: same network, optimizer,
   batches and views), then arm 5's scheduled linear term from step 196 on, at arm 2's logged scale of each step.

Arm 5 asks whether a linear term survives the shortfall term's early sharpness (scale 66-109 in the first steps); it
collapsed on every seed it ran. Arm 6 compares the two links once both train: from the same epoch-1 state, the
shortfall term's own continuation against the linear term at its sharpness. If arm 6 trains like arm 2, the link's
shape adds nothing beyond its sharpness once training is under way; if it collapses too, at which scale it does.

Every run logs each step's loss and the loss's statistics (``"type": "steps"`` lines) and records the commit and the
CPU in its header. The summary pairs runs only within one commit and one CPU family (benchmarks/lab/pairing.py).

    # two slots side by side, one thread each; arm 2 first (the scheduled arm needs its schedule)
    OMP_NUM_THREADS=1 setsid nohup python benchmarks/simclr_link_or_temperature.py \\
        --runs infonce-topm-shortfall-seed0 > link-A.log 2>&1 &
    python benchmarks/simclr_link_or_temperature.py --fix-schedules      # once arm 2's runs have finished
    python benchmarks/simclr_link_or_temperature.py --summarize

The runs, the schedules and the summary go to ``--output-dir`` (``--fix-schedules`` too): by default
runs/benchmarks/simclr_link_or_temperature/ (git ignores it); the committed ones only when it names them
(``--output-dir benchmarks/results/simclr_link_or_temperature``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks import simclr_ablation as ablation  # noqa: E402
from benchmarks.lab import pairing, plots, runlog, schedules, summaries  # noqa: E402
from benchmarks.lab import simclr_runner as runner  # noqa: E402
from benchmarks.lab.collapse import collapsed_epochs  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

OUTPUT = scratch(__file__)  # the committed runs (benchmarks/results/simclr_link_or_temperature/) only by name
STATE = Path("/work/st-weince-link-state")
BASELINE = "infonce"
SHORTFALL = "infonce-topm-shortfall"
CONTROL = "infonce-tau0.2"
SCALE3 = "infonce-topm-infonce-scale3"
SCHEDULED = "infonce-topm-infonce-scheduled"
WARM = "infonce-topm-infonce-scheduled-warm"
ARMS: dict[str, dict[str, Any]] = {
    **{arm: ablation.STUDY_ARMS[arm] for arm in (BASELINE, SHORTFALL, CONTROL, SCALE3)},
    SCHEDULED: {
        "loss": "weince",
        "options": {"mode": "none", "top_m": {"infonce_weight": 0.5}},
        "infonce_scale_schedule": SHORTFALL,
    },
    # The links once both train: arm 2's first epoch, then the scheduled linear term from arm 2's epoch-1 state.
    WARM: {
        "loss": "weince",
        "options": {"mode": "none", "top_m": {"infonce_weight": 0.5}},
        "infonce_scale_schedule": SHORTFALL,
        "warm_start": {"arm": SHORTFALL, "epochs": 1},
    },
}
SEEDS = (0, 1, 2)
# Arm 2 first, then the arm that follows its schedule; the arms without a schedule after them.
RUN_ORDER = [(arm, seed) for arm in (SHORTFALL, SCHEDULED) for seed in SEEDS] + [
    (arm, seed) for arm in (BASELINE, CONTROL, SCALE3, WARM) for seed in SEEDS
]
CONFIG: dict[str, Any] = {**ablation.ABLATION, "arms": ARMS, "log_steps": True}


METRICS = ("linear_top1", "knn_top1")
# (arm, reference): what each comparison asks
COMPARISONS = [
    (SHORTFALL, SCHEDULED, "the link's shape at the same sharpness, step by step"),
    (SHORTFALL, WARM, "the link's shape at the same sharpness once both train (from arm 2's epoch-1 state)"),
    (SHORTFALL, SCALE3, "the shortfall link against the sharpest fixed linear scale that trains"),
    (SCHEDULED, SCALE3, "the shortfall term's schedule of sharpness against a fixed scale of 3"),
    (CONTROL, SHORTFALL, "a lower temperature everywhere against the shortfall term"),
    (CONTROL, SCHEDULED, "a lower temperature everywhere against the scheduled linear term"),
    (SHORTFALL, BASELINE, "the shortfall term over InfoNCE"),
    (SCHEDULED, BASELINE, "the scheduled linear term over InfoNCE"),
    (SCALE3, BASELINE, "the fixed linear term over InfoNCE"),
    (CONTROL, BASELINE, "the temperature control over InfoNCE"),
]


def summarize(output_dir: Path) -> dict[str, Any]:
    """summary.json, summary.md and curves.png from the run files in ``output_dir``."""
    runs = runlog.run_files(output_dir)
    finals, states, shown = {}, {}, {}
    for name, records in runs.items():
        key = (records[0]["loss"], records[0]["seed"])
        recorded = pairing.code_state(records)
        # a run on a CPU family that reproduced another's kernels bit for bit pairs as that one (kernel_parity.json)
        states[key] = pairing.kernel_family(recorded, name, output_dir)
        shown[key] = f"{str(recorded.commit)[:7]} on {recorded.cpu_family}" + (
            f" (kernels of {states[key].cpu_family})" if states[key].cpu_family != recorded.cpu_family else ""
        )
        if (final := runlog.final_record(records)) is not None:
            finals[key] = final
    for (arm, seed), state in list(states.items()):
        source = (ARMS[arm].get("warm_start") or {}).get("arm")
        if source is not None and (source, seed) in states:  # paired through its first epoch, bit for bit the source's
            name, source_name = runlog.run_name(arm, seed), runlog.run_name(source, seed)
            states[arm, seed] = pairing.warm_start_state(runs[name], runs[source_name], states[source, seed])
            if states[arm, seed] != state:
                shown[arm, seed] += f" (first epoch bit for bit {source_name}'s)"
    per_arm = {
        arm: {
            "seeds": sorted(s for a, s in finals if a == arm),
            "code_states": sorted({shown[a, s] for a, s in finals if a == arm}),
            **{m: summaries.mean_std([r[m] for (a, _), r in finals.items() if a == arm]) for m in METRICS},
        }
        for arm in ARMS
        if any(a == arm for a, _ in finals)
    }
    collapsed = {name: epochs for name, records in runs.items() if (epochs := collapsed_epochs(records))}
    summary = {
        "description": __doc__.split("\n\n")[0],
        "config": CONFIG,
        "runs_present": sorted(runs),
        "runs_finished": sorted(runlog.run_name(a, s) for a, s in finals),
        "runs_missing": [runlog.run_name(a, s) for a, s in RUN_ORDER if (a, s) not in finals],
        "code_states": {runlog.run_name(*key): vars(state) for key, state in sorted(states.items())},
        "per_arm": per_arm,
        "paired": (paired := pairing.paired_differences(finals, states, COMPARISONS, SEEDS, METRICS)),
        "holm_family_size": pairing.add_holm(paired),
        "finals": {
            runlog.run_name(a, s): {m: r[m] for m in (*METRICS, "linear_val_top1", "knn_top1_by_k")}
            for (a, s), r in sorted(finals.items())
        },
        "collapsed_epochs": collapsed,
        "summary_provenance": provenance(),
    }
    summaries.write_summary(output_dir, summary, markdown(summary))
    plot_steps(runs, output_dir / "curves.png")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| arm | seeds | code state (commit on CPU family) | linear top-1 (%) | k-NN top-1, k=50 (%) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for arm, row in summary["per_arm"].items():
        lines.append(
            f"| {arm} | {', '.join(map(str, row['seeds']))} | {'; '.join(row['code_states'])} "
            f"| {summaries.format_stat(row['linear_top1'])} | {summaries.format_stat(row['knn_top1'])} |"
        )
    lines += ["", "Paired by seed, points (mean +- sample std, n; paired t with n - 1 degrees of freedom, two-sided p; "
              f"Holm-adjusted over the study's {summary['holm_family_size']} tests)",
              "", "| comparison | n | linear top-1 | t, p | k-NN top-1 | t, p | refused |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, entry in summary["paired"].items():
        cells = []
        for metric in METRICS:
            if metric not in entry:
                cells += ["-", "-"]
                continue
            test = entry["tests"][metric]
            t = "-"
            if test["t"] is not None:
                p, holm = (summaries.format_p(test[key]) for key in ("p_two_sided", "p_holm"))
                p, holm = (value if value.startswith("<") else f"= {value}" for value in (p, holm))
                t = f"t = {test['t']:+.2f}, p {p} (Holm {holm})"
            cells += [summaries.format_stat(entry[metric], sign=True), t]
        n = len(entry.get("seeds", []))
        refused = "; ".join(f"seed {s}: {why}" for s, why in entry["refused"].items()) or "-"
        lines.append(f"| {name} | {n} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {refused} |")
    lines += [
        "",
        "Collapsed epochs (benchmarks/lab/collapse.py: the 99.9 % quantile of the cosine between distinct "
        "images' projections within 1e-3 of 1, k-NN below its own at initialisation): "
        + (", ".join(f"{name} {epochs}" for name, epochs in summary["collapsed_epochs"].items()) or "none"),
    ]
    if summary["runs_missing"]:
        lines += ["", f"Not finished yet: {', '.join(summary['runs_missing'])}"]
    return "\n".join(lines)


def plot_steps(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Per seed, every step's training loss of each arm, and the top-M terms' effective scale (arm 2's logged one;
    the scheduled arm's, which follows it; the fixed scale 3)."""
    with plots.figure(path, 2, (11.0, 3.6)) as (loss_axes, scale_axes):
        for name, records in sorted(runs.items()):
            steps = sorted((r for r in records if r.get("type") == "steps"), key=lambda r: r["epoch"])
            losses = [value for r in steps for value in r["loss"]]
            if losses:
                loss_axes.plot(losses, lw=0.6, label=name)
            statistics = {k: [v for r in steps for v in r["loss_statistics"].get(k, [])] for k in (
                "weince_effective_scale_top_m_shortfall", "weince_effective_scale_top_m_infonce")}  # fmt: skip
            for key, values in statistics.items():
                if values:
                    scale_axes.plot(values, lw=0.6, label=f"{name}: {key.split('scale_')[1]}")
        loss_axes.set(title="training loss per step", xlabel="step", yscale="log")
        scale_axes.set(title="top-M effective scale per step", xlabel="step", yscale="log")
        for axes in (loss_axes, scale_axes):
            axes.grid(alpha=0.3)
            axes.legend(fontsize=6)


def fix_schedules(output_dir: Path) -> list[Path]:
    """The schedule of every seed whose arm-2 run has finished and that has none yet."""
    written = []
    for seed in SEEDS:
        path = output_dir / f"{runlog.run_name(SHORTFALL, seed)}.jsonl"
        if runlog.final_line(path) is None or schedules.schedule_path(output_dir, SHORTFALL, seed).exists():
            continue
        written.append(schedules.fix_schedule(output_dir, SHORTFALL, seed))
        print(f"fixed {written[-1]}", flush=True)
    return written


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--fix-schedules" in args:
        args.remove("--fix-schedules")
        fix_schedules(runner.study_parser(__doc__, OUTPUT, STATE).parse_args(args).output_dir)
        return
    runner.main(args, sys.modules[__name__], CONFIG, list(ARMS), block="simclr_link_or_temperature")


if __name__ == "__main__":
    main()
