"""The diagnostics' verdict on two synthetic inputs that differ only in how the winners were chosen (issue 54):
the same Weibull-tailed geometry (unit vectors uniform on the sphere of R^5: cosines near the cap have density
~ (1 - s)^((k - 3)/2) with k = 5, i.e. xi = -2 / (k - 1) = -0.5, docs/diagnostics.md), and each anchor's positive
drawn from 256 fresh uniform candidates with probability ~ exp(l(s)), l WEINCE's blended logit with beta = 1,
tau = 0.1 and lambda = 0.9 ("blend") or lambda = 0 (the softmax, "softmax"). The negative pool is 4,000 further
uniform points. Both go through the command line's own analysis (st_weince.diagnostics.__main__.analyse), at the
command's defaults otherwise (4,096 pairs, batches of 128, scale 20).

Usage, from the repository root: python benchmarks/results/diagnostics/verdict_synthetic.py
"""

from __future__ import annotations

import sys

import torch
from torch.nn import functional as F

from st_weince.diagnostics.__main__ import Encoded, analyse, build_parser

OUT = "benchmarks/results/diagnostics/synthetic-{name}"
DIM, POOL, PAIRS, CANDIDATES, TAU, BETA = 5, 4000, 4096, 256, 0.1, 1.0


def sphere(count: int, generator: torch.Generator, *shape: int) -> torch.Tensor:
    return F.normalize(torch.randn(count, *shape, DIM, generator=generator, dtype=torch.float64), dim=-1)


def synthetic(lam: float, seed: int) -> Encoded:
    generator = torch.Generator().manual_seed(seed)
    pool = sphere(POOL, generator)
    anchors = sphere(PAIRS, generator)
    candidates = sphere(PAIRS, generator, CANDIDATES)
    scores = torch.einsum("pd,pcd->pc", anchors, candidates).clamp(-1.0, 1.0 - 1e-6)
    logits = (1.0 - lam) * scores / TAU - lam * BETA * torch.log1p(-scores)
    chosen = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=generator).squeeze(1)
    positives = candidates[torch.arange(PAIRS), chosen]
    info = {"kind": f"synthetic: positive drawn by WEINCE's link, lambda = {lam}, beta = {BETA}, tau = {TAU}"}
    data = {"inputs": POOL, "negative_pool": f"{POOL} unit vectors uniform on the sphere of R^{DIM}", "seed": seed}
    return Encoded(pool.float(), {"pairs": (anchors.float(), positives.float(), info)}, data)


if __name__ == "__main__":
    for name, lam in (("blend", 0.9), ("softmax", 0.0)):
        argv = ["--model", f"synthetic-{name}", "--name", f"synthetic-{name}", "--output-dir", OUT.format(name=name)]
        args = build_parser().parse_args(argv)
        args.command = " ".join(["python", *sys.argv])
        analyse(synthetic(lam, seed=0), args)
