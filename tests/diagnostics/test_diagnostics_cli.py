"""The diagnostics command line end to end on a tiny text model and a tiny image encoder (offline, small)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from st_weince.diagnostics.__main__ import main
from tests.conftest import TINY_SENTENCES

PLOTS = ("pot_density.png", "pot_qq.png", "pot_stability.png")


def _tiny_text_model(tmp_path: Path) -> Path:
    """A tiny BERT whose tokenizer knows the words of the test sentences."""
    from recipe_tools import build_tiny_bert

    path = tmp_path / "tiny-bert"
    model = build_tiny_bert(path, sentences=TINY_SENTENCES)
    assert model.tokenizer("the cat")["input_ids"][1] != model.tokenizer.unk_token_id
    return path


@pytest.mark.slow
def test_cli_text_model(tmp_path) -> None:
    words = sorted({w for s in TINY_SENTENCES for w in s.split()})
    rng = random.Random(0)
    sentences = tmp_path / "sentences.txt"
    lines = [" ".join(rng.choices(words, k=rng.randint(4, 10))) for _ in range(200)]
    sentences.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pairs = tmp_path / "pairs.csv"  # sentence, its words reversed, a score; the low-score rows are filtered out
    rows = [f"{s},{' '.join(reversed(s.split()))},{4.5 if k % 4 else 1.0}" for k, s in enumerate(lines[:90])]
    pairs.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = [
        "--model", str(_tiny_text_model(tmp_path)), "--pairs", str(pairs), "--min-pair-score", "4.0",
        "--sentences", str(sentences), "--output-dir", str(out),
        "--num-inputs", "120", "--batch-size", "32", "--threshold-quantile", "0.95",
        "--stability-quantiles", "0.9", "0.95", "--profile-points", "3", "--max-seq-length", "16",
        "--anchor-sample", "20", "--anchor-threshold-quantile", "0.7", "--dropout-views",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name in (*PLOTS, "link_profile_dropout.png"):
        assert (out / name).stat().st_size > 1000
    assert summary["scale"]["negative_pairs"] == 120 * 119 // 2
    assert summary["pot"]["threshold_quantile"] == 0.95
    assert summary["pot"]["num_exceedances"] == pytest.approx(0.05 * 120 * 119 / 2, abs=2)
    assert [f["threshold_quantile"] for f in summary["pot_stability"]] == [0.9, 0.95]
    per_anchor = summary["pot_per_anchor"]
    assert per_anchor["rows_fitted"] + per_anchor["rows_skipped"] == 20
    assert per_anchor["exceedances_per_row_median"] == pytest.approx(0.3 * 119, abs=1)
    assert (out / "pot_per_anchor.png").exists()
    link = summary["link"]["dropout"]
    assert link["rows"] == 96  # 3 full batches of 32
    assert summary["link"]["pairs"]["rows"] == 64  # 67 pairs score >= 4 (unless deduplicated): 2 full batches
    assert summary["link"]["pairs"]["positives"]["min_score"] == 4.0
    assert (out / "link_profile_pairs.png").exists()
    assert link["beta1_tau_fitted"]["free"] == ["lambda", "tau"]
    assert link["tau_fixed_beta_fitted"]["tau"] == 0.05
    assert 0.0 <= link["beta1_tau_fitted"]["lam"] <= 1.0
    assert summary["command"].startswith("st-weince-diagnostics --model")
    assert summary["versions"]["torch"] == torch.__version__
    # the verdict on the given pairs (tests/diagnostics/test_diagnostics_verdict.py checks its numbers)
    assert summary["verdict"]["positives"] == "pairs" and summary["verdict"]["line"].startswith("Verdict: ")
    assert summary["weince_gate"]["anchors"] == 64 and summary["scale"]["training_scale"] == 20.0


@pytest.mark.slow
def test_cli_image_encoder(tmp_path, capsys) -> None:
    from simclr_diagnostics import image_views  # recipes/simclr_diagnostics.py: the image encoders are the recipe's
    from simclr_tools.models import SimCLRModel, save_encoder

    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        folder = tmp_path / "images" / "test" / label
        folder.mkdir(parents=True)
        for k in range(24):
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"{k}.png")
    torch.manual_seed(0)
    encoder_dir = save_encoder(SimCLRModel("resnet18", width=4, hidden_dim=16, projection_dim=8), tmp_path / "enc")
    out = tmp_path / "out"
    argv = [
        "--encoder", str(encoder_dir), "--images", str(tmp_path / "images"), "--output-dir", str(out),
        "--num-inputs", "48", "--batch-size", "16", "--threshold-quantile", "0.9",
        "--stability-quantiles", "0.8", "0.9", "--profile-points", "3", "--encode-batch-size", "16",
        "--anchor-sample", "0",
    ]  # fmt: skip
    with pytest.raises(SystemExit):  # the wheel's command line has no image reader: it says where it is
        main(argv)
    assert "run python recipes/simclr_diagnostics.py" in capsys.readouterr().err
    assert main(argv, image_views=image_views) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scale"]["layout"] == "nt_xent" and summary["scale"]["temperature"] == 0.5
    assert summary["link"]["augment"]["rows"] == 96  # 3 batches of 16 pairs -> 2 x 16 anchors each
    assert summary["data"]["encoder_config"]["projection_dim"] == 8
    assert (out / "link_profile_augment.png").exists()
    assert summary["pot_per_anchor"] is None and not (out / "pot_per_anchor.png").exists()


def test_cli_rejects_missing_inputs(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path)])
    assert "exactly one of --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "nope"), "--sentences", "x.txt", "--output-dir", str(tmp_path)])
    assert "not a local directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--sentences", "x.txt", "--skip-dropout", "--output-dir", str(tmp_path)])
    assert "--skip-dropout needs --pairs" in capsys.readouterr().err
