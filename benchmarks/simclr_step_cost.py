"""Step cost of SimCLR training on one CPU thread for the candidate configurations of the issue-14 study.

Times a few training steps (augmentation + forward + backward + Adam, after one warm-up step) on random uint8
32x32 images for each (width, batch pairs, channels_last, loss), and reports pairs per second and the implied minutes
for 5 epochs of the 50,000 CIFAR-10 training images. The load average of the machine is recorded next to the figures.

    OMP_NUM_THREADS=1 python benchmarks/simclr_step_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from st_weince.utils.provenance import provenance
from st_weince.vision import SimCLRAugment, SimCLRModel, SimCLRObjective, SimCLRTraining, build_optimizer

OUTPUT = Path(__file__).resolve().parent / "results" / "simclr_study" / "step_cost.json"
CANDIDATES = [  # (width, batch pairs, channels_last, loss)
    (8, 64, False, "weince"),
    (8, 64, True, "weince"),
    (16, 128, False, "weince"),
    (16, 128, True, "weince"),
    (16, 256, True, "infonce"),
    (16, 256, True, "weince"),
    (16, 256, True, "rb-sigmoid"),
    (32, 128, True, "weince"),
]


def step_cost(width: int, batch: int, channels_last: bool, loss: str, steps: int) -> dict:
    torch.manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8)
    model = SimCLRModel("resnet18", width=width)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    objective = SimCLRObjective(loss)  # SimCLR's scale 2 (temperature 0.5)
    optimizer = build_optimizer(model, objective, lr=1e-3, weight_decay=0.0)
    augment = SimCLRAugment(generator=torch.Generator().manual_seed(0))
    training = SimCLRTraining(model, objective, optimizer, augment, channels_last=channels_last)
    seconds = []
    for _ in range(steps + 1):  # the first step is a warm-up
        tick = time.perf_counter()
        float(training.step(images))  # the step's loss on the host: the step is done
        seconds.append(time.perf_counter() - tick)
    per_step = sum(seconds[1:]) / steps
    return {
        "width": width,
        "batch_pairs": batch,
        "channels_last": channels_last,
        "loss": loss,
        "seconds_per_step": per_step,
        "pairs_per_second": batch / per_step,
        "minutes_for_5_epochs_of_50k": 5 * 50000 / (batch / per_step) / 60,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    for candidate in CANDIDATES:
        rows.append(step_cost(*candidate, steps=args.steps))
        print(json.dumps(rows[-1]), flush=True)
    record = {
        "description": "training step cost on one CPU thread (random 32x32 images), see docs/evidence.md",
        "steps_timed": args.steps,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
        **provenance(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
