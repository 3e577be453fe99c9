"""Trainer integration for losses WITH parameters (RB-Sigmoid's ``log_t``, ``b_rel`` ...), in one call.

The sentence-transformers trainer puts a loss's parameters into its optimizer, but (ECOSYSTEM-NOTES.md):

1. under DDP only the model is wrapped, so the loss parameters' gradients are not averaged across processes;
2. checkpoints hold only the model, so a resumed run restarts the loss parameters from their initial values;
3. weight decay reaches every parameter whose name does not look like a bias or a norm (``log_t``, ``b_rel``);
4. (cached losses only) gradients computed inside ``forward`` miss the outer scaling.

:func:`prepare_trainer` fixes 1-3 and attaches the statistics logging of :mod:`st_weince.training.statistics`:

- gradients of the loss's own parameters are all-reduced (averaged) in ``on_pre_optimizer_step``, after the model's
  DDP all-reduce and before the optimizer step, once per optimizer step;
- every checkpoint gets ``st_weince_loss_state.pt`` (the loss's own parameters and buffers, not the model's), and
  ``trainer.train(resume_from_checkpoint=...)`` (a path or True) restores it before training resumes; the optimizer
  state of those parameters is restored by the trainer itself, since they are in its optimizer;
- the trainer's ``get_decay_parameter_names`` leaves out the names a loss reports through
  ``no_weight_decay_parameter_names()`` (if the optimizer already exists, those parameters are moved to a group
  without weight decay);
- with ``load_best_model_at_end`` the loss state of the best checkpoint is loaded with the best model.

It is harmless for losses without parameters (WEINCELoss): nothing is saved, averaged or regrouped.

Trap 4 is not handled: RB-Sigmoid has no cached (GradCache) variant.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from st_weince.training.statistics import LossStatisticsCallback, log_loss_statistics

logger = logging.getLogger(__name__)

LOSS_STATE_FILE = "st_weince_loss_state.pt"


def _losses(loss: nn.Module | dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``{prefix: loss}``: one entry with prefix "" for a single loss, one per dataset name for a dict of losses."""
    if isinstance(loss, dict):
        return {f"{name}.": module for name, module in loss.items()}
    return {"": loss}


def _own_entries(loss: nn.Module) -> dict[str, Tensor]:
    """The loss's state entries outside its ``model`` child (which the trainer checkpoints itself)."""
    return {name: value for name, value in loss.state_dict().items() if not name.startswith("model.")}


def _own_parameters(loss: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in loss.named_parameters() if not name.startswith("model.") and p.requires_grad]


def loss_state_dict(loss: nn.Module | dict[str, nn.Module]) -> dict[str, Tensor]:
    """Parameters and buffers of the loss(es) that are not part of the model, detached and on the CPU."""
    state: dict[str, Tensor] = {}
    for prefix, module in _losses(loss).items():
        state.update({prefix + name: value.detach().cpu().clone() for name, value in _own_entries(module).items()})
    return state


@torch.no_grad()
def load_loss_state_dict(loss: nn.Module | dict[str, nn.Module], state: dict[str, Tensor]) -> None:
    """Copy ``state`` (from :func:`loss_state_dict`) into the loss(es) in place; keys must match exactly."""
    targets: dict[str, Tensor] = {}
    for prefix, module in _losses(loss).items():
        targets.update({prefix + name: value for name, value in _own_entries(module).items()})
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"the saved loss state does not fit this loss: missing {missing}, unexpected {unexpected}. "
            "Was the checkpoint written with another loss configuration?"
        )
    for name, target in targets.items():
        if target.shape != state[name].shape:
            raise ValueError(
                f"loss state entry {name!r} has shape {tuple(state[name].shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(state[name].to(device=target.device, dtype=target.dtype))


def save_loss_state(loss: nn.Module | dict[str, nn.Module], directory: str | os.PathLike) -> str | None:
    """Write :func:`loss_state_dict` to ``directory/st_weince_loss_state.pt``; returns the path, or None when the
    loss has no state of its own (nothing is written)."""
    state = loss_state_dict(loss)
    if not state:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOSS_STATE_FILE)
    torch.save(state, path)
    return path


def load_loss_state(loss: nn.Module | dict[str, nn.Module], directory: str | os.PathLike) -> bool:
    """Restore the loss state saved in ``directory``. Returns False (and warns if the loss has state of its own)
    when the checkpoint holds no loss state."""
    path = os.path.join(directory, LOSS_STATE_FILE)
    if not os.path.isfile(path):
        if loss_state_dict(loss):
            logger.warning(
                "checkpoint %s holds no %s: the loss parameters start from their initial values",
                directory,
                LOSS_STATE_FILE,
            )
        return False
    load_loss_state_dict(loss, torch.load(path, map_location="cpu", weights_only=True))
    return True


def average_loss_gradients(loss: nn.Module | dict[str, nn.Module]) -> None:
    """Average the gradients of the loss's own trainable parameters over all processes (one all-reduce).

    Call it on every rank after backward and before the optimizer step (``prepare_trainer`` does it for the
    trainer; custom training loops call it themselves). A parameter without gradient on a rank counts as zero, so
    the collective is the same on every rank. No-op without an initialised process group or with one process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = [p for module in _losses(loss).values() for _, p in _own_parameters(module)]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for p in params:
        count = p.numel()
        p.grad = flat[offset : offset + count].view_as(p).to(p.dtype)
        offset += count


def no_weight_decay_names(loss: nn.Module | dict[str, nn.Module]) -> set[str]:
    """Names (as the trainer sees them: prefixed by the dataset name for a dict of losses) of loss parameters that
    must not get weight decay, as reported by each loss's ``no_weight_decay_parameter_names()``."""
    names: set[str] = set()
    for prefix, module in _losses(loss).items():
        if hasattr(module, "no_weight_decay_parameter_names"):
            names.update(prefix + name for name in module.no_weight_decay_parameter_names())
    return names


class LossStateCallback(TrainerCallback):
    """Averages loss-parameter gradients across processes, saves the loss state into every checkpoint and loads the
    best checkpoint's loss state with the best model. Added by :func:`prepare_trainer`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        average_loss_gradients(self.trainer.loss)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        run_dir = self.trainer._get_output_dir(trial=None)
        save_loss_state(self.trainer.loss, os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_train_end(self, args, state, control, **kwargs):
        if args.load_best_model_at_end and state.best_model_checkpoint and os.path.isdir(state.best_model_checkpoint):
            load_loss_state(self.trainer.loss, state.best_model_checkpoint)


def prepare_trainer(trainer: Any) -> Any:
    """One call after building a SentenceTransformerTrainer (or any transformers Trainer with a ``loss``) and before
    ``trainer.train()``: logging of the loss statistics, loss-state checkpointing and resume, no weight decay on
    loss parameters, gradient averaging of loss parameters across processes. Idempotent; returns the trainer.
    """
    if getattr(trainer, "_st_weince_prepared", False):
        return trainer
    if not any(isinstance(cb, LossStatisticsCallback) for cb in trainer.callback_handler.callbacks):
        log_loss_statistics(trainer)
    trainer.add_callback(LossStateCallback(trainer))

    excluded = no_weight_decay_names(trainer.loss)
    original_decay_names = trainer.get_decay_parameter_names

    @functools.wraps(original_decay_names)
    def get_decay_parameter_names(model: nn.Module) -> list[str]:
        return [name for name in original_decay_names(model) if name not in excluded]

    trainer.get_decay_parameter_names = get_decay_parameter_names
    if trainer.optimizer is not None:
        _move_to_no_decay_group(trainer)

    original_train = trainer.train

    @functools.wraps(original_train)
    def train(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        checkpoint = resume_from_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = get_last_checkpoint(trainer.args.output_dir) if checkpoint else None
        if checkpoint is not None:
            load_loss_state(trainer.loss, checkpoint)
        return original_train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train
    trainer._st_weince_prepared = True
    return trainer


def _move_to_no_decay_group(trainer: Any) -> None:
    """For an optimizer built before prepare_trainer: move the loss parameters into a group without weight decay."""
    params = {
        id(p)
        for module in _losses(trainer.loss).values()
        if hasattr(module, "no_weight_decay_parameter_names")
        for name, p in module.named_parameters()
        if name in set(module.no_weight_decay_parameter_names())
    }
    if not params:
        return
    optimizer = trainer.optimizer
    moved = []
    for group in optimizer.param_groups:
        if group.get("weight_decay", 0.0) != 0.0:
            moved += [p for p in group["params"] if id(p) in params]
            group["params"] = [p for p in group["params"] if id(p) not in params]
    if moved:
        template = {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}
        optimizer.add_param_group({**template, "params": moved, "weight_decay": 0.0})
