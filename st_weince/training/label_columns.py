"""The label columns the false-negative guard's ``"same_label"`` rule reads, checked by
:func:`~st_weince.training.prepare_trainer` before step 1 (docs/false-negatives.md, "Labels"): without the check a
dataset without a label column fails at its first batch, perhaps after checkpoints, and a text column inside the
collator without a word of labels. Text labels are refused with the fix, not encoded here: an encoding chosen here
would be invisible in the caller's datasets.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from st_weince.training.protocol import LossState

#: sentence-transformers' ``DEFAULT_LABEL_COLUMNS``, for a trainer whose collator does not name its own.
DEFAULT_LABEL_COLUMNS = ("label", "labels", "score", "scores")
_INTEGER_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def same_label_losses(loss: nn.Module) -> list[str]:
    """The class names of the modules of a loss (wrappers included) whose guard reads labels."""
    modules = loss.modules()
    return [type(module).__name__ for module in modules if isinstance(module, LossState) and module.reads_labels()]


def check_label_columns(trainer: Any) -> None:
    """Refuse, naming the dataset, the loss and the fix, a train or eval dataset whose loss uses
    ``false_negative_filter="same_label"`` without a label column of integer class ids. Reads column names and
    features only; a dataset that declares neither is checked by the loss at its first batch."""
    loss = trainer.loss
    losses = {name: same_label_losses(module) for name, module in loss.items()} if isinstance(loss, dict) else None
    single = same_label_losses(loss) if losses is None else []
    label_columns = list(getattr(trainer.data_collator, "valid_label_columns", None) or DEFAULT_LABEL_COLUMNS)
    for role, datasets in (("train", trainer.train_dataset), ("eval", trainer.eval_dataset)):
        named = dict(datasets) if isinstance(datasets, dict) else {} if datasets is None else {None: datasets}
        for name, dataset in named.items():
            users = single if losses is None else losses.get(name, [])
            if users:
                where = f"the {role} dataset" + (f" {name!r}" if name is not None else "")
                loss_uses = f"its loss ({', '.join(sorted(set(users)))}) uses false_negative_filter='same_label'"
                code = "dataset" if name is None else f"dataset[{name!r}]"  # the dataset in the fix's code
                _check_label_column(dataset, label_columns, f"{where}: {loss_uses}", code)


def _check_label_column(dataset: Any, label_columns: list[str], text: str, code: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return
    column = next((name for name in label_columns if name in columns), None)
    if column is None:
        raise ValueError(
            f"{text}, which compares each row's class id, and this dataset has no label column (one of "
            f"{label_columns}; its columns are {list(columns)}). Add a 'label' column of integer class ids, or give "
            "this dataset's loss another false_negative_filter"
        )
    feature = (getattr(dataset, "features", None) or {}).get(column)
    if feature is None:
        return
    kind = type(feature).__name__
    dtype = getattr(feature, "dtype", None)
    if kind == "ClassLabel" or (kind == "Value" and dtype in _INTEGER_DTYPES):
        return
    if kind == "Value" and dtype in ("string", "large_string"):
        problem = f"holds text ({dtype}), which the data collator cannot batch"
        fix = f"encode it as class ids first: {code} = {code}.class_encode_column({column!r})"
    elif kind == "Value" and str(dtype).startswith("float"):
        problem = f"holds {dtype} numbers: scores have no classes, and float ids lose precision (float32 above 2^24)"
        fix = (
            f"for whole-number ids cast it: {code} = {code}.cast_column({column!r}, datasets.Value('int64')); for "
            "scores choose another false_negative_filter"
        )
    else:
        problem = f"holds {feature}, not one id per row"
        fix = "give one integer class id per row"
    raise ValueError(f"{text}, which compares integer class ids, and its label column {column!r} {problem}: {fix}")


__all__ = ["check_label_columns", "same_label_losses"]
