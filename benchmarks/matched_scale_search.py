"""The sharpest fixed scale at which the ablation's linear top-M InfoNCE term does not collapse the encoder.

The ablation's matched arm (``infonce-topm-infonce-matched``, benchmarks/simclr_ablation.py) runs InfoNCE + 0.5 x
top-M InfoNCE at the top-M shortfall term's effective scale, 30.87. Both seeds collapsed in epoch 1: the epoch's
mean loss sat at the collapsed encoder's log(2N - 1) + 0.5 log(M + 1) = 8.202 (8.227 and 8.228) and the batch pivot
rho0, the 0.2 quantile of the hardest negatives' shortfall 1 - s, fell to 0.001. This script trains the same arm,
seed 0, the same initial network, batches and views, for ``--steps`` steps at each candidate scale and records every
step's loss and rho0, so that the sharpest scale that does not collapse can be chosen before any 5-epoch run.

A step counts as collapsed when its loss lies within 0.05 of the collapsed encoder's and its rho0 below 0.01; a
candidate collapses when its last 20 steps all do. Output: one JSON line per candidate in
benchmarks/results/simclr_ablation_matched_scale/scale_search.jsonl (written as each finishes).

    OMP_NUM_THREADS=1 python benchmarks/matched_scale_search.py --scales 20 12 --steps 150
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
from benchmarks.lab.simclr_eval import DEFAULT_DATA, load_data  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402
from st_weince.vision import SimCLRAugment, SimCLRTraining, build_run, data_order  # noqa: E402

OUTPUT = ablation.MATCHED_SCALE_DIR / "scale_search.jsonl"
COLLAPSE_LOSS_MARGIN = 0.05
COLLAPSE_RHO0 = 0.01
LAST_STEPS = 20


def probe(scale: float, steps: int, seed: int, data, config: dict) -> dict:
    """``steps`` steps of the matched arm at ``scale`` from the seed's initial network; every step's loss and rho0."""
    arm = ablation.MATCHED
    arms = {**config["arms"], arm: {**config["arms"][arm]}}
    arms[arm]["options"] = {**arms[arm]["options"], "top_m_infonce_scale": scale}
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
    collapse = ablation.collapse_loss(arm, config["batch_size"])
    collapsed_steps = [abs(v - collapse) < COLLAPSE_LOSS_MARGIN and r < COLLAPSE_RHO0 for v, r in zip(losses, rho0)]
    first = next((i for i, c in enumerate(collapsed_steps) if c), None)
    return {
        "scale": scale,
        "seed": seed,
        "steps": steps,
        "collapse_loss": collapse,
        "collapsed": all(collapsed_steps[-LAST_STEPS:]),
        "first_collapsed_step": first,
        "loss": losses,
        "rho0": rho0,
        "seconds": time.perf_counter() - tick,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=float, nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
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
