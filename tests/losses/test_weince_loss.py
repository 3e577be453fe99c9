"""WEINCELoss as a sentence-transformers loss: MNRL parity, layouts, errors, trainer integration."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_weince.functional import Gate, WEINCEOptions, nt_xent_layout, weince_cross_entropy
from st_weince.losses import WEINCELoss
from tests.float32_tolerance import query_group, tail_fit_tolerances, ulps_apart

DIRECTION_SETTINGS = [
    (("query_to_doc",), "joint"),
    (("query_to_doc", "doc_to_query"), "joint"),
    (("query_to_doc", "doc_to_query"), "per_direction"),
    (("query_to_doc", "query_to_query"), "joint"),
    (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint"),
    (("query_to_doc", "doc_to_doc"), "joint"),
]


def embeddings(batch_size: int, num_columns: int, dim: int = 24, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, dim, generator=generator)
    return [
        (base + 0.8 * torch.randn(batch_size, dim, generator=generator)).requires_grad_(True)
        for _ in range(num_columns)
    ]


@pytest.mark.parametrize(("directions", "partition_mode"), DIRECTION_SETTINGS)
@pytest.mark.parametrize("num_columns", [2, 4])
def test_lambda_zero_equals_mnrl(directions, partition_mode, num_columns):
    columns = embeddings(48, num_columns, seed=len(directions) + num_columns)
    mnrl = MultipleNegativesRankingLoss(None, scale=20.0, directions=directions, partition_mode=partition_mode)
    # aic_margin = 1e9 forces the geometry gate, hence lambda, to exactly 0
    no_gate = {"aic_margin": 1e9}
    weince = WEINCELoss(None, scale=20.0, directions=directions, partition_mode=partition_mode, gate=no_gate)
    expected = mnrl.compute_loss_from_embeddings(columns, None)
    loss = weince.compute_loss_from_embeddings(columns, None)
    assert float(weince.last_statistics.lam.abs().max()) == 0.0
    assert abs(float(loss - expected)) < 1e-6
    grads = torch.autograd.grad(loss, columns)
    expected_grads = torch.autograd.grad(expected, columns)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_default_blend_differs_from_mnrl_and_matches_functional():
    columns = embeddings(64, 2, seed=1)
    loss_fn = WEINCELoss(None, beta=1.0)
    loss = loss_fn.compute_loss_from_embeddings(columns, None)
    assert float(loss_fn.last_statistics.lam.mean()) > 0.01
    scores = F.normalize(columns[0], dim=1) @ F.normalize(columns[1], dim=1).T
    expected = weince_cross_entropy(scores, torch.arange(64), None, WEINCEOptions(scale=20.0, beta=1.0))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    mnrl = MultipleNegativesRankingLoss(None).compute_loss_from_embeddings(columns, None)
    assert abs(float(loss - mnrl)) > 1e-3


@pytest.mark.numerics
def test_query_anchored_rows_share_statistics_over_the_joint_row():
    """With (query_to_doc, query_to_query) each anchor's statistics cover docs and other queries together,
    which on two views of the same items is the SimCLR NT-Xent row of the first view."""
    view_a, view_b = embeddings(32, 2, seed=2)
    loss_fn = WEINCELoss(None, scale=2.0, directions=("query_to_doc", "query_to_query"), beta=1.0)
    loss_fn.compute_loss_from_embeddings([view_a, view_b], None)
    scores, positive_index, valid_mask = nt_xent_layout(view_a, view_b)
    # rows of view a in the 2N layout: columns ordered (view a, view b); the loss orders them (docs, queries)
    reordered = torch.cat([scores[:32, 32:], scores[:32, :32]], dim=1)
    mask = torch.cat([valid_mask[:32, 32:], valid_mask[:32, :32]], dim=1)
    stats = loss_fn.statistics(reordered, torch.arange(32), mask)
    # The loss scores docs and queries with two matmuls, nt_xent_layout with one: float32 may round them differently.
    ulps = ulps_apart(query_group(loss_fn, [view_a, view_b]).scores, reordered)
    tolerance = tail_fit_tolerances(reordered, torch.arange(32), mask, loss_fn.options, ulps)
    torch.testing.assert_close(loss_fn.last_statistics.lam, stats.lam, atol=tolerance["lam"], rtol=0)
    assert float(stats.lam.max()) > 0.0


def test_loss_from_scores_is_the_nt_xent_weince():
    view_a, view_b = embeddings(24, 2, seed=3)
    loss_fn = WEINCELoss(None, scale=2.0, beta=1.0)
    scores, positive_index, valid_mask = nt_xent_layout(view_a, view_b)
    loss = loss_fn.loss_from_scores(scores, positive_index, valid_mask)
    expected = weince_cross_entropy(scores, positive_index, valid_mask, WEINCEOptions(scale=2.0, beta=1.0))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    loss.backward()
    assert view_a.grad is not None and torch.isfinite(view_a.grad).all()


@pytest.mark.parametrize("batch_size", [1, 2, 3, 9])
def test_tiny_batches_are_finite(batch_size):
    columns = embeddings(batch_size, 3, seed=batch_size)
    loss = WEINCELoss(None).compute_loss_from_embeddings(columns, None)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(c.grad).all() for c in columns)


def test_identical_embeddings_scores_exactly_one():
    base = torch.randn(1, 16).repeat(12, 1)
    columns = [base.clone().requires_grad_(True), base.clone().requires_grad_(True)]
    loss = WEINCELoss(None, beta="auto").compute_loss_from_embeddings(columns, None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(columns[0].grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast(dtype):
    columns = embeddings(64, 2, seed=4)
    loss_fn = WEINCELoss(None)
    full = loss_fn.compute_loss_from_embeddings(columns, None)
    with torch.autocast("cpu", dtype=dtype):
        low = loss_fn.compute_loss_from_embeddings([c.to(dtype) for c in columns], None)
    low.backward()
    assert torch.isfinite(low) and torch.isfinite(columns[0].grad).all()
    assert float(low) == pytest.approx(float(full), rel=0.05)


def test_bad_inputs_raise_clear_errors():
    loss_fn = WEINCELoss(None)
    columns = embeddings(8, 2, seed=5)
    with pytest.raises(ValueError, match="at least 2 input columns"):
        loss_fn.compute_loss_from_embeddings(columns[:1], None)
    with pytest.raises(ValueError, match="same batch size"):
        loss_fn.compute_loss_from_embeddings([columns[0], columns[1][:5]], None)
    broken = columns[1].detach().clone()
    broken[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        loss_fn.compute_loss_from_embeddings([columns[0], broken], None)
    with pytest.raises(ValueError, match="scale"):
        WEINCELoss(None, scale=0.0)
    with pytest.raises(ValueError, match="scale"):
        WEINCELoss(None, scale=-20.0)
    with pytest.raises(ValueError, match="query_to_doc"):
        WEINCELoss(None, directions=("doc_to_query",))
    with pytest.raises(ValueError, match="per_direction"):
        WEINCELoss(None, directions=("query_to_doc", "query_to_query"), partition_mode="per_direction")
    with pytest.raises(ValueError, match="beta"):
        WEINCELoss(None, beta=-1.0)
    with pytest.raises(ValueError, match="mode"):
        WEINCELoss(None, mode="softmax")


def test_config_and_citation_are_json_ready():
    loss_fn = WEINCELoss(None, beta=1.0, directions=("query_to_doc", "doc_to_query"))
    config = loss_fn.get_config_dict()
    assert json.loads(json.dumps(config)) == config
    assert config["scale"] == 20.0 and config["beta"] == 1.0 and config["gate"]["q"] == 0.2
    assert "2606.00262" in loss_fn.citation


@pytest.mark.slow
def test_trainer_trains_logs_saves_reloads(tiny_model, tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer

    from st_weince.training import prepare_trainer
    from tests.conftest import TINY_SENTENCES, build_trainer

    dataset = Dataset.from_dict({"anchor": TINY_SENTENCES * 2, "positive": (TINY_SENTENCES * 2)[::-1]})
    loss = WEINCELoss(tiny_model, gate=Gate(q=0.4))
    trainer = build_trainer(
        tiny_model,
        loss,
        tmp_path / "out",
        dataset=dataset,
        per_device_train_batch_size=12,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy="no",
    )
    prepare_trainer(trainer)
    before = tiny_model.encode(["the cat sat on the mat"], convert_to_tensor=True)
    trainer.train()
    after = tiny_model.encode(["the cat sat on the mat"], convert_to_tensor=True)
    assert not torch.allclose(before, after), "training did not change the model"
    logged = [record for record in trainer.state.log_history if "loss" in record]
    assert len(logged) == 3
    for record in logged:
        assert 0.0 <= record["weince_lambda_mean"] <= 1.0
        assert 0.0 <= record["weince_lambda_gt_half"] <= 1.0
        assert record["weince_rho0"] > 0.0
        assert "weince_delta_aic_mean" in record
    tiny_model.save_pretrained(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "WEINCELoss" in card and "2606.00262" in card
    # the card's loss configuration rebuilds the loss, the gate included
    configs = [json.loads(block) for block in re.findall(r"```json\n(\s*\{.*?\n\s*\})\n\s*```", card, flags=re.DOTALL)]
    (config,) = [config for config in configs if "gate" in config]
    assert WEINCELoss(None, **config).options == loss.options and config["gate"]["q"] == 0.4
    reloaded = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    torch.testing.assert_close(reloaded.encode(["the cat sat on the mat"], convert_to_tensor=True), after)
