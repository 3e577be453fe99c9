"""prepare_trainer where practitioners go next (issue 54, items 3-5): a second call with other arguments, two RB-Sigmoid
losses in one dict (which values the model carries, and match_probability's error), and checkpoints whose loss-state
entry is corrupt or that were copied to another output_dir."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from datasets import DatasetDict
from sentence_transformers import SentenceTransformer

from st_weince import match_probability
from st_weince.calibration import carried_match_probability
from st_weince.losses import RBSigmoidLoss, WEINCELoss
from st_weince.training import (
    LOSS_STATE_FILE,
    LOSS_STATE_RECORD,
    check_resumable,
    load_loss_state,
    prepare_trainer,
    read_checkpoint_loss_state,
    save_loss_state,
)
from tests.conftest import build_trainer, pairs_dataset, stop_at
from tests.training.test_rb_sigmoid_trainer import make_trainer


# ----- item 3: a second call -----
def test_a_second_call_with_other_arguments_is_refused_naming_the_first(tiny_model, tmp_path):
    trainer = build_trainer(tiny_model, RBSigmoidLoss(tiny_model), tmp_path, max_steps=1)
    prepare_trainer(trainer)
    callbacks = list(trainer.callback_handler.callbacks)
    assert prepare_trainer(trainer) is trainer  # the same arguments: nothing happens
    assert trainer.callback_handler.callbacks == callbacks
    with pytest.raises(ValueError, match=r"called on this trainer already, with other arguments "
                       r"\(loss_learning_rate=0\.001 now, 0\.03 in the first call\)"):  # fmt: skip
        prepare_trainer(trainer, loss_learning_rate=1e-3)
    with pytest.raises(ValueError, match=r"allow_missing_loss_state=True now, False in the first call"):
        prepare_trainer(trainer, allow_missing_loss_state=True)
    assert trainer.args.learning_rate_mapping[r"^(?:b_rel|log_t)$"] == pytest.approx(3e-2)  # the first call's


# ----- item 4: two RB-Sigmoid losses in one dict -----
def two_sigmoid_losses(model_dir, output_dir, **prepare_arguments):
    model = SentenceTransformer(str(model_dir), device="cpu")
    losses = {"sts": RBSigmoidLoss(model), "pairs": RBSigmoidLoss(model, relative_bias=0.3)}
    datasets = DatasetDict({"sts": pairs_dataset(), "pairs": pairs_dataset(shift=2)})
    trainer = build_trainer(model, losses, output_dir, dataset=datasets, max_steps=1)
    return prepare_trainer(trainer, **prepare_arguments)


def test_two_sigmoid_losses_name_the_cause_and_the_choice(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="st_weince.training.callbacks"):
        trainer = two_sigmoid_losses(tiny_model_dir, tmp_path / "none")
    cause = r"2 losses train their own t and b_rel \(those of sts, pairs\)"
    choice = r"prepare_trainer\(trainer, carried_values_from='sts'\)"
    assert len([r for r in caplog.records if "2 losses train their own t and b_rel" in r.getMessage()]) == 1
    with pytest.raises(ValueError, match=f"{cause}.*the model carries none of them: choose.*{choice}"):
        match_probability(trainer.model, ["the cat sat"], ["a dog runs"])
    # saved and loaded without the package's help, the model still names the cause
    trainer.model.save(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=cause):
        match_probability(SentenceTransformer(str(tmp_path / "saved"), device="cpu"), ["a"], ["b"])

    chosen = two_sigmoid_losses(tiny_model_dir, tmp_path / "chosen", carried_values_from="pairs")
    carried = carried_match_probability(chosen.model)
    assert carried.b_rel == pytest.approx(0.3) and carried.b_rel == chosen.loss["pairs"].trained_values()["b_rel"]
    assert match_probability(chosen.model, ["the cat sat"], ["a dog runs"]).shape == (1, 1)


def test_carried_values_from_must_name_a_sigmoid_loss_of_the_dict(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"carried_values_from='nli' is none of the trainer's datasets"):
        two_sigmoid_losses_of(tiny_model, tmp_path, carried_values_from="nli")
    with pytest.raises(ValueError, match=r"carried_values_from='wiki': its loss \(WEINCELoss\) trains no values"):
        two_sigmoid_losses_of(tiny_model, tmp_path, carried_values_from="wiki")
    with pytest.raises(ValueError, match=r"names a dataset of a dict of losses, and this trainer has one loss"):
        prepare_trainer(build_trainer(tiny_model, RBSigmoidLoss(tiny_model), tmp_path), carried_values_from="sts")


def two_sigmoid_losses_of(model, output_dir, **prepare_arguments):
    losses = {"sts": RBSigmoidLoss(model), "wiki": WEINCELoss(model)}
    datasets = DatasetDict({"sts": pairs_dataset(), "wiki": pairs_dataset(shift=2)})
    return prepare_trainer(build_trainer(model, losses, output_dir, dataset=datasets), **prepare_arguments)


# ----- item 5: checkpoints -----
@pytest.fixture(scope="module")
def rb_checkpoint(tiny_model_dir, tmp_path_factory):
    """An RB-Sigmoid run stopped after step 3: its checkpoint-3 (kept read-only by the tests: they copy it)."""
    output = tmp_path_factory.mktemp("rb-run")
    make_trainer(tiny_model_dir, output, callbacks=[stop_at(3)]).train()
    return output / "checkpoint-3"


def corrupted_copy(checkpoint, target, entry):
    shutil.copytree(checkpoint, target)
    path = target / "trainer_state.json"
    content = json.loads(path.read_text())
    content["stateful_callbacks"][LOSS_STATE_RECORD] = entry
    path.write_text(json.dumps(content))
    return target


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["garbage", [1, 2], {"args": "x", "attributes": {}}])
def test_a_corrupt_loss_state_entry_names_the_file_and_the_entry(tiny_model_dir, rb_checkpoint, tmp_path, entry):
    checkpoint = corrupted_copy(rb_checkpoint, tmp_path / "run" / "checkpoint-3", entry)
    entry_named = r"its loss-state entry stateful_callbacks\['LossStateRecord'\] is corrupt"
    named = r"trainer_state\.json.*" + entry_named
    resumed_from = r"trainer_state\.json of the checkpoint resumed from \(step 3\): "
    with pytest.raises(ValueError, match=resumed_from + entry_named):
        make_trainer(tiny_model_dir, tmp_path / "run").train(resume_from_checkpoint=str(checkpoint))
    with pytest.raises(ValueError, match=str(checkpoint / "trainer_state.json").replace(".", r"\.") + ".*is corrupt"):
        check_resumable(RBSigmoidLoss(None), checkpoint)
    with pytest.raises(ValueError, match=named):
        read_checkpoint_loss_state(checkpoint)


@pytest.mark.slow
def test_a_string_global_step_names_the_file_and_the_field(tiny_model_dir, rb_checkpoint, tmp_path):
    loss = RBSigmoidLoss(None)
    save_loss_state(loss, tmp_path, global_step=3)
    path = tmp_path / LOSS_STATE_FILE
    record = json.loads(path.read_text())
    record["global_step"] = "three"
    path.write_text(json.dumps(record))
    field = r"its field 'global_step' must be an integer \(the training step it was written at\), got str 'three'"
    with pytest.raises(ValueError, match=f"{LOSS_STATE_FILE}: the loss-state record is corrupt: {field}"):
        load_loss_state(loss, tmp_path)
    # in a checkpoint's trainer_state.json, named at the resume
    checkpoint = tmp_path / "run" / "checkpoint-3"
    state = json.loads((rb_checkpoint / "trainer_state.json").read_text())["stateful_callbacks"][LOSS_STATE_RECORD]
    state["attributes"]["global_step"] = "3"
    corrupted_copy(rb_checkpoint, checkpoint, state)
    with pytest.raises(ValueError, match=r"trainer_state\.json of the checkpoint resumed from \(step 3\): the "
                       r"loss-state record is corrupt: its field 'global_step' must be an integer"):  # fmt: skip
        make_trainer(tiny_model_dir, tmp_path / "run").train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:WEINCELoss at a batch of 4")
def test_a_checkpoint_copied_to_another_output_dir_gets_the_named_refusal(tiny_model_dir, rb_checkpoint, tmp_path):
    """docs/training.md: a checkpoint of another loss is refused naming the change before the optimizer is loaded,
    wherever it lies; before issue 54 one copied from another output_dir reached torch's "loaded state dict has a
    different number of parameter groups"."""
    copied = tmp_path / "copied" / "checkpoint-3"
    shutil.copytree(rb_checkpoint, copied)
    with pytest.raises(ValueError, match="RBSigmoidLoss in the checkpoint, WEINCELoss now"):
        make_trainer(tiny_model_dir, tmp_path / "new", loss_cls=WEINCELoss).train(resume_from_checkpoint=str(copied))
    # the same loss resumes from the copy
    resumed = make_trainer(tiny_model_dir, tmp_path / "new")
    resumed.train(resume_from_checkpoint=str(copied))
    assert resumed.state.global_step == 6
