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
from st_weince.diagnostics.link import fit_link
from st_weince.diagnostics.verdict import GRADIENT_CHANGE, LINK_ALPHA, WEINCEGate, decide
from tests.conftest import TINY_SENTENCES

BATCH = 32
SCALE = 20.0
COLUMNS = ("question", "answer", "intent")


def _gate(lam_mean: float, changed: float = 0.3) -> WEINCEGate:
    return WEINCEGate(SCALE, lam_mean, 0.0, SCALE, changed, 1.0, anchors=64, batches=2, options={})


def _pot(xi: float, low: float, high: float) -> SimpleNamespace:
    return SimpleNamespace(xi=xi, xi_ci=(low, high), ci_level=0.95)  # the fields decide() reads of a PotFit


def _link(p_value: float, separated: bool = False) -> SimpleNamespace:  # the fields decide() reads of a LinkFit
    return SimpleNamespace(
        free=("lambda", "tau"), separated=separated, p_value=p_value, loglik=-100.0, loglik_softmax=-103.2,
        num_anchors=64, lr_statistic=6.4, lam=0.3, lam_ci=(0.05, 0.6),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("xi_ci", "p_value", "separated", "tail", "link", "loss"),
    [
        ((-0.5, -0.4), 0.001, False, "yes", "yes", "WEINCE"),
        ((-0.5, -0.4), 0.3, False, "yes", "no", "MNRL/InfoNCE"),  # Weibull, but the winners want no shortfall logit
        ((-0.5, -0.4), 0.001, True, "yes", "undecided", "MNRL/InfoNCE"),  # separated: the link says nothing
        ((-0.1, 0.05), 0.001, False, "undecided", "yes", "MNRL/InfoNCE"),
        ((0.1, 0.2), 0.001, False, "no", "yes", "MNRL/InfoNCE"),
    ],
)
def test_rule_chooses_weince_for_a_weibull_tail_whose_winners_want_the_blend(
    xi_ci, p_value, separated, tail, link, loss
) -> None:
    verdict = decide(
        _pot(sum(xi_ci) / 2, *xi_ci), _gate(0.25), _link(p_value, separated), positive_mean=0.8,
        hardest_negative_mean=0.6,
    )  # fmt: skip
    assert (verdict.weibull_tail, verdict.link_prefers_blend, verdict.loss, verdict.guard) == (tail, link, loss, None)
    line = verdict.line()
    assert line.startswith("Verdict: ") and "\n" not in line
    assert f"tail Weibull-type: {tail} (xi = {sum(xi_ci) / 2:.3f}, 95 % CI [{xi_ci[0]:.3f}, {xi_ci[1]:.3f}])" in line
    assert (
        f"winners prefer WEINCE's blended link to the softmax: {link} (log-likelihood +0.0500 per anchor, LR 6.40, "
        f"p = {p_value:.2g}; lambda at beta = 1: 0.300, 95 % CI [0.050, 0.600])"
    ) in line
    assert "would change the hardest negative's gradient by >= 25% for 30% of anchors (gate lambda mean 0.250)" in line
    assert "false negatives: no (hardest-negative mean 0.600 <= positive mean 0.800)" in line
    assert line.endswith(f"loss: {loss}.")
    assert verdict.to_dict()["link_alpha"] == LINK_ALPHA and verdict.to_dict()["gradient_change"] == GRADIENT_CHANGE


def test_rule_reads_the_link_fitted_with_beta_fixed() -> None:
    link = _link(0.001)
    link.free = ("lambda", "beta")
    with pytest.raises(ValueError, match="beta fixed"):
        decide(_pot(-0.4, -0.5, -0.3), _gate(0.3), link, 0.8, 0.6)


def test_rule_adds_a_guard_when_the_hardest_negatives_beat_the_positives() -> None:
    pot, gate, link = _pot(-0.4, -0.5, -0.3), _gate(0.3), _link(0.001)
    labelled = decide(pot, gate, link, 0.57, 0.79, label_column="intent", hardest_negative_same_label_share=0.6)
    assert labelled.false_negatives_likely and labelled.loss == "WEINCE"
    expected = "false negatives: yes (hardest-negative mean 0.790 > positive mean 0.570; 60% share the anchor's intent)"
    assert expected in labelled.line()
    assert labelled.line().endswith(
        'loss: WEINCE, with false_negative_filter="same_label" (labels: intent; it reads integer class ids from a '
        'column named "label": dataset.rename_column("intent", "label"), then dataset.class_encode_column("label") '
        "if they are names)."
    )
    named_label = decide(pot, gate, link, 0.57, 0.79, label_column="label").guard
    assert named_label.endswith('named "label": dataset.class_encode_column("label") if they are names)')
    unlabelled = decide(pot, gate, link, 0.57, 0.79)
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
    lam, positive, hardest, same, rows_scores = [], [], [], [], []
    for start in range(0, len(rows), BATCH):
        a, p = anchors[start : start + BATCH], positives[start : start + BATCH]
        loss.compute_loss_from_embeddings([a, p])
        lam.append(loss.last_statistics.lam)
        scores = (a @ p.T).double()
        rows_scores.append(a @ p.T)
        positive.append(scores.diagonal())
        off = scores - 10.0 * torch.eye(BATCH, dtype=torch.float64)
        hardest.append(off.max(1).values)
        same += [intents[start + r] == intents[start + int(c)] for r, c in enumerate(off.argmax(1))]
    stacked = torch.cat(rows_scores).clamp(-1.0, 1.0)
    winners = torch.arange(BATCH).repeat(len(rows) // BATCH)
    link = fit_link(stacked, winners, None, free=("lambda", "tau"), profile_points=3)
    return {
        "link_p": link.p_value, "link_lam": link.lam, "link_gain": (link.loglik - link.loglik_softmax) / len(rows),
        "link_separated": link.separated,
        "xi": pot.xi, "xi_low": pot.xi_ci[0], "xi_high": pot.xi_ci[1], "lam": float(torch.cat(lam).mean()),
        "positive": float(torch.cat(positive).mean()), "hardest": float(torch.cat(hardest).mean()),
        "same": sum(same) / len(same),
    }  # fmt: skip


VERDICT = re.compile(
    r"^Verdict: tail Weibull-type: (?P<tail>yes|no|undecided) \(xi = (?P<xi>\S+), 95 % CI \[(?P<xi_low>\S+), "
    r"(?P<xi_high>\S+)\]\); winners prefer WEINCE's blended link to the softmax: (?P<link>yes|no|undecided) "
    r"\(log-likelihood (?P<link_gain>\S+) per anchor, LR \S+, p = (?P<link_p>\S+); lambda at beta = 1: "
    r"(?P<link_lam>\S+), 95 % CI \[\S+, \S+\]\); WEINCE at scale 20 would change the hardest negative's gradient "
    r"by >= 25% for (?P<changed>\d+)% of anchors \(gate lambda mean (?P<lam>\S+)\); hardest negatives look like false "
    r"negatives: (?P<fn>yes|no) \(hardest-negative mean (?P<hardest>\S+) (?:>|<=) positive mean (?P<positive>\S+); "
    r"(?P<same>\d+)% share the anchor's intent\); "
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
        "--scale", str(SCALE), "--batch-size", str(BATCH), "--threshold-quantile", "0.95",
        "--stability-quantiles", "0.95", "--profile-points", "3", "--anchor-sample", "0", "--max-seq-length", "16",
        *extra,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    return last_line, json.loads((out / "summary.json").read_text())


def test_cli_verdict_on_csv_jsonl_and_saved_datasets(tmp_path, capsys, tiny_model_dir, no_plots, monkeypatch) -> None:
    from datasets import Dataset, DatasetDict

    rows = _pairs()
    csv_path = tmp_path / "pairs.csv"
    with csv_path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([COLUMNS, *rows])
    encoded: list[str] = []

    def counting_encode(model, texts, **kwargs):
        encoded.extend(texts)
        return encode_texts(model, texts, **kwargs)

    encode_texts = cli.encode_texts
    monkeypatch.setattr(cli, "encode_texts", counting_encode)
    line, summary = _run(capsys, tiny_model_dir, csv_path, tmp_path / "csv", "--columns", "question", "answer")
    # each distinct text of the pairs is encoded once (the pool is the same texts), no dropout views
    assert sorted(encoded) == sorted({text for row in rows for text in row[:2]})

    match = VERDICT.match(line)
    assert match, line
    expected = _expected(tiny_model_dir, rows)
    for key in ("xi", "xi_low", "xi_high", "lam", "positive", "hardest"):
        assert float(match[key]) == pytest.approx(expected[key], abs=1.5e-3), key
    assert int(match["same"]) == pytest.approx(100 * expected["same"], abs=1)
    weibull = "yes" if expected["xi_high"] < 0 else "no" if expected["xi_low"] > 0 else "undecided"
    assert match["tail"] == weibull
    assert float(match["link_lam"]) == pytest.approx(expected["link_lam"], abs=1.5e-3)
    assert float(match["link_gain"]) == pytest.approx(expected["link_gain"], abs=1.5e-4)
    link = "undecided" if expected["link_separated"] else "yes" if expected["link_p"] < LINK_ALPHA else "no"
    assert match["link"] == link
    assert match["fn"] == ("yes" if expected["hardest"] > expected["positive"] else "no")
    assert bool(match["guard"]) == (match["fn"] == "yes")
    assert match["loss"] == ("WEINCE" if weibull == "yes" and link == "yes" else "MNRL/InfoNCE")
    assert summary["verdict"]["line"] == line and summary["verdict"]["positives"] == "pairs"
    assert list(summary["link"]) == ["pairs"]  # with pairs, no dropout views are encoded by default
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


def _choices(rng: torch.Generator, lam: float, rows: int = 600, candidates: int = 32) -> tuple[torch.Tensor, ...]:
    """Scores of a low-dimensional geometry (cosines of 5-d unit vectors) and winners drawn from the blended link
    with ``beta = 1`` at weight ``lam`` (0: the softmax at temperature 0.1)."""
    from torch.nn import functional as F

    a = F.normalize(torch.randn(rows, 5, generator=rng, dtype=torch.float64), dim=-1)
    b = F.normalize(torch.randn(rows, candidates, 5, generator=rng, dtype=torch.float64), dim=-1)
    scores = torch.einsum("rd,rcd->rc", a, b).clamp(-1.0, 1.0)
    logits = (1.0 - lam) * scores / 0.1 - lam * torch.log1p(-scores.clamp(max=1 - 1e-6))
    winners = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=rng).squeeze(1)
    return scores, winners


def test_link_evidence_depends_on_the_data() -> None:
    """The replaced test (gate lambda mean >= 0.1) passed on any batch whose tails were fitted; the link's evidence
    says "yes" only where the winners were drawn with a shortfall term."""
    from st_weince.diagnostics.verdict import link_preference

    rng = torch.Generator().manual_seed(0)
    verdicts = {}
    for lam in (0.0, 0.9):
        scores, winners = _choices(rng, lam)
        fit = fit_link(scores, winners, None, free=("lambda", "tau"), profile_points=3)
        verdicts[lam] = link_preference(fit), fit.lam_ci
    assert verdicts[0.0][0] == "no" and verdicts[0.0][1][0] == 0.0
    assert verdicts[0.9][0] == "yes" and verdicts[0.9][1][0] > 0.0


def test_hardest_negative_gradient_ratio_against_the_closed_form() -> None:
    """d CE / d s_h = p_h * dl_h/ds_h: WEINCE's ((1 - lam) scale + lam beta / (1 - s_h)) under its own softmax, over
    InfoNCE's (scale) under its softmax; lam = 0 gives exactly 1."""
    from st_weince.diagnostics.verdict import hardest_negative_gradient_ratio

    rng = torch.Generator().manual_seed(1)
    scores = (torch.rand(8, 6, generator=rng) * 1.6 - 0.8).double()
    winners = torch.arange(6).repeat(2)[:8]
    mask = torch.ones_like(scores, dtype=torch.bool)
    mask[0, 5] = False  # a masked candidate is no negative
    lam = torch.linspace(0.0, 0.9, 8, dtype=torch.float64)
    beta = torch.full((8,), 1.5, dtype=torch.float64)
    ratio = hardest_negative_gradient_ratio(scores, winners, mask, lam, beta, SCALE, 1e-6)
    for r in range(8):
        s = scores[r].numpy()
        negatives = [c for c in range(6) if c != int(winners[r]) and bool(mask[r, c])]
        h = max(negatives, key=lambda c: s[c])
        blend = (1 - float(lam[r])) * SCALE * s - float(lam[r]) * 1.5 * np.log1p(-s)
        soft = SCALE * s
        valid = mask[r].numpy()
        p_blend = np.exp(blend - blend[valid].max()) * valid
        p_soft = np.exp(soft - soft[valid].max()) * valid
        p_blend, p_soft = p_blend / p_blend.sum(), p_soft / p_soft.sum()
        expected = p_blend[h] * ((1 - float(lam[r])) * SCALE + float(lam[r]) * 1.5 / (1 - s[h])) / (p_soft[h] * SCALE)
        assert float(ratio[r]) == pytest.approx(expected, rel=1e-9)
    assert float(ratio[0]) == pytest.approx(1.0, rel=1e-12)
