"""Trainer integration of RBSigmoidLoss through st_weince.training.prepare_trainer: an interrupted and resumed run
ends with the same t and b_rel as an uninterrupted one, no weight decay on the loss parameters, t / b_rel / b / margin
in the trainer's logs, and harmlessness for WEINCELoss (no parameters)."""

from __future__ import annotations

import json
import os
import shutil
from functools import partial

import pytest
import torch
from sentence_transformers import SentenceTransformer

from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss, WEINCELoss
from st_weince.training import (
    DEFAULT_LOSS_LEARNING_RATE,
    LOSS_STATE_FILE,
    LOSS_STATE_RECORD,
    prepare_trainer,
    read_checkpoint_loss_state,
)
from tests.conftest import SHORT_RUN, build_trainer, pairs_dataset, stop_at

pytestmark = pytest.mark.slow


def make_trainer(
    model_dir,
    output_dir,
    *,
    loss_cls=RBSigmoidLoss,
    prepare=True,
    callbacks=(),
    allow_missing_loss_state=False,
    eval_dataset=None,
    dropout=True,
    **overrides,
):
    model = SentenceTransformer(str(model_dir), device="cpu")
    if not dropout:  # deterministic forward passes, so that cached and uncached training can be compared
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    settings = {**SHORT_RUN, "per_device_train_batch_size": 4, "max_steps": 6, "weight_decay": 0.5}
    settings.update(save_strategy="steps", save_steps=3)
    trainer = build_trainer(
        model, loss_cls(model), output_dir, eval_dataset=eval_dataset, callbacks=callbacks, **{**settings, **overrides}
    )
    if prepare:
        prepare_trainer(trainer, allow_missing_loss_state=allow_missing_loss_state)
    return trainer


def final_parameters(trainer) -> tuple[float, float]:
    return trainer.loss.scale.item(), trainer.loss.b_rel.item()


def test_interrupted_and_resumed_run_ends_like_an_uninterrupted_one(tiny_model_dir, tmp_path):
    full = make_trainer(tiny_model_dir, tmp_path / "full")
    full.train()
    expected = final_parameters(full)
    saved = read_checkpoint_loss_state(tmp_path / "full" / "checkpoint-3")
    assert set(saved) == {"log_t", "b_rel"}
    assert saved["log_t"].item() != pytest.approx(torch.tensor(10.0).log().item())  # it moved in 3 steps
    assert not os.path.exists(tmp_path / "full" / "checkpoint-3" / LOSS_STATE_FILE)  # inside trainer_state.json

    interrupted = make_trainer(tiny_model_dir, tmp_path / "split", callbacks=[stop_at(3)])
    interrupted.train()
    assert interrupted.state.global_step == 3
    resumed = make_trainer(tiny_model_dir, tmp_path / "split")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    got = final_parameters(resumed)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)

    # A checkpoint without the loss state (written without prepare_trainer) is refused: resuming from it would
    # restart t and b_rel while their optimizer state is restored. (Before: a warning, and the run went on.)
    stripped = tmp_path / "stripped" / "checkpoint-3"
    shutil.copytree(tmp_path / "split" / "checkpoint-3", stripped)
    trainer_state = json.loads((stripped / "trainer_state.json").read_text())
    del trainer_state["stateful_callbacks"][LOSS_STATE_RECORD]
    (stripped / "trainer_state.json").write_text(json.dumps(trainer_state))
    refused = make_trainer(tiny_model_dir, tmp_path / "stripped")
    with pytest.raises(FileNotFoundError, match=r"trainer_state\.json.*allow_missing_loss_state=True"):
        refused.train(resume_from_checkpoint=str(stripped))
    # The opt-in starts the loss parameters fresh, and the run ends elsewhere.
    restarted = make_trainer(tiny_model_dir, tmp_path / "stripped", allow_missing_loss_state=True)
    restarted.train(resume_from_checkpoint=str(stripped))
    assert final_parameters(restarted) != pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_no_weight_decay_on_loss_parameters(tiny_model_dir, tmp_path):
    def group_decay(trainer) -> dict[str, float]:
        decay = {}
        for group in trainer.optimizer.param_groups:
            for p in group["params"]:
                decay[id(p)] = group["weight_decay"]
        loss = trainer.loss
        word_embeddings = next(p for n, p in loss.model.named_parameters() if "word_embeddings" in n)
        return {"log_t": decay[id(loss.log_t)], "b_rel": decay[id(loss.b_rel)], "weights": decay[id(word_embeddings)]}

    plain = make_trainer(tiny_model_dir, tmp_path / "a", prepare=False)
    plain.create_optimizer()
    assert group_decay(plain) == {"log_t": 0.5, "b_rel": 0.5, "weights": 0.5}  # the trap

    # prepare_trainer replaces nothing of the trainer: the loss parameters get groups of their own through
    # learning_rate_mapping, whose weight decay its callback sets to 0 when training begins.
    prepared = make_trainer(tiny_model_dir, tmp_path / "b", max_steps=1, save_strategy="no")
    assert "get_decay_parameter_names" not in vars(prepared) and "_load_from_checkpoint" not in vars(prepared)
    prepared.train()
    assert group_decay(prepared) == {"log_t": 0.0, "b_rel": 0.0, "weights": 0.5}
    groups = {id(p): g for g in prepared.optimizer.param_groups for p in g["params"]}
    assert groups[id(prepared.loss.log_t)]["lr"] == pytest.approx(DEFAULT_LOSS_LEARNING_RATE)

    # An optimizer that exists before prepare_trainer is not regrouped: one that decays a loss parameter is refused.
    late = make_trainer(tiny_model_dir, tmp_path / "c", prepare=False)
    late.create_optimizer()
    with pytest.raises(
        ValueError, match=r"The optimizer given to the trainer puts weight decay on \['b_rel', 'log_t'\]"
    ):
        prepare_trainer(late)
    missing = make_trainer(tiny_model_dir, tmp_path / "e", prepare=False)
    missing.optimizer = torch.optim.AdamW(missing.model.parameters(), lr=1e-5)
    with pytest.raises(ValueError, match=r"does not hold the loss parameters \['b_rel', 'log_t'\]"):
        prepare_trainer(missing)

    # An own learning rate of the user's for the loss parameters wins, and they still get no weight decay.
    def one_step_trainer(folder: str, mapping: dict[str, float]):
        return make_trainer(
            tiny_model_dir, tmp_path / folder, learning_rate_mapping=mapping, max_steps=1, save_strategy="no"
        )

    mapped = one_step_trainer("d", {r"^(log_t|b_rel)$": 1e-2})
    mapped.train()
    groups = {id(p): g for g in mapped.optimizer.param_groups for p in g["params"]}
    for parameter in (mapped.loss.log_t, mapped.loss.b_rel):
        assert groups[id(parameter)]["lr"] == pytest.approx(1e-2) and groups[id(parameter)]["weight_decay"] == 0.0

    # A mapping of the user's that puts them in one group with model weights: refused when training begins.
    mixed = one_step_trainer("f", {r"(log_t|b_rel|word_embeddings)": 1e-3})
    with pytest.raises(ValueError, match=r"holds the loss parameters \['b_rel', 'log_t'\] together with 1 other"):
        mixed.train()


def test_t_b_rel_b_and_margin_in_the_logs(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "logs", max_steps=3, save_strategy="no")
    prepare_trainer(trainer)  # idempotent: no second callback
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == 3
    for record in records:
        for key in ("rb_sigmoid_t", "rb_sigmoid_b_rel", "rb_sigmoid_b", "rb_sigmoid_margin"):
            assert key in record
        assert record["rb_sigmoid_b"] == pytest.approx(record["rb_sigmoid_t"] * record["rb_sigmoid_b_rel"], abs=2e-5)
        assert -1.0 <= record["rb_sigmoid_margin"] <= 1.0
    # t is state: each record holds it as it is at the log, after its step's update
    assert records[0]["rb_sigmoid_t"] != pytest.approx(10.0, rel=1e-5)
    assert records[-1]["rb_sigmoid_t"] == pytest.approx(trainer.loss.trained_values()["t"], abs=1e-6)


def test_prepare_trainer_is_harmless_for_weince(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "weince", loss_cls=WEINCELoss, max_steps=3)
    trainer.train()
    assert os.path.isdir(tmp_path / "weince" / "checkpoint-3")
    assert not os.path.exists(tmp_path / "weince" / "checkpoint-3" / LOSS_STATE_FILE)
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert "weince_lambda_mean" in records[-1]


def test_cached_loss_trains_like_the_uncached_one_with_accumulation(tiny_model_dir, tmp_path):
    """CachedRBSigmoidLoss in the trainer with gradient accumulation (the trainer divides each micro-batch's loss by
    the number of steps): with plain SGD (Adam would hide a wrong gradient scale) t and b_rel end where the uncached
    loss takes them; the checkpoint holds the loss state and the logs hold t, b_rel, b and the margin."""
    finals = {}
    for name, loss_cls in (("uncached", RBSigmoidLoss), ("cached", partial(CachedRBSigmoidLoss, mini_batch_size=3))):
        trainer = make_trainer(
            tiny_model_dir,
            tmp_path / name,
            loss_cls=loss_cls,
            dropout=False,
            optim="sgd",
            learning_rate=1e-3,
            weight_decay=0.0,
            max_steps=3,
            save_steps=3,
            gradient_accumulation_steps=2,
        )
        trainer.train()
        finals[name] = final_parameters(trainer)
        saved = read_checkpoint_loss_state(tmp_path / name / "checkpoint-3")
        assert set(saved) == {"log_t", "b_rel"}
        record = [r for r in trainer.state.log_history if "loss" in r][-1]
        assert {"rb_sigmoid_t", "rb_sigmoid_b_rel", "rb_sigmoid_b", "rb_sigmoid_margin"} <= set(record)
    assert finals["uncached"][0] != pytest.approx(10.0, rel=1e-4), "t must have moved"
    assert finals["cached"] == pytest.approx(finals["uncached"], rel=1e-5, abs=1e-6)


def test_t_and_b_rel_move_materially_at_a_fine_tuning_rate(tiny_model_dir, tmp_path, one_torch_thread):
    """At the model's fine-tuning rate (2e-5) t and b_rel hardly move; prepare_trainer's own learning rate
    for them (DEFAULT_LOSS_LEARNING_RATE) makes them train."""
    settings = {"max_steps": 5, "learning_rate": 2e-5, "weight_decay": 0.0, "save_strategy": "no"}
    moved = {}
    for name, loss_learning_rate in (("own", DEFAULT_LOSS_LEARNING_RATE), ("model", None)):
        trainer = make_trainer(tiny_model_dir, tmp_path / name, prepare=False, **settings)
        prepare_trainer(trainer, loss_learning_rate=loss_learning_rate)
        trainer.train()
        t, b_rel = final_parameters(trainer)
        moved[name] = (abs(t / 10.0 - 1), abs(b_rel - 0.7))
    assert moved["own"][0] > 0.02 and moved["own"][1] > 0.02, moved  # 5 Adam steps of about 1e-2 each
    assert moved["model"][0] < 1e-3 and moved["model"][1] < 1e-3, moved


def test_load_best_model_at_end_loads_the_best_checkpoints_loss_state(tiny_model_dir, tmp_path, one_torch_thread):
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path / "best",
        max_steps=4,
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        eval_dataset=pairs_dataset(),
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-4")  # else the test would show nothing
    saved = read_checkpoint_loss_state(best)
    assert trainer.loss.log_t.item() == saved["log_t"].item() and trainer.loss.b_rel.item() == saved["b_rel"].item()
