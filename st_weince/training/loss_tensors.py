"""The loss's own tensors (its parameters and buffers, not its model's; inside wrappers too), by the trainer's names:
as plain data, as a file for custom training loops, and their gradients averaged across processes."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: File written by :func:`save_loss_state` (custom training loops; the trainer integration keeps the loss state in
#: ``trainer_state.json`` instead, see :mod:`st_weince.training.loss_state`).
LOSS_STATE_FILE = "st_weince_loss_state.pt"


# ----- which tensors belong to the loss -----
def losses_by_prefix(loss: nn.Module | dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``{prefix: loss}``: one entry with prefix "" for a single loss, one per dataset name for a dict of losses
    (the trainer names their parameters ``"{dataset name}.{name}"``)."""
    if isinstance(loss, dict):
        return {f"{name}.": module for name, module in loss.items()}
    return {"": loss}


def _model_tensor_ids(loss: nn.Module) -> set[int]:
    """Ids of the tensors of every ``model`` child in the loss tree (the sentence-transformers convention: a loss
    stores its model as ``self.model``; wrappers store it again). The trainer checkpoints those itself."""
    ids: set[int] = set()
    for module in loss.modules():
        model = module._modules.get("model")
        if model is not None:
            ids.update(id(t) for t in model.parameters())
            ids.update(id(t) for t in model.buffers())
    return ids


def own_tensors(loss: nn.Module | dict[str, nn.Module], trainable_only: bool = False) -> dict[str, Tensor]:
    """The loss's own parameters and persistent buffers (not the model's), by the names the trainer gives them
    (``log_t``; ``loss.log_t`` under ``MatryoshkaLoss``; ``{dataset}.log_t`` for a dict of losses). The tensors
    themselves, not copies; each once."""
    found: dict[str, Tensor] = {}
    for prefix, module in losses_by_prefix(loss).items():
        excluded = _model_tensor_ids(module)
        seen: set[int] = set()
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in excluded or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if trainable_only and not (isinstance(tensor, nn.Parameter) and tensor.requires_grad):
                continue
            found[prefix + name] = tensor
    return found


def own_parameters(loss: nn.Module | dict[str, nn.Module]) -> list[nn.Parameter]:
    return list(own_tensors(loss, trainable_only=True).values())


def no_weight_decay_parameters(loss: nn.Module | dict[str, nn.Module]) -> list[nn.Parameter]:
    """Parameters that must not get weight decay: those named by ``no_weight_decay_parameter_names()`` of any
    module in the loss tree (RBSigmoidLoss: all its own; a wrapper passes its inner loss's through)."""
    params: dict[int, nn.Parameter] = {}
    for module in losses_by_prefix(loss).values():
        for submodule in module.modules():
            if hasattr(submodule, "no_weight_decay_parameter_names"):
                named = dict(submodule.named_parameters())
                for name in submodule.no_weight_decay_parameter_names():
                    params[id(named[name])] = named[name]
    return list(params.values())


def no_weight_decay_names(loss: nn.Module | dict[str, nn.Module]) -> set[str]:
    """The trainer's names of :func:`no_weight_decay_parameters`."""
    ids = {id(p) for p in no_weight_decay_parameters(loss)}
    return {name for name, p in own_tensors(loss, trainable_only=True).items() if id(p) in ids}


# ----- the loss state as plain data -----
def loss_state_dict(loss: nn.Module | dict[str, nn.Module]) -> dict[str, Tensor]:
    """The loss's own parameters and buffers (:func:`own_tensors`), detached copies on the CPU."""
    return {name: value.detach().cpu().clone() for name, value in own_tensors(loss).items()}


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
def load_loss_state_dict(loss: nn.Module | dict[str, nn.Module], state: dict[str, Tensor], source: str = "") -> None:
    """Copy ``state`` (from :func:`loss_state_dict`) into the loss(es) in place; names and shapes must match."""
    targets = own_tensors(loss)
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


# ----- the loss state as a file (custom training loops) -----
def _atomic_write(path: str, write) -> None:
    """Write through a temporary file in the same folder, flushed to disk, then renamed over ``path``: a reader (or a
    kill) sees the old file or the complete new one, never a partial one."""
    directory = os.path.dirname(path) or "."
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def save_loss_state(loss: nn.Module | dict[str, nn.Module], directory: str | os.PathLike) -> str | None:
    """Write :func:`loss_state_dict` to ``directory/st_weince_loss_state.pt`` atomically; returns the path, or None
    when the loss has no state of its own (nothing is written). Refuses non-finite values (FloatingPointError)."""
    state = loss_state_dict(loss)
    if not state:
        return None
    path = os.path.join(os.fspath(directory), LOSS_STATE_FILE)
    check_finite_loss_state(state, f"writing {path}")
    os.makedirs(directory, exist_ok=True)
    _atomic_write(path, lambda stream: torch.save(state, stream))
    return path


def load_loss_state(loss: nn.Module | dict[str, nn.Module], directory: str | os.PathLike) -> None:
    """Restore the loss state written by :func:`save_loss_state` into ``directory``.

    Raises FileNotFoundError naming the file when it is absent (for a loss with state of its own), and ValueError
    naming it when it is empty or not a loss-state file."""
    path = os.path.join(os.fspath(directory), LOSS_STATE_FILE)
    if not own_tensors(loss):
        return
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: {directory} holds no loss state")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty (0 bytes): the loss state was not written completely")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's own message would suggest weights_only=False: never load untrusted pickles
        raise ValueError(f"{path} is corrupt or not a loss-state file ({type(error).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a loss-state file (expected a mapping of names to tensors)")
    load_loss_state_dict(loss, state, source=path)


# ----- distributed -----
def average_loss_gradients(loss: nn.Module | dict[str, nn.Module]) -> None:
    """Average the gradients of the loss's own trainable parameters over all processes (one all-reduce).

    Call it on every rank after backward and before the optimizer step (``prepare_trainer`` does it for the
    trainer; custom training loops call it themselves). A parameter without gradient on a rank counts as zero, so
    the collective is the same on every rank. No-op without an initialised process group or with one process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = own_parameters(loss)
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
