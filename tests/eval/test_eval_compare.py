"""eval/compare.py: score files side by side, mean +- sample std over seeds."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `eval/` is a top-level folder of the repository, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from eval import compare  # noqa: E402

WEINCE = [
    {"STS12": 70.0, "STSBenchmark": 80.0},
    {"STS12": 71.0, "STSBenchmark": 81.5},
    {"STS12": 72.5, "STSBenchmark": 79.0},
]
MNRL = [{"STS12": 68.0, "STSBenchmark": 78.0}, {"STS12": 69.0, "STSBenchmark": 78.4}]


def _write_sts(path: Path, model: str, scores: dict[str, float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    scores = {**scores, "avg": sum(scores.values()) / len(scores)}
    path.write_text(json.dumps({"model": model, "scores": scores, "provenance": {"seed": 1}}), encoding="utf-8")
    return path


@pytest.fixture()
def runs_dir(tmp_path: Path) -> Path:
    for i, scores in enumerate(WEINCE, start=1):
        _write_sts(tmp_path / f"weince/seed{i}/sts.json", f"out/weince-seed{i}", scores)
    for i, scores in enumerate(MNRL, start=1):
        _write_sts(tmp_path / f"mnrl/seed{i}/sts.json", f"out/mnrl-seed{i}", scores)
    return tmp_path


def test_groups_seeds_by_name_and_computes_mean_and_sample_std(runs_dir: Path, capsys):
    result = compare.main([str(runs_dir / "*/seed*/sts.json"), "--output-dir", str(runs_dir / "cmp")])
    groups = result["groups"]
    assert set(groups) == {"out/weince", "out/mnrl"}
    for name, runs in (("out/weince", WEINCE), ("out/mnrl", MNRL)):
        for metric in ("STS12", "STSBenchmark"):
            values = [r[metric] for r in runs]
            cell = groups[name][metric]
            assert cell["n"] == len(values)
            assert cell["mean"] == pytest.approx(statistics.mean(values))
            assert cell["std"] == pytest.approx(statistics.stdev(values))  # n - 1 in the denominator
    printed = capsys.readouterr().out
    weince_std = statistics.stdev([r["STS12"] for r in WEINCE])
    assert f"| out/weince | 3 | {statistics.mean([r['STS12'] for r in WEINCE]):.2f} ± {weince_std:.2f} |" in printed
    with (runs_dir / "cmp/compare.csv").open(encoding="utf-8", newline="") as handle:
        rows = {(r["group"], r["metric"]): r for r in csv.DictReader(handle)}
    assert float(rows[("out/mnrl", "STSBenchmark")]["mean"]) == pytest.approx(78.2)
    assert rows[("out/mnrl", "STSBenchmark")]["values"].split() == ["78.0", "78.4"]
    assert (runs_dir / "cmp/compare.md").read_text(encoding="utf-8").startswith("| run | n | STS12 |")


def test_labels_and_metric_patterns(runs_dir: Path):
    result = compare.main(
        [f"A={runs_dir}/weince/seed*/sts.json", f"B={runs_dir}/mnrl/seed1/sts.json", "--metrics", "STS1*"]
    )
    assert result["metrics"] == ["STS12"]
    assert result["groups"]["A"]["STS12"]["n"] == 3
    assert result["groups"]["B"]["STS12"] == {"n": 1, "mean": 68.0, "std": None, "values": [68.0]}


def test_generic_results_json_and_mteb_outputs(tmp_path: Path):
    for seed, value in ((1, 0.5), (2, 0.7)):
        (tmp_path / f"run_seed{seed}").mkdir()
        results = {"final": {"stsb_test": value, "note": "text is ignored"}, "seed": seed, "provenance": {"x": 3}}
        (tmp_path / f"run_seed{seed}/results.json").write_text(json.dumps(results), encoding="utf-8")
    mteb = {"results": {"m1": {"scores": {"STS12": 1.0}}, "m2": {"scores": {"STS12": 3.0}}}, "cache": None}
    (tmp_path / "mteb_scores.json").write_text(json.dumps(mteb), encoding="utf-8")
    (tmp_path / "mteb_scores.csv").write_text("model,STS12,avg\nm1,2.0,2.0\n", encoding="utf-8")
    runs = compare.expand_arguments([str(tmp_path / "run_seed*/results.json"), str(tmp_path / "mteb_scores.json")])
    runs += compare.expand_arguments([f"csv={tmp_path / 'mteb_scores.csv'}"])
    groups, metrics = compare.aggregate(runs, ["final.*", "STS12"])
    assert metrics == ["final.stsb_test", "STS12"]
    generic = str(tmp_path / "run/results.json")
    assert groups[generic]["final.stsb_test"].values == [0.5, 0.7]
    assert groups["m1"]["STS12"].values == [1.0] and groups["m2"]["STS12"].values == [3.0]
    assert groups["csv"]["STS12"].values == [2.0]
    all_metrics = compare.aggregate(runs)[1]
    assert "seed" in all_metrics and "provenance.x" not in all_metrics


def test_missing_metric_counts_only_runs_that_have_it(tmp_path: Path):
    _write_sts(tmp_path / "x_seed1.json", "x_seed1", {"STS12": 1.0, "SICK-R": 5.0})
    _write_sts(tmp_path / "x_seed2.json", "x_seed2", {"STS12": 3.0})
    groups, _ = compare.aggregate(compare.expand_arguments([str(tmp_path / "x_seed*.json")]))
    assert groups["x"]["STS12"].n == 2 and groups["x"]["SICK-R"].n == 1
    table = compare.to_markdown(groups, ["STS12", "SICK-R"])
    assert "| x | 2 | 2.00 ± 1.41 | 5.00 (n=1) |" in table


def test_errors(tmp_path: Path):
    with pytest.raises(ValueError, match="no file matches"):
        compare.expand_arguments([str(tmp_path / "nothing*.json")])
    with pytest.raises(ValueError, match="does not exist"):
        compare.load_runs(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="is not valid JSON"):
        compare.load_runs(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text('{"model": "m", "scores": {"STS12": NaN}}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"scores \['STS12'\] are not finite"):
        compare.load_runs(tmp_path / "nan.json")
    (tmp_path / "empty.json").write_text('{"name": "x"}', encoding="utf-8")
    with pytest.raises(ValueError, match="no numeric metric"):
        compare.load_runs(tmp_path / "empty.json")
    _write_sts(tmp_path / "ok.json", "m", {"STS12": 1.0})
    with pytest.raises(ValueError, match="no metric matches"):
        compare.aggregate(compare.expand_arguments([str(tmp_path / "ok.json")]), ["SICK*"])
    with pytest.raises(ValueError, match="not a regular expression"):
        compare.run(compare.parse_args([str(tmp_path / "ok.json"), "--seed-pattern", "("]))


def test_committed_references_compare(capsys):
    result = compare.main([str(REPO_ROOT / "eval/reference/all-MiniLM-L6-v2.sts.json"), "--metrics", "STSBenchmark"])
    assert result["groups"]["all-MiniLM-L6-v2"]["STSBenchmark"]["mean"] == pytest.approx(82.03, abs=0.05)
