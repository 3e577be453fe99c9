"""The trained t and b_rel travel with the model: after trainer.train() with prepare_trainer, the model carries them
in its configuration, a save -> load round trip keeps them (no trust_remote_code, no custom module),
st_weince.match_probability computes sigmoid(t (s - b_rel)) from them, the model card shows them next to the
configured loss, and the cap of max_scale holds in a trainer run (and its state is logged)."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers import SentenceTransformer
from transformers import TrainerCallback

import st_weince
from st_weince import MatchProbability, match_probability
from st_weince.calibration import CONFIG_KEY, carried_match_probability
from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss, WEINCELoss
from st_weince.training import prepare_trainer
from tests.conftest import SHORT_RUN, TINY_SENTENCES, build_trainer, stop_at

pytestmark = pytest.mark.slow


class PushScaleUp(TrainerCallback):
    """A persistent upward gradient on log_t (the worst case the cap is for), replacing the loss's own."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.loss.log_t.grad = torch.full_like(self.loss.log_t, -1.0)


def train(model_dir, output_dir, loss_cls=RBSigmoidLoss, callbacks=(), resume=None, **loss_options):
    model = SentenceTransformer(str(model_dir), device="cpu")
    loss = loss_cls(model, **loss_options)
    settings = {**SHORT_RUN, "per_device_train_batch_size": 4, "max_steps": 5, "save_strategy": "steps"}
    trainer = build_trainer(model, loss, output_dir, callbacks=callbacks, **settings, save_steps=2)
    for callback in callbacks:
        callback.loss = loss
    prepare_trainer(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("loss_cls", [RBSigmoidLoss, CachedRBSigmoidLoss])
def test_trained_values_travel_with_the_saved_model(tiny_model_dir, tmp_path, loss_cls, one_torch_thread):
    options = {"mini_batch_size": 2} if loss_cls is CachedRBSigmoidLoss else {}
    trainer = train(tiny_model_dir, tmp_path / "run", loss_cls, [PushScaleUp()], max_scale=10.2, **options)
    loss, model = trainer.loss, trainer.model
    trained = loss.trained_values()
    assert trained["b_rel"] != pytest.approx(0.7, rel=1e-4)
    assert trained["t"] == pytest.approx(10.2, rel=1e-6)  # pushed up at 3e-2 a step: at the cap from the 2nd step
    assert trained["t"] <= 10.2  # the cap holds in the trainer (the parameter is clamped after every step)
    assert loss.log_t.item() <= loss.log_scale_cap
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert all("rb_sigmoid_t_capped" in r and r["rb_sigmoid_t"] <= 10.2 + 1e-4 for r in records)
    # t is logged as it is after each step's update: 10 exp(3e-2) > 10.2, at the cap from the first update on
    assert all(r["rb_sigmoid_t_capped"] == 1.0 and r["rb_sigmoid_t"] == pytest.approx(10.2, abs=1e-5) for r in records)

    carried = carried_match_probability(model)
    assert (carried.t, carried.b_rel, carried.global_step) == (trained["t"], trained["b_rel"], 5)
    assert carried.loss == loss_cls.__name__
    # get_config_dict: the configured loss (rebuilds it as configured); the trained values are separate
    assert loss.get_config_dict()["scale"] == 10.0 and loss.get_config_dict()["relative_bias"] == 0.7

    saved = tmp_path / "saved"
    model.save_pretrained(str(saved))
    reloaded = SentenceTransformer(str(saved), device="cpu")  # a plain load: no trust_remote_code
    assert [type(m).__name__ for m in reloaded] == [type(m).__name__ for m in SentenceTransformer(str(tiny_model_dir))]
    carried_back = carried_match_probability(reloaded)
    assert (carried_back.t, carried_back.b_rel, carried_back.b) == (trained["t"], trained["b_rel"], trained["b"])
    # the values are plain JSON in the transformer's config.json (readable without st-weince)
    config = json.loads((saved / "config.json").read_text())[CONFIG_KEY]
    assert config["t"] == trained["t"] and config["loss"] == loss_cls.__name__

    texts_a, texts_b = TINY_SENTENCES[:3], TINY_SENTENCES[3:7]
    probabilities = match_probability(reloaded, texts_a, texts_b)
    assert probabilities.shape == (3, 4)
    cosine = reloaded.similarity(reloaded.encode(texts_a), reloaded.encode(texts_b))  # cos_sim: the model's own
    expected = torch.sigmoid(trained["t"] * (cosine.double() - trained["b_rel"]))
    torch.testing.assert_close(probabilities.double(), expected, rtol=1e-5, atol=1e-6)
    # the embeddings are the trained model's
    torch.testing.assert_close(reloaded.encode(texts_a), model.encode(texts_a), rtol=1e-6, atol=1e-6)

    # the card: the configured loss and, next to it, the trained values
    card = (saved / "README.md").read_text()
    assert '"scale": 10.0' in card and '"max_scale": 10.2' in card
    assert "Trained values" in card and json.dumps(trained["t"]) in card and json.dumps(trained["b_rel"]) in card

    # a checkpoint carries the values of its own step
    at_step_4 = carried_match_probability(SentenceTransformer(str(tmp_path / "run" / "checkpoint-4"), device="cpu"))
    assert at_step_4.global_step == 4 and at_step_4.t <= 10.2


def test_a_resumed_run_at_the_cap_ends_like_an_uninterrupted_one(tiny_model_dir, tmp_path, one_torch_thread):
    """The checkpoint holds the clamped log_t and its optimizer state: resuming at step 2 under the cap gives the
    uninterrupted run's t and b_rel (and the carried values)."""
    full = train(tiny_model_dir, tmp_path / "full", RBSigmoidLoss, [PushScaleUp()], max_scale=10.2)
    train(tiny_model_dir, tmp_path / "cut", RBSigmoidLoss, [PushScaleUp(), stop_at(2)], max_scale=10.2)
    resumed = train(tiny_model_dir, tmp_path / "cut", RBSigmoidLoss, [PushScaleUp()], resume=True, max_scale=10.2)
    assert resumed.state.global_step == 5
    assert resumed.loss.trained_values() == pytest.approx(full.loss.trained_values(), rel=1e-6, abs=1e-7)
    assert resumed.loss.trained_values()["t"] <= 10.2
    assert carried_match_probability(resumed.model) == carried_match_probability(full.model)


def test_a_model_without_trained_values_says_so(tiny_model_dir, tmp_path, one_torch_thread):
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    with pytest.raises(ValueError, match="carries no trained RB-Sigmoid t and b_rel"):
        match_probability(model, ["a"], ["b"])
    # trained with a loss without t and b_rel: nothing is attached
    trainer = train(tiny_model_dir, tmp_path / "weince", WEINCELoss)
    assert carried_match_probability(trainer.model) is None
    with pytest.raises(ValueError, match="carries no trained"):
        st_weince.match_probability(trainer.model, ["a"], ["b"])
    with pytest.raises(ValueError, match="needs a finite t > 0"):
        MatchProbability(t=0.0, b_rel=0.5, b=0.0)


def test_a_model_trained_further_by_another_loss_carries_stale_values_that_match_probability_refuses(
    tiny_model_dir, tmp_path, one_torch_thread
):
    """Issue 44: RB-Sigmoid training gives the model t and b_rel; WEINCE training of that model, saved, must not leave
    them there as if they described it. They stay, marked with what produced them, and match_probability refuses
    them, saying why."""
    rb_sigmoid = train(tiny_model_dir, tmp_path / "rb")
    assert carried_match_probability(rb_sigmoid.model) is not None
    rb_sigmoid.model.save(str(tmp_path / "after-rb"))
    after_rb = SentenceTransformer(str(tmp_path / "after-rb"), device="cpu")
    assert match_probability(after_rb, ["a"], ["b"]).shape == (1, 1)
    weince = train(tmp_path / "after-rb", tmp_path / "weince", WEINCELoss)
    weince.model.save(str(tmp_path / "after-weince"))
    reloaded = SentenceTransformer(str(tmp_path / "after-weince"), device="cpu")
    stored = getattr(reloaded[0].auto_model.config, CONFIG_KEY)
    assert "trained by RBSigmoidLoss at step 5" in stored["stale"] and "WEINCELoss" in stored["stale"]
    with pytest.raises(ValueError, match=r"stale: they were trained by RBSigmoidLoss at step 5.*WEINCELoss"):
        match_probability(reloaded, ["a"], ["b"])
    # training with RB-Sigmoid again gives fresh values
    again = train(tmp_path / "after-weince", tmp_path / "rb-again")
    assert "stale" not in getattr(again.model[0].auto_model.config, CONFIG_KEY)
    assert match_probability(again.model, ["a"], ["b"]).shape == (1, 1)
