"""benchmarks/lab/pairing.py: which runs pair (one commit, one CPU family or a family that reproduced its kernels bit
for bit), and Holm's adjustment of a study's family of tests."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest

from benchmarks.lab import pairing
from benchmarks.lab.pairing import CodeState
from tests.conftest import REPO_ROOT, load_script

REFERENCE = "AuthenticAMD family 25 model 1, AVX2"
OTHER = "AuthenticAMD family 25 model 17, AVX2"
COMMIT = "7cc7eaf2a27a143f324f73f0461d37fd856bba03"


def holm_rejections(p_values: dict[str, float], alpha: float) -> set[str]:
    """Holm's procedure as its paper states it, independently of the adjusted p: test the smallest p against
    alpha / m, the next against alpha / (m - 1), ..., and stop at the first that fails."""
    ordered = sorted(p_values, key=p_values.get)
    rejected = set()
    for rank, key in enumerate(ordered):
        if p_values[key] > alpha / (len(ordered) - rank):
            break
        rejected.add(key)
    return rejected


def test_holm_adjusted_p_rejects_exactly_what_holms_procedure_rejects_at_every_level():
    rng = random.Random(0)
    for _ in range(200):
        p_values = {f"t{i}": rng.choice([rng.random(), rng.random() / 50, 0.0125]) for i in range(rng.randint(1, 12))}
        adjusted = pairing.holm(p_values)
        assert set(adjusted) == set(p_values)
        for alpha in (0.001, 0.01, 0.05, 0.1, 0.5):
            assert {k for k, p in adjusted.items() if p <= alpha} == holm_rejections(p_values, alpha)
        assert all(p_values[k] <= adjusted[k] <= 1.0 for k in p_values)


def test_holm_of_the_label_guard_study_turns_the_weince_minus_mnrl_probe_from_0_016_to_0_095():
    """The label-guard study's 12 raw p (its committed summary) and the adjusted p the issue recomputed."""
    summary = json.loads((REPO_ROOT / "benchmarks/results/false_negatives_same_label/summary.json").read_text())
    entry = summary["paired"]["weince_minus_mnrl"]["tests"]["test_linear_probe"]
    assert summary["holm_family_size"] == 12
    assert entry["p_two_sided"] == pytest.approx(0.016, abs=5e-4)
    assert entry["p_holm"] == pytest.approx(0.095, abs=5e-4)


def test_add_holm_takes_every_test_with_a_p_as_the_family_and_skips_those_without():
    paired = {
        "a_minus_b": {"tests": {"x": {"p_two_sided": 0.01}, "y": {"p_two_sided": None}}},
        "c_minus_b": {"tests": {"x": {"p_two_sided": 0.04}, "y": {"p_two_sided": 0.03}}},
        "d_minus_b": {"refused": {"0": "CPU families differ"}},
    }
    assert pairing.add_holm(paired) == 3
    assert paired["a_minus_b"]["tests"]["x"]["p_holm"] == pytest.approx(0.03)
    assert paired["c_minus_b"]["tests"]["y"]["p_holm"] == pytest.approx(0.06)
    assert paired["c_minus_b"]["tests"]["x"]["p_holm"] == pytest.approx(0.06)  # monotone: never below a smaller p's
    assert "p_holm" not in paired["a_minus_b"]["tests"]["y"]


def write_kernel_parity(directory, runs, reproduced=True):
    record = {"reference_family": REFERENCE, "family": OTHER, "commit": COMMIT, "runs": runs, "reproduced": reproduced,
              "settings": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}  # fmt: skip
    (directory / pairing.KERNEL_PARITY).write_text(json.dumps(record))


def test_a_run_listed_in_the_kernel_parity_record_pairs_as_the_reference_family_and_no_other_does(tmp_path):
    reference, other = CodeState(COMMIT, REFERENCE), CodeState(COMMIT, OTHER)
    assert "CPU families differ" in pairing.refusal(reference, "a", other, "b", [])
    write_kernel_parity(tmp_path, ["b-seed0"])
    listed = pairing.kernel_family(other, "b-seed0", tmp_path)
    assert listed == CodeState(COMMIT, REFERENCE)
    assert pairing.refusal(reference, "a", listed, "b", []) is None
    # not listed (trained without the settings), another commit, or a record that did not reproduce: its own family
    assert pairing.kernel_family(other, "b-seed1", tmp_path) == other
    at_another_commit = CodeState("0" * 40, OTHER)
    assert pairing.kernel_family(at_another_commit, "b-seed0", tmp_path) == at_another_commit
    write_kernel_parity(tmp_path, ["b-seed0"], reproduced=False)
    assert pairing.kernel_family(other, "b-seed0", tmp_path) == other
    # a run of the reference family is left alone; a run with a problem keeps it
    assert pairing.kernel_family(reference, "b-seed0", tmp_path) == reference
    broken = CodeState(None, OTHER, "no commit recorded")
    assert pairing.kernel_family(broken, "b-seed0", tmp_path) == broken


def test_runs_pair_only_within_one_commit_and_family_or_a_committed_parity_group():
    states = [CodeState(COMMIT, REFERENCE), CodeState("1" * 40, REFERENCE), CodeState(COMMIT, OTHER)]
    for a, b in itertools.combinations(states, 2):
        assert pairing.refusal(a, "x", b, "y", []) is not None
    parity = [(frozenset({COMMIT, "1" * 40}), frozenset({"x", "y"}), REFERENCE)]
    assert pairing.refusal(states[0], "x", states[1], "y", parity) is None
    assert pairing.refusal(states[0], "x", states[1], "z", parity) is not None  # the check covered other arms


def test_the_committed_kernel_parity_record_follows_from_its_evidence_and_one_changed_step_breaks_it(
    tmp_path, monkeypatch
):
    """benchmarks/kernel_parity.py recomputed from the committed evidence gives the committed record; a rerun whose
    one step's loss differs by one ulp is not reproduced."""
    script = load_script("benchmarks/kernel_parity.py", "kernel_parity")
    study = REPO_ROOT / "benchmarks/results/simclr_link_or_temperature"
    committed = json.loads((study / pairing.KERNEL_PARITY).read_text())
    evidence = committed["evidence"]
    epochs = evidence["first_epochs"]
    argv = ["--study-dir", str(tmp_path), "--reference-fingerprint", evidence["ten_steps"]["reference"],
            "--fingerprint", evidence["ten_steps"]["here"], "--reference-run", *(e["reference"] for e in epochs),
            "--settings", *(f"{k}={v}" for k, v in committed["settings"].items()),
            "--runs", *committed["runs"]]  # fmt: skip
    monkeypatch.chdir(REPO_ROOT)  # the record names its evidence relative to the repository
    script.main([*argv, "--rerun", *(e["here"] for e in epochs)])
    assert json.loads((tmp_path / pairing.KERNEL_PARITY).read_text()) == committed
    assert committed["reproduced"] and [e["lines_compared"] for e in epochs] == [3, 3]
    assert {Path(e["reference"]).name for e in epochs} == {"infonce-seed1.jsonl", "infonce-topm-shortfall-seed0.jsonl"}

    lines = (REPO_ROOT / epochs[-1]["here"]).read_text().splitlines()
    steps = next(i for i, line in enumerate(lines) if json.loads(line)["type"] == "steps")
    record = json.loads(lines[steps])
    record["loss"][100] = float(np.nextafter(np.float32(record["loss"][100]), np.float32(np.inf)))
    lines[steps] = json.dumps(record)
    changed = tmp_path / "rerun.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    script.main([*argv, "--rerun", epochs[0]["here"], str(changed)])
    broken = json.loads((tmp_path / pairing.KERNEL_PARITY).read_text())
    assert not broken["reproduced"] and [e["equal"] for e in broken["evidence"]["first_epochs"]] == [True, False]


def test_a_warm_started_run_pairs_with_its_source_only_through_a_bit_for_bit_first_epoch():
    def run(commit, family, step_losses, probe):
        header = {"type": "header", "git_commit": commit, "machine": {"cpu": {"family": family}}}
        return [
            header,
            {"type": "checkpoint", "epoch": 0, "knn_top1": 30.0, "elapsed_seconds": 1.0},
            {"type": "steps", "epoch": 1, "loss": step_losses},
            {"type": "checkpoint", "epoch": 1, "knn_top1": probe, "elapsed_seconds": 9.0},
            {"type": "checkpoint", "epoch": 2, "knn_top1": probe + 1},  # after the handover: may differ
        ]

    source = run(COMMIT, REFERENCE, [9.5, 9.25], 35.5)
    source_state = pairing.code_state(source)
    warm = run("2" * 40, OTHER, [9.5, 9.25], 35.5)
    warm[-1]["knn_top1"] = 20.0
    assert pairing.warm_start_state(warm, source, source_state) == source_state
    for changed in (run("2" * 40, OTHER, [9.5, 9.250001], 35.5), run("2" * 40, OTHER, [9.5, 9.25], 35.51)):
        assert pairing.warm_start_state(changed, source, source_state) == CodeState("2" * 40, OTHER)
