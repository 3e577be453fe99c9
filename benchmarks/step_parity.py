"""Step parity across commits: do the first training steps of one SimCLR ablation run come out bit for bit the same?

What it is for: two runs of one arm and seed made at different commits can be paired (their difference read as
noise-free) only when the code between the commits trains identically on this machine. For each commit this tool
checks the commit out into a temporary detached git worktree (removed afterwards), runs that commit's OWN
``benchmarks/simclr_ablation.py`` through its stable command line (``--runs``, ``--override``, ``--output-dir``,
``--state-dir``, ``--stop-after-epoch``, ``--data-dir``) for one epoch of ``--steps`` steps (``limit_train`` = steps x
batch size, probes shrunk to a minimum: they do not enter the fingerprint), and records a fingerprint: the SHA-256
over the saved state's model tensors (in state-dict order: dtype, shape and contiguous bytes, not the names) and the
epoch's ``train_loss`` as a float hex. Commits with equal fingerprints train bit for bit alike on this CPU; the output
names them (``identical_groups``) with the CPU family and the library versions, since float rounding depends on both.

    OMP_NUM_THREADS=1 python benchmarks/step_parity.py 7723f2f 3b93f56 --arm infonce-topm-shortfall --seed 1 \
        --steps 10 --output benchmarks/results/simclr_link_or_temperature/divergence/parity.json

Output (JSON)::

    {"arm": ..., "seed": ..., "steps": ..., "cpu_family": "...", "cpu": {...}, "versions": {...},
     "commits": {sha: {"fingerprint": ..., "train_loss_hex": ..., "train_loss": ..., "seconds": ...}},
     "identical_groups": [[sha, ...], ...]}

A commit whose run fails gets ``{"error": ...}`` and joins no group. One process at a time, one thread each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from st_weince.utils.provenance import cpu_record, provenance  # noqa: E402

DEFAULT_DATA = Path("/work/shared/data/cifar10/cifar10-jpg.zip")
BATCH_SIZE = 256  # the ablation's batch (pairs); an epoch is limit_train // batch_size steps
# Shrunk probes (they only need to run): 500 test and probe images, one probe epoch, no epoch-0 checkpoint.
SMALL_PROBES = {"limit_test": 500, "probe_subset": 500, "probe_epochs": 1, "pot_images": 500, "eval_at_start": False}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def model_fingerprint(state_path: Path) -> str:
    """SHA-256 over the model tensors of a saved run state, in state-dict order (names left out: a rename is no
    numerical change)."""
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    digest = hashlib.sha256()
    for tensor in state["model"].values():
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_commit(
    sha: str, arm: str, seed: int, steps: int, data_dir: Path, scratch: Path, batch_size: int = BATCH_SIZE
) -> dict[str, Any]:
    """One epoch of ``steps`` steps at ``sha`` in a temporary worktree; the fingerprint of what it trained."""
    worktree, out, state = scratch / f"wt-{sha[:10]}", scratch / f"out-{sha[:10]}", scratch / f"state-{sha[:10]}"
    git("worktree", "add", "--detach", str(worktree), sha)
    try:
        env = {**os.environ, "PYTHONPATH": str(worktree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        imported = subprocess.run(
            [sys.executable, "-c", "import st_weince; print(st_weince.__file__)"],
            cwd=worktree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not imported.startswith(str(worktree)):
            raise RuntimeError(f"{sha}: st_weince imported from {imported}, not from the worktree")
        override = {"batch_size": batch_size, "limit_train": steps * batch_size, **SMALL_PROBES}
        command = [
            sys.executable, "benchmarks/simclr_ablation.py", "--runs", f"{arm}-seed{seed}",
            "--override", json.dumps(override), "--output-dir", str(out), "--state-dir", str(state),
            "--stop-after-epoch", "1", "--data-dir", str(data_dir), "--threads", "1",
        ]  # fmt: skip
        tick = time.perf_counter()
        done = subprocess.run(command, cwd=worktree, env=env, capture_output=True, text=True)
        seconds = round(time.perf_counter() - tick, 1)
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr)[-2000:], "seconds": seconds}
        lines = [json.loads(line) for line in (out / f"{arm}-seed{seed}.jsonl").read_text().splitlines()]
        epoch_one = next(r for r in lines if r.get("type") == "checkpoint" and r["epoch"] == 1)
        return {
            "fingerprint": model_fingerprint(state / f"{arm}-seed{seed}" / "state.pt"),
            "train_loss_hex": float(epoch_one["train_loss"]).hex(),
            "train_loss": epoch_one["train_loss"],
            "steps": epoch_one["step"],
            "seconds": seconds,
        }
    finally:
        git("worktree", "remove", "--force", str(worktree))


def identical_groups(commits: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The commits with equal (fingerprint, train_loss_hex), in the order given; failed commits are left out."""
    groups: dict[tuple[str, str], list[str]] = {}
    for sha, result in commits.items():
        if "fingerprint" in result:
            groups.setdefault((result["fingerprint"], result["train_loss_hex"]), []).append(sha)
    return list(groups.values())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="+", help="commits to compare (any git revision)")
    parser.add_argument("--arm", default="infonce-topm-shortfall", help="run-name prefix of the ablation's arm")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="training steps in the one epoch")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="pairs a step (the ablation's 256)")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="CIFAR-10 ImageFolder or zip")
    parser.add_argument("--scratch", type=Path, default=None, help="parent of the temporary worktrees and runs")
    parser.add_argument("--output", type=Path, default=None, help="JSON file (default: stdout only)")
    args = parser.parse_args(argv)
    shas = [git("rev-parse", "--verify", f"{c}^{{commit}}") for c in args.commits]
    commits: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="step-parity-", dir=args.scratch) as scratch:
        for sha in dict.fromkeys(shas):
            commits[sha] = run_commit(
                sha, args.arm, args.seed, args.steps, args.data_dir, Path(scratch), args.batch_size
            )
            print(f"{sha[:10]} {json.dumps(commits[sha])[:200]}", flush=True)
    record = provenance([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    result = {
        "arm": args.arm,
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "override": {"batch_size": args.batch_size, "limit_train": args.steps * args.batch_size, **SMALL_PROBES},
        "cpu_family": cpu_record()["family"],
        "cpu": record["machine"]["cpu"],
        "versions": record["versions"],
        "python": record["python"],
        "command": record["command"],
        "date_utc": record["date_utc"],
        "tool_commit": record["git_commit"],
        "commits": commits,
        "identical_groups": identical_groups(commits),
    }
    text = json.dumps(result, indent=1)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
