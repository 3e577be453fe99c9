"""Kernel parity across CPU families: does a run on this machine, with stated kernel settings, train bit for bit as a
committed run made on another CPU family?

A study's pairs are taken within one CPU family (benchmarks/lab/pairing.py), since float rounding differs between
kernel families. A machine of another family can still add runs to a study when it computes the same kernels: e.g.
an AVX-512 AMD EPYC (family 25 model 17) limited with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` against
the study's AVX2 AMD EPYC (family 25 model 1). This script checks two pieces of evidence, both at the study's commit:

1. the 10-step fingerprint of ``benchmarks/step_parity.py`` (model SHA-256 and train loss) on this machine equals the
   committed one of the reference family;
2. the first epoch of finished committed runs (one per code path: InfoNCE, the top-M shortfall term), rerun here
   (``--stop-after-epoch 1``), equals the committed records in every field but timings: the epoch-0 probes, every
   step's loss and statistics, the epoch-1 probes.

It writes ``kernel_parity.json`` beside the study's runs: the two families, the settings, the commit, the evidence
(paths and SHA-256 of the compared files), ``reproduced`` and the runs made under those settings (``--runs``, the
names of the run files). ``pairing.kernel_family`` reads it: a listed run pairs as the reference family's.

    python benchmarks/kernel_parity.py --study-dir benchmarks/results/simclr_link_or_temperature \\
        --reference-fingerprint .../divergence/step_parity_seed1_10steps.json \\
        --fingerprint .../kernel_parity/step_parity_seed1_10steps_model17.json \\
        --reference-run .../infonce-seed1.jsonl .../infonce-topm-shortfall-seed0.jsonl \\
        --rerun .../kernel_parity/infonce-seed1-epoch1-model17.jsonl .../kernel_parity/infonce-topm-shortfall-... \\
        --settings ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 --runs infonce-seed0 ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.lab import runlog  # noqa: E402
from benchmarks.lab.pairing import KERNEL_PARITY, first_epoch  # noqa: E402


def fingerprint_of(check: dict[str, Any], commit: str) -> dict[str, Any]:
    """The fingerprint of ``commit`` (a prefix is enough) in a step_parity output."""
    (entry,) = [v for sha, v in check["commits"].items() if sha.startswith(commit)]
    return {"fingerprint": entry["fingerprint"], "train_loss_hex": entry["train_loss_hex"]}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    reference_check, check = (json.loads(Path(p).read_text()) for p in (args.reference_fingerprint, args.fingerprint))
    if len(args.reference_run) != len(args.rerun):
        raise SystemExit(f"give one --rerun per --reference-run, got {len(args.rerun)} and {len(args.reference_run)}")
    epochs = []
    for reference_path, rerun_path in zip(args.reference_run, args.rerun):
        reference_run, rerun = runlog.read_lines(Path(reference_path)), runlog.read_lines(Path(rerun_path))
        if reference_run[0]["git_commit"] != rerun[0]["git_commit"]:
            raise SystemExit(f"{rerun_path} and {reference_path} ran at different commits")
        lines = first_epoch(reference_run)
        epochs.append({
            "equal": bool(lines) and lines == first_epoch(rerun),
            "lines_compared": len(lines),
            "reference": reference_path,
            "reference_sha256": runlog.file_sha256(Path(reference_path)),
            "here": rerun_path,
            "here_sha256": runlog.file_sha256(Path(rerun_path)),
        })  # fmt: skip
    header = rerun[0]
    commit = header["git_commit"]
    same_steps = fingerprint_of(reference_check, commit[:7]) == fingerprint_of(check, commit[:7])
    return {
        "reference_family": reference_run[0]["machine"]["cpu"]["family"],
        "family": header["machine"]["cpu"]["family"],
        "cpu": header["machine"]["cpu"],
        "settings": dict(s.split("=", 1) for s in args.settings),
        "commit": commit,
        "evidence": {
            "ten_steps": {"equal": same_steps, "reference": args.reference_fingerprint, "here": args.fingerprint},
            "first_epochs": epochs,
        },
        "reproduced": same_steps and all(epoch["equal"] for epoch in epochs),
        "runs": sorted(args.runs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study-dir", type=Path, required=True, help=f"where {KERNEL_PARITY} is written")
    parser.add_argument("--reference-fingerprint", required=True, help="step_parity output of the reference family")
    parser.add_argument("--fingerprint", required=True, help="step_parity output of this machine")
    parser.add_argument("--reference-run", nargs="+", required=True, help="finished committed run files of the "
                        "reference family (one per arm whose code path the check should cover)")  # fmt: skip
    parser.add_argument("--rerun", nargs="+", required=True, help="their first epochs rerun here, in the same order")
    parser.add_argument("--settings", nargs="+", required=True, help="NAME=VALUE the runs here were made with")
    parser.add_argument("--runs", nargs="*", default=[], help="the run names made here under those settings")
    args = parser.parse_args(argv)
    record = compare(args)
    (args.study_dir / KERNEL_PARITY).write_text(json.dumps(record, indent=1) + "\n")
    print(f"reproduced: {record['reproduced']} ({record['family']} as {record['reference_family']})")


if __name__ == "__main__":
    main()
