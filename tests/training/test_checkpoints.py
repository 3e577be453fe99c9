"""The loss state survives any kill: worker processes (forked by tests/forked.py) SIGKILLed at chosen moments of a
checkpoint save (and at a random moment), then resumed here with
``resume_from_checkpoint=last_complete_checkpoint(output_dir)``, end exactly like an uninterrupted run (the loss
state: RB-Sigmoid's t and b_rel, the WEINCE composite's batch tail index; every per-step loss). Also: refused
checkpoints, corrupt loss state, non-finite loss parameters."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from st_weince.functional import TopM
from st_weince.losses import RBSigmoidLoss
from st_weince.training import (
    LOSS_STATE_FILE,
    LOSS_STATE_RECORD,
    check_resumable,
    last_complete_checkpoint,
    load_loss_state,
    prepare_trainer,
    read_checkpoint_loss_state,
    save_loss_state,
)
from st_weince.training.loss_tensors import loss_state_dict
from tests.checkpoint_worker import MAX_STEPS, build_trainer
from tests.conftest import stop_at

pytestmark = pytest.mark.slow


def outcome(trainer) -> dict:
    losses = {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}
    return {"state": {name: value.item() for name, value in loss_state_dict(trainer.loss).items()}, "losses": losses}


def uninterrupted_run(model_dir, output_dir: Path, loss: str) -> dict:
    torch.set_num_threads(1)
    trainer = prepare_trainer(build_trainer(model_dir, output_dir, loss=loss))
    trainer.train()
    result = outcome(trainer)
    assert sorted(result["losses"]) == list(range(1, MAX_STEPS + 1))
    return result


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> dict:
    return uninterrupted_run(tiny_model_dir, tmp_path_factory.mktemp("full"), "rb-sigmoid")


@pytest.fixture(scope="module")
def uninterrupted_composite(tiny_model_dir, tmp_path_factory) -> dict:
    result = uninterrupted_run(tiny_model_dir, tmp_path_factory.mktemp("full-composite"), "weince-composite")
    assert set(result["state"]) == {"batch_beta_ema"}
    return result


def readable_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def run_and_kill(
    server,
    model_dir,
    output_dir: Path,
    block: str = "none",
    step: int = -1,
    delay: float | None = None,
    loss: str = "rb-sigmoid",
):
    """Start the worker (a process forked from the fork server, tests/forked.py); SIGKILL it when it signals that it
    blocks inside the save (or ``delay`` seconds after its first checkpoint is complete). Returns True if it was
    killed (False: it finished first)."""
    ready = output_dir.parent / f"{output_dir.name}.ready"
    argv = [model_dir, output_dir, "--loss", loss, "--block", block, "--block-step", step, "--ready", ready]
    log = output_dir.parent / f"{output_dir.name}.log"
    process = server.start(log, module="tests.checkpoint_worker", argv=argv, env={"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 240
    trigger = ready if delay is None else output_dir / "checkpoint-2" / "trainer_state.json"
    while not (trigger.exists() and (delay is None or readable_json(trigger))):
        if process.poll() is not None:
            if delay is not None:
                return False
            raise AssertionError(f"the worker ended before blocking: {process.output()[-3000:]}")
        assert time.monotonic() < deadline, "the worker did not reach the save in time"
        time.sleep(0.05)
    if delay is not None:
        time.sleep(delay)
    killed = process.poll() is None
    process.kill()
    assert process.wait() in (0, -signal.SIGKILL)
    return killed


def resume(model_dir, output_dir: Path, loss: str = "rb-sigmoid") -> dict:
    names_before = sorted(p.name for p in output_dir.iterdir())
    trainer = prepare_trainer(build_trainer(model_dir, output_dir, loss=loss))
    assert sorted(p.name for p in output_dir.iterdir()) == names_before  # prepare_trainer renames nothing
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(output_dir))
    return outcome(trainer)


def assert_same_run(got: dict, expected: dict, loss_rel: float = 1e-4) -> None:
    assert set(got["state"]) == set(expected["state"])
    for name, value in expected["state"].items():
        assert got["state"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert sorted(got["losses"]) == sorted(expected["losses"])
    for step, loss in expected["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, rel=loss_rel, abs=1e-4), f"loss at step {step}"


@pytest.mark.parametrize(
    ("block", "resumed_from"),
    [
        ("model", 2),  # checkpoint-4 holds the model only: resume from checkpoint-2
        ("state", 2),  # model, optimizer, RNG, no trainer_state.json yet: not complete either
        ("on_save", 4),  # complete: the moment at which a crash could leave the loss state missing
    ],
)
def test_killed_inside_a_save_resumes_like_an_uninterrupted_run(
    block, resumed_from, fork_server, tiny_model_dir, tmp_path, uninterrupted, one_torch_thread
):
    output = tmp_path / "run"
    assert run_and_kill(fork_server, tiny_model_dir, output, block=block, step=4)
    assert (output / "checkpoint-4").is_dir()
    assert last_complete_checkpoint(output) == str(output / f"checkpoint-{resumed_from}")
    if resumed_from == 2:  # transformers' own choice, the highest-numbered folder, refuses the incomplete one
        with pytest.raises(FileNotFoundError, match=r"checkpoint-4.trainer_state\.json"):
            prepare_trainer(build_trainer(tiny_model_dir, output)).train(resume_from_checkpoint=True)
    got = resume(tiny_model_dir, output)
    assert read_checkpoint_loss_state(output / "checkpoint-2")["log_t"].item() != pytest.approx(10.0)
    assert_same_run(got, uninterrupted)
    first_resumed = json.loads((output / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    assert any(r.get("step") == resumed_from + 1 for r in first_resumed)


@pytest.mark.parametrize(("block", "resumed_from"), [("model", 2), ("state", 2), ("on_save", 4)])
def test_composite_tail_index_killed_inside_a_save_resumes_like_an_uninterrupted_run(
    block, resumed_from, fork_server, tiny_model_dir, tmp_path, uninterrupted_composite, one_torch_thread
):
    """The WEINCE composite's batch tail index (a buffer, no parameter) has RB-Sigmoid's guarantees."""
    output = tmp_path / "run"
    assert run_and_kill(fork_server, tiny_model_dir, output, block=block, step=4, loss="weince-composite")
    assert last_complete_checkpoint(output) == str(output / f"checkpoint-{resumed_from}")
    got = resume(tiny_model_dir, output, loss="weince-composite")
    saved = read_checkpoint_loss_state(output / "checkpoint-2")["batch_beta_ema"].item()
    assert saved != pytest.approx(TopM.beta_ema_start), "the tail index must have moved by step 2"
    assert_same_run(got, uninterrupted_composite)


def test_killed_at_a_random_moment_resumes_like_an_uninterrupted_run(
    fork_server, tiny_model_dir, tmp_path, uninterrupted, one_torch_thread
):
    output = tmp_path / "run"
    # Steps 3-6 and the saves of checkpoint-4 and -6 take about 0.5 s here; the kill lands anywhere in them.
    delay = random.Random().uniform(0.0, 0.6)
    killed = run_and_kill(fork_server, tiny_model_dir, output, delay=delay)
    print(f"killed={killed} after {delay:.3f} s; left: {sorted(p.name for p in output.iterdir())}")
    assert_same_run(resume(tiny_model_dir, output), uninterrupted)


def test_checkpoint_without_loss_state_is_refused_and_corrupt_state_named(tiny_model_dir, tmp_path, one_torch_thread):
    output = tmp_path / "run"
    prepare_trainer(build_trainer(tiny_model_dir, output, callbacks=[stop_at(2)])).train()
    trainer_state_file = output / "checkpoint-2" / "trainer_state.json"
    content = json.loads(trainer_state_file.read_text())

    # A corrupt loss-state entry: the error names trainer_state.json and never suggests weights_only=False.
    content["stateful_callbacks"][LOSS_STATE_RECORD]["attributes"]["entries"]["log_t"]["values"] = "garbage"
    trainer_state_file.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"trainer_state\.json.*'log_t' is corrupt") as error:
        prepare_trainer(build_trainer(tiny_model_dir, output)).train(resume_from_checkpoint=True)
    assert "weights_only" not in str(error.value)

    # No loss state at all (written without prepare_trainer): refused, naming the file and the opt-in.
    del content["stateful_callbacks"][LOSS_STATE_RECORD]
    trainer_state_file.write_text(json.dumps(content))
    with pytest.raises(FileNotFoundError, match=r"trainer_state\.json.*allow_missing_loss_state=True"):
        prepare_trainer(build_trainer(tiny_model_dir, output)).train(resume_from_checkpoint=True)

    # An empty trainer_state.json (a kill while the trainer wrote it): not complete, and nothing is renamed.
    trainer_state_file.write_text("")
    prepare_trainer(build_trainer(tiny_model_dir, output))
    assert last_complete_checkpoint(output) is None and trainer_state_file.is_file()
    with pytest.raises(ValueError, match=r"trainer_state\.json is empty: this checkpoint is incomplete"):
        check_resumable(RBSigmoidLoss(None), output / "checkpoint-2")


def test_non_finite_loss_parameters_stop_training_before_the_checkpoint(tiny_model_dir, tmp_path, one_torch_thread):
    class Diverge(TrainerCallback):
        def __init__(self, loss):
            self.loss = loss

        def on_step_end(self, args, state, control, **kwargs):  # runs before prepare_trainer's callbacks
            if state.global_step == 4:
                with torch.no_grad():
                    self.loss.b_rel.fill_(float("nan"))

    output = tmp_path / "run"
    trainer = build_trainer(tiny_model_dir, output)
    trainer.add_callback(Diverge(trainer.loss))
    prepare_trainer(trainer)
    with pytest.raises(FloatingPointError, match=r"checkpoint at step 4.*b_rel.*not finite"):
        trainer.train()
    assert sorted(p.name for p in output.iterdir() if p.name.startswith(("checkpoint", "incomplete"))) == [
        "checkpoint-2"
    ]


def test_loss_state_file_helpers(tiny_model, tmp_path):
    loss = RBSigmoidLoss(tiny_model, scale=3.0)
    with pytest.raises(FileNotFoundError, match=LOSS_STATE_FILE):
        load_loss_state(loss, tmp_path)
    path = Path(save_loss_state(loss, tmp_path))
    assert sorted(json.loads(path.read_text())["entries"]) == ["b_rel", "log_t"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    fresh = RBSigmoidLoss(tiny_model)
    load_loss_state(fresh, tmp_path)
    assert fresh.scale.item() == pytest.approx(3.0)
    corrupt = [(b"", "is empty"), (b"\x80\x02not JSON", "is corrupt"), (b"{}", "corrupt or of an unknown")]
    for content, message in corrupt:
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message) as error:
            load_loss_state(fresh, tmp_path)
        assert str(path) in str(error.value) and "weights_only" not in str(error.value)
    with torch.no_grad():
        loss.log_t.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match="log_t"):
        save_loss_state(loss, tmp_path / "inf")
    assert not (tmp_path / "inf" / LOSS_STATE_FILE).exists()


def test_resume_with_restore_callback_states_from_checkpoint(tiny_model_dir, tmp_path, uninterrupted, one_torch_thread):
    """With the trainer's own callback-state restore switched on, it re-creates LossStateRecord from the checkpoint;
    the re-created record is linked to the loss again and the run still ends like the uninterrupted one."""

    output = tmp_path / "run"
    prepare_trainer(build_trainer(tiny_model_dir, output, callbacks=[stop_at(2)])).train()
    trainer = prepare_trainer(build_trainer(tiny_model_dir, output, restore_callback_states_from_checkpoint=True))
    trainer.train(resume_from_checkpoint=True)
    assert_same_run(outcome(trainer), uninterrupted)
    assert read_checkpoint_loss_state(output / "checkpoint-6")["log_t"].item() == trainer.loss.log_t.item()


def test_last_complete_checkpoint_reads_only_checkpoint_folders_by_their_step(tmp_path):
    """The trainer resumes from folders named exactly ``checkpoint-N``, the highest step first (10 after 9, not by
    text); a copy such as ``checkpoint-5-old``, a file, or a folder without a readable trainer_state.json is passed
    over."""
    for name, state in [
        ("checkpoint-9", '{"global_step": 1}'),
        ("checkpoint-10", '{"global_step": 1}'),
        ("checkpoint-12", None),
        ("checkpoint-50-old", '{"global_step": 1}'),
    ]:
        (tmp_path / name).mkdir()
        if state is not None:
            (tmp_path / name / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-60").write_text("a file, not a folder")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    assert last_complete_checkpoint(tmp_path / "missing") is None
