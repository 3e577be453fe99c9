"""RBSigmoidLoss inside MatryoshkaLoss, Matryoshka2dLoss and AdaptiveLayerLoss with prepare_trainer: the loss
parameters are found through the wrapper, logged, saved (alone, not with copies of the model) and restored, get no
weight decay, get their own learning rate, and a documented prefix-robust learning_rate_mapping entry wins."""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.sentence_transformer.losses import AdaptiveLayerLoss, Matryoshka2dLoss, MatryoshkaLoss

from st_weince.losses import RBSigmoidLoss
from st_weince.training import DEFAULT_LOSS_LEARNING_RATE, prepare_trainer, read_checkpoint_loss_state, state_tensors
from tests.checkpoint_worker import build_trainer
from tests.conftest import stop_at

pytestmark = pytest.mark.slow

WRAPPERS = {
    "matryoshka": (lambda model, inner: MatryoshkaLoss(model, inner, [32, 16]), "loss."),
    "matryoshka_2d": (lambda model, inner: Matryoshka2dLoss(model, inner, [32, 16]), "loss.loss."),
    "adaptive_layer": (lambda model, inner: AdaptiveLayerLoss(model, inner), "loss."),
}


def wrapped_trainer(model_dir, output_dir, wrapper: str, **overrides):
    settings = {"max_steps": 3, "save_steps": 2, "weight_decay": 0.5, **overrides}
    trainer = build_trainer(model_dir, output_dir, **settings)
    inner = trainer.loss
    trainer.loss = WRAPPERS[wrapper][0](trainer.model, inner)
    return trainer, inner


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrapped_rb_sigmoid_with_prepare_trainer(wrapper, tiny_model_dir, tmp_path, one_torch_thread):
    prefix = WRAPPERS[wrapper][1]
    trainer, inner = wrapped_trainer(tiny_model_dir, tmp_path / "full", wrapper)
    assert sorted(state_tensors(trainer.loss)) == [prefix + "b_rel", prefix + "log_t"]
    prepare_trainer(trainer)
    trainer.train()
    # the optimizer as it trained (weight decay comes off the loss parameters' groups when training begins)
    groups = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    for parameter in (inner.log_t, inner.b_rel):
        assert groups[id(parameter)]["weight_decay"] == 0.0
        assert groups[id(parameter)]["lr"] == DEFAULT_LOSS_LEARNING_RATE
    embeddings = next(p for n, p in trainer.model.named_parameters() if "word_embeddings" in n)
    assert groups[id(embeddings)]["weight_decay"] == 0.5 and groups[id(embeddings)]["lr"] == 5e-2

    records = [r for r in trainer.state.log_history if "loss" in r]
    # t and b_rel are state: a record holds them as they are at the log, after its step's optimizer step
    assert records[0]["rb_sigmoid_t"] != pytest.approx(10.0, rel=1e-3)
    assert records[-1]["rb_sigmoid_t"] == pytest.approx(inner.trained_values()["t"], abs=1e-6)
    assert records[-1]["rb_sigmoid_b"] == pytest.approx(records[-1]["rb_sigmoid_t"] * records[-1]["rb_sigmoid_b_rel"])

    saved = read_checkpoint_loss_state(tmp_path / "full" / "checkpoint-2")
    assert sorted(saved) == [prefix + "b_rel", prefix + "log_t"]  # no copies of the model's tensors

    # Interrupted at step 2, resumed: the same end as the uninterrupted run.
    split, _ = wrapped_trainer(tiny_model_dir, tmp_path / "split", wrapper, callbacks=[stop_at(2)])
    prepare_trainer(split).train()
    resumed, resumed_inner = wrapped_trainer(tiny_model_dir, tmp_path / "split", wrapper)
    prepare_trainer(resumed).train(resume_from_checkpoint=True)
    assert resumed_inner.log_t.item() == pytest.approx(inner.log_t.item(), rel=1e-5)
    assert resumed_inner.b_rel.item() == pytest.approx(inner.b_rel.item(), rel=1e-5, abs=1e-6)


def test_documented_mapping_matches_under_wrappers_and_wins(tiny_model_dir, tmp_path):
    mapping = {r"(^|\.)(log_t|b_rel)$": 3e-3}  # docs/training.md: matches with and without a wrapper's prefix
    for wrapper in ("matryoshka", "matryoshka_2d"):
        trainer, inner = wrapped_trainer(
            tiny_model_dir, tmp_path / wrapper, wrapper, learning_rate_mapping=mapping, max_steps=1, save_strategy="no"
        )
        prepare_trainer(trainer).train()
        groups = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
        assert groups[id(inner.log_t)]["lr"] == 3e-3 and groups[id(inner.log_t)]["weight_decay"] == 0.0
    plain = prepare_trainer(build_trainer(tiny_model_dir, tmp_path / "plain", learning_rate_mapping=mapping))
    plain.create_optimizer()
    groups = {id(p): g for g in plain.optimizer.param_groups for p in g["params"]}
    assert groups[id(plain.loss.b_rel)]["lr"] == 3e-3


def test_no_own_learning_rate_on_request(tiny_model_dir, tmp_path):
    trainer = prepare_trainer(build_trainer(tiny_model_dir, tmp_path, learning_rate=1e-3), loss_learning_rate=None)
    trainer.create_optimizer()
    groups = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    assert groups[id(trainer.loss.log_t)]["lr"] == 1e-3
    with pytest.raises(ValueError, match="loss_learning_rate"):
        prepare_trainer(build_trainer(tiny_model_dir, tmp_path), loss_learning_rate=float("nan"))
    assert isinstance(trainer.loss, RBSigmoidLoss) and torch.is_tensor(trainer.loss.log_t)


def test_state_tensors_of_a_dict_of_losses_use_the_trainers_names(tiny_model):
    losses = {"nli": RBSigmoidLoss(tiny_model), "pairs": MatryoshkaLoss(tiny_model, RBSigmoidLoss(tiny_model), [16])}
    assert sorted(state_tensors(losses)) == ["nli.b_rel", "nli.log_t", "pairs.loss.b_rel", "pairs.loss.log_t"]
    assert sorted(state_tensors(RBSigmoidLoss(tiny_model, trainable_scale=False))) == ["b_rel"]


def test_arguments_reused_for_another_loss_do_not_carry_the_loss_pattern(tiny_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformerTrainer

    from st_weince.losses import WEINCELoss

    rb = prepare_trainer(build_trainer(tiny_model_dir, tmp_path))
    assert any("log_t" in pattern for pattern in rb.args.learning_rate_mapping)
    shared_args = build_trainer(tiny_model_dir, tmp_path).args
    for loss_cls in (RBSigmoidLoss, WEINCELoss):
        trainer = SentenceTransformerTrainer(
            model=rb.model, args=shared_args, train_dataset=rb.train_dataset, loss=loss_cls(rb.model)
        )
        prepare_trainer(trainer).create_optimizer()  # WEINCE: would raise "No parameters found matching the pattern"
    assert shared_args.learning_rate_mapping == {}
