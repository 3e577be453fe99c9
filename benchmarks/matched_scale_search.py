"""How long the ablation's linear top-M InfoNCE term stays near the collapsed state, at fixed scales.

The ablation's matched arm (``infonce-topm-infonce-matched``, benchmarks/simclr_ablation.py) runs InfoNCE + 0.5 x
top-M InfoNCE at the top-M shortfall term's effective scale, 30.87. All three seeds collapsed: the epoch's mean loss
sat just above the collapsed encoder's log(2N - 1) + 0.5 log(M + 1) = 8.202 (8.227, 8.228, 8.226 in epoch 1) and
k-NN fell below its value at initialisation. Those runs were stopped after 1-2 epochs. This script trains the same
arm, seed 0, the same initial network, batches and views, for ``--steps`` steps at each candidate scale and records
every step's loss and batch pivot rho0 (the 0.2 quantile of the hardest negatives' shortfall 1 - s).

A step has no k-NN, so the collapse rule (benchmarks/lab/collapse.py) cannot judge it. A step counts as near the
collapsed state by ``collapse.probe_step_near_collapse``: the loss within 0.05 of the collapsed encoder's, either
side, and rho0 below 0.005. A probe "left" at the first step of LEAVE_STEPS steps in a row that are not near it.
Every arm starts near it (the initial network maps all images close together: rho0 0.029 at step 0). A probe times
that start; it does not say whether a scale trains, which needs the probes and epochs of a full run.
Output: one JSON line per candidate (written as each finishes), appended to ``--output`` (default in
runs/benchmarks/; the committed probes only when it names them); ``--summarize`` re-derives each line's verdict from
its per-step values.

    OMP_NUM_THREADS=1 python benchmarks/matched_scale_search.py --scales 4 --steps 195
    python benchmarks/matched_scale_search.py --summarize \
        --output benchmarks/results/simclr_ablation_matched_scale/scale_search_epoch1.jsonl   # the committed probes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import simclr_ablation as ablation  # noqa: E402
from benchmarks.lab import collapse  # noqa: E402
from benchmarks.lab.arms import build_run  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.simclr_eval import DEFAULT_DATA, load_data  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

from simclr_tools.augment import SimCLRAugment  # noqa: E402
from simclr_tools.training import SimCLRTraining, data_order  # noqa: E402

OUTPUT = scratch(__file__, "scale_search_epoch1.jsonl")  # the committed probes: ablation.MATCHED_SCALE_DIR
LAST_STEPS = 20
LEAVE_STEPS = 5


def probe(scale: float, steps: int, seed: int, data, config: dict) -> dict:
    """``steps`` steps of the matched arm at ``scale`` from the seed's initial network; every step's loss and rho0."""
    arm = ablation.MATCHED
    arms = {**config["arms"], arm: {**config["arms"][arm]}}
    options = arms[arm]["options"]
    arms[arm]["options"] = {**options, "top_m": {**options["top_m"], "infonce_scale": scale}}
    run_config = {**config, "arms": arms}
    model, objective, optimizer = build_run(arm, seed, run_config)
    augment = SimCLRAugment(data.setup.augment, generator=torch.Generator().manual_seed(seed))
    training = SimCLRTraining(model, objective, optimizer, augment, config["channels_last"])
    losses, rho0 = [], []

    def on_step(step: int, loss: torch.Tensor) -> None:
        losses.append(float(loss))
        rho0.append(float(objective.pop_logged_statistics()["weince_rho0"]))
        if step % 25 == 0:
            print(f"  scale {scale}: step {step} loss {losses[-1]:.4f} rho0 {rho0[-1]:.4f}", flush=True)

    tick = time.perf_counter()
    images = data.train.images
    training.epoch(images, data_order(images.shape[0], seed, 0), config["batch_size"], steps=steps, on_step=on_step)
    record = {"scale": scale, "seed": seed, "steps": steps, "loss": losses, "rho0": rho0}
    return {**record, **verdict(record), "seconds": time.perf_counter() - tick}


def verdict(record: dict) -> dict:
    """A probe's verdict from its per-step loss and rho0: ``collapsed`` when its last LAST_STEPS steps are all near
    the collapsed state (``collapse.probe_step_near_collapse``), the first such step and the step it left."""
    value = collapse.collapse_loss(ablation.STUDY_ARMS[ablation.MATCHED], ablation.ABLATION["batch_size"])
    steps = [collapse.probe_step_near_collapse(v, r, value) for v, r in zip(record["loss"], record["rho0"])]
    tail = slice(-LAST_STEPS, None)
    first = next((i for i, c in enumerate(steps) if c), None)
    # left the collapsed state: the first step after it of LEAVE_STEPS in a row that are not collapsed
    left = None
    if first is not None:
        left = next(
            (i for i in range(first, len(steps) - LEAVE_STEPS + 1) if not any(steps[i : i + LEAVE_STEPS])), None
        )
    return {
        "collapse_loss": value,
        "collapsed": all(steps[tail]),
        "first_collapsed_step": first,
        "left_collapse_at_step": left,
        "last_steps_mean_loss": sum(record["loss"][tail]) / len(record["loss"][tail]),
        "last_steps_mean_rho0": sum(record["rho0"][tail]) / len(record["rho0"][tail]),
    }


def summarize(path: Path) -> list[dict]:
    """Each probe's scale, steps and verdict, re-derived from its per-step values, sharpest first."""
    rows = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        rows.append({"scale": record["scale"], "seed": record["seed"], "steps": record["steps"], **verdict(record)})
    rows.sort(key=lambda row: -row["scale"])
    for row in rows:
        print(
            f"scale {row['scale']:6.2f}, {row['steps']} steps: collapsed {row['collapsed']}; last {LAST_STEPS} steps: "
            f"loss {row['last_steps_mean_loss']:.4f} (collapsed {row['collapse_loss']:.4f}), "
            f"rho0 {row['last_steps_mean_rho0']:.4f}; collapsed from step {row['first_collapsed_step']}, left at "
            f"step {row['left_collapse_at_step']}"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=float, nargs="+", default=[])
    parser.add_argument("--summarize", action="store_true", help="the verdicts of the probes in --output")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.output)
        return
    torch.set_num_threads(1)
    config = dict(ablation.ABLATION)
    data = load_data(config, args.data_dir)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for scale in args.scales:
        result = probe(scale, args.steps, args.seed, data, config)
        print(f"scale {scale}: collapsed {result['collapsed']} (first collapsed step {result['first_collapsed_step']})")
        with args.output.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({**result, "provenance": provenance(argv)}) + "\n")


if __name__ == "__main__":
    main()
