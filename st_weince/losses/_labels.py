"""The losses take no labels: a dataset column that sentence-transformers turns into labels is ignored, once with a
warning that names it and says what to use instead."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

# The columns sentence-transformers' data collator passes to the loss as ``labels`` (``valid_label_columns``).
LABEL_COLUMNS = ("label", "score")
GRADED_PAIRS_ADVICE = (
    "every (anchor, positive) row is trained as a positive pair, also one labelled 0. For pairs with a similarity "
    "score use CoSENTLoss or AnglELoss (sentence-transformers); for 0/1-labelled pairs keep only the positive ones, "
    "or use ContrastiveLoss / OnlineContrastiveLoss"
)
_WARNED = "_st_weince_warned_unused_labels"


def warn_unused_labels(loss: object, labels: Tensor | None, column: str | None = None) -> None:
    """Warn once per loss object that it ignores ``labels``. ``column``: the dataset column they come from, when
    known (``prepare_trainer`` knows it); else the collator's label columns are named.

    Costs the step nothing: whether labels were given is known on the host; nothing is read from the device.
    """
    if labels is None or getattr(loss, _WARNED, False) or torch.compiler.is_compiling():
        return
    name = type(loss).__name__
    source = f"the {column!r} column" if column else "the " + " or ".join(repr(c) for c in LABEL_COLUMNS) + " column"
    message = f"{name} does not use labels and ignores {source} of the dataset: {GRADED_PAIRS_ADVICE}."
    warnings.warn(message, stacklevel=3)
    setattr(loss, _WARNED, True)
