"""Issue 53 items 1 and 4, in one process: a process group that the trainer trains NOT_PARALLEL is refused with a
gathering loss (by prepare_trainer and by the loss at its first training step), a launcher that asked for more
processes than train gets a warning from prepare_trainer, SimCSE gathers by default on several processes, and the
loss's own parameters obey max_grad_norm (clipped on their own, their norm logged as loss_grad_norm).

The process group of 2 is stood in for by torch.distributed's answers (for a whole trainer run, by
``process_group_size``, the one place the checks read them); tests/training/test_engines.py runs the same refusal with a
real 2-process group."""

from __future__ import annotations

import math

import pytest
import torch

import st_weince.training.processes as processes
from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss, WEINCELoss
from st_weince.training import clip_loss_gradients, prepare_trainer
from tests.conftest import SHORT_RUN, build_trainer, load_script
from tests.training.test_processes import (
    ACCELERATE_CPU_TWO,
    ACCELERATE_CPU_TWO_ARGV,
    LAUNCHER_VARIABLES,
    TORCHRUN_RANK0,
)


@pytest.fixture
def two_process_group(monkeypatch):
    """A process group of 2 that transformers trains NOT_PARALLEL (torchrun on a CPU without use_cpu=True), as
    torch.distributed reports it; set after the trainer is built."""

    def start() -> None:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)

    return start


@pytest.fixture
def two_process_group_in_training(monkeypatch):
    """The same for a whole trainer run: only the checks' one reader sees the group, not the trainer's collectives."""
    monkeypatch.setattr(processes, "process_group_size", lambda: 2)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("loss_cls", [WEINCELoss, RBSigmoidLoss, CachedRBSigmoidLoss])
def test_prepare_trainer_refuses_a_process_group_trained_not_parallel(
    tiny_model, tmp_path, two_process_group, no_launcher, loss_cls
):
    trainer = build_trainer(tiny_model, loss_cls(tiny_model, gather_across_devices=True), tmp_path, max_steps=1)
    assert trainer.args.world_size == 1  # what transformers makes of it
    two_process_group()
    with pytest.raises(RuntimeError) as error:
        prepare_trainer(trainer)
    message = str(error.value)
    assert "process group of 2 processes, but the trainer trains on 1" in message
    assert "use_cpu=True" in message and "torchrun --nproc_per_node 2" in message


def test_without_gathering_prepare_trainer_accepts_the_group(tiny_model, tmp_path, two_process_group, no_launcher):
    trainer = build_trainer(tiny_model, RBSigmoidLoss(tiny_model), tmp_path, max_steps=1)
    two_process_group()
    prepare_trainer(trainer)  # each process trains alone, on its own data: not the loss's concern


@pytest.mark.parametrize("loss_cls", [WEINCELoss, CachedRBSigmoidLoss])
def test_the_loss_refuses_its_first_step_in_an_unparallel_trainer(
    tiny_model, tmp_path, two_process_group_in_training, no_launcher, loss_cls
):
    """A trainer built without prepare_trainer (WEINCE needs none): the loss's first training step refuses."""
    loss = loss_cls(tiny_model, gather_across_devices=True)
    loss.mark_state_managed("this test")
    settings = {**SHORT_RUN, "max_steps": 1, "per_device_train_batch_size": 4}
    trainer = build_trainer(tiny_model, loss, tmp_path, **settings)
    with pytest.raises(RuntimeError, match=r"use_cpu=True(.|\n)*torchrun --nproc_per_node 2"):
        trainer.train()


def test_a_plain_torch_loop_with_a_group_is_not_refused(tiny_model, monkeypatch):
    """A loop of plain torch (DDP or FSDP by hand) never set accelerate up: nothing to refuse."""
    from accelerate.state import PartialState

    monkeypatch.setattr(processes, "process_group_size", lambda: 2)
    monkeypatch.setattr(PartialState, "_shared_state", {})
    assert not processes.accelerate_trains_unparallel()
    processes.check_process_group(True, "WEINCELoss")


def test_prepare_trainer_warns_when_torchrun_asked_for_more(tiny_model, tmp_path, no_launcher):
    trainer = build_trainer(tiny_model, RBSigmoidLoss(tiny_model), tmp_path, max_steps=1)
    for name, value in TORCHRUN_RANK0.items():
        no_launcher.setenv(name, value)
    with pytest.warns(UserWarning, match="torchrun asked for 2 processes, but this run trains on 1") as record:
        prepare_trainer(trainer)
    message = str(record[0].message)
    assert "use_cpu=True" in message and "\n    torchrun --nproc_per_node 2 " in message


def test_prepare_trainer_warns_for_accelerate_launch_on_a_cpu(tiny_model, tmp_path, no_launcher):
    """accelerate launch --cpu --num_processes 2 my_script.py: one process, quietly, before issue 53."""
    trainer = build_trainer(tiny_model, WEINCELoss(tiny_model), tmp_path, max_steps=1)
    for name, value in ACCELERATE_CPU_TWO.items():
        no_launcher.setenv(name, value)
    script = ["my_script.py", "--epochs", "1"]
    no_launcher.setattr("sys.argv", script)
    no_launcher.setattr(processes, "_parent_command_line", lambda: [*ACCELERATE_CPU_TWO_ARGV[:-3], *script])
    no_launcher.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.warns(UserWarning, match="accelerate launch asked for 2 processes, but this run trains on 1") as record:
        prepare_trainer(trainer)
    assert str(record[0].message).endswith("\n    torchrun --nproc_per_node 2 my_script.py --epochs 1")
    assert "only with --multi_gpu" in str(record[0].message)


def test_simcse_gathers_across_devices_by_default_on_several_processes():
    """The command the warning prints for the recipe (no --gather-across-devices) trains the same loss as 1 process."""
    simcse = load_script("recipes/simcse.py", "simcse_recipe_for_process_checks")
    args = simcse.parse_args(["--preset", "cpu-demo"])
    assert args.gather_across_devices is None  # resolved in train(): world size > 1
    assert simcse.resolve_gather_across_devices(args, world_size=2) is True
    assert simcse.resolve_gather_across_devices(args, world_size=1) is False
    off = simcse.parse_args(["--preset", "cpu-demo", "--no-gather-across-devices"])
    assert simcse.resolve_gather_across_devices(off, world_size=2) is False


# ----- item 4: the loss's own parameters obey max_grad_norm -----


def test_clip_loss_gradients_clips_them_on_their_own():
    loss = RBSigmoidLoss(None)
    loss.log_t.grad = torch.full_like(loss.log_t, 3.0)
    loss.b_rel.grad = torch.full_like(loss.b_rel, -4.0)
    norm = clip_loss_gradients(loss, 0.5)
    assert float(norm) == pytest.approx(5.0, rel=1e-6)  # sqrt(3^2 + 4^2), before clipping
    clipped = math.hypot(float(loss.log_t.grad.sum()), float(loss.b_rel.grad.sum()))
    assert clipped == pytest.approx(0.5, rel=1e-5)
    assert float(loss.log_t.grad.sum()) / float(loss.b_rel.grad.sum()) == pytest.approx(-0.75, rel=1e-6)
    # No clip asked for: the norm only
    assert float(clip_loss_gradients(loss, None)) == pytest.approx(0.5, rel=1e-5)
    assert clip_loss_gradients(RBSigmoidLoss(None, trainable_scale=False, trainable_bias=False), 1.0) is None


@pytest.mark.parametrize("loss_cls", [RBSigmoidLoss, CachedRBSigmoidLoss])
def test_one_trainer_step_moves_the_loss_parameters_at_most_what_the_clip_allows(tiny_model, tmp_path, loss_cls):
    """max_grad_norm 1e-4, plain SGD: before issue 53 one step moved log_t by 1.81 and b_rel by 8.29."""
    max_norm, rate = 1e-4, 3e-2
    loss = loss_cls(tiny_model)
    before = {name: p.detach().clone() for name, p in loss.state_tensors().items()}
    settings = {**SHORT_RUN, "max_steps": 1, "per_device_train_batch_size": 8, "optim": "sgd"}
    trainer = build_trainer(tiny_model, loss, tmp_path, **settings, max_grad_norm=max_norm)
    prepare_trainer(trainer, loss_learning_rate=rate)
    trainer.train()
    after = loss.state_tensors()
    moved = math.sqrt(sum(float((after[name].detach() - value).square().sum()) for name, value in before.items()))
    assert moved > 0, "the loss parameters must train"
    # SGD: the step is rate x the clipped gradient, whose norm is at most max_norm; plus the float32 rounding of
    # each stored value (one unit in the last place of |value|, measured as the difference of two stored values)
    rounding = sum(float(torch.finfo(torch.float32).eps * value.abs().sum()) for value in before.values())
    assert moved <= rate * max_norm + rounding
    logged = [entry for entry in trainer.state.log_history if "loss_grad_norm" in entry]
    assert logged and logged[0]["loss_grad_norm"] > max_norm  # the norm before clipping, beside grad_norm
    assert "grad_norm" in logged[0]
