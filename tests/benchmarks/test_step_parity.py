"""benchmarks/step_parity.py's fingerprint and grouping (no training: the commit runs are the tool's own business)."""

from __future__ import annotations

import torch

from tests.conftest import load_script

parity = load_script("benchmarks/step_parity.py", "step_parity")


def save(path, model: dict[str, torch.Tensor]):
    torch.save({"model": model, "epoch": 1}, path)
    return path


def test_fingerprint_sees_one_ulp_and_ignores_names_and_memory_format(tmp_path):
    weight = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    model = {"conv.weight": weight, "bn.num_batches_tracked": torch.tensor(7)}
    base = parity.model_fingerprint(save(tmp_path / "a.pt", model))
    renamed = {"encoder.conv.weight": weight.contiguous(memory_format=torch.channels_last), "n": torch.tensor(7)}
    assert parity.model_fingerprint(save(tmp_path / "b.pt", renamed)) == base
    nudged = weight.clone()
    nudged.view(-1)[5] = torch.nextafter(nudged.view(-1)[5], torch.tensor(float("inf")))
    assert parity.model_fingerprint(save(tmp_path / "c.pt", {**model, "conv.weight": nudged})) != base


def test_identical_groups_pair_fingerprint_and_loss_and_skip_failures():
    commits = {
        "a": {"fingerprint": "f1", "train_loss_hex": "0x1.4p+3"},
        "b": {"fingerprint": "f2", "train_loss_hex": "0x1.4p+3"},
        "c": {"error": "boom"},
        "d": {"fingerprint": "f1", "train_loss_hex": "0x1.4p+3"},
        "e": {"fingerprint": "f1", "train_loss_hex": "0x1.5p+3"},
    }
    assert parity.identical_groups(commits) == [["a", "d"], ["b"], ["e"]]
