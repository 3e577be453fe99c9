"""SimCLR-style image pre-training with InfoNCE, WEINCE or RB-Sigmoid, then frozen-feature evaluation.

Only the loss changes between runs; it is the SAME class as on the text side (st_weince/vision/objectives.py). The
datasets, augmentations, CIFAR ResNets, setups, training step and probes are in simclr_tools/ beside this script.
``--loss-option KEY=VALUE`` (repeatable) goes to the loss class, which validates it; ``--scale`` is 1 / temperature
(default 2), or RB-Sigmoid's starting t. ``--preset`` is a setup of simclr_tools/setups.py (docs/vision.md compares
them): ``batchnorm-head`` (the default) or ``released`` (docs/algorithms.md 1.2b for both arms; ``--loss weince`` is
the released composite unless ``--no-preset-loss-options``); ``--lr``, ``--weight-decay``, ``--hidden-dim`` override it.

    python recipes/simclr.py --dataset cifar10 --data-dir ../shared/data/cifar10/cifar10-jpg.zip --loss weince \
        --width 16 --batch-size 64 --max-steps 200 --limit-train 10000 --limit-eval 2000 --output-dir runs/demo
    accelerate launch recipes/simclr.py --preset released --dataset cifar100 --data-dir data --loss weince
    torchrun --nproc_per_node 2 recipes/simclr.py ...   # several processes on a CPU (gloo)
    accelerate launch --multi_gpu --num_processes 2 recipes/simclr.py ...   # on 2 GPUs (or 2 CPU processes)

``--batch-size`` is per process: each process scores its own pairs (the NT-Xent score matrix is built locally, so
nothing is gathered across processes). The script prints how many processes it trains on and warns when the launcher
asked for more. ``--output-dir`` (default ``runs/simclr/<preset>-<loss>-seed<seed>-<launch time>``) gets
results.json, training_curves.png and the model (simclr_tools.models.load_encoder reads it).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from functools import partial
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from st_weince.utils.cli import quiet_known_warnings, user_errors_exit
from st_weince.vision.objectives import LOSSES, SIMCLR_BETA, SIMCLR_SCALE, SimCLRObjective

from recipe_tools import (
    announce_processes,
    fill_output_dir,
    merge_options,
    parse_key_values,
    positive_float,
    positive_int,
    quiet_unless_rank_zero,
    write_run_outputs,
)
from simclr_tools.augment import SimCLRAugment, SimCLRAugmentConfig, eval_transform
from simclr_tools.data import DEFAULT_SPLITS, ImageTensorDataset, load_dataset
from simclr_tools.evaluation import evaluate_encoder
from simclr_tools.models import BACKBONES, SimCLRModel, save_encoder
from simclr_tools.setups import SETUPS
from simclr_tools.training import SimCLRTraining, build_model, build_optimizer, data_order

FEATURE_WIDTH = "features"  # --hidden-dim value: as wide as the backbone features


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--preset", default="batchnorm-head", choices=sorted(SETUPS), help="the setup (see above)")
    add("--dataset", default="cifar10", choices=sorted(DEFAULT_SPLITS))
    add("--data-dir", default=None, help="ImageFolder dir / zip (offline) or torchvision root")
    add("--no-download", action="store_true", help="never download torchvision datasets")
    for name, what in (("train", "pre-training"), ("probe-train", "labelled train"), ("eval", "test")):
        add(f"--limit-{name}", type=positive_int, default=None, help=f"class-balanced subset of {what} images")
    add("--subset-seed", type=int, default=0, help="seed of the subsets (same for every run)")
    add("--backbone", default="resnet18", choices=sorted(BACKBONES))
    add("--width", type=int, default=64, help="channels of the first stage (64 = standard ResNet)")
    add("--imagenet-stem", action="store_true", help="7x7 stride-2 stem with max-pool")
    add("--hidden-dim", type=lambda v: v if v == FEATURE_WIDTH else positive_int(v), help="an integer or 'features'")
    add("--projection-dim", type=int, default=64)
    add("--loss", default="weince", choices=LOSSES)
    add("--scale", type=positive_float, default=None, help="1 / temperature (default 2); rb-sigmoid: starting t")
    add("--loss-option", action="append", default=[], metavar="KEY=VALUE", help="loss keyword; repeatable")
    add("--no-preset-loss-options", action="store_true", help="ignore the preset's loss options")
    add("--batch-size", type=int, default=256, help="pairs per step and process (2x views)")
    add("--lr", type=float, default=None, help="the preset's by default")
    add("--weight-decay", type=float, default=None, help="the preset's by default")
    add("--epochs", type=float, default=100.0)
    add("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=None, help="torch CPU threads")
    add("--log-every", type=int, default=10)
    add("--probe-epochs", type=int, default=100)
    add("--eval-batch-size", type=int, default=512)
    add("--skip-eval", action="store_true")
    add("--output-dir", default=None, help="default: runs/simclr/<preset>-<loss>-seed<seed>-<launch time>")
    add("--no-save-model", action="store_true")
    args = parser.parse_args(argv)
    setup = SETUPS[args.preset]
    args.lr = setup.lr if args.lr is None else args.lr
    args.weight_decay = setup.weight_decay if args.weight_decay is None else args.weight_decay
    if args.hidden_dim is None:
        args.hidden_dim = FEATURE_WIDTH if setup.hidden_dim is None else setup.hidden_dim
    try:
        explicit = parse_key_values(args.loss_option)
    except ValueError as error:
        parser.error(str(error))
    preset_options = {} if args.no_preset_loss_options else setup.loss_options.get(args.loss, {})
    args.loss_kwargs = merge_options(preset_options, explicit)
    if args.loss == "rb-sigmoid" and args.scale is not None and "scale" in args.loss_kwargs:
        parser.error("--loss rb-sigmoid: give the starting scale with --scale, not --loss-option scale=...")
    if args.scale is None and args.loss != "rb-sigmoid":
        args.scale = SIMCLR_SCALE  # RB-Sigmoid starts from its own default t unless --scale
    return fill_output_dir(parser, args, "runs/simclr", f"{args.preset}-{args.loss}-seed{args.seed}")


def load_split(args: argparse.Namespace, split: str, limit: int | None) -> ImageTensorDataset:
    """``split``: "pretrain", "train" or "test", the dataset's split for it (DEFAULT_SPLITS)."""
    return load_dataset(args.dataset, DEFAULT_SPLITS[args.dataset][split], args.data_dir, limit=limit,
                        subset_seed=args.subset_seed, download=not args.no_download)  # fmt: skip


def load_model(args: argparse.Namespace) -> SimCLRModel:
    hidden_dim = None if args.hidden_dim == FEATURE_WIDTH else args.hidden_dim
    return build_model(SETUPS[args.preset], backbone=args.backbone, width=args.width, hidden_dim=hidden_dim,
                       projection_dim=args.projection_dim, cifar_stem=not args.imagenet_stem)  # fmt: skip


def build_loss(args: argparse.Namespace) -> SimCLRObjective:
    """The loss class in the NT-Xent layout; RB-Sigmoid's scale is its trained t, which --scale starts."""
    options = dict(args.loss_kwargs)
    beta = options.pop("beta", SIMCLR_BETA)  # the vision setting (WEINCELoss's own default is "auto")
    if args.loss == "rb-sigmoid" and args.scale is not None:
        options["scale"] = args.scale
    scale = SIMCLR_SCALE if args.loss == "rb-sigmoid" else args.scale
    return SimCLRObjective(args.loss, scale=scale, beta=beta, loss_kwargs=options)


def train(args: argparse.Namespace, accelerator: Accelerator, training: SimCLRTraining, images: torch.Tensor) -> dict:
    """``--max-steps`` (or ``--epochs``) steps over the seeded data order; the loss curve every ``--log-every``."""
    steps_per_epoch = len(images) // (args.batch_size * accelerator.num_processes)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.epochs * steps_per_epoch)
    history: list[dict[str, float]] = []
    pending: list[torch.Tensor] = []
    bar = tqdm(total=max_steps, desc=f"simclr {args.loss}", disable=not accelerator.is_main_process)

    def log(step: int, loss: torch.Tensor) -> None:
        pending.append(loss)
        bar.update()
        if bar.n % args.log_every == 0 or bar.n == max_steps:  # the host sync, every --log-every steps
            history.append({"step": bar.n, "loss": sum(float(v) for v in pending) / len(pending),
                            **training.objective.pop_logged_statistics()})  # fmt: skip
            pending.clear()
            bar.set_postfix({k: f"{v:.4g}" for k, v in history[-1].items() if k != "step"})

    tick = time.perf_counter()
    for epoch in range(math.ceil(max_steps / steps_per_epoch)):
        order = data_order(len(images), args.seed, epoch)  # the same on every process
        training.epoch(images, order, args.batch_size, steps=max_steps - epoch * steps_per_epoch, on_step=log,
                       process_index=accelerator.process_index, num_processes=accelerator.num_processes)  # fmt: skip
    train_seconds, pairs = time.perf_counter() - tick, max_steps * args.batch_size * accelerator.num_processes
    return {"steps": max_steps, "epochs_seen": pairs / len(images), "train_seconds": train_seconds,
            "throughput": training.throughput(pairs, train_seconds, max_steps),
            "final_loss": history[-1]["loss"] if history else None, "history": history}  # fmt: skip


def evaluate(args: argparse.Namespace, encoder: torch.nn.Module, pretrain: ImageTensorDataset,
             augment_config: SimCLRAugmentConfig, device: torch.device) -> dict[str, Any]:  # fmt: skip
    """The preset's probe protocol on frozen, un-augmented backbone features."""
    splits, tick = DEFAULT_SPLITS[args.dataset], time.perf_counter()
    probe_limit = args.limit_probe_train if args.limit_probe_train is not None else args.limit_train
    same = splits["train"] == splits["pretrain"] and probe_limit == args.limit_train
    probe_train = pretrain if same else load_split(args, "train", probe_limit)
    transform = partial(eval_transform, mean=augment_config.mean, std=augment_config.std)
    test, protocol = load_split(args, "test", args.limit_eval), SETUPS[args.preset].probe
    result = evaluate_encoder(encoder, probe_train, test, protocol, transform, epochs=args.probe_epochs,
                              batch_size=args.eval_batch_size, device=device, seed=args.seed)  # fmt: skip
    print(f"linear top-1 {result['linear_top1']:.2f} %  k-NN top-1 (k={result['knn_headline_k']}) "
          f"{result['knn_top1']:.2f} %")  # fmt: skip
    return {**result, "eval_seconds": time.perf_counter() - tick}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    # Several processes without CUDA (torchrun on a CPU machine): accelerate sets up gloo only when told cpu=True.
    accelerator = Accelerator(cpu=int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available())
    processes = announce_processes(accelerator.num_processes, prints=accelerator.is_main_process)
    set_seed(args.seed)
    with accelerator.main_process_first():
        pretrain = load_split(args, "pretrain", args.limit_train)
    if len(pretrain) < args.batch_size * accelerator.num_processes:
        raise ValueError(f"--batch-size {args.batch_size} needs at least that many images, got {len(pretrain)}")
    model, objective = load_model(args), build_loss(args).to(accelerator.device)
    optimizer = build_optimizer(model, objective, args.lr, args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    augment_config = SETUPS[args.preset].augment_for(args.dataset)
    augment = SimCLRAugment(augment_config, generator=torch.Generator().manual_seed(args.seed))
    training = SimCLRTraining(model, objective, optimizer, augment, backward=accelerator.backward)
    results = {"dataset": args.dataset, "preset": args.preset, "loss": args.loss, "seed": args.seed,
               "pretrain_images": len(pretrain)}  # fmt: skip
    results.update(train(args, accelerator, training, pretrain.images.to(accelerator.device)))
    results["loss_parameters"] = {n: float(p.detach().reshape(-1)[0]) for n, p in objective.named_parameters()}
    results["objective"] = objective.get_config_dict()

    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process and not args.skip_eval:
        results.update(evaluate(args, unwrapped.encoder, pretrain, augment_config, accelerator.device))
    if accelerator.is_main_process and not args.no_save_model:
        save_encoder(unwrapped, args.output_dir, {"loss": args.loss, "seed": args.seed, "steps": results["steps"]})
    results["num_processes"] = accelerator.num_processes
    record = write_run_outputs(args.output_dir, results, args, log_history=results["history"],
                               title=f"SimCLR {args.loss}", write=accelerator.is_main_process,
                               processes=processes.record())  # fmt: skip
    accelerator.wait_for_everyone()
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quiet_known_warnings()
    quiet_unless_rank_zero()  # the other processes' warnings and progress bars would repeat rank 0's
    args = parse_args(argv)
    with user_errors_exit("simclr.py"):  # a missing data folder, a bad value: one line, exit status 2
        return run(args)


if __name__ == "__main__":
    main()
