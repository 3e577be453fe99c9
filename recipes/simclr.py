"""SimCLR-style image pre-training with InfoNCE, WEINCE or RB-Sigmoid, then frozen-feature evaluation.

Only the loss changes between runs; it is the SAME class as on the text side (see st_weince/vision/objectives.py).
Loss options go to the loss class, which validates them: ``--loss-option KEY=VALUE`` (repeatable, as in
recipes/simcse.py); ``--scale`` is infonce/weince's factor on cosine scores (1 / temperature, docs/conventions.md;
default 2) and RB-Sigmoid's starting scale ``t`` (default: the loss's own):

    --loss infonce      sentence-transformers' MultipleNegativesRankingLoss, both view orders (= NT-Xent)
    --loss weince       st_weince.losses.WEINCELoss.loss_from_scores on the NT-Xent 2N layout (beta = 1)
    --loss rb-sigmoid   st_weince.losses.RBSigmoidLoss.loss_from_scores on the same layout (t, b_rel trained)

Two presets (``--preset``; docs/vision.md has every setting side by side). Both: CIFAR-stem ResNet-18, projections
to 64 dimensions, scale 2 (temperature 0.5), batch 256 pairs, 100 epochs, weighted k-NN (temperature 0.1, k in
{1, 2, 5, 10, 20, 50}) and a linear probe (100 epochs) on un-augmented frozen features.

    previous   this project's earlier setup (the default): head Linear(f, 512) - BatchNorm - ReLU - Linear(512, 64),
               Adam lr 1e-3 with weight decay 1e-6, colour jitter 0.4/0.4/0.4/0.1, normalised inputs; probe on
               standardised features of the whole train split (Adam lr 1e-3), k-NN against the whole train split.
    released   the released WEINCE setup of docs/algorithms.md 1.2b, for both arms: head Linear(f, f, no bias) - ReLU -
               Linear(f, 64, no bias), Adam lr 3e-4 without weight decay, colour jitter 0.8/0.8/0.8/0.2, no
               normalisation; a stratified 80/20 train/validation split, the probe (logistic regression, Adam lr 3e-4)
               on raw features of the 80 %, test and validation accuracy after the last epoch, k-NN over 5 split seeds
               (headline k = 50). ``--loss weince`` is the released composite: the preset adds the loss options
               top_m_shortfall_weight=0.5, top_m_infonce_weight=0.5 (M = 50, scale 2, beta 1); ``--loss-option``
               overrides each, ``--no-preset-loss-options`` drops them (the blend alone). ``--loss infonce`` is the
               baseline arm.

``--lr``, ``--weight-decay`` and ``--hidden-dim`` override the preset's values.
Augmentations run batched on the training device (st_weince/vision/augment.py).

    # offline, reduced scale (a few minutes on one CPU core)
    python recipes/simclr.py --dataset cifar10 --data-dir ../shared/data/cifar10/cifar10-jpg.zip --loss weince \
        --width 16 --batch-size 64 --max-steps 200 --limit-train 10000 --limit-eval 2000 --output-dir runs/demo
    # the released setup, both arms, full scale on GPUs (torchvision download when online)
    accelerate launch recipes/simclr.py --preset released --dataset cifar100 --data-dir data --loss infonce
    accelerate launch recipes/simclr.py --preset released --dataset cifar100 --data-dir data --loss weince

Under several processes every process computes the loss on its own share of the batch (``--batch-size`` is per
process; no cross-process negatives) and gradients are averaged, including those of RB-Sigmoid's parameters.

Outputs in ``--output-dir``: ``results.json`` (linear_top1, knn_top1 = weighted k-NN top-1 at the preset's headline k,
in percent; all k, recall@k, under ``released`` also the validation figures and every split seed's k-NN; throughput,
loss curve, configuration, machine, library versions, command) and the trained model
(``model.pt`` + ``model_config.json``; load with ``st_weince.vision.load_encoder``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from st_weince.losses.weince import RELEASED_COMPOSITE
from st_weince.training import average_loss_gradients
from st_weince.utils.cli import parse_key_values, positive_float, quiet_known_warnings, user_errors_exit
from st_weince.utils.provenance import provenance
from st_weince.vision import (
    LOSSES,
    PREVIOUS_PROTOCOL,
    RELEASED_AUGMENT,
    RELEASED_PROTOCOL,
    SIMCLR_BETA,
    SIMCLR_SCALE,
    SimCLRAugment,
    SimCLRModel,
    SimCLRObjective,
    eval_transform,
    evaluate_frozen_features,
    extract_features,
    load_dataset,
    save_encoder,
)
from st_weince.vision.augment import SimCLRAugmentConfig
from st_weince.vision.data import DEFAULT_SPLITS
from st_weince.vision.models import BACKBONES

STL10_MEAN, STL10_STD = (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)
FEATURE_WIDTH = "features"  # --hidden-dim value: as wide as the backbone features

# Everything the two presets set differently; batch 256, scale 2, 100 epochs and 64-d projections are shared.
PRESETS: dict[str, dict[str, Any]] = {
    "previous": {
        "lr": 1e-3,
        "weight_decay": 1e-6,
        "hidden_dim": 512,
        "head_batch_norm": True,
        "head_output_bias": True,
        "augment": SimCLRAugmentConfig(),
        "probe": PREVIOUS_PROTOCOL,
        "loss_options": {},
    },
    "released": {
        "lr": 3e-4,
        "weight_decay": 0.0,
        "hidden_dim": FEATURE_WIDTH,
        "head_batch_norm": False,
        "head_output_bias": False,
        "augment": RELEASED_AUGMENT,
        "probe": RELEASED_PROTOCOL,
        # the composite arm: L_blend + 0.5 L_shortfall_topM + 0.5 L_infonce_topM, M = 50 (WEINCELoss.released; its
        # scale 2 and beta 1 are the recipe's --scale and the vision beta)
        "loss_options": {
            "weince": {name: RELEASED_COMPOSITE[name] for name in ("top_m_shortfall_weight", "top_m_infonce_weight")}
        },
    },
}


def hidden_width(value: str) -> int | str:
    """--hidden-dim: a positive integer or "features"."""
    if value == FEATURE_WIDTH:
        return value
    try:
        width = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or {FEATURE_WIDTH!r}, got {value!r}") from None
    if width < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or {FEATURE_WIDTH!r}, got {value!r}")
    return width


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="previous", choices=sorted(PRESETS), help="the setup (see above)")
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default="cifar10", choices=sorted(DEFAULT_SPLITS))
    data.add_argument("--data-dir", default=None, help="ImageFolder dir / zip (offline) or torchvision root")
    data.add_argument("--no-download", action="store_true", help="never download torchvision datasets")
    data.add_argument("--limit-train", type=int, default=None, help="class-balanced subset of pre-training images")
    data.add_argument("--limit-probe-train", type=int, default=None, help="labelled train images for the probes")
    data.add_argument("--limit-eval", type=int, default=None, help="class-balanced subset of test images")
    data.add_argument("--subset-seed", type=int, default=0, help="seed of the subsets (same for every run)")
    model = parser.add_argument_group("model")
    model.add_argument("--backbone", default="resnet18", choices=sorted(BACKBONES))
    model.add_argument("--width", type=int, default=64, help="channels of the first stage (64 = standard ResNet)")
    model.add_argument("--imagenet-stem", action="store_true", help="7x7 stride-2 stem with max-pool")
    model.add_argument(
        "--hidden-dim", type=hidden_width, default=None, help="head width: an integer or 'features' (preset's)"
    )
    model.add_argument("--projection-dim", type=int, default=64)
    loss = parser.add_argument_group("loss")
    loss.add_argument("--loss", default="weince", choices=LOSSES)
    loss.add_argument(
        "--scale",
        type=positive_float,
        default=None,
        help=f"infonce/weince: 1 / temperature (default {SIMCLR_SCALE:g}); rb-sigmoid: its starting t",
    )
    loss.add_argument(
        "--loss-option", action="append", default=[], metavar="KEY=VALUE", help="loss keyword, e.g. beta=1; repeatable"
    )
    loss.add_argument(
        "--no-preset-loss-options", action="store_true", help="ignore the preset's loss options (the class defaults)"
    )
    train = parser.add_argument_group("training")
    train.add_argument("--batch-size", type=int, default=256, help="pairs per step and process (2x views)")
    train.add_argument("--lr", type=float, default=None, help="the preset's by default")
    train.add_argument("--weight-decay", type=float, default=None, help="the preset's by default")
    train.add_argument("--epochs", type=float, default=100.0)
    train.add_argument("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    train.add_argument("--log-every", type=int, default=10)
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--probe-epochs", type=int, default=100)
    evaluation.add_argument("--eval-batch-size", type=int, default=512)
    evaluation.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--output-dir", default="runs/simclr")
    parser.add_argument("--no-save-model", action="store_true")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    for name in ("lr", "weight_decay", "hidden_dim"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    try:
        explicit = parse_key_values(args.loss_option)
    except ValueError as error:
        parser.error(str(error))
    preset_options = {} if args.no_preset_loss_options else preset["loss_options"].get(args.loss, {})
    args.loss_kwargs = {**preset_options, **explicit}
    for name in ("limit_train", "limit_probe_train", "limit_eval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.batch_size < 2:
        parser.error("--batch-size must be at least 2 (the NT-Xent layout needs 2 pairs)")
    if args.scale is None and args.loss != "rb-sigmoid":
        args.scale = SIMCLR_SCALE  # temperature 0.5; RB-Sigmoid starts from its own default t unless --scale
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    quiet_known_warnings()
    args = parse_args(argv)
    with user_errors_exit("simclr.py"):  # a missing data folder, a bad value: one line, exit status 2
        return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    # Several processes without CUDA (torchrun on a CPU machine): accelerate sets up gloo only when told cpu=True.
    multi_cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    accelerator = Accelerator(cpu=multi_cpu)
    set_seed(args.seed)
    device = accelerator.device
    output_dir = Path(args.output_dir)
    splits = DEFAULT_SPLITS[args.dataset]
    mean_std = (STL10_MEAN, STL10_STD) if args.dataset == "stl10" else (None, None)

    # --- data (in memory, uint8) ---
    load = {"data_dir": args.data_dir, "subset_seed": args.subset_seed, "download": not args.no_download}
    with accelerator.main_process_first():
        pretrain = load_dataset(args.dataset, splits["pretrain"], limit=args.limit_train, **load)
    accelerator.print(f"pre-training images: {len(pretrain)} {tuple(pretrain.images.shape[1:])}")
    if len(pretrain) < args.batch_size * accelerator.num_processes:
        raise ValueError(f"--batch-size {args.batch_size} needs at least that many images, got {len(pretrain)}")

    # --- model, loss, optimizer ---
    preset = PRESETS[args.preset]
    model = SimCLRModel(
        args.backbone,
        width=args.width,
        cifar_stem=not args.imagenet_stem,
        hidden_dim=None if args.hidden_dim == FEATURE_WIDTH else args.hidden_dim,
        projection_dim=args.projection_dim,
        head_batch_norm=preset["head_batch_norm"],
        head_output_bias=preset["head_output_bias"],
    )
    options = dict(args.loss_kwargs)
    beta = options.pop("beta", SIMCLR_BETA)  # the vision reference setting (WEINCELoss's own default is "auto")
    scale = args.scale
    if args.loss == "rb-sigmoid":  # RB-Sigmoid's scale is its trained t: --scale is its start
        if scale is not None:
            if "scale" in options:
                raise ValueError("--loss rb-sigmoid: give the starting scale with --scale, not --loss-option scale=...")
            options["scale"] = scale
        scale = SIMCLR_SCALE  # the objective's InfoNCE/WEINCE factor, which RB-Sigmoid does not read
    objective = SimCLRObjective(args.loss, beta=beta, loss_kwargs=options, scale=scale).to(device)
    loss_parameters = [p for p in objective.parameters() if p.requires_grad]
    param_groups = [{"params": list(model.parameters())}]
    if loss_parameters:
        param_groups.append({"params": loss_parameters, "weight_decay": 0.0})  # no decay on t, b_rel
    optimizer = torch.optim.Adam(param_groups, lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)

    steps_per_epoch = len(pretrain) // (args.batch_size * accelerator.num_processes)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(args.seed)
    augment_config = preset["augment"]
    if mean_std[0] and args.preset == "previous":  # the released setup never normalises
        augment_config = dataclasses.replace(augment_config, mean=mean_std[0], std=mean_std[1])
    augment = SimCLRAugment(augment_config, generator=generator)
    images_on_device = pretrain.images.to(device)

    # --- training ---
    model.train()
    history: list[dict[str, float]] = []
    augment_seconds = step_seconds = 0.0
    running = 0.0
    order: torch.Tensor = torch.empty(0, dtype=torch.long)
    cursor = 0
    bar = tqdm(range(max_steps), desc=f"simclr {args.loss}", disable=not accelerator.is_main_process)
    for step in bar:
        if cursor + args.batch_size * accelerator.num_processes > order.numel():
            order = torch.randperm(len(pretrain), generator=generator)  # same permutation on every process
            cursor = 0
        chunk = order[cursor : cursor + args.batch_size * accelerator.num_processes]
        batch = chunk[accelerator.process_index :: accelerator.num_processes]
        cursor += chunk.numel()

        tick = time.perf_counter()
        view_a, view_b = augment(images_on_device[batch.to(device)])
        augment_seconds += time.perf_counter() - tick
        projections = model(torch.cat([view_a, view_b]))
        z1, z2 = projections.chunk(2)
        loss = objective(z1, z2)
        if not torch.isfinite(loss):
            raise ValueError(f"loss became {float(loss)} at step {step}; lower --lr or check the data")
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        average_loss_gradients(objective)  # the loss is not inside DDP: average t, b_rel over processes
        optimizer.step()
        step_seconds += time.perf_counter() - tick
        running += float(loss.detach())
        if (step + 1) % args.log_every == 0 or step + 1 == max_steps:
            count = (step % args.log_every) + 1
            record = {"step": step + 1, "loss": running / count, **objective.pop_logged_statistics()}
            history.append(record)
            running = 0.0
            bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k != "step"})
    train_seconds = step_seconds
    pairs = max_steps * args.batch_size * accelerator.num_processes

    unwrapped = accelerator.unwrap_model(model)
    results: dict[str, Any] = {
        "dataset": args.dataset,
        "preset": args.preset,
        "loss": args.loss,
        "seed": args.seed,
        "steps": max_steps,
        "epochs_seen": pairs / len(pretrain),
        "pretrain_images": len(pretrain),
        "throughput": {
            "augmented_views_per_second": 2 * pairs / max(augment_seconds, 1e-9),
            "source_images_per_second_data_pipeline": pairs / max(augment_seconds, 1e-9),
            "train_pairs_per_second": pairs / max(train_seconds, 1e-9),
            "seconds_per_step": train_seconds / max(max_steps, 1),
            "augment_share_of_step": augment_seconds / max(train_seconds, 1e-9),
        },
        "final_loss": history[-1]["loss"] if history else None,
        "loss_parameters": {n: float(p.detach().reshape(-1)[0]) for n, p in objective.named_parameters()},
        "objective": objective.get_config_dict(),
        "history": history,
    }

    # --- evaluation on frozen backbone features (main process) ---
    if not args.skip_eval and accelerator.is_main_process:
        tick = time.perf_counter()
        probe_limit = args.limit_probe_train if args.limit_probe_train is not None else args.limit_train
        if splits["train"] == splits["pretrain"] and probe_limit == args.limit_train:
            probe_train = pretrain
        else:
            probe_train = load_dataset(args.dataset, splits["train"], limit=probe_limit, **load)
        test = load_dataset(args.dataset, splits["test"], limit=args.limit_eval, **load)
        mean, std = augment_config.mean, augment_config.std

        def transform(images: torch.Tensor) -> torch.Tensor:
            return eval_transform(images, mean, std)

        encoder = unwrapped.encoder
        train_features = extract_features(encoder, probe_train.images, transform, args.eval_batch_size, device)
        test_features = extract_features(encoder, test.images, transform, args.eval_batch_size, device)
        evaluation = evaluate_frozen_features(
            train_features,
            probe_train.labels,
            test_features,
            test.labels,
            preset["probe"],
            epochs=args.probe_epochs,
            num_classes=len(probe_train.classes),
            seed=args.seed,
        )
        results.update(
            {
                **evaluation,
                "probe_train_images": len(probe_train),
                "eval_images": len(test),
                "eval_seconds": time.perf_counter() - tick,
            }
        )
        accelerator.print(
            f"linear top-1 {evaluation['linear_top1']:.2f} %  "
            f"k-NN top-1 (k={evaluation['knn_headline_k']}) {evaluation['knn_top1']:.2f} %"
        )

    if accelerator.is_main_process:
        results.update(
            {
                "config": {k: v for k, v in vars(args).items()},
                "num_processes": accelerator.num_processes,
                "train_seconds": train_seconds,
                "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                "environment": provenance(),
            }
        )
        output_dir.mkdir(parents=True, exist_ok=True)
        if not args.no_save_model:
            save_encoder(unwrapped, output_dir, {"loss": args.loss, "seed": args.seed, "steps": max_steps})
        (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    accelerator.wait_for_everyone()
    return results


if __name__ == "__main__":
    main()
