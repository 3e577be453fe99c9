"""A loss whose own state nobody handles refuses its first training step, instead of losing that state silently:
RBSigmoidLoss (t, b_rel), its cached variant, either inside MatryoshkaLoss, and the released WEINCE composite (its
batch tail index) under a plain SentenceTransformerTrainer; prepare_trainer and mark_state_managed lift it; WEINCE
without state, evaluation and no-grad passes are never refused."""

from __future__ import annotations

import math

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Module
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

from st_weince.functional import TopM
from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss, WEINCELoss
from st_weince.training import prepare_trainer
from tests.conftest import SHORT_RUN, TINY_SENTENCES, build_trainer

LINE = "st_weince.training.prepare_trainer(trainer)"


def tiny_model(model_dir) -> SentenceTransformer:
    return SentenceTransformer(str(model_dir), device="cpu")


def two_steps(model, loss, output_dir, **arguments):
    settings = {**SHORT_RUN, "per_device_train_batch_size": 8, "max_steps": 2, **arguments}
    return build_trainer(model, loss, output_dir, **settings)


LOSSES_WITH_STATE = {
    "rb-sigmoid": (lambda model: RBSigmoidLoss(model), "log_t, b_rel"),
    "cached-rb-sigmoid": (lambda model: CachedRBSigmoidLoss(model, mini_batch_size=4), "log_t, b_rel"),
    "matryoshka-rb-sigmoid": (lambda model: MatryoshkaLoss(model, RBSigmoidLoss(model), [32, 16]), "log_t, b_rel"),
    "released-composite": (
        lambda model: WEINCELoss(model, top_m=TopM(m=3, shortfall_weight=0.5, beta_tail_min_points=16)),
        "batch_beta_ema",
    ),
}


@pytest.mark.parametrize("name", list(LOSSES_WITH_STATE))
def test_a_plain_trainer_is_refused_at_the_first_step_naming_the_line(name, tiny_model_dir, tmp_path):
    make, state = LOSSES_WITH_STATE[name]
    model = tiny_model(tiny_model_dir)
    loss = make(model)
    before = {key: value.clone() for key, value in loss.state_dict().items() if not key.startswith("model.")}
    trainer = two_steps(model, loss, tmp_path / "plain")
    with pytest.raises(RuntimeError, match=r"has state of its own that training changes") as refused:
        trainer.train()
    message = str(refused.value)
    assert LINE in message and f"({state})" in message and "loss.mark_state_managed()" in message
    assert "a resume restarts it" in message and "drift apart across processes" in message
    assert trainer.state.global_step == 0  # refused before any optimizer step: nothing trained, nothing lost
    after = {key: value for key, value in loss.state_dict().items() if not key.startswith("model.")}
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("name", ["rb-sigmoid", "matryoshka-rb-sigmoid", "released-composite"])
def test_prepare_trainer_lifts_the_refusal_and_the_state_trains(name, tiny_model_dir, tmp_path):
    make, _ = LOSSES_WITH_STATE[name]
    model = tiny_model(tiny_model_dir)
    loss = make(model)
    trainer = two_steps(model, loss, tmp_path / "prepared")
    prepare_trainer(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    inner = loss.loss if isinstance(loss, MatryoshkaLoss) else loss
    assert inner.state_managed_by == "st_weince.training.prepare_trainer"
    if isinstance(inner, RBSigmoidLoss):
        assert inner.scale.item() != pytest.approx(10.0, rel=1e-4)  # t trained at the loss's own rate
    else:
        assert inner.batch_beta_ema.item() != 4.0  # the tail index's moving average advanced


def test_weince_without_state_trains_with_a_plain_trainer(tiny_model_dir, tmp_path):
    model = tiny_model(tiny_model_dir)
    loss = WEINCELoss(model)
    assert loss.state_tensors() == {}
    trainer = two_steps(model, loss, tmp_path / "weince")
    trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_own_loops_declare_the_state_managed_and_evaluation_is_never_refused(tiny_model_dir):
    model = tiny_model(tiny_model_dir)
    loss = RBSigmoidLoss(model)
    features = [model.preprocess(TINY_SENTENCES[:6]), model.preprocess(TINY_SENTENCES[1:7])]
    loss.eval()
    loss(features)  # evaluation (the trainer's eval loop) is not a training step
    loss.train()
    with torch.no_grad():
        loss(features)
    with pytest.raises(RuntimeError, match="mark_state_managed"):
        loss(features)
    assert loss.mark_state_managed() is loss and loss.state_managed_by == "the caller's training loop"
    value = loss(features)
    value.backward()
    assert loss.log_t.grad is not None and torch.isfinite(loss.log_t.grad).all()
    frozen = RBSigmoidLoss(model, trainable_scale=False, trainable_bias=False)
    assert frozen.state_tensors() == {}
    frozen(features).backward()  # constants: nothing to lose


class LossParametersModule(Module):
    """The rejected design (docs/training.md): the loss's parameters as the last module of the model, where the
    trainer would save, resume and synchronise them as model weights."""

    config_keys: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.log_t = torch.nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, features: dict) -> dict:
        return features

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.save_torch_weights(output_path, safe_serialization=safe_serialization)
        self.save_config(output_path)

    @classmethod
    def load(cls, model_name_or_path: str, **kwargs) -> LossParametersModule:
        return cls()


@pytest.mark.slow  # the fork server (5-7 s to start) unless another test started it
def test_the_model_module_design_needs_trust_remote_code_and_the_package(fork_server, tiny_model_dir, tmp_path):
    """Why the loss keeps its parameters and prepare_trainer remains: sentence-transformers 6 refuses to load a model
    with a module class from outside its namespace without trust_remote_code=True, and a user without the package
    that defines the class cannot load it at all. If this test fails, the trainer-owned design becomes possible."""
    model = tiny_model(tiny_model_dir)
    model.append(LossParametersModule())
    model.save(str(tmp_path / "with-module"))
    with pytest.raises(ValueError, match="trust_remote_code"):
        SentenceTransformer(str(tmp_path / "with-module"), device="cpu")
    loaded = SentenceTransformer(str(tmp_path / "with-module"), device="cpu", trust_remote_code=True)
    assert isinstance(loaded[-1], LossParametersModule)
    without_package = (
        "from sentence_transformers import SentenceTransformer\n"
        f"SentenceTransformer({str(tmp_path / 'with-module')!r}, device='cpu', trust_remote_code=True)"
    )
    # A process (forked by tests/forked.py) in which this checkout's tests are not importable.
    log = tmp_path / "without-package.log"
    worker = fork_server.start(log, code=without_package, cwd=tmp_path, isolate=True)
    assert worker.wait(timeout=300) != 0 and "No module named 'tests'" in worker.output()
