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
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks import simclr_ablation as ablation  # noqa: E402
from benchmarks.lab import runlog, schedules  # noqa: E402
from benchmarks.lab import simclr_runner as runner  # noqa: E402

OUTPUT = REPO / "benchmarks" / "results" / "simclr_link_or_temperature"
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
        output = Path(args[args.index("--output-dir") + 1]) if "--output-dir" in args else OUTPUT
        fix_schedules(output)
        return
    runner.main(args, sys.modules[__name__], CONFIG, list(ARMS), block="simclr_link_or_temperature")


if __name__ == "__main__":
    main()
