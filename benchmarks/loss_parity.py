"""Two checkouts, the same values? Loss and gradients of every loss in many layouts (batch 12 to 1,024, pairs and hard
negatives, guards, symmetric and joint directions, cached, the vision path), float32 and float64, fingerprinted.

Each configuration's loss and the bytes of its gradients are hashed (SHA-256), so "bit for bit" means equal hashes
and the file stays small. Run it in each checkout (``PYTHONPATH`` picks the package) and compare:

    PYTHONPATH=/tmp/before python benchmarks/loss_parity.py --output /tmp/before.json
    python benchmarks/loss_parity.py --compare /tmp/before.json --output benchmarks/results/loss_parity.json

One thread, so that repeated runs of one checkout are bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

import torch


def _configurations() -> dict:
    from st_weince.functional import TopM
    from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss

    released_top_m = {"top_m": TopM(m=50, shortfall_weight=0.5, infonce_weight=0.5), "scale": 2.0, "beta": 1.0}
    symmetric = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    return {  # name: (make the loss, batch, columns)
        "weince_b256": (lambda: WEINCELoss(None), 256, 2),
        "weince_b1024_hard_negative": (lambda: WEINCELoss(None), 1024, 3),
        "weince_joint_query_to_query": (lambda: WEINCELoss(None, directions=symmetric[:2]), 200, 2),
        "weince_symmetric_joint": (lambda: WEINCELoss(None, directions=symmetric), 150, 2),
        "weince_relative_guard": (lambda: WEINCELoss(None, false_negative_filter=("relative", 0.95)), 256, 2),
        "weince_beta1_rho_gate": (lambda: WEINCELoss(None, beta=1.0, mode="rho"), 300, 2),
        "released_b512": (lambda: WEINCELoss.released(None), 512, 2),
        "released_b1024_hard_negative": (lambda: WEINCELoss.released(None), 1024, 3),
        "released_query_to_query": (lambda: WEINCELoss.released(None, directions=symmetric[:2]), 200, 2),
        "released_relative_guard": (
            lambda: WEINCELoss.released(None, false_negative_filter=("relative", 0.95)),
            256,
            2,
        ),
        "released_b12": (lambda: WEINCELoss.released(None), 12, 2),
        "cached_released": (lambda: CachedWEINCELoss(None, mini_batch_size=64, **released_top_m), 256, 2),
        "rb_sigmoid_b1024": (lambda: RBSigmoidLoss(None), 1024, 2),
        "rb_sigmoid_symmetric_hard_negative": (lambda: RBSigmoidLoss(None, symmetric=True), 300, 3),
        "rb_sigmoid_chunked": (lambda: RBSigmoidLoss(None, chunk_size=100), 300, 2),
        "cached_rb_sigmoid": (lambda: CachedRBSigmoidLoss(None, mini_batch_size=64), 256, 2),
    }


def _columns(batch: int, columns: int, dim: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    noise = [0.7 * torch.randn(batch, dim, generator=generator, dtype=torch.float64) for _ in range(columns - 1)]
    out = [base] + [base + n for n in noise]
    return [column.to(dtype).requires_grad_() for column in out]


def _fingerprint(loss: torch.Tensor, gradients: list[torch.Tensor]) -> dict:
    flat = torch.cat([g.detach().flatten() for g in gradients]).contiguous()
    return {"loss": float(loss.detach()), "gradients_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}


def fingerprints() -> dict:
    from st_weince.functional import nt_xent_layout
    from st_weince.losses import RBSigmoidLoss, WEINCELoss

    results = {}
    for dtype in (torch.float32, torch.float64):
        suffix = str(dtype).removeprefix("torch.")
        for name, (make, batch, columns) in _configurations().items():
            torch.manual_seed(0)
            loss = make().to(dtype)
            embeddings = _columns(batch, columns, 64, 1, dtype)
            if name.startswith("cached"):
                size = loss.mini_batch_size
                reps = [[e.detach()[b : b + size].requires_grad_() for b in range(0, batch, size)] for e in embeddings]
                value = loss.calculate_loss(reps, None, with_backward=True)
                gradients = [torch.cat([rep.grad for rep in column]) for column in reps]
            else:
                value = loss.compute_loss_from_embeddings(embeddings, None)
                value.backward()
                gradients = [e.grad for e in embeddings]
            results[f"{name}/{suffix}"] = _fingerprint(value, gradients)
        for name, make in (("released_scores", WEINCELoss.released), ("rb_sigmoid_scores", RBSigmoidLoss)):
            views = _columns(64, 2, 32, 3, dtype)
            value = make(None).to(dtype).loss_from_scores(*nt_xent_layout(*views))
            value.backward()
            results[f"{name}/{suffix}"] = _fingerprint(value, [v.grad for v in views])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="another checkout's output")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import st_weince

    checkout = Path(st_weince.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    document = {"commit": commit.stdout.strip(), "torch": torch.__version__, "fingerprints": fingerprints()}
    if args.compare is not None:
        other = json.loads(args.compare.read_text())
        differ = [key for key, value in document["fingerprints"].items() if other["fingerprints"].get(key) != value]
        document["compared_with"] = {"commit": other["commit"], "fingerprints": other["fingerprints"], "differ": differ}
        same = len(document["fingerprints"]) - len(differ)
        print(f"{same} of {len(document['fingerprints'])} bit for bit; differ: {differ}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
