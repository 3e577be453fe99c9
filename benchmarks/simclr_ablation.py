"""Which term of the released WEINCE composite carries its gain? Ten arms under the released SimCLR setup.

The published vision figures train ``L = L_blend + 0.5 L_shortfall_topM + 0.5 L_infonce_topM`` (M = 50,
ALGORITHMS.md 1.2b) against plain InfoNCE. The arms, each with the same seeds 0, 1, 2:

1. ``infonce``: NT-Xent at temperature 0.5 (sentence-transformers' MNRL in both view orders);
2. ``infonce-topm-infonce``: InfoNCE + 0.5 x InfoNCE over the positive and the M hardest negatives;
3. ``infonce-topm-shortfall``: InfoNCE + 0.5 x the shortfall softmax over the positive and the M hardest negatives
   (its tail index beta_t: the batch fit and its moving average);
4. ``blend``: WEINCE's blended cross-entropy alone (scale 2, beta 1), what ``WEINCELoss`` implemented before;
5. ``composite``: the released loss, the blend + both top-M terms at weight 0.5;
6. ``infonce-tau0.2``: InfoNCE at temperature 0.2, a control: both top-M terms sharpen the loss on the hardest
   negatives, and so does a lower temperature than 0.5;
7. ``composite-tau0.2``: the composite at the control's temperature (added after the six had run): against arm 6,
   does the composite add anything once InfoNCE's temperature is lowered too?
8. ``infonce-topm-both``: InfoNCE + both top-M terms at weight 0.5, no blend (added after the seven): the missing
   cell. Against the composite it gives the blend's contribution on top of both terms; its overlap with arms 2 and 3
   says whether the two top-M terms act on the same hardest negatives.
9. ``infonce-topm-infonce-matched``: arm 2 with its top-M InfoNCE term at the top-M shortfall term's effective scale
   (30.87, measured in arm 3's runs): link or temperature at matched sharpness, against arm 3. It collapsed on
   every seed; its runs were stopped after 1-2 epochs;
10. ``infonce-topm-infonce-scale3``: arm 2 at the fixed scale 3, the sharpest scale whose one-epoch probe
   (benchmarks/matched_scale_search.py) left the collapsed start.

Arms 9 and 10 ran at other commits than arm 3 (the run headers record each commit). The link-or-temperature
question is settled at one commit in benchmarks/simclr_link_or_temperature.py, not here.

Arms 2 and 3 are WEINCELoss with ``mode="none"`` (lambda = 0: the blend IS InfoNCE, to float rounding) plus one
top-M term; arm 1 is MNRL, the baseline of the other studies. Each arm minus InfoNCE, paired by seed, and the
interaction ``(5 - 1) - [(2 - 1) + (3 - 1) + (4 - 1)]`` (is the composite more than the sum of its parts?) and arms 5
and 7 minus arm 6 come out of ``--summarize``, each with its paired t (n - 1 degrees of freedom) and two-sided p.

Setting: the study runner benchmarks/lab/simclr_runner.py (identical initialisation, batches and augmentations per seed;
resumable JSON lines; states outside the git tree) under its ``"released"`` setup: CIFAR-10 (all 50,000 training
images), CIFAR-stem ResNet-18 of width 16 (study 1's scale), projection head Linear(128, 128, no bias) - ReLU -
Linear(128, 64, no bias), Adam lr 3e-4 without weight decay, batch 256 pairs, temperature 0.5, colour jitter
0.8/0.8/0.8/0.2 with p 0.8, grayscale p 0.2, no normalisation. Evaluation: the released probe protocol
(simclr_tools.evaluation.RELEASED_PROTOCOL) on un-augmented backbone features of the training images: a stratified 80/20
split, logistic regression on the raw features of the 80 % (Adam lr 3e-4, batch 256, 100 epochs), test accuracy
after the last epoch; weighted k-NN (temperature 0.1, k in {1, 2, 5, 10, 20, 50}, headline k = 50) averaged over
split seeds 1..5. The final line (``"type": "final"``) uses all 50,000 training images; the per-epoch checkpoints
use the same fixed class-balanced subset of 10,000 for the curves.

Why 5 epochs, not study 1's 10: one epoch of width-16 ResNet-18 over 50,000 images takes 5.5-8 minutes of
training on one quiet core of this machine (two runs side by side; more when the machine is shared), so 18 runs x 10
epochs, two at a time, need 9-13 hours, over the six hours this ablation may take; at 5 epochs they need 5-7 hours
(``SCALE_NOTE`` gives the measurements). This is recorded in every run's header (``config.epochs``) and in the
summary (``scale_note``).

    # two slots side by side, one thread each (one run at a time per process; see --runs)
    OMP_NUM_THREADS=1 setsid nohup python benchmarks/simclr_ablation.py --runs infonce-seed0 > ablation-A.log 2>&1 &
    OMP_NUM_THREADS=1 setsid nohup python benchmarks/simclr_ablation.py --runs infonce-tau0.2-seed0 > ablation-B.log &
    # paired differences, interaction and curves from whatever has landed
    python benchmarks/simclr_ablation.py --summarize

The runs and the summary go to ``--output-dir``: by default runs/benchmarks/simclr_ablation/ (git ignores it); the
committed ones are rewritten only when it names them (``--output-dir benchmarks/results/simclr_ablation``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks.lab import collapse, pairing, plots, runlog, summaries  # noqa: E402
from benchmarks.lab import simclr_runner as runner  # noqa: E402
from benchmarks.lab.arms import ARMS, MATCHED_TOP_M_INFONCE_SCALE  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

from simclr_tools.setups import SETUPS  # noqa: E402

OUTPUT = scratch(__file__)  # the committed runs (benchmarks/results/simclr_ablation/) only with --output-dir
STATE = Path("/work/st-weince-ablation-state")
SCALE_NOTE = (
    "5 epochs of all 50,000 CIFAR-10 training images at study 1's width (ResNet-18 width 16), not study 1's 10: with "
    "two runs side by side, one thread each, an epoch takes 5.5-8 minutes of training when nothing else runs "
    "(blend-seed1: 1,610 s for its 5 epochs; blend-seed0: 469 s an epoch) plus about 35 s of checkpoint probes, "
    "and 15-25 minutes when the machine is shared. The first six arms' 18 runs x 10 epochs, two at a time, would "
    "have needed 9-13 hours on the quiet machine, beyond the six the ablation could take; at 5 epochs they needed "
    "5-7 hours, more than one working session, so the runs resume from their state across sessions. Arms 7 and 8 "
    "(composite-tau0.2, infonce-topm-both) were added later at the same scale: 24 runs; then the two per-view runs "
    "and the link-or-temperature arms 9 (three runs, collapsed and stopped) and 10 (three runs, 5 epochs each): 32 "
    "runs in all."
)
BASELINE = "infonce"
RELEASED = SETUPS["released"]
# ARMS (benchmarks.lab.arms): run-name prefix -> the objective: the loss, its options, the temperature where not 0.5.
# The composite's parts, each measured as InfoNCE + that part (the blend replaces InfoNCE, so it is measured alone).
PARTS = ("infonce-topm-infonce", "infonce-topm-shortfall", "blend")
COMPOSITE = "composite"
# The temperature control. The composite is also compared with it directly (is its gain more than a lower
# temperature's?), and so is the composite at the control's temperature (does it add anything at that temperature?).
CONTROL = "infonce-tau0.2"
AGAINST_CONTROL = (COMPOSITE, "composite-tau0.2")
# The missing cell (added once the seven had run): InfoNCE + both top-M terms, no blend. Against the composite it gives
# what the blend adds on top of both terms; its overlap, (both - InfoNCE) - sum over the two top-M arms of (arm -
# InfoNCE), says whether the two top-M terms act on the same hardest negatives (negative: less than their sum).
BOTH_TOP_M = "infonce-topm-both"
TOP_M_PARTS = ("infonce-topm-infonce", "infonce-topm-shortfall")
# The per-view check (seed 0 only): InfoNCE and the composite with one forward pass per view, as the released code
# encodes them, so that BatchNorm normalises each view on its own; paired with each other, does it move the
# composite-minus-InfoNCE difference of the one-pass runs?
PER_VIEW_ARMS: dict[str, dict[str, Any]] = {
    f"{arm}-per-view": {**ARMS[arm], "encode_views_separately": True} for arm in (BASELINE, COMPOSITE)
}
# Link or temperature (added after the eight): the top-M InfoNCE term at the top-M shortfall term's sharpness. Its
# fixed inverse temperature is the shortfall term's effective scale (the secant slope of its logit over each row's
# positive and M hardest negatives, st_weince.functional.effective_scale) measured in arm 3's own runs before any
# matched run: the mean of the logged weince_effective_scale_top_m_shortfall over epoch 1 of
# infonce-topm-shortfall, seeds 0 and 1, rerun for that epoch at 3b93f56 (28.35 and 33.39) and committed in
# MATCHED_SCALE_DIR. matched_scale() recomputes it; a test checks the constant against it.
# The reruns' epoch-1 probes differ from the committed runs'. Arm 3 seed 1 at epoch 1, linear / k-NN: 31.36 / 30.32
# (committed, 7723f2f), 29.53 / 28.54 (3b93f56), 30.65 / 30.12 (7cc7eaf). Not the downsample convolution: at width 16
# none has fewer than 16 input channels. Two parts (benchmarks/results/simclr_link_or_temperature/divergence/): the
# blend's fused cross-entropy rewrite (7a8751a, 7f3ab13, merged in 0c1610b), a float32 rounding change amplified by
# training, moves seed 1 by -1.75 / -2.48; and the 7723f2f record does not reproduce on the AMD EPYC of the reruns
# (-0.08 / +0.70; its CPU was not recorded). 7cc7eaf differs again (not isolated). So the one-commit study,
# benchmarks/simclr_link_or_temperature.py, pairs only runs of one commit and one CPU family.
MATCHED = "infonce-topm-infonce-matched"
MATCHED_SCALE_DIR = REPO / "benchmarks" / "results" / "simclr_ablation_matched_scale"
MATCHED_SCALE = MATCHED_TOP_M_INFONCE_SCALE
# The matched runs collapsed and were stopped: seeds 0 and 1 after epoch 2, seed 2 after epoch 1. Arm 10, a fixed
# scale of 3, is compared with arm 3 instead.
SHARPEST = "infonce-topm-infonce-scale3"
# One-probe-per-scale runs (benchmarks/matched_scale_search.py, seed 0, output in MATCHED_SCALE_DIR) time how long a
# fixed scale's loss stays near the collapsed value. Every arm starts there (the initial network maps all images
# close together). Scale 2 left at step 52, scale 3 at step 126; scale 4 had not left by step 195, the end of its
# one-epoch probe; 9-30.87 had not left by step 120, the end of theirs. Whether scales of 4 and more ever leave is
# unknown: no such run went on to 5 epochs.
# Collapse is judged by benchmarks/lab/collapse.py (the projections of distinct images within 1e-3 of one direction,
# and k-NN below the run's own at epoch 0).
STUDY_ARMS = {**ARMS, **PER_VIEW_ARMS}
SEEDS = (0, 1, 2)
# Seed 0 of every arm first; InfoNCE and the temperature control first (they need no top-M option).
# The seventh arm, the composite at temperature 0.2, was added once the six had run.
ARM_ORDER = (
    "infonce",
    "infonce-tau0.2",
    "blend",
    "composite",
    "infonce-topm-infonce",
    "infonce-topm-shortfall",
    "composite-tau0.2",
    "infonce-topm-both",
    SHARPEST,
)
# Not expected to finish: the matched arm's runs were stopped once collapsed (the summary's collapsed table).
RUN_ORDER = [(arm, seed) for seed in SEEDS for arm in ARM_ORDER] + [(arm, 0) for arm in PER_VIEW_ARMS]
ABLATION: dict[str, Any] = {
    **runner.STUDY,
    "setup": "released",
    "hidden_dim": RELEASED.hidden_dim,  # None: the head's hidden layer as wide as the features
    "lr": RELEASED.lr,
    "weight_decay": RELEASED.weight_decay,
    "temperature": 0.5,
    "beta": 1.0,
    "epochs": 5,
    "full_eval_epochs": [],  # the final line only
    "arms": STUDY_ARMS,
}
METRICS = ("linear_top1", "knn_top1")


def paired(finals: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """Every arm minus InfoNCE of the same seed (by seed, mean +- sample std), the composite at either temperature
    minus the temperature control, the composite minus both top-M terms, the composite's interaction and the two
    top-M terms' overlap."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for (arm, seed), record in finals.items():
        by_arm.setdefault(arm, {})[seed] = record
    comparisons = [(arm, BASELINE) for arm in ARMS if arm != BASELINE]
    comparisons += [(arm, CONTROL) for arm in AGAINST_CONTROL]
    comparisons.append((COMPOSITE, BOTH_TOP_M))
    # link or temperature: the shortfall link against the linear one at its sharpness (> 0: the link's shape gives
    # more than the sharpness), and the matched term against arm 2's (what sharpening the linear term gives)
    comparisons.append(("infonce-topm-shortfall", MATCHED))
    comparisons.append((MATCHED, "infonce-topm-infonce"))
    comparisons.append(("infonce-topm-shortfall", "infonce-topm-infonce"))  # the two links, each at its own scale
    comparisons.append(("infonce-topm-shortfall", SHARPEST))
    comparisons.append((SHARPEST, "infonce-topm-infonce"))
    comparisons.append((f"{COMPOSITE}-per-view", f"{BASELINE}-per-view"))
    out: dict[str, Any] = {}
    for arm, reference in comparisons:
        difference = summaries.paired_difference(by_arm.get(arm, {}), by_arm.get(reference, {}), METRICS)
        if difference is not None:
            out[f"{arm}_minus_{reference}"] = difference
    for name, whole, parts in (("interaction", COMPOSITE, PARTS), ("top_m_overlap", BOTH_TOP_M, TOP_M_PARTS)):
        shortfall = interaction(out, whole, parts)
        if shortfall is not None:
            out[name] = shortfall
    return out


def matched_scale(measurement_dir: Path = MATCHED_SCALE_DIR) -> float:
    """The top-M shortfall term's effective scale in arm 3's runs: the mean over the measured runs of the epoch-1
    mean of ``weince_effective_scale_top_m_shortfall`` (the loss's logged values, averaged over the epoch's steps)."""
    values = []
    for records in runlog.run_files(measurement_dir).values():
        epoch_one = [r for r in records if r.get("type") == "checkpoint" and r["epoch"] == 1]
        values.append(epoch_one[0]["loss_statistics"]["weince_effective_scale_top_m_shortfall"])
    if not values:
        raise FileNotFoundError(f"no epoch-1 record of infonce-topm-shortfall in {measurement_dir}")
    return sum(values) / len(values)


def collapsed_runs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every run, finished or not, with an epoch that the collapse rule (benchmarks/lab/collapse.py) flags: those
    epochs, and the last epoch's loss, the collapsed encoder's loss and k-NN (and k-NN at epoch 0)."""
    out = {}
    for name, records in runs.items():
        arm = STUDY_ARMS[records[0]["loss"]]
        epochs = collapse.collapsed_epochs(records)
        if not epochs:
            continue
        checkpoints = [r for r in records if r.get("type") == "checkpoint"]
        last = checkpoints[-1]
        out[name] = {
            "collapsed_epochs": epochs,
            "epoch": last["epoch"],
            "collapsed_at_end": last["epoch"] in epochs,
            "train_loss": last["train_loss"],
            "collapse_loss": collapse.collapse_loss(arm, ABLATION["batch_size"]),
            "projection_similarity_q999": (last.get("pot_projection") or {}).get("threshold"),
            "knn_top1": last["knn_top1"],
            "knn_top1_epoch0": next((r["knn_top1"] for r in checkpoints if r["epoch"] == 0), None),
        }
    return out


def interaction(out: dict[str, Any], whole: str, parts: tuple[str, ...]) -> dict[str, Any] | None:
    """``(whole - InfoNCE) - sum over parts of (part - InfoNCE)`` by seed, from the paired differences in ``out``
    (None until one seed has them all): is ``whole`` more (> 0) or less (< 0) than the sum of its parts?"""
    differences = [out.get(f"{arm}_minus_{BASELINE}", {"per_seed": {}})["per_seed"] for arm in (whole, *parts)]
    seeds = sorted(set.intersection(*(set(map(int, d)) for d in differences)))
    if not seeds:
        return None
    total, *terms = differences
    per_seed = {str(s): {m: total[str(s)][m] - sum(t[str(s)][m] for t in terms) for m in METRICS} for s in seeds}
    return {
        "definition": f"({whole} - {BASELINE}) - sum over {list(parts)} of (part - {BASELINE})",
        "seeds": seeds,
        "per_seed": per_seed,
        **summaries.seed_stats(per_seed, METRICS),
    }


def summarize(output_dir: Path) -> dict[str, Any]:
    """summary.json and summary.md from the run files in ``output_dir``."""
    runs = runlog.run_files(output_dir)
    finals = {
        (records[0]["loss"], records[0]["seed"]): final
        for records in runs.values()
        if (final := runlog.final_record(records)) is not None
    }
    present = list(runs)
    headers = {name: {k: records[0].get(k) for k in runlog.HEADER_KEYS} for name, records in runs.items()}
    per_arm = {
        arm: {
            "seeds": sorted(s for a, s in finals if a == arm),
            **{m: summaries.mean_std([r[m] for (a, _), r in finals.items() if a == arm]) for m in METRICS},
        }
        for arm in STUDY_ARMS
        if any(a == arm for a, _ in finals)
    }
    summary = {
        "description": (
            "Released-setup ablation of the WEINCE composite on CIFAR-10 (JPEG copy), CPU, one thread per run; "
            "accuracies in percent on the 10,000 test images, released probe protocol on all 50,000 training images "
            "(linear: stratified 80 % of them, test accuracy after epoch 100; k-NN: mean over 5 split seeds, "
            "headline k = 50); mean +- sample std over seeds; paired = same seed (same init, batches, views)."
        ),
        "scale_note": SCALE_NOTE,
        "config": ABLATION,
        "runs_present": present,
        "runs_finished": sorted(runlog.run_name(a, s) for a, s in finals),
        "runs_missing": [runlog.run_name(a, s) for a, s in RUN_ORDER if (a, s) not in finals],
        "per_arm": per_arm,
        "paired": (differences := paired(finals)),
        "holm_family_size": holm_family(differences),
        "finals": {
            runlog.run_name(a, s): {
                **{m: r[m] for m in (*METRICS, "linear_val_top1", "knn_top1_by_k")},
                "loss_statistics": r["loss_statistics"],
                "train_seconds": r["train_seconds"],
            }
            for (a, s), r in sorted(finals.items())
        },
        "collapsed": collapsed_runs(runs),
        "provenance_of_runs": headers,
        "summary_provenance": provenance(),
    }
    summaries.write_summary(output_dir, summary, markdown(summary))
    if summary["paired"]:
        plots.plot_paired(summary["paired"], output_dir / "paired.png", "paired differences by seed")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    lines = [summary["scale_note"], ""]
    lines += ["| arm | seeds | linear top-1 (%) | k-NN top-1, k=50 (%) |", "| --- | --- | --- | --- |"]
    for arm, row in summary["per_arm"].items():
        lines.append(
            f"| {arm} | {', '.join(map(str, row['seeds']))} | {summaries.format_stat(row['linear_top1'])} "
            f"| {summaries.format_stat(row['knn_top1'])} |"
        )
    lines += ["", "Paired by seed (same initialisation, batches and augmentations), points", ""]
    lines += summaries.paired_table(summary["paired"])
    lines += ["", "How sure: paired t (mean / (std / sqrt(n)), n - 1 degrees of freedom), its two-sided p "
              f"(Holm-adjusted over the study's {summary.get('holm_family_size', 0)} tests) and the sign count",
              ""]  # fmt: skip
    lines += ["| comparison | n | linear: t, p, seeds > 0 | k-NN: t, p, seeds > 0 |", "| --- | --- | --- | --- |"]
    for name, difference in summary["paired"].items():
        cells = [paired_t_and_signs(difference, metric) for metric in METRICS]
        lines.append(f"| {name} | {len(difference['seeds'])} | {cells[0]} | {cells[1]} |")
    if summary["collapsed"]:
        lines += [
            "",
            "Collapsed runs (a result, not an accuracy comparison; benchmarks/lab/collapse.py: the 99.9 % quantile "
            "of the cosine between distinct images' projections within 1e-3 of 1, and k-NN below the run's own at "
            "epoch 0)",
            "",
            "| run | collapsed epochs | last epoch | cosine q99.9 | train loss | collapsed encoder's "
            "| k-NN (epoch 0) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, row in summary["collapsed"].items():
            lines.append(
                f"| {name} | {', '.join(map(str, row['collapsed_epochs']))} | {row['epoch']} "
                f"| {row['projection_similarity_q999']:.5f} | {row['train_loss']:.3f} "
                f"| {'-' if row['collapse_loss'] is None else format(row['collapse_loss'], '.3f')} "
                f"| {row['knn_top1']:.2f} ({row['knn_top1_epoch0']:.2f}) |"
            )
    if summary["runs_missing"]:
        lines += ["", f"Not finished yet: {', '.join(summary['runs_missing'])}"]
    return "\n".join(lines)


def holm_family(differences: dict[str, Any]) -> int:
    """The paired t of every difference (``tests``) and its Holm-adjusted p over the study's whole family of tests;
    returns the family's size."""
    for difference in differences.values():
        difference["tests"] = {m: pairing.paired_t(difference[m]) for m in METRICS if m in difference}
    return pairing.add_holm(differences)


def paired_t_and_signs(difference: dict[str, Any], metric: str) -> str:
    """``t = ..., p = ..., k of n > 0`` of one paired difference: the paired t with n - 1 degrees of freedom, its
    two-sided p (benchmarks/lab/pairing.py) and the sign count (with 3 seeds, 3 of 3 or 0 of 3 happen by chance with
    probability 1/4)."""
    values = [row[metric] for row in difference["per_seed"].values()]
    positive = sum(value > 0 for value in values)
    test = pairing.paired_t(difference[metric])
    if test["t"] is None:
        return f"t -, {positive} of {len(values)} > 0"
    holm = (difference.get("tests") or {}).get(metric, {}).get("p_holm")
    adjusted = "" if holm is None else f" (Holm {holm:.3f})"
    return f"t = {test['t']:+.2f}, p = {test['p_two_sided']:.3f}{adjusted}, {positive} of {len(values)} > 0"


def main(argv: list[str] | None = None) -> None:
    runner.main(argv, sys.modules[__name__], ABLATION, list(STUDY_ARMS), block="simclr_ablation")


if __name__ == "__main__":
    main()
