"""The diagnostics' verdict: its rule, and the command line on pair files with named columns (CSV, JSON lines, saved
``datasets`` folders), the verdict's numbers checked against values computed here from the model's embeddings."""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from st_weince.diagnostics import __main__ as cli
from st_weince.diagnostics.evt import pot_fit
from st_weince.diagnostics.verdict import LAMBDA_NEGLIGIBLE, WeinceGate, decide
from tests.conftest import TINY_SENTENCES

BATCH = 32
SCALE = 20.0
COLUMNS = ("question", "answer", "intent")


def _gate(lam_mean: float) -> WeinceGate:
    return WeinceGate(SCALE, lam_mean, 0.0, SCALE, anchors=64, batches=2, options={})


def _pot(xi: float, low: float, high: float) -> SimpleNamespace:
    return SimpleNamespace(xi=xi, xi_ci=(low, high), ci_level=0.95)  # the fields decide() reads of a PotFit


@pytest.mark.parametrize(
    ("xi_ci", "lam", "tail", "loss"),
    [
        ((-0.5, -0.4), 0.3, "yes", "WEINCE"),
        ((-0.5, -0.4), LAMBDA_NEGLIGIBLE / 2, "yes", "MNRL/InfoNCE"),  # Weibull, but the gate barely opens
        ((-0.1, 0.05), 0.3, "undecided", "MNRL/InfoNCE"),
        ((0.1, 0.2), 0.3, "no", "MNRL/InfoNCE"),
    ],
)
def test_rule_chooses_weince_for_a_weibull_tail_and_a_non_negligible_lambda(xi_ci, lam, tail, loss) -> None:
    verdict = decide(_pot(sum(xi_ci) / 2, *xi_ci), _gate(lam), positive_mean=0.8, hardest_negative_mean=0.6)
    assert (verdict.weibull_tail, verdict.loss, verdict.guard) == (tail, loss, None)
    line = verdict.line()
    assert line.startswith("Verdict: ") and "\n" not in line
    assert f"tail Weibull-type: {tail} (xi = {sum(xi_ci) / 2:.3f}, 95 % CI [{xi_ci[0]:.3f}, {xi_ci[1]:.3f}])" in line
    assert f"WEINCE's lambda at scale 20: mean {lam:.3f}" in line
    assert "false negatives: no (hardest-negative mean 0.600 <= positive mean 0.800)" in line
    assert line.endswith(f"loss: {loss}.")


def test_rule_adds_a_guard_when_the_hardest_negatives_beat_the_positives() -> None:
    pot, gate = _pot(-0.4, -0.5, -0.3), _gate(0.3)
    labelled = decide(pot, gate, 0.57, 0.79, label_column="intent", hardest_negative_same_label_share=0.6)
    assert labelled.false_negatives_likely and labelled.loss == "WEINCE"
    expected = "false negatives: yes (hardest-negative mean 0.790 > positive mean 0.570; 60% share the anchor's intent)"
    assert expected in labelled.line()
    assert labelled.line().endswith(
        'loss: WEINCE, with false_negative_filter="same_label" (labels: intent; it reads integer class ids from a '
        'column named "label": dataset.rename_column("intent", "label"), then dataset.class_encode_column("label") '
        "if they are names)."
    )
    named_label = decide(pot, gate, 0.57, 0.79, label_column="label").guard
    assert named_label.endswith('named "label": dataset.class_encode_column("label") if they are names)')
    unlabelled = decide(pot, gate, 0.57, 0.79)
    assert 'threshold guard (false_negative_filter=("absolute", m)' in unlabelled.guard
    assert unlabelled.to_dict()["line"] == unlabelled.line()


def _pairs(count: int = 64) -> list[tuple[str, str, str]]:
    """Question, answer, intent: random sentences of the tiny vocabulary, an answer sharing half its words."""
    words = sorted({w for s in TINY_SENTENCES for w in s.split()})
    rng = random.Random(0)
    rows = []
    for k in range(count):
        question = rng.choices(words, k=rng.randint(4, 10))
        answer = question[: len(question) // 2] + rng.choices(words, k=4)
        rows.append((" ".join(question), " ".join(answer), f"intent{k % 4}"))
    return rows


def _expected(model_dir: Path, rows: list[tuple[str, str, str]]) -> dict[str, float]:
    """The verdict's numbers from the model's own ``encode`` and the loss class itself, batch by batch."""
    from sentence_transformers import SentenceTransformer

    from st_weince.losses import WEINCELoss

    model = SentenceTransformer(str(model_dir), device="cpu")
    questions, answers, intents = (list(column) for column in zip(*rows))
    texts = list(dict.fromkeys(questions + answers))
    unit = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True).astype(np.float64)
    pool = (unit @ unit.T)[np.triu_indices(len(texts), k=1)]
    pot = pot_fit(pool, 0.95)
    anchors = torch.as_tensor(model.encode(questions, normalize_embeddings=True))
    positives = torch.as_tensor(model.encode(answers, normalize_embeddings=True))
    loss = WEINCELoss(model, scale=SCALE)
    lam, positive, hardest, same = [], [], [], []
    for start in range(0, len(rows), BATCH):
        a, p = anchors[start : start + BATCH], positives[start : start + BATCH]
        loss.compute_loss_from_embeddings([a, p])
        lam.append(loss.last_statistics.lam)
        scores = (a @ p.T).double()
        positive.append(scores.diagonal())
        off = scores - 10.0 * torch.eye(BATCH, dtype=torch.float64)
        hardest.append(off.max(1).values)
        same += [intents[start + r] == intents[start + int(c)] for r, c in enumerate(off.argmax(1))]
    return {
        "xi": pot.xi, "xi_low": pot.xi_ci[0], "xi_high": pot.xi_ci[1], "lam": float(torch.cat(lam).mean()),
        "positive": float(torch.cat(positive).mean()), "hardest": float(torch.cat(hardest).mean()),
        "same": sum(same) / len(same),
    }  # fmt: skip


VERDICT = re.compile(
    r"^Verdict: tail Weibull-type: (?P<tail>yes|no|undecided) \(xi = (?P<xi>\S+), 95 % CI \[(?P<xi_low>\S+), "
    r"(?P<xi_high>\S+)\]\); WEINCE's lambda at scale 20: mean (?P<lam>\S+) \((?P<weight>non-negligible|negligible), "
    r"threshold 0\.1\); hardest negatives look like false negatives: (?P<fn>yes|no) \(hardest-negative mean "
    r"(?P<hardest>\S+) (?:>|<=) positive mean (?P<positive>\S+); (?P<same>\d+)% share the anchor's intent\); "
    r"loss: (?P<loss>WEINCE|MNRL/InfoNCE)(?P<guard>, with false_negative_filter=\"same_label\" \(labels: intent; it "
    r"reads integer class ids from a column named \"label\": dataset\.rename_column\(\"intent\", \"label\"\), then "
    r"dataset\.class_encode_column\(\"label\"\) if they are names\))?\.$"
)


@pytest.fixture()
def no_plots(monkeypatch) -> None:
    """The plots cost about a second each and are checked by test_diagnostics_cli.py; here only numbers count."""
    for name in dir(cli):
        if name.startswith("plot_"):
            monkeypatch.setattr(cli, name, lambda *args, **kwargs: None)


def _run(capsys, model_dir: Path, pairs: Path, out: Path, *extra: str) -> tuple[str, dict]:
    argv = [
        "--model", str(model_dir), "--pairs", str(pairs), "--label-column", "intent", "--output-dir", str(out),
        "--scale", str(SCALE), "--skip-dropout", "--batch-size", str(BATCH), "--threshold-quantile", "0.95",
        "--stability-quantiles", "0.95", "--profile-points", "3", "--anchor-sample", "0", "--max-seq-length", "16",
        *extra,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    return last_line, json.loads((out / "summary.json").read_text())


def test_cli_verdict_on_csv_jsonl_and_saved_datasets(tmp_path, capsys, tiny_model_dir, no_plots) -> None:
    from datasets import Dataset, DatasetDict

    rows = _pairs()
    csv_path = tmp_path / "pairs.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([COLUMNS, *rows])
    line, summary = _run(capsys, tiny_model_dir, csv_path, tmp_path / "csv", "--columns", "question", "answer")

    match = VERDICT.match(line)
    assert match, line
    expected = _expected(tiny_model_dir, rows)
    for key in ("xi", "xi_low", "xi_high", "lam", "positive", "hardest"):
        assert float(match[key]) == pytest.approx(expected[key], abs=1.5e-3), key
    assert int(match["same"]) == pytest.approx(100 * expected["same"], abs=1)
    weibull = "yes" if expected["xi_high"] < 0 else "no" if expected["xi_low"] > 0 else "undecided"
    assert match["tail"] == weibull
    assert match["weight"] == ("non-negligible" if expected["lam"] >= LAMBDA_NEGLIGIBLE else "negligible")
    assert match["fn"] == ("yes" if expected["hardest"] > expected["positive"] else "no")
    assert bool(match["guard"]) == (match["fn"] == "yes")
    assert match["loss"] == ("WEINCE" if weibull == "yes" and expected["lam"] >= LAMBDA_NEGLIGIBLE else "MNRL/InfoNCE")
    assert summary["verdict"]["line"] == line and summary["verdict"]["positives"] == "pairs"
    assert summary["data"]["negative_pool"] == "distinct texts of the pairs"
    texts = len({text for row in rows for text in row[:2]})
    assert (summary["scale"]["inputs"], summary["scale"]["negative_pairs"]) == (texts, texts * (texts - 1) // 2)
    link = summary["link"]["pairs"]
    assert link["beta1_tau_fitted"]["meaning"] == "lambda of the link fitted with beta = 1, tau free"
    assert link["tau_fixed_beta_fitted"]["meaning"] == "lambda at your temperature tau = 1/scale = 0.05, beta free"
    assert link["tau_fixed_beta_fitted"]["tau"] == pytest.approx(1 / SCALE)
    assert summary["weince_gate"]["anchors"] == 64 and summary["weince_gate"]["batches"] == 2

    # the same pairs as JSON lines (columns in order: the first two are the pair without --columns) and as saved
    # datasets folders (a Dataset, and a DatasetDict whose "train" split is taken) give the same verdict
    jsonl_path = tmp_path / "pairs.jsonl"
    jsonl_path.write_text("".join(json.dumps(dict(zip(COLUMNS, r))) + "\n" for r in rows), encoding="utf-8")
    assert _run(capsys, tiny_model_dir, jsonl_path, tmp_path / "jsonl")[0] == line
    table = Dataset.from_dict({name: list(column) for name, column in zip(COLUMNS, zip(*rows))})
    table.save_to_disk(str(tmp_path / "dataset"))
    named = ("--columns", "question", "answer")
    assert _run(capsys, tiny_model_dir, tmp_path / "dataset", tmp_path / "ds", *named)[0] == line
    DatasetDict(train=table, test=table.select(range(8))).save_to_disk(str(tmp_path / "dataset_dict"))
    assert _run(capsys, tiny_model_dir, tmp_path / "dataset_dict", tmp_path / "dd", *named)[0] == line


def test_cli_names_a_missing_column_and_lists_the_columns(tmp_path, capsys, tiny_model_dir) -> None:
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("question,answer,intent\nthe cat sat,a dog runs,pets\nrain falls,birds fly,weather\n")
    argv = ["--model", str(tiny_model_dir), "--pairs", str(pairs), "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--columns", "question", "reply"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(f"{pairs} has no column 'reply' (--columns); its columns: question, answer, intent")
    with pytest.raises(SystemExit):
        cli.main([*argv, "--columns", "question", "answer", "--label-column", "label"])
    assert "has no column 'label' (--label-column); its columns: question, answer, intent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*argv[:2], "--output-dir", str(tmp_path / "out")])
    assert "--model needs --pairs" in capsys.readouterr().err
