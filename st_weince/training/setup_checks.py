"""Setups that run but do not do what the user expects, found once by :func:`~st_weince.training.prepare_trainer`
from the trainer's configuration, so that no training step pays for them (no host-device sync):

- WEINCE at a batch too small for any anchor's tail fit: lambda is 0 for every anchor and the loss is InfoNCE;
- a label column (``label`` / ``score``) that the loss ignores.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from st_weince.functional.layouts import mnrl_layout, normalize_rows
from st_weince.functional.weince import WeinceOptions, weince_tail_fit
from st_weince.losses import RBSigmoidLoss, WEINCELoss
from st_weince.losses._labels import LABEL_COLUMNS, warn_unused_labels

_LARGEST_BATCH_SEARCHED = 4096


def negatives_needed(options: WeinceOptions) -> int:
    """The fewest negatives per anchor at which WEINCE fits an anchor's tail (with the defaults: 4). Found by
    fitting rows of distinct scores, so that the rule itself stays in :func:`weince_tail_fit`."""
    for count in range(1, _LARGEST_BATCH_SEARCHED):
        scores = torch.linspace(0.9, -0.9, count + 1, dtype=torch.float64)[None, :]
        if bool(weince_tail_fit(scores, torch.zeros(1, dtype=torch.long), None, options).fitted[0]):
            return count
    raise ValueError(f"no tail is fitted below {_LARGEST_BATCH_SEARCHED} negatives with {options}")


def _query_group(loss: Any, batch_size: int, num_columns: int):
    """The query-anchored candidate group of the loss's layout for a batch of random embeddings."""
    generator = torch.Generator().manual_seed(0)
    columns = [normalize_rows(torch.randn(batch_size, 8, generator=generator)) for _ in range(num_columns)]
    return mnrl_layout(columns[0], columns[1:], loss.options.directions, loss.options.partition_mode).groups[0]


def negatives_per_anchor(loss: Any, batch_size: int, num_columns: int) -> int:
    """How many negatives each query-anchored row of the loss has at this (global) batch size and column count."""
    group = _query_group(loss, batch_size, num_columns)
    candidates = group.scores.shape[1] if group.valid_mask is None else int(group.valid_mask[0].sum())
    return candidates - int(group.has_positive)


def fits_a_tail(loss: Any, batch_size: int, num_columns: int) -> bool:
    """Whether WEINCE fits any anchor's tail at this (global) batch size and column count."""
    group = _query_group(loss, batch_size, num_columns)
    fit = weince_tail_fit(group.scores, group.positive_index, group.valid_mask, loss.options.math)
    return bool(fit.fitted.any())


def small_batch_message(loss: Any, batch_size: int, num_columns: int) -> str | None:
    """The warning for a WEINCE loss that fits no anchor's tail at this global batch size, or None."""
    if loss.options.mode == "none" or batch_size < 1 or fits_a_tail(loss, batch_size, num_columns):
        return None
    needed = next(
        (size for size in range(batch_size + 1, _LARGEST_BATCH_SEARCHED) if fits_a_tail(loss, size, num_columns)),
        None,
    )
    have = negatives_per_anchor(loss, batch_size, num_columns)
    return (
        f"{type(loss).__name__} at a batch of {batch_size} ({have} negative{'s' if have != 1 else ''} per anchor) "
        "fits no anchor's tail: its "
        f"tail fit needs at least {negatives_needed(loss.options.math)} negatives per anchor, so lambda is 0 for every "
        "anchor and the loss is InfoNCE (MultipleNegativesRankingLoss). "
        + (f"Use a batch of at least {needed}" if needed else "Use a larger batch")
        + " (per_device_train_batch_size, and a dataset at least that long; with gather_across_devices=True the "
        "batch of all processes together); the default tail uses up to the hardest "
        f"{loss.options.min_tail_points} negatives, which a batch of 64 or more gives."
    )


def _datasets_and_losses(trainer: Any) -> list[tuple[Any, nn.Module]]:
    datasets = trainer.train_dataset
    losses = trainer.loss
    if isinstance(datasets, dict):
        return [(dataset, losses[name] if isinstance(losses, dict) else losses) for name, dataset in datasets.items()]
    if datasets is None:
        return []
    return [(datasets, next(iter(losses.values())) if isinstance(losses, dict) else losses)]


def check_trainer_setup(trainer: Any) -> None:
    """Warn (once per loss) about a WEINCE loss whose configured batch fits no tail, and about label columns that
    st-weince's losses ignore. Reads only the trainer's configuration; nothing on the device."""
    label_columns = getattr(trainer.data_collator, "valid_label_columns", None) or LABEL_COLUMNS
    for dataset, loss in _datasets_and_losses(trainer):
        names = list(getattr(dataset, "column_names", None) or [])
        labels = [name for name in names if name in label_columns]
        num_columns = len(names) - len(labels)
        for module in loss.modules():  # each module once
            if not isinstance(module, (WEINCELoss, RBSigmoidLoss)):
                continue
            if labels:
                warn_unused_labels(module, labels[0], column=labels[0])
            if not isinstance(module, WEINCELoss) or num_columns < 2 or getattr(module, "_st_weince_warned_batch", 0):
                continue
            batch_size = int(trainer.args.per_device_train_batch_size)
            if hasattr(dataset, "__len__"):
                batch_size = min(batch_size, len(dataset))
            if module.options.gather_across_devices:
                batch_size *= max(int(getattr(trainer.args, "world_size", 1)), 1)
            message = small_batch_message(module, batch_size, num_columns)
            if message:
                warnings.warn(message, stacklevel=3)
                module._st_weince_warned_batch = True
