"""One SimCLR training step and epoch, shared by recipes/simclr.py, the studies and benchmarks/gpu_study.py.

A step: two augmented views of a batch -> model (channels_last and autocast when asked) -> the objective on float32
projections -> backward -> the loss's own gradients averaged over processes -> optimizer step. An epoch walks the
seeded data order (:func:`data_order`) in whole batches and makes one host sync, at its end, for its mean loss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from st_weince.training import average_loss_gradients

from simclr_tools.augment import SimCLRAugment
from simclr_tools.models import SimCLRModel
from simclr_tools.setups import Setup


def data_order(num_images: int, seed: int, epoch: int) -> Tensor:
    """The permutation of epoch ``epoch`` for seed ``seed``: the same for every loss, and recomputable on resume."""
    generator = torch.Generator().manual_seed(1_000_003 * (seed + 1) + epoch)
    return torch.randperm(num_images, generator=generator)


def to_memory_format(images: Tensor, channels_last: bool) -> Tensor:
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def build_model(
    setup: Setup,
    *,
    backbone: str = "resnet18",
    width: int = 64,
    hidden_dim: int | None = None,
    projection_dim: int = 64,
    cifar_stem: bool = True,
    channels_last: bool = False,
) -> SimCLRModel:
    """The backbone and the setup's projection head (``hidden_dim`` None: as wide as the features)."""
    model = SimCLRModel(
        backbone,
        width=width,
        cifar_stem=cifar_stem,
        hidden_dim=hidden_dim,
        projection_dim=projection_dim,
        head_batch_norm=setup.head_batch_norm,
        head_output_bias=setup.head_output_bias,
    )
    return model.to(memory_format=torch.channels_last) if channels_last else model


def build_optimizer(model: nn.Module, objective: nn.Module, lr: float, weight_decay: float) -> torch.optim.Adam:
    """Adam over the model and the loss's trainable parameters (RB-Sigmoid's t, b_rel), the latter without decay."""
    groups: list[dict[str, Any]] = [{"params": list(model.parameters())}]
    loss_parameters = [p for p in objective.parameters() if p.requires_grad]
    if loss_parameters:
        groups.append({"params": loss_parameters, "weight_decay": 0.0})
    return torch.optim.Adam(groups, lr=lr, weight_decay=weight_decay)


@dataclass
class SimCLRTraining:
    """The training state of one run and its step and epoch.

    Args:
        model: views [2N, C, H, W] -> projections [2N, D] (a DDP-wrapped model works too).
        objective: ``objective(z1, z2)`` -> scalar loss.
        optimizer: over the model and the objective's parameters (:func:`build_optimizer`).
        augment: ``augment(images)`` -> two views (its generator fixes the augmentations).
        channels_last: feed the views in channels_last memory format (the model should be converted too).
        autocast_dtype: run the model's forward under autocast in this dtype (e.g. bfloat16); None: off.
            The loss always sees float32 projections.
        backward: how to back-propagate (``accelerator.backward`` under accelerate).
        encode_views_separately: one forward pass per view, as the released WEINCE code does, so that BatchNorm
            normalises each view with its own batch statistics; False (default): both views in one pass of 2N
            images, whose BatchNorm statistics mix the two views (docs/vision.md).
    """

    model: nn.Module
    objective: nn.Module
    optimizer: torch.optim.Optimizer
    augment: SimCLRAugment
    channels_last: bool = False
    autocast_dtype: torch.dtype | None = None
    backward: Callable[[Tensor], Any] = Tensor.backward
    augment_seconds: float = 0.0  # host time spent launching the augmentations (asynchronous on a GPU)
    encode_views_separately: bool = False

    def step(self, images: Tensor) -> Tensor:
        """One optimizer step on a batch of uint8 images; returns the detached loss (no host sync)."""
        tick = time.perf_counter()
        view_a, view_b = self.augment(images)
        self.augment_seconds += time.perf_counter() - tick
        dtype = self.autocast_dtype
        with torch.autocast(view_a.device.type, dtype=dtype, enabled=dtype is not None):
            if self.encode_views_separately:
                views = [to_memory_format(view, self.channels_last) for view in (view_a, view_b)]
                projections = torch.cat([self.model(view) for view in views])
            else:
                projections = self.model(to_memory_format(torch.cat([view_a, view_b]), self.channels_last))
        z1, z2 = projections.float().chunk(2)
        loss = self.objective(z1, z2)
        self.optimizer.zero_grad(set_to_none=True)
        self.backward(loss)
        average_loss_gradients(self.objective)  # the loss is not inside DDP: average t, b_rel over processes
        self.optimizer.step()
        return loss.detach()

    def throughput(self, pairs: int, train_seconds: float, steps: int) -> dict[str, float]:
        """The run's speed: ``pairs`` trained in ``train_seconds`` over ``steps``, and the augmentations' share."""
        return {
            "source_images_per_second_data_pipeline": pairs / max(self.augment_seconds, 1e-9),
            "train_pairs_per_second": pairs / max(train_seconds, 1e-9),
            "seconds_per_step": train_seconds / max(steps, 1),
            "augment_share_of_step": self.augment_seconds / max(train_seconds, 1e-9),
        }

    def epoch(
        self,
        images: Tensor,
        order: Tensor,
        batch_size: int,
        *,
        steps: int | None = None,
        on_step: Callable[[int, Tensor], None] | None = None,
        process_index: int = 0,
        num_processes: int = 1,
    ) -> float:
        """Whole batches of ``images`` in the order ``order`` (at most ``steps`` of them); returns the mean loss.

        ``batch_size`` is per process: each step takes the next ``batch_size * num_processes`` indices of ``order``
        and this process every ``num_processes``-th of them. ``on_step(step, loss)`` sees every step's detached
        loss (step counted from 0 within the epoch). ValueError when the loss is not finite.
        """
        global_batch = batch_size * num_processes
        steps_per_epoch = order.numel() // global_batch
        if steps_per_epoch < 1:
            raise ValueError(f"batch_size {batch_size} needs at least {global_batch} images, got {order.numel()}")
        steps = steps_per_epoch if steps is None else min(steps, steps_per_epoch)
        order = order.to(images.device)
        loss_sum = torch.zeros((), device=images.device)
        self.model.train()
        for step in range(steps):
            batch = order[step * global_batch : (step + 1) * global_batch][process_index::num_processes]
            loss = self.step(images[batch])
            loss_sum += loss
            if on_step is not None:
                on_step(step, loss)
        loss_mean = float(loss_sum) / steps  # the epoch's one host sync
        if not math.isfinite(loss_mean):
            raise ValueError(f"the training loss became {loss_mean}; lower the learning rate or check the data")
        return loss_mean
