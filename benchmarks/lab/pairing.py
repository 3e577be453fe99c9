"""Which runs may be paired: only runs of one code state and one CPU family.

Float rounding alone moves a SimCLR run by seed-noise size: arm 3 moved by 1.8 k-NN points between two commits of
the ablation, and a rerun of the same code and seed on an AMD EPYC missed the committed record (whose CPU was not
recorded) by 0.7 k-NN points: a machine difference, inferred by elimination. So a
paired difference is taken only between runs that trained at one commit (or at commits that a committed parity check,
``benchmarks/step_parity.py``, shows bit for bit the same for both runs' arms) and on one CPU family (the
``machine.cpu.family`` every run's header records). A run resumed at another commit or on another CPU is no single
code state and pairs with nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scipy.stats

from benchmarks.lab import summaries

PARITY_DIR = Path(__file__).resolve().parents[1] / "results" / "step_parity"


@dataclass(frozen=True)
class CodeState:
    """The commit and CPU family a run trained at; ``problem`` says why it is none (else None)."""

    commit: str | None
    cpu_family: str | None
    problem: str | None = None


def _state_of(record: dict[str, Any]) -> tuple[str | None, str | None]:
    cpu = (record.get("machine") or {}).get("cpu") or {}
    return record.get("git_commit"), cpu.get("family")


def code_state(records: list[dict[str, Any]]) -> CodeState:
    """The code state of a run file: its header's commit and CPU family, the same in every resume line."""
    commit, family = _state_of(records[0])
    if commit is None:
        return CodeState(None, family, "no commit recorded")
    if family is None:
        return CodeState(commit, None, "no CPU recorded")
    for record in records[1:]:
        if record.get("type") == "resume" and _state_of(record) != (commit, family):
            other = _state_of(record)
            return CodeState(commit, family, f"resumed at {str(other[0])[:7]} on {other[1]}")
    return CodeState(commit, family)


KERNEL_PARITY = "kernel_parity.json"
TIMINGS = ("train_seconds", "eval_seconds", "elapsed_seconds", "load_average")


def first_epoch(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run file's lines of epochs 0 and 1 (checkpoints and per-step lines), timings left out: what two runs that
    trained bit for bit alike through epoch 1 have in common."""
    return [
        {k: v for k, v in r.items() if k not in TIMINGS}
        for r in records
        if r.get("type") in ("checkpoint", "steps") and r["epoch"] <= 1
    ]


def warm_start_state(warm: list[dict[str, Any]], source: list[dict[str, Any]], source_state: CodeState) -> CodeState:
    """The code state a warm-started run pairs under with its source arm's run of the same seed: the source's, when
    the warm run's first epoch (the source arm's, by construction) equals the source run's bit for bit (every step's
    loss and statistics, the probes); else its own. That equality shows, for this run, that its commit and machine
    train the source arm as the source run did, whatever commit and CPU family its header records."""
    own = code_state(warm)
    lines = first_epoch(warm)
    if own.problem is None and source_state.problem is None and lines and lines == first_epoch(source):
        return source_state
    return own


def kernel_family(state: CodeState, run: str, output_dir: Path) -> CodeState:
    """A run's code state with its CPU family read as the family whose kernels it reproduced bit for bit.

    ``output_dir/kernel_parity.json`` (committed beside a study's runs) records that one CPU family, run with stated
    settings (e.g. ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 CPU), reproduced another's
    training at one commit: the 10-step fingerprint and a whole first epoch, bit for bit. A run it lists by name,
    trained at that commit on that family, pairs as the reference family's; any other run keeps its own family."""
    path = output_dir / KERNEL_PARITY
    if state.problem is not None or not path.is_file():
        return state
    record = json.loads(path.read_text())
    if (
        run in record["runs"]
        and state.cpu_family == record["family"]
        and state.commit is not None
        and record["commit"].startswith(state.commit[:7])
        and record["reproduced"]
    ):
        return CodeState(state.commit, record["reference_family"])
    return state


def parity_groups(directory: Path = PARITY_DIR) -> list[tuple[frozenset[str], frozenset[str], str | None]]:
    """``(commits, arms, cpu family)`` of every committed parity check's groups of bit-for-bit equal commits."""
    groups = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        check = json.loads(path.read_text())
        arms = frozenset(check.get("arms") or [check.get("arm")])
        for group in check.get("identical_groups", []):
            groups.append((frozenset(group), arms, check.get("cpu_family")))
    return groups


def refusal(
    a: CodeState, arm_a: str, b: CodeState, arm_b: str, parity: list[tuple[frozenset[str], frozenset[str], str | None]]
) -> str | None:
    """Why two runs may not be paired, or None when they may."""
    for state in (a, b):
        if state.problem is not None:
            return state.problem
    if a.cpu_family != b.cpu_family:
        return f"CPU families differ ({a.cpu_family}; {b.cpu_family})"
    if a.commit == b.commit:
        return None
    for commits, arms, family in parity:
        if {a.commit, b.commit} <= commits and {arm_a, arm_b} <= arms and family in (None, a.cpu_family):
            return None
    return f"commits differ ({a.commit[:7]}, {b.commit[:7]}) and no parity check shows their training steps equal"


def paired_differences(
    finals: dict[tuple[str, int], dict[str, Any]],
    states: dict[tuple[str, int], CodeState],
    comparisons: Iterable[tuple[str, str, str]],
    seeds: Iterable[int],
    metrics: tuple[str, ...],
) -> dict[str, Any]:
    """Each ``(arm, reference, question)`` paired by seed where the two runs may be paired: mean +- sample std of the
    differences (``summaries.paired_difference``), n, the paired t and its two-sided p-value (n - 1 degrees of
    freedom), and the seeds refused with the reason."""
    parity = parity_groups()
    out: dict[str, Any] = {}
    for arm, reference, question in comparisons:
        paired_seeds, refused = [], {}
        for seed in seeds:
            if (arm, seed) not in finals or (reference, seed) not in finals:
                continue
            why = refusal(states[arm, seed], arm, states[reference, seed], reference, parity)
            if why is None:
                paired_seeds.append(seed)
            else:
                refused[str(seed)] = why
        difference = summaries.paired_difference(
            {s: finals[arm, s] for s in paired_seeds}, {s: finals[reference, s] for s in paired_seeds}, metrics
        )
        if difference is None and not refused:
            continue
        entry: dict[str, Any] = {"question": question, "refused": refused}
        if difference is not None:
            entry.update(difference)
            entry["tests"] = {metric: paired_t(difference[metric]) for metric in metrics}
        out[f"{arm}_minus_{reference}"] = entry
    return out


def paired_t(stat: dict[str, float | int]) -> dict[str, float | int | None]:
    """The paired t (mean / (std / sqrt(n))) of a ``summaries.mean_std`` of differences, its degrees of freedom and
    two-sided p-value; None below 2 seeds or without spread."""
    n = stat["n"]
    if n < 2 or not stat["std"] > 0:
        return {"n": n, "t": None, "df": None, "p_two_sided": None}
    t = stat["mean"] / (stat["std"] / math.sqrt(n))
    return {"n": n, "t": t, "df": n - 1, "p_two_sided": float(2 * scipy.stats.t.sf(abs(t), n - 1))}


def holm(p_values: dict[Any, float]) -> dict[Any, float]:
    """Holm's step-down adjustment of a family of p-values (key -> p): the i-th smallest becomes the running maximum
    of min(1, (m - j + 1) p_(j)) over j <= i. It controls the chance of any false "significant" in the family."""
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    adjusted, running = {}, 0.0
    for rank, (key, p) in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * p))
        adjusted[key] = running
    return adjusted


def add_holm(paired: dict[str, Any]) -> int:
    """Holm-adjusted p (``p_holm``) beside every paired t's p in a study's ``paired`` dict (``entry["tests"]``): the
    family is every test of the study that has a p. Returns the family's size."""
    family = {
        (name, metric): test["p_two_sided"]
        for name, entry in paired.items()
        for metric, test in (entry.get("tests") or {}).items()
        if test.get("p_two_sided") is not None
    }
    for (name, metric), p in holm(family).items():
        paired[name]["tests"][metric]["p_holm"] = p
    return len(family)
