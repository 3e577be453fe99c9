"""The loss state of a loss tree (:class:`~st_weince.training.protocol.LossState` modules, inside wrappers such as
``MatryoshkaLoss`` too, or a dict of losses), by the names the trainer gives its parameters: the tensors, which take
no weight decay, the step after each optimizer step, and the gradients averaged across processes and clipped."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from st_weince.training.protocol import LossState

LossTree = nn.Module | dict[str, nn.Module]


def state_modules(loss: LossTree) -> dict[str, LossState]:
    """``{prefix: module}`` of every :class:`LossState` module of the loss tree, each once, with the prefix the
    trainer puts before its parameters' names: ``""`` for the loss itself, ``"loss."`` inside ``MatryoshkaLoss``,
    ``"{dataset}."`` (and so on) for a dict of losses."""
    roots = {f"{name}.": module for name, module in loss.items()} if isinstance(loss, dict) else {"": loss}
    found: dict[str, LossState] = {}
    seen: set[int] = set()
    for root_prefix, root in roots.items():
        for name, module in root.named_modules():
            if isinstance(module, LossState) and id(module) not in seen:
                seen.add(id(module))
                found[root_prefix + (f"{name}." if name else "")] = module
    return found


def state_tensors(loss: LossTree) -> dict[str, Tensor]:
    """The tensors of every loss module's :meth:`~LossState.state_tensors`, by the trainer's names (``log_t``;
    ``loss.log_t`` under ``MatryoshkaLoss``; ``{dataset}.log_t`` for a dict of losses). The tensors themselves."""
    modules = state_modules(loss).items()
    return {prefix + name: t for prefix, module in modules for name, t in module.state_tensors().items()}


def state_parameters(loss: LossTree) -> dict[str, nn.Parameter]:
    """The trainable parameters among :func:`state_tensors`."""
    return {name: t for name, t in state_tensors(loss).items() if isinstance(t, nn.Parameter) and t.requires_grad}


def no_weight_decay_names(loss: LossTree) -> set[str]:
    """The trainer's names of the parameters that must train without weight decay."""
    return {prefix + name for prefix, module in state_modules(loss).items() for name in module.no_weight_decay()}


def after_optimizer_step(loss: LossTree) -> None:
    for module in state_modules(loss).values():
        module.after_optimizer_step()


def loss_state_dict(loss: LossTree) -> dict[str, Tensor]:
    """:func:`state_tensors` as detached copies on the CPU."""
    return {name: value.detach().cpu().clone() for name, value in state_tensors(loss).items()}


def check_finite_loss_state(state: dict[str, Tensor], where: str) -> None:
    """Raise FloatingPointError naming the entries that are NaN or infinite (they must never be checkpointed)."""
    bad = [name for name, value in state.items() if value.is_floating_point() and not bool(value.isfinite().all())]
    if bad:
        values = {name: state[name].tolist() for name in bad}
        raise FloatingPointError(
            f"{where}: the loss parameters {values} are not finite; training is stopped and they are not written "
            "to a checkpoint. The loss parameters diverged: lower their learning rate "
            "(prepare_trainer(trainer, loss_learning_rate=...)) or the model's, and resume from the last checkpoint."
        )


@torch.no_grad()
def load_loss_state_dict(loss: LossTree, state: dict[str, Tensor], source: str = "") -> None:
    """Copy ``state`` (from :func:`loss_state_dict`) into the loss(es) in place; names and shapes must match."""
    targets = state_tensors(loss)
    where = f" ({source})" if source else ""
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"the saved loss state{where} does not fit this loss: missing {missing}, unexpected {unexpected}. "
            "Was it written with another loss configuration or another wrapper?"
        )
    for name, target in targets.items():
        if tuple(target.shape) != tuple(state[name].shape):
            raise ValueError(
                f"loss state entry {name!r}{where} has shape {tuple(state[name].shape)}, expected {tuple(target.shape)}"
            )
    check_finite_loss_state(state, f"loss state{where}")
    for name, target in targets.items():
        target.copy_(state[name].to(device=target.device, dtype=target.dtype))


def average_loss_gradients(loss: LossTree) -> None:
    """Average the gradients of the loss's own trainable parameters over all processes (one all-reduce), on every
    rank after backward and before the optimizer step; a missing gradient counts as zero, so that every rank runs the
    same collective. No-op without a process group of several processes."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = list(state_parameters(loss).values())
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


def clip_loss_gradients(loss: LossTree, max_norm: float | None) -> Tensor | None:
    """Clip the gradients of the loss's own trainable parameters to a total 2-norm of ``max_norm`` and return their
    norm before clipping (a 0-d device tensor: no host sync), or None when none has a gradient; ``max_norm`` None, 0 or
    infinite: the norm only. On their own, not jointly with the model's: the scale's gradient can be orders of
    magnitude above the model's and would shrink its step (docs/training.md, ``max_grad_norm``). A loop of your own
    calls it after :func:`average_loss_gradients`, before ``optimizer.step()``."""
    params = [p for p in state_parameters(loss).values() if p.grad is not None]
    if not params:
        return None
    if max_norm is None or not 0 < max_norm < math.inf:
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
