"""Reduced-scale unsupervised SimCSE comparison: InfoNCE vs WEINCE vs RB-Sigmoid, plus WEINCE's beta study.

Every run is ``recipes/simcse.py --preset cpu-demo`` from all-MiniLM-L6-v2 with the same data, steps, batch and
evaluation; only the loss (and the seed) changes. The runs go one after the other, single-threaded, each in its own
process with its log in ``runs/simcse-compare/<config>-seed<k>/run.log``; a run whose ``results.json`` exists is
skipped, so the script can be restarted. After each run the tables in ``--results-dir`` are rewritten (by default
``<runs-dir>/tables``; the committed ones, in ``benchmarks/results/simcse/``, only when it names that folder):

    runs.csv       one row per run (config, seed, steps, STS-B dev best, best step, STS-B test, seconds, command and
                   the commit whose CLI it is)
    summary.json   per config: mean and sample std over seeds; the starting model's scores; scale, seeds,
                   commands, machine and library versions
    summary.md     the same as a Markdown table

Usage (5-12 minutes per run on one core of this busy 2-core machine, most of it STS-B evaluation):

    OMP_NUM_THREADS=1 python benchmarks/simcse_compare.py                      # everything
    OMP_NUM_THREADS=1 python benchmarks/simcse_compare.py --configs infonce weince --seeds 0
    python benchmarks/simcse_compare.py --summarize-only --results-dir benchmarks/results/simcse  # the committed tables
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.lab.summaries import format_stat, mean_std  # noqa: E402
from eval.sts_tasks import STSEvaluator, read_stsb_splits  # noqa: E402
from recipes.recipe_tools import minilm_path  # noqa: E402

RECIPE = REPO / "recipes" / "simcse.py"
COMMITTED_RESULTS = REPO / "benchmarks" / "results" / "simcse"  # rewritten only when --results-dir names it
STSB_DIR = REPO / "eval" / "data" / "stsb"

# The scale (see docs/simcse.md for the justification; it is set by the shared 2-core machine, where one training
# step takes ~40 s and one pass over an STS-B split 2-3 minutes): batch 64 (the paper's, so WEINCE's tail fit sees
# 63 negatives per anchor), 6 optimizer steps at lr 1e-4 (linear decay; 3.3x the paper's 3e-5, so that the few steps
# move the weights measurably), 384 sentences of the 4,096-sentence slice, the same for every run; STS-B dev (first
# 500 pairs) and the full STS-B test once, after the last step.
SCALE = {
    "batch_size": 64,
    "max_steps": 6,
    "eval_steps": 6,
    "logging_steps": 1,
    "max_seq_length": 32,
    "lr": 1e-4,
    "dev_pairs": 500,
}

CONFIGS: dict[str, list[str]] = {
    "infonce": ["--loss", "infonce"],
    "weince": ["--loss", "weince"],  # WEINCELoss's text default for beta
    "weince-beta1": ["--loss", "weince", "--loss-option", "beta=1"],  # the reference implementation's beta
    "weince-beta10": ["--loss", "weince", "--loss-option", "beta=10"],  # 1 x (0.5 / tau): the reference ratio at 0.05
    "rb-sigmoid": ["--loss", "rb-sigmoid"],
}
DEFAULT_CONFIGS = ["infonce", "weince", "rb-sigmoid", "weince-beta1", "weince-beta10"]


def common_args(seed: int, output_dir: Path) -> list[str]:
    return [
        "--preset", "cpu-demo",
        "--seed", str(seed),
        "--output-dir", str(output_dir),
        "--batch-size", str(SCALE["batch_size"]),
        "--max-steps", str(SCALE["max_steps"]),
        "--eval-steps", str(SCALE["eval_steps"]),
        "--logging-steps", str(SCALE["logging_steps"]),
        "--max-seq-length", str(SCALE["max_seq_length"]),
        "--learning-rate", str(SCALE["lr"]),
        "--dev-pairs", str(SCALE["dev_pairs"]),
        "--no-eval-before",
        "--save-total-limit", "1",
        "--threads", "1",
    ]  # fmt: skip


def baseline(out_dir: Path) -> dict[str, float]:
    """STS-B dev/test of the starting model (all-MiniLM-L6-v2), evaluated exactly as the runs evaluate."""
    path = out_dir / "baseline.json"
    scores = json.loads(path.read_text()) if path.exists() else {}
    if "stsb_dev" in scores and "stsb_test" in scores and scores.get("dev_pairs") == SCALE["dev_pairs"]:
        return scores
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_path(), device="cpu")
    stsb = read_stsb_splits(STSB_DIR, SCALE["dev_pairs"])
    if "stsb_dev" in scores:  # an earlier baseline on the full dev split
        scores["stsb_dev_full"] = scores.pop("stsb_dev")
    scores["stsb_dev"] = 100 * STSEvaluator(stsb["dev"], name="stsb-dev").spearman(model)
    if "stsb_test" not in scores:
        scores["stsb_test"] = 100 * STSEvaluator(stsb["test"], name="stsb-test").spearman(model)
    scores |= {"model": minilm_path(), "eval_max_length": model.max_seq_length, "dev_pairs": SCALE["dev_pairs"]}
    path.write_text(json.dumps(scores, indent=2) + "\n")
    return scores


def full_dev(runs_dir: Path, configs: list[str], seeds: list[int]) -> None:
    """STS-B dev on all 1,500 pairs for the final models of the given runs (``full_dev.json`` in each run folder).

    The runs' own dev score uses the first 500 pairs only, which are all from one genre (STS-B dev is ordered by
    source: captions first); the full split is the fair basis for choosing between configurations.
    """
    from sentence_transformers import SentenceTransformer

    dev = STSEvaluator(read_stsb_splits(STSB_DIR)["dev"], name="stsb-dev")

    for config in configs:
        for seed in seeds:
            run = runs_dir / f"{config}-seed{seed}"
            if not (run / "final").is_dir() or (run / "full_dev.json").exists():
                continue
            print(f"full STS-B dev: {config} seed {seed} ...", flush=True)
            saved = json.loads((run / "results.json").read_text())
            model = SentenceTransformer(str(run / "final"), device="cpu")
            model.max_seq_length = saved["config"]["eval_max_length"]  # final/ of older runs kept the training length
            score = 100 * dev.spearman(model)
            (run / "full_dev.json").write_text(json.dumps({"stsb_dev_full": score, "pairs": 1500}) + "\n")


def summarize(
    runs_dir: Path, configs: list[str], seeds: list[int], base: dict[str, float], command: str, results: Path
) -> None:
    results.mkdir(parents=True, exist_ok=True)
    rows, environment, loss_configs = [], None, {}
    for config in configs:
        for seed in seeds:
            path = runs_dir / f"{config}-seed{seed}" / "results.json"
            if not path.exists():
                continue
            r = json.loads(path.read_text())
            environment = environment or r["environment"]
            loss_configs[config] = r["loss_config"]
            rows.append(
                {
                    "config": config,
                    "seed": seed,
                    "steps": r["steps"],
                    "stsb_dev_best": round(r["stsb_dev_best"], 3),
                    "best_step": r["best_step"],
                    "stsb_dev_last": round(r["stsb_dev_history"][-1][1], 3),
                    "stsb_test": round(r["stsb_test"], 3),
                    "stsb_dev_full": (
                        round(json.loads(full.read_text())["stsb_dev_full"], 3)
                        if (full := path.parent / "full_dev.json").exists()
                        else None
                    ),
                    "train_seconds": r["train_seconds"],
                    "command": r["command"],
                    # the commit whose recipes/simcse.py the command is for (the CLI changes: --threads was
                    # --num-threads, --loss-option beta=N was --beta N)
                    "command_commit": (r["environment"].get("git_commit") or "")[:7],
                }
            )
    with open(results / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["config"])
        writer.writeheader()
        writer.writerows(rows)

    summary = {}
    for config in configs:
        mine = [row for row in rows if row["config"] == config]
        if mine:
            summary[config] = {
                "seeds": [row["seed"] for row in mine],
                "stsb_dev_best": mean_std([row["stsb_dev_best"] for row in mine]),
                "stsb_dev_last": mean_std([row["stsb_dev_last"] for row in mine]),
                "stsb_test": mean_std([row["stsb_test"] for row in mine]),
                "stsb_dev_full": (
                    mean_std(full_rows)
                    if (full_rows := [row["stsb_dev_full"] for row in mine if row["stsb_dev_full"] is not None])
                    else None
                ),
                "loss_config": loss_configs[config],
            }
    # Same seed = same batches (the sampler's order depends on the seed only): per-seed differences to InfoNCE
    # remove the data-order effect that the seeds share.
    paired = {}
    reference = {row["seed"]: row for row in rows if row["config"] == "infonce"}
    for config in summary:
        if config == "infonce":
            continue
        diffs = [
            row["stsb_test"] - reference[row["seed"]]["stsb_test"]
            for row in rows
            if row["config"] == config and row["seed"] in reference
        ]
        if diffs:
            paired[config] = {"stsb_test_minus_infonce": mean_std(diffs), "per_seed": [round(d, 3) for d in diffs]}
    payload = {
        "what": "unsupervised SimCSE from all-MiniLM-L6-v2, reduced scale; cosine Spearman x100 on STS-B",
        "scale": SCALE | {"train_file": "recipes/assets/wiki1m_slice.txt", "batch_sampler": "no_duplicates"},
        "starting_model": base,
        "configs": {name: CONFIGS[name] for name in configs},
        "summary": summary,
        "paired_vs_infonce": paired,
        "commands": [
            "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/simcse_compare.py",
            "OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/simcse_compare.py --full-dev [CONFIG ...]",
        ],
        "last_invocation": command,
        "environment": environment,
        "updated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (results / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")

    lines = [
        f"Starting model (all-MiniLM-L6-v2): STS-B test {base['stsb_test']:.2f}, dev first 500 pairs "
        f"{base['stsb_dev']:.2f}, dev all pairs {base.get('stsb_dev_full', float('nan')):.2f}",
        "",
        "Mean +- sample std over seeds, cosine Spearman x100; dev: the one evaluation, after the last step.",
        "",
        "| config | seeds | STS-B test | STS-B dev, first 500 pairs | STS-B dev, all 1,500 pairs (seeds) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in summary.items():
        dev_full = f"{format_stat(s['stsb_dev_full'])} ({s['stsb_dev_full']['n']})" if s["stsb_dev_full"] else "-"
        test, dev = format_stat(s["stsb_test"]), format_stat(s["stsb_dev_best"])
        lines.append(f"| {name} | {len(s['seeds'])} | {test} | {dev} | {dev_full} |")
    if paired:
        lines += ["", "STS-B test minus InfoNCE's on the same seed (same batches): mean +- std (per seed)", ""]
        lines += ["| config | difference | per seed |", "| --- | --- | --- |"]
        for name, p in paired.items():
            per_seed = ", ".join(f"{d:+.2f}" for d in p["per_seed"])
            lines.append(f"| {name} | {format_stat(p['stsb_test_minus_infonce'])} | {per_seed} |")
    (results / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=sorted(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--runs-dir", default=str(REPO / "runs" / "simcse-compare"))
    parser.add_argument(
        "--full-dev", nargs="*", metavar="CONFIG", help="only evaluate these configs' final models on all of STS-B dev"
    )
    parser.add_argument("--summarize-only", action="store_true", help="only rewrite the tables from finished runs")
    parser.add_argument(
        "--results-dir",
        default=None,
        help=f"where the tables go (default: RUNS_DIR/tables); {COMMITTED_RESULTS.relative_to(REPO)} rewrites the "
        "committed ones",
    )
    args = parser.parse_args()
    results = Path(args.results_dir) if args.results_dir else Path(args.runs_dir) / "tables"
    command = " ".join(["python", "benchmarks/simcse_compare.py"] + sys.argv[1:])
    runs_dir = Path(args.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.summarize_only:
        summarize(runs_dir, args.configs, args.seeds, baseline(runs_dir), command, results)
        print((results / "summary.md").read_text(), flush=True)
        return
    if args.full_dev is not None:
        full_dev(runs_dir, args.full_dev or args.configs, args.seeds)
        summarize(runs_dir, args.configs, args.seeds, baseline(runs_dir), command, results)
        print((results / "summary.md").read_text(), flush=True)
        return
    print("starting model ...", flush=True)
    base = baseline(runs_dir)
    print(f"starting model: dev {base['stsb_dev']:.2f} test {base['stsb_test']:.2f}", flush=True)
    # Priority order, so that a run cut short by the deadline leaves a usable result: every config on the first seed,
    # then the three-loss comparison on the other seeds, then the beta study's other seeds.
    first, rest = args.seeds[:1], args.seeds[1:]
    comparison = [c for c in args.configs if not c.startswith("weince-beta")]
    plan = [(c, s) for s in first for c in args.configs]
    plan += [(c, s) for s in rest for c in comparison]
    plan += [(c, s) for s in rest for c in args.configs if c not in comparison]
    for index, (config, seed) in enumerate(plan, 1):
        out = runs_dir / f"{config}-seed{seed}"
        if (out / "results.json").exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(RECIPE), *CONFIGS[config], *common_args(seed, out)]
        started = time.time()
        print(f"[{index}/{len(plan)}] {config} seed {seed} ... (log: {out / 'run.log'})", flush=True)
        with open(out / "run.log", "w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        print(f"    exit {code} after {time.time() - started:.0f} s", flush=True)
        summarize(runs_dir, args.configs, args.seeds, base, command, results)
    summarize(runs_dir, args.configs, args.seeds, base, command, results)
    print((results / "summary.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
