"""Upgrades keep runs: a checkpoint written before an option existed (its record lacks the option) resumes under the
option's default, which keeps the old behaviour, and is refused at any other value, naming the option. Which options
may differ at resume (they change only how the loss is computed) is declared in the options dataclasses; training/
keeps no list of option names."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from transformers import TrainerCallback

import st_weince
from st_weince.functional import Gate, RBSigmoidOptions, TopM, WEINCEOptions
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.losses._gradcache import GradCacheOptions
from st_weince.training import LOSS_STATE_RECORD, check_resumable, read_checkpoint_loss_state
from st_weince.training.checkpoints import check_record_resumable, loss_state_record
from tests.conftest import stop_at
from tests.training.test_rb_sigmoid_trainer import make_trainer

OPTIONS_CLASSES = (WEINCEOptions, Gate, TopM, RBSigmoidOptions, GradCacheOptions)


def _record_without(loss, *path: str) -> dict:
    """The loss's checkpoint record with the option at ``path`` (in the top loss's configuration) removed, as an
    older version that did not have it would have written it."""
    record = json.loads(json.dumps(loss_state_record(loss)))
    config = record["loss"]["loss"]["config"]
    for key in path[:-1]:
        config = config[key]
    del config[path[-1]]
    return record


@pytest.mark.parametrize(
    ("loss_class", "path", "other_value"),
    [
        (RBSigmoidLoss, ("symmetric",), {"symmetric": True}),
        (RBSigmoidLoss, ("exchange",), {"gather_across_devices": True, "exchange": "neighbour"}),
        (CachedRBSigmoidLoss, ("locked_adapter",), {"locked_adapter": True}),
        (WEINCELoss, ("false_negative_filter",), {"false_negative_filter": ("absolute", 0.1)}),
        (WEINCELoss, ("top_m",), {"top_m": TopM(shortfall_weight=0.5)}),
        (CachedWEINCELoss, ("gate", "aic_margin"), {"gate": Gate(aic_margin=3.0)}),
    ],
)
def test_a_record_without_a_later_option_resumes_at_its_default(loss_class, path, other_value):
    loss = loss_class(None)
    record = _record_without(loss, *path)
    check_record_resumable(loss_class(None), record, "the old checkpoint")  # the default: the old behaviour
    with pytest.raises(ValueError, match=rf"{path[0]}=.* in the checkpoint, .* now"):
        check_record_resumable(loss_class(None, **other_value), record, "the old checkpoint")


def test_an_option_this_version_no_longer_has_is_named():
    record = json.loads(json.dumps(loss_state_record(RBSigmoidLoss(None))))
    record["loss"]["loss"]["config"]["retired_flag"] = True
    with pytest.raises(ValueError, match=r"retired_flag=True in the checkpoint, None now"):
        check_record_resumable(RBSigmoidLoss(None), record, "the old checkpoint")


def test_operational_options_are_declared_in_the_dataclasses_and_may_differ():
    """Each option says in its dataclass field whether it changes only how the loss is computed; those may differ at
    resume, every other one is compared."""
    operational = {cls.__name__: cls.operational_fields() for cls in OPTIONS_CLASSES}
    assert operational["WEINCEOptions"] == {"check_inputs"}
    assert operational["RBSigmoidOptions"] == {"check_inputs", "chunk_size"}
    assert operational["GradCacheOptions"] == {"mini_batch_size", "mini_batch_num_tokens", "show_progress_bar"}
    record = loss_state_record(CachedRBSigmoidLoss(None))
    changed = CachedRBSigmoidLoss(None, check_inputs=False, chunk_size=7, mini_batch_size=3, show_progress_bar=True)
    check_record_resumable(changed, record, "the checkpoint")
    with pytest.raises(ValueError, match="max_scale=100.0 in the checkpoint, 50.0 now"):
        check_record_resumable(CachedRBSigmoidLoss(None, max_scale=50.0), record, "the checkpoint")


def test_training_keeps_no_list_of_option_names():
    """training/ reads what it compares from the losses (``resume_config``): no option name is written there, so an
    option added to a dataclass needs no change in training/. The attributes every sentence-transformers loss of
    MNRL's kind has (``gather_across_devices``, ...) are the host's names, which training/ may read on any loss."""
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    hosts = set(inspect.signature(MultipleNegativesRankingLoss).parameters)
    names = {field.name for cls in OPTIONS_CLASSES for field in dataclasses.fields(cls)} - hosts
    training = Path(st_weince.__file__).parent / "training"
    for path in sorted(training.glob("*.py")):
        text = path.read_text()
        quoted = sorted(name for name in names if f'"{name}"' in text or f"'{name}'" in text)
        assert not quoted, f"{path.name} names the options {quoted}"


@pytest.mark.slow
def test_a_checkpoint_without_a_later_option_resumes_through_the_trainer(tiny_model_dir, tmp_path, one_torch_thread):
    """A real run's checkpoint, its record edited as a version without the ``exchange`` option would have written
    it, resumes through the trainer with the loss state restored; the same checkpoint with a non-default value is
    refused before anything is loaded."""
    output = tmp_path / "run"
    make_trainer(tiny_model_dir, output, callbacks=[stop_at(3)]).train()
    checkpoint = output / "checkpoint-3"
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    entry = state["stateful_callbacks"][LOSS_STATE_RECORD]
    record = entry["attributes"] if isinstance(entry, dict) else entry[0]["attributes"]
    del record["loss"]["loss"]["config"]["exchange"]
    state_file.write_text(json.dumps(state))
    saved = read_checkpoint_loss_state(checkpoint)

    check_resumable(RBSigmoidLoss(None), checkpoint)
    restored: dict[str, float] = {}

    class KeepRestoredState(TrainerCallback):  # runs after prepare_trainer's callback has restored the loss state
        def on_train_begin(self, args, state, control, **kwargs):
            restored["log_t"] = resumed.loss.log_t.item()

    resumed = make_trainer(tiny_model_dir, output, callbacks=[])
    resumed.add_callback(KeepRestoredState())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert restored["log_t"] == saved["log_t"].item()
    assert resumed.state.global_step == 6
    assert read_checkpoint_loss_state(output / "checkpoint-6").keys() == saved.keys()
    with pytest.raises(ValueError, match="exchange='all_gather' in the checkpoint, 'neighbour' now"):
        check_resumable(RBSigmoidLoss(None, gather_across_devices=True, exchange="neighbour"), checkpoint)
