"""InfoNCE against WEINCE on CIFAR-10 with a full-width ResNet-18, on one GPU in about 8 minutes.

Two setups (``--setup``; simclr_tools.setups.SETUPS, as the studies and recipes/simclr.py --preset):

- ``released`` (default): ALGORITHMS.md 1.2b's training setup for both arms (projection head without BatchNorm or
  biases, hidden width = feature width; Adam lr 3e-4 without weight decay; colour jitter 0.8/0.8/0.8/0.2; no
  normalisation), InfoNCE against the released composite (the blend + 0.5 x top-M shortfall + 0.5 x top-M InfoNCE,
  M = 50: the arms ``infonce`` and ``composite`` of benchmarks.lab.arms.ARMS), evaluated with the released
  probe protocol too (stratified 80/20 split, linear probe on raw features, Adam lr 3e-4, 100 epochs; k-NN over 5
  split seeds) besides the k-NN on the whole train split;
- ``batchnorm-head``: the BatchNorm-head setup (Adam lr 1e-3,
  weight decay 1e-6, jitter 0.4/0.4/0.4/0.1, normalised inputs, standardized probe), InfoNCE against the blend
  alone (``weince``).

``--pair link`` (released setup) trains three arms of the link-or-temperature question instead: arm 3
(``infonce-topm-shortfall``, InfoNCE + 0.5 top-M shortfall), the linear top-M term at the fixed scale 30.87
(``infonce-topm-infonce-matched``) and the scheduled arm of benchmarks/simclr_link_or_temperature.py
(``infonce-topm-infonce-scheduled``): the linear top-M term whose scale at each step is arm 3's logged effective scale
at that step. That schedule is fixed from arm 3's run of this invocation (same seed) before the scheduled arm starts.
These arms record every step's loss and top-M effective scales.

All arms start from the same seed (same initial network, data order and augmentations) and train with
simclr_tools.training.SimCLRTraining, the step of the recipe and the studies. The first arm trains whole
epochs while they fit its share of the time budget; the others then train the same number of epochs,
so the comparison is at equal images seen. Augmentations run on the GPU (simclr_tools.augment.SimCLRAugment does
the pixel work on the images' device; only the per-image random parameters are drawn on the CPU), the forward pass
runs under bf16 autocast with channels_last tensors, the loss in float32. At the end: weighted k-NN top-1 (k = 20,
temperature 0.1, all k kept) on frozen backbone features of all 50,000 training and 10,000 test images, and the POT
shape xi of the test projections' negative scores. One JSON with configuration, provenance and both results.

    python benchmarks/gpu_study.py                         # on a GPU machine, ~8 minutes
    python benchmarks/gpu_study.py --device cpu --quick    # a tiny CPU run of the same code path (seconds)
    python benchmarks/gpu_study.py --pair link --budget-seconds 720   # the three link arms on a GPU

The JSON goes to runs/benchmarks/gpu_study/ (git ignores it) unless ``--output`` names a file, e.g.
``--output benchmarks/results/gpu_study/gpu_study.json`` for a record to commit.

Not run on a GPU yet (no GPU was available to the session that wrote it): its timing and accuracy are unmeasured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab, before the imports below
# ruff: noqa: E402

from benchmarks.lab.arms import ARMS, build_objective  # noqa: E402
from benchmarks.lab.outputs import scratch
from benchmarks.lab.runlog import run_name
from benchmarks.lab.schedules import SCHEDULED_STATISTIC, ScheduledScale, schedule_in_memory
from benchmarks.lab.simclr_runner import StepLog
from benchmarks.simclr_link_or_temperature import ARMS as LINK_STUDY_ARMS
from benchmarks.simclr_link_or_temperature import SCHEDULED, SHORTFALL
from st_weince.diagnostics import pot_fit
from st_weince.diagnostics.collect import negative_pool
from st_weince.utils.provenance import provenance
from st_weince.vision.objectives import SIMCLR_BETA, SIMCLR_SCALE

from simclr_tools.augment import SimCLRAugment, eval_transform
from simclr_tools.data import balanced_subset, load_dataset
from simclr_tools.evaluation import (
    KNN_KS,
    KNN_TEMPERATURE,
    STANDARDIZED_PROTOCOL,
    evaluate_frozen_features,
    extract_features,
    knn_evaluate,
)
from simclr_tools.models import SimCLRModel
from simclr_tools.setups import SETUPS
from simclr_tools.training import SimCLRTraining, build_model, build_optimizer, data_order, to_memory_format

DEFAULT_DATA = REPO.parent / "shared" / "data" / "cifar10" / "cifar10-jpg.zip"
DEFAULT_OUTPUT = scratch(__file__, "gpu_study.json")  # the committed results only with --output
DEFAULT_OUTPUT_LINK = DEFAULT_OUTPUT.with_name("gpu_study_link.json")  # --pair link without --output
# The two arms of each setup, baseline first; their objectives: benchmarks.lab.arms.ARMS.
SETUP_ARMS = {"released": ("infonce", "composite"), "batchnorm-head": ("infonce", "blend")}
# --pair link (released setup): the top-M shortfall term against the linear top-M term at its fixed effective scale
# and at arm 3's per-step effective scale, each on top of InfoNCE (docs/evidence.md "link or temperature").
LINK_ARMS = (SHORTFALL, "infonce-topm-infonce-matched", SCHEDULED)
STUDY_ARMS = {**ARMS, **LINK_STUDY_ARMS}
KNN_HEADLINE_K = 20
# Share of the budget for the arms' training, split evenly among them; the rest covers data loading, the first
# epoch's warm-up and evaluation.
TRAIN_SHARE = 0.80

FULL = {"width": 64, "batch_size": 256, "limit_train": None, "limit_test": None, "pot_images": 4000}
QUICK = {"width": 4, "batch_size": 32, "limit_train": 256, "limit_test": 128, "pot_images": 100}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--output", type=Path, default=None, help="gpu_study.json (gpu_study_link.json: --pair link)")
    parser.add_argument("--budget-seconds", type=float, default=480.0, help="whole script, both losses")
    parser.add_argument("--epochs", type=int, default=None, help="fixed epochs instead of what fits the budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setup", choices=sorted(SETUP_ARMS), default="released", help="see above")
    parser.add_argument(
        "--pair", choices=("setup", "link"), default="setup", help="the setup's two arms, or the three LINK_ARMS"
    )
    parser.add_argument("--lr", type=float, default=None, help="the setup's by default")
    parser.add_argument("--weight-decay", type=float, default=None, help="the setup's by default")
    parser.add_argument("--temperature", type=float, default=1.0 / SIMCLR_SCALE)
    parser.add_argument("--quick", action="store_true", help="tiny data and network (CPU smoke run)")
    parser.add_argument("--no-bf16", action="store_true", help="float32 forward instead of bf16 autocast")
    parser.add_argument("--probe-epochs", type=int, default=100, help="the released protocol's linear probe")
    args = parser.parse_args(argv)
    args.scale = QUICK if args.quick else FULL
    for name in ("lr", "weight_decay"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(SETUPS[args.setup], name))
    if args.pair == "link" and args.setup != "released":
        parser.error("--pair link compares arms of the released-setup ablation: use --setup released")
    args.arms = LINK_ARMS if args.pair == "link" else SETUP_ARMS[args.setup]
    if args.output is None:
        args.output = DEFAULT_OUTPUT_LINK if args.pair == "link" else DEFAULT_OUTPUT
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if not args.budget_seconds > 0:
        parser.error(f"--budget-seconds must be positive, got {args.budget_seconds}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu --quick for a CPU smoke run")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_one(
    loss: str,
    images: Tensor,
    args: argparse.Namespace,
    device: torch.device,
    epochs: int | None,
    train_budget: float,
    schedule: dict[str, Any] | None = None,
) -> tuple[SimCLRModel, dict[str, Any]]:
    """Train ``epochs`` epochs, or (``epochs`` None) whole epochs while the next one is expected to fit the budget.
    ``schedule`` (the scheduled arm): the top-M InfoNCE scale of every step (benchmarks/lab/schedules.py). The link
    arms record every step's loss and top-M effective scales (``per_step``)."""
    setup = SETUPS[args.setup]
    torch.manual_seed(args.seed)
    model = build_model(setup, width=args.scale["width"], hidden_dim=setup.hidden_dim, channels_last=True).to(device)
    objective = build_objective(loss, {"arms": STUDY_ARMS, "temperature": args.temperature}).to(device)
    if schedule is not None:
        objective = ScheduledScale(objective, schedule).to(device)
    steps = StepLog(objective) if args.pair == "link" else None
    optimizer = build_optimizer(model, objective, args.lr, args.weight_decay)
    augment = SimCLRAugment(setup.augment, generator=torch.Generator().manual_seed(args.seed))
    autocast_dtype = None if args.no_bf16 else torch.bfloat16  # the loss stays in float32
    training = SimCLRTraining(model, objective, optimizer, augment, channels_last=True, autocast_dtype=autocast_dtype)
    batch_size = args.scale["batch_size"]
    steps_per_epoch = images.shape[0] // batch_size
    losses: list[float] = []
    epoch_seconds: list[float] = []
    synchronize(device)
    started = time.perf_counter()
    while epochs is None or len(epoch_seconds) < epochs:
        tick = time.perf_counter()
        order = data_order(images.shape[0], args.seed, len(losses))
        losses.append(training.epoch(images, order, batch_size, on_step=steps and steps.on_step))
        epoch_seconds.append(time.perf_counter() - tick)
        spent = time.perf_counter() - started
        # The next epoch costs about as much as the last one (the first includes warm-up).
        if epochs is None and spent + epoch_seconds[-1] > train_budget:
            break
    train_seconds = time.perf_counter() - started
    pairs = len(epoch_seconds) * steps_per_epoch * batch_size
    record = {
        "epochs": len(epoch_seconds),
        "steps": len(epoch_seconds) * steps_per_epoch,
        "images_seen": pairs,
        "train_seconds": train_seconds,
        "epoch_seconds": epoch_seconds,
        "pairs_per_second": pairs / train_seconds,
        "train_loss_per_epoch": losses,
        # the loss's means over the whole run (the name is older than that)
        "loss_statistics_last_epoch": objective.pop_logged_statistics() if steps is None else steps.means(),
        "objective": objective.get_config_dict(),
    }
    if steps is not None:
        scales = {k: v for k, v in steps.statistics.items() if k.startswith("weince_effective_scale_top_m")}
        record["per_step"] = {"loss": steps.loss, "loss_statistics": scales}
    return model, record


def link_schedule(results: dict[str, Any], arm: str, seed: int) -> dict[str, Any] | None:
    """The scheduled arm's schedule: the per-step effective scale its source arm logged in this run; None for an arm
    without one."""
    source = STUDY_ARMS.get(arm, {}).get("infonce_scale_schedule")
    if source is None:
        return None
    if source not in results:
        raise ValueError(f"{arm} follows {source}'s per-step scale: train {source} first")
    values = results[source]["per_step"]["loss_statistics"][SCHEDULED_STATISTIC]
    return schedule_in_memory(values, f"{run_name(source, seed)} of this gpu_study run")


def evaluate(model: SimCLRModel, train: Any, test: Any, args: argparse.Namespace, device: torch.device) -> dict:
    tick = time.perf_counter()
    setup = SETUPS[args.setup]

    def transform(images: Tensor) -> Tensor:
        return to_memory_format(eval_transform(images, setup.augment.mean, setup.augment.std), True)

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_bf16)
    with autocast:
        train_features = extract_features(model.encoder, train.images, transform, 1024, device)
        test_features = extract_features(model.encoder, test.images, transform, 1024, device)
        pot_index = torch.tensor(balanced_subset(test.labels, args.scale["pot_images"], 0))
        projections = extract_features(model, test.images[pot_index], transform, 1024, device)
    ks = [k for k in KNN_KS if k <= len(train)]
    num_classes = len(train.classes)
    knn = knn_evaluate(train_features, train.labels, test_features, test.labels, ks, KNN_TEMPERATURE, num_classes)
    try:
        fit = pot_fit(negative_pool(projections), 0.999 if not args.quick else 0.7)
        pot = {"xi": fit.xi, "xi_ci": list(fit.xi_ci), "num_exceedances": fit.num_exceedances}
    except ValueError as error:  # recorded, not hidden
        pot = {"xi": None, "error": str(error)}
    headline = KNN_HEADLINE_K if KNN_HEADLINE_K in knn.top1 else max(knn.top1)
    out = {
        "knn_top1": knn.top1[headline],
        "knn_k": headline,
        "knn": knn.as_dict(),
        "pot_projection": pot,
    }
    if setup.probe is not STANDARDIZED_PROTOCOL:  # the setup's own probe protocol, on the same features
        released = evaluate_frozen_features(
            train_features.float(),
            train.labels,
            test_features.float(),
            test.labels,
            setup.probe,
            epochs=args.probe_epochs,
            num_classes=num_classes,
            seed=args.seed,
        )
        out["probe_protocol"] = {
            key: released[key]
            for key in ("protocol", "linear_top1", "linear_val_top1", "knn_top1", "knn_headline_k", "knn", "knn_val")
        }
    out["eval_seconds"] = time.perf_counter() - tick
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    scale = args.scale
    train = load_dataset("cifar10", "train", args.data_dir, limit=scale["limit_train"], download=False)
    test = load_dataset("cifar10", "test", args.data_dir, limit=scale["limit_test"], download=False)
    images = train.images.to(device)
    train_budget = TRAIN_SHARE * args.budget_seconds / len(args.arms)
    results: dict[str, Any] = {}
    epochs = args.epochs
    baseline, arm = args.arms[:2]
    for loss in args.arms:
        schedule = link_schedule(results, loss, args.seed)
        model, record = train_one(loss, images, args, device, epochs, train_budget, schedule)
        epochs = record["epochs"]  # the other arms train exactly as many epochs as the first
        record.update(evaluate(model, train, test, args, device))
        results[loss] = record
        print(
            f"{loss}: {record['epochs']} epochs in {record['train_seconds']:.0f} s "
            f"({record['pairs_per_second']:.0f} pairs/s), k-NN top-1 {record['knn_top1']:.2f}",
            flush=True,
        )
        del model
    output = {
        "description": (
            f"{' vs '.join(args.arms)}, {args.setup} setup, SimCLR on CIFAR-10 (JPEG copy), CIFAR-stem ResNet-18, "
            "same seed, same epochs; GPU-side augmentations, bf16 autocast, channels_last; weighted k-NN top-1 in "
            "percent (whole train split as the bank, k = 20); under the released setup also its probe protocol."
        ),
        "config": {
            **scale,
            "setup": args.setup,
            "arms": {name: STUDY_ARMS[name] for name in args.arms},
            "quick": args.quick,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "budget_seconds": args.budget_seconds,
            "fixed_epochs": args.epochs,
            "seed": args.seed,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "temperature": args.temperature,
            "beta": SIMCLR_BETA,
            "bf16": not args.no_bf16,
            "channels_last": True,
            "train_images": len(train),
            "test_images": len(test),
        },
        "results": results,
        # the second arm minus the first (InfoNCE for --pair setup; the top-M shortfall arm for --pair link)
        "weince_minus_infonce_knn_top1": results[arm]["knn_top1"] - results[baseline]["knn_top1"],
        "minus_first_arm_knn_top1": {a: results[a]["knn_top1"] - results[baseline]["knn_top1"] for a in args.arms[1:]},
        "total_seconds": time.perf_counter() - started,
        **provenance(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.output} ({output['total_seconds']:.0f} s)", flush=True)
    return output


if __name__ == "__main__":
    main()
