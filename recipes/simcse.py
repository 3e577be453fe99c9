"""Unsupervised SimCSE with WEINCE, InfoNCE or RB-Sigmoid, on the sentence-transformers trainer.

Every sentence goes twice through the encoder in train mode: the two dropout masks make the positive pair, the other
sentences of the batch are the negatives (Gao et al., 2021). Only the loss changes: ``--loss weince`` (WEINCELoss, the
default), ``infonce`` (MultipleNegativesRankingLoss, the SimCSE loss) or ``rb-sigmoid`` (RBSigmoidLoss).
``--loss-option KEY=VALUE`` (repeatable, JSON values) goes to the loss class, which validates it. ``--scale`` is
infonce/weince's factor on cosine scores (1 / temperature) and RB-Sigmoid's starting ``t`` (else its own default).
``--preset paper`` is SimCSE's setup; ``cpu-demo`` runs offline in minutes on a CPU. docs/simcse.md has the outputs.

    python recipes/simcse.py --preset cpu-demo
    torchrun --nproc_per_node 2 recipes/simcse.py --preset cpu-demo --loss infonce
    accelerate launch --multi_gpu --num_processes 4 recipes/simcse.py --preset paper

``--batch-size`` is the global batch: on several processes the loss gathers the in-batch negatives across them by
default, so 1 and N processes train the same loss (``--no-gather-across-devices``: each process's own share only).
The script prints how many processes it trains on; ``prepare_trainer`` warns when the launcher asked for more (on a
CPU, ``accelerate launch --cpu --num_processes 2`` starts one process; ``--multi_gpu`` or torchrun start two).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer import SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.training_args import BatchSamplers
from transformers import set_seed

from st_weince.losses import RBSigmoidLoss, WEINCELoss
from st_weince.training import prepare_trainer
from st_weince.utils.cli import quiet_known_warnings, user_errors_exit

from recipe_tools import (
    DEMO_TRAIN_FILE,
    POOLINGS,
    announce_processes,
    checkpoint_to_resume,
    fetch_wiki1m,
    fill_output_dir,
    load_simcse_model,
    parse_key_values,
    positive_float,
    print_near_zero_loss_note,
    quiet_unless_rank_zero,
    read_training_file,
    resolve_precision,
    stsb_before_training,
    write_run_outputs,
)

REPO = Path(__file__).resolve().parents[1]
# The STS-B scores come from eval/sts_tasks.py, so that the printed figures are the ones eval/sts.py gives.
if str(REPO / "eval") not in sys.path:
    sys.path.append(str(REPO / "eval"))
from sts_tasks import STSEvaluator, read_stsb_splits  # noqa: E402

DEV_METRIC = "eval_stsb-dev_spearman_cosine"
LOSSES = {"infonce": MultipleNegativesRankingLoss, "weince": WEINCELoss, "rb-sigmoid": RBSigmoidLoss}
NEAR_ZERO_LOSS = 1e-2
PAPER = {  # SimCSE's unsupervised BERT-base setup (train_file None: wiki1m_for_simcse.txt from the hub)
    "model": "bert-base-uncased", "train_file": None, "batch_size": 64, "learning_rate": 3e-5, "max_seq_length": 32,
    "scale": 20.0, "epochs": 1.0, "max_steps": -1, "eval_steps": 125, "logging_steps": 125, "pooling": "cls",
    "mlp_head": True, "eval_before": False, "save_optimizer_state": True,
}  # fmt: skip
CPU_DEMO = {  # offline: the packaged all-MiniLM-L6-v2 (model None; else a random BERT), a Wikipedia slice
    **PAPER, "model": None, "train_file": str(DEMO_TRAIN_FILE), "max_steps": 20, "eval_steps": 20, "logging_steps": 5,
    "pooling": "model", "mlp_head": False, "eval_before": True, "save_optimizer_state": False,
}  # fmt: skip
PRESETS = {"paper": PAPER, "cpu-demo": CPU_DEMO}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-demo")
    p.add_argument("--loss", choices=sorted(LOSSES), default="weince")
    p.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE", help="loss keyword; repeatable")
    p.add_argument("--scale", type=positive_float, help="infonce/weince: 1 / temperature; rb-sigmoid: its starting t")
    p.add_argument("--model", help="local model directory, a hub name, or 'tiny' (random 4-layer BERT)")
    p.add_argument("--train-file", help="text file with one training sentence per line")
    p.add_argument("--max-train-samples", type=int, help="use only the first N sentences of the training file")
    p.add_argument("--stsb-dir", default=str(REPO / "eval" / "data" / "stsb"), help="stsb-en-{dev,test}.csv")
    p.add_argument("--dev-pairs", type=int, help="evaluate on the first N pairs of STS-B dev only (default: all)")
    p.add_argument("--output-dir", default=None, help="default: runs/simcse/<preset>-<loss>-seed<seed>-<launch time>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, help="global batch size (all processes together)")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--max-seq-length", type=int, help="training truncation in tokens (evaluation is not truncated)")
    p.add_argument("--eval-max-length", type=int, help="max_seq_length of the evaluated and saved model")
    p.add_argument("--epochs", type=float)
    p.add_argument("--max-steps", type=int, help="optimizer steps; -1 = the epochs")
    p.add_argument("--eval-steps", type=int, help="evaluate STS-B dev (and keep a checkpoint) every N steps")
    p.add_argument("--logging-steps", type=int)
    p.add_argument("--pooling", choices=POOLINGS, help="'model' keeps the model's own pooling")
    p.add_argument("--mlp-head", action=argparse.BooleanOptionalAction, help="MLP over the embedding, training only")
    p.add_argument("--dropout", type=float, help="override the encoder's dropout probability (the augmentation)")
    p.add_argument("--eval-before", action=argparse.BooleanOptionalAction, help="STS-B dev/test before training")
    p.add_argument("--gather-across-devices", action=argparse.BooleanOptionalAction,
                   help="in-batch negatives from all processes (default: on with several processes)")  # fmt: skip
    p.add_argument("--resume-from-checkpoint", help="a checkpoint-* directory, or 'latest' (the last complete one)")
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--save-optimizer-state", action=argparse.BooleanOptionalAction, help="checkpoints can resume")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto", help="auto: GPU bf16/fp16")
    p.add_argument("--threads", type=int, help="torch CPU threads per process (default: torch's choice)")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None and not (key == "scale" and args.loss == "rb-sigmoid"):
            setattr(args, key, value)
    run_name = f"{args.preset}-{args.loss}-seed{args.seed}"
    return fill_output_dir(p, args, "runs/simcse", run_name, args.resume_from_checkpoint)


def build_loss(args: argparse.Namespace, model):
    """The loss, with ``--loss-option`` as keyword arguments: the loss class validates them."""
    options = parse_key_values(args.loss_option)
    if args.scale is not None:  # None only for rb-sigmoid without --scale: the loss's own default
        if "scale" in options:
            raise ValueError(f"--loss {args.loss}: give the scale with --scale, not --loss-option scale=...")
        options["scale"] = args.scale
    try:
        gather = resolve_gather_across_devices(args, int(os.environ.get("WORLD_SIZE", "1")))
        return LOSSES[args.loss](model, gather_across_devices=gather, **options)
    except (TypeError, ValueError) as error:  # an unknown or invalid option, in the loss class's own words
        raise ValueError(f"--loss {args.loss} --loss-option {options}: {error}") from error


def resolve_gather_across_devices(args: argparse.Namespace, world_size: int) -> bool:
    """``--[no-]gather-across-devices`` as given, else on with several processes: ``--batch-size`` is the global batch,
    so 1 and N processes train the same loss (each process's anchors against all the batch's candidates)."""
    return world_size > 1 if args.gather_across_devices is None else args.gather_across_devices


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; the trainer's process group has the same
    rank_zero = int(os.environ.get("RANK", "0")) == 0  # rank 0 prints
    processes = announce_processes(world_size, prints=rank_zero, warn=False)  # prepare_trainer warns
    args.gather_across_devices = resolve_gather_across_devices(args, world_size)
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} is the global batch and must be divisible by the "
                         f"{world_size} processes")  # fmt: skip
    resume = checkpoint_to_resume(args.resume_from_checkpoint, args.output_dir)  # checked before any work
    set_seed(args.seed)
    sentences = read_training_file(args.train_file or fetch_wiki1m(), args.max_train_samples, args.batch_size)
    stsb = read_stsb_splits(args.stsb_dir, args.dev_pairs)  # checked before the model is loaded
    model, num_encoder_modules = load_simcse_model(args)  # the encoder, and SimCSE's MLP head with --mlp-head
    # Both score the encoder without the training-only MLP head, as eval/sts.py scores the saved final/ model.
    dev = STSEvaluator(stsb["dev"], name="stsb-dev", num_modules=num_encoder_modules)
    test = STSEvaluator(stsb["test"], name="stsb-test", num_modules=num_encoder_modules)
    loss = build_loss(args, model)
    loss_config_at_start = loss.get_config_dict()  # RB-Sigmoid: t and b_rel as they start
    if rank_zero:
        print(f"SimCSE: training {args.loss} ({type(loss).__name__}), {loss_config_at_start}\noutput: "
              f"{args.output_dir}", flush=True)  # fmt: skip
    before = stsb_before_training(model, dev, test, show=rank_zero) if args.eval_before and resume is None else {}
    cuda, precision = torch.cuda.is_available(), resolve_precision(args.precision)
    training_args = SentenceTransformerTrainingArguments(  # SimCSE's schedule: linear decay, no warm-up, no decay
        output_dir=args.output_dir, num_train_epochs=args.epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size // world_size, learning_rate=args.learning_rate, warmup_steps=0,
        weight_decay=0.0, lr_scheduler_type="linear", batch_sampler=BatchSamplers.NO_DUPLICATES,
        eval_strategy="steps", eval_steps=args.eval_steps, save_steps=args.eval_steps, load_best_model_at_end=True,
        save_total_limit=args.save_total_limit, save_only_model=not args.save_optimizer_state,
        metric_for_best_model=DEV_METRIC, logging_steps=args.logging_steps, seed=args.seed, data_seed=args.seed,
        bf16=precision == "bf16", fp16=precision == "fp16", use_cpu=not cuda, dataloader_drop_last=True,
        report_to="none", dataloader_pin_memory=cuda,
    )  # fmt: skip
    # Truncation is a training setting: the collator truncates, the model keeps its length for evaluation.
    collator = SentenceTransformerDataCollator(preprocess_fn=model.preprocess, max_length=args.max_seq_length)
    dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences})
    trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss,
                                         evaluator=dev, data_collator=collator)  # fmt: skip
    prepare_trainer(trainer)  # the loss's statistics in the logs; loss state in checkpoints; DDP; no weight decay
    train_seconds = trainer.train(resume_from_checkpoint=resume).metrics["train_runtime"]

    # The best checkpoint (by STS-B dev) is loaded at the end; evaluate and save it without the MLP head.
    state = trainer.state
    encoder = SentenceTransformer(modules=list(model)[:num_encoder_modules], device=str(model.device))
    dev_history = [(e["step"], 100 * e[DEV_METRIC]) for e in state.log_history if DEV_METRIC in e]
    if not dev_history:  # fewer steps than --eval-steps: evaluate the final model once
        dev_history = [(state.global_step, 100 * dev.spearman(encoder))]
    best_dev = 100 * state.best_metric if state.best_metric is not None else dev_history[-1][1]
    results = {  # loss_trained_values: RB-Sigmoid's t and b_rel as trained (loss_config is the configuration)
        "steps": state.global_step, "stsb_dev_best": best_dev, "best_step": state.best_global_step,
        "stsb_test": 100 * test.spearman(encoder), "stsb_dev_history": dev_history, "before": before,
        "train_seconds": round(train_seconds, 1), "train_sentences": len(sentences),
        "loss_config_at_start": loss_config_at_start, "loss_config": loss.get_config_dict(),
        "loss_trained_values": loss.trained_values() if hasattr(loss, "trained_values") else None,
        "log_history": state.log_history,
    }  # fmt: skip
    title, is_main = f"SimCSE {args.loss}, {args.preset}, seed {args.seed}", trainer.is_world_process_zero()
    results = write_run_outputs(args.output_dir, results, args, log_history=state.log_history, title=title,
                                dev_metric=DEV_METRIC, write=is_main, processes=processes.record())  # fmt: skip
    if is_main:
        encoder.save(str(Path(args.output_dir) / "final"))
        was = f"   [before: dev {before['stsb_dev']:.2f}  test {before['stsb_test']:.2f}]" if before else ""
        print(f"STS-B after {state.global_step} steps of {args.loss}: dev best {best_dev:.2f} (step "
              f"{state.best_global_step or state.global_step})  test {results['stsb_test']:.2f}{was}\nresults: "
              f"{args.output_dir}/results.json; model: {args.output_dir}/final", flush=True)  # fmt: skip
        print_near_zero_loss_note(state.log_history, NEAR_ZERO_LOSS)  # last, so that it is not taken for a bug
    return results


def main(argv: list[str] | None = None) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_known_warnings()
    quiet_unless_rank_zero()  # the other processes' warnings and progress bars would repeat rank 0's
    args = parse_args(argv)
    with user_errors_exit("simcse.py"):  # a missing file, model or checkpoint, a bad value: one line, exit status 2
        return train(args)


if __name__ == "__main__":
    main()
