"""RB-Sigmoid against its two references, in float32, on the same embeddings: open_clip's ``SigLipLoss`` (PyPI
``open_clip_torch``, not a dependency of st-weince) and the formula of the paper authors' released experiments
(``SigLIP/utils/siglip_loss.py`` of github.com/BangachevKiril/RepresentationLearningTheory, re-stated below from its
description: ``-[y log(sigmoid(z) + 1e-8) + (1 - y) log(1 - sigmoid(z) + 1e-8)]``, averaged over all N^2 pairs).

For each case it reports, relative to the float64 value of the same loss on the same float32 embeddings:
``ours`` (RBSigmoidLoss, sum over candidates, mean over anchors), ``open_clip`` (the same normalisation;
``logit_bias = -t b_rel``) and ``authors`` (scaled by N to that normalisation, against the float64 of its own formula,
since its 1e-8 floor is part of that formula); and the float32 parity ``|ours - theirs| / |theirs|`` with each. The
embeddings' gradients are compared the same way (largest entry difference over the largest entry).

    pip install open_clip_torch
    python benchmarks/rb_sigmoid_parity.py                                  # the current code
    PYTHONPATH=<a checkout of another commit> python benchmarks/rb_sigmoid_parity.py --label before

Each label's cases are merged into ``--output`` (default in runs/benchmarks/; the committed record is
``benchmarks/results/rb_sigmoid_parity.json``, rewritten only when named).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import st_weince
from st_weince.losses import RBSigmoidLoss
from st_weince.utils.provenance import provenance

# git ignores runs/ (benchmarks/lab/outputs.py); the committed record is benchmarks/results/rb_sigmoid_parity.json
OUTPUT = Path(__file__).resolve().parents[1] / "runs" / "benchmarks" / "rb_sigmoid_parity.json"
# (t, b_rel): SigLIP's start, RB-Sigmoid's start, a trained value, the cap with a negative and a positive bias
SETTINGS = [(10.0, -1.0), (10.0, 0.7), (55.0, 0.3), (100.0, -0.5), (100.0, 0.7)]
SHAPES = [(64, 64), (256, 384)]  # (pairs, dimension)
SEEDS = (0, 1, 2)
NOISE = 0.3  # positive = anchor + NOISE * noise: most matches are close, so most terms are small


def authors_formula(u: torch.Tensor, v: torch.Tensor, t: torch.Tensor, b_rel: torch.Tensor) -> torch.Tensor:
    """The released experiments' loss on normalised rows, times N (their mean over N^2 pairs -> ours)."""
    u, v = F.normalize(u, dim=1), F.normalize(v, dim=1)
    logits = (u @ v.T) * t - b_rel * t
    labels = torch.eye(u.shape[0], dtype=u.dtype)
    p = torch.sigmoid(logits)
    pairs = -torch.log(p + 1e-8) * labels - torch.log(1 - p + 1e-8) * (1 - labels)
    return pairs.mean() * u.shape[0]


def open_clip_loss(u: torch.Tensor, v: torch.Tensor, t: torch.Tensor, b_rel: torch.Tensor) -> torch.Tensor:
    from open_clip.loss import SigLipLoss  # not a dependency: imported when measured, so --help runs without it

    return SigLipLoss()(F.normalize(u, dim=1), F.normalize(v, dim=1), t, -t * b_rel)


def ours(u: torch.Tensor, v: torch.Tensor, t: torch.Tensor, b_rel: torch.Tensor) -> torch.Tensor:
    loss = RBSigmoidLoss(None, scale=float(t), relative_bias=float(b_rel), max_scale=max(100.0, float(t)))
    return loss.to(u.dtype).compute_loss_from_embeddings([u, v])


def value_and_gradient(fn, u: torch.Tensor, v: torch.Tensor, t: float, b_rel: float, dtype: torch.dtype):
    u = u.detach().to(dtype).clone().requires_grad_()
    scalars = [torch.tensor(x, dtype=torch.float32).to(dtype) for x in (t, b_rel)]  # the float32 values, widened
    value = fn(u, v.to(dtype), *scalars)
    value.backward()
    return value.detach().double(), u.grad.double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def case(pairs: int, dim: int, t: float, b_rel: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(pairs, dim, generator=g)
    v = u + NOISE * torch.randn(pairs, dim, generator=g)
    implementations = {"ours": ours, "open_clip": open_clip_loss, "authors": authors_formula}
    results = {name: value_and_gradient(fn, u, v, t, b_rel, torch.float32) for name, fn in implementations.items()}
    exact = {name: value_and_gradient(fn, u, v, t, b_rel, torch.float64) for name, fn in implementations.items()}
    row = {"pairs": pairs, "dim": dim, "t": t, "b_rel": b_rel, "seed": seed, "loss_float64": float(exact["ours"][0])}
    for name in implementations:
        row[f"{name}_loss_vs_float64"] = relative(results[name][0], exact[name][0])
        row[f"{name}_grad_vs_float64"] = relative(results[name][1], exact[name][1])
    for name in ("open_clip", "authors"):
        row[f"parity_loss_{name}"] = relative(results["ours"][0], results[name][0])
        row[f"parity_grad_{name}"] = relative(results["ours"][1], results[name][1])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="current")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [case(p, d, t, b, s) for p, d in SHAPES for t, b in SETTINGS for s in SEEDS]
    keys = [k for k in rows[0] if k.endswith("_vs_float64") or k.startswith("parity_")]
    # the largest over shapes and seeds, per setting: a saturated setting (every term far below the ulp of its
    # logit) is where a formula's float32 rounding shows, and where the authors' 1e-8 floor dominates their loss
    by_setting = {
        f"t={t:g}, b_rel={b:g}": {
            "loss_float64_range": [min(r["loss_float64"] for r in group), max(r["loss_float64"] for r in group)],
            **{k: max(r[k] for r in group) for k in keys},
        }
        for t, b in SETTINGS
        if (group := [r for r in rows if (r["t"], r["b_rel"]) == (t, b)])
    }
    result = {
        "description": __doc__.split("\n\n")[0],
        "st_weince_path": str(Path(st_weince.__file__).parent),
        "by_setting": by_setting,
        "cases": rows,
        "provenance": provenance(sys.argv if argv is None else [sys.argv[0], *argv]),
    }
    previous = json.loads(args.output.read_text()) if args.output.exists() else {}
    previous[args.label] = result
    args.output.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"{args.label} ({result['st_weince_path']}): the largest relative difference over shapes and seeds")
    print("setting | loss (float64) | " + " | ".join(keys))
    for setting, row in by_setting.items():
        low, high = row["loss_float64_range"]
        print(f"{setting} | {low:.2g}-{high:.2g} | " + " | ".join(f"{row[k]:.2g}" for k in keys))


if __name__ == "__main__":
    main()
