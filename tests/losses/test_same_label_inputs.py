"""Labels as people have them, for false_negative_filter="same_label" (issue 54, item 2): 64-bit ids compared exactly;
float (NaN) labels, labels of another shape, lists and arrays refused naming the problem; and, by prepare_trainer
before step 1, a text label column (with the fix) and a dataset of a dict without a label column."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict

from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.training import prepare_trainer
from st_weince.utils.hotpath import count_host_syncs
from tests.conftest import TINY_SENTENCES, build_trainer

LOSSES = [WEINCELoss, RBSigmoidLoss, CachedWEINCELoss, CachedRBSigmoidLoss]


def columns(rows: int = 8, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randn(rows, 6, dtype=torch.float64, generator=generator)
    return [anchors, anchors + 0.5 * torch.randn(rows, 6, dtype=torch.float64, generator=generator)]


def loss_value(cls, labels, embeddings=None, **options):
    embeddings = columns() if embeddings is None else embeddings
    if cls.__name__.startswith("Cached"):
        loss = cls(None, false_negative_filter="same_label", mini_batch_size=4, **options).double()
        return loss.calculate_loss([list(column.split(4)) for column in embeddings], labels)
    loss = cls(None, false_negative_filter="same_label", **options).double()
    return loss.compute_loss_from_embeddings(embeddings, labels)


@pytest.mark.parametrize("cls", LOSSES)
def test_64_bit_ids_above_2_to_the_53_are_not_merged(cls):
    """Ids 2^53 and 2^53 + 1 are equal as float64: compared that way every candidate of a row was masked (loss 0.0 for
    WEINCE). Compared exactly, alternating ids mask the same candidates as the small ids 0 and 1."""
    big = torch.tensor([2**53, 2**53 + 1] * 4)
    small = torch.tensor([0, 1] * 4)
    assert torch.equal(loss_value(cls, big), loss_value(cls, small))
    distinct = torch.arange(8, dtype=torch.int64) + (2**62 - 8)  # 8 ids next to each other near the int64 limit
    assert torch.equal(loss_value(cls, distinct), loss_value(cls, torch.arange(8)))


def test_exact_labels_add_no_host_sync():
    loss = WEINCELoss(None, false_negative_filter="same_label", check_inputs=False).double()
    with count_host_syncs() as syncs:
        loss.compute_loss_from_embeddings(columns(), torch.tensor([2**53, 2**53 + 1] * 4))
    assert syncs.total == 0


@pytest.mark.parametrize(
    ("labels", "error", "message"),
    [
        (torch.tensor([0.0, 1.0, float("nan"), 2.0] * 2), ValueError, r"the labels are torch\.float32.*may hold NaN"),
        (torch.full((8,), float("nan"), dtype=torch.float64), ValueError, "class_encode_column"),
        (
            torch.arange(8).reshape(4, 2),
            ValueError,
            r"one label per row, a 1-D tensor of 8 class ids, got 8 labels of "
            r"shape \(4, 2\) for 8 rows",
        ),
        (
            list(range(8)),
            TypeError,
            r"torch tensor of integer class ids \(one per row\), got list: convert them with "
            r"torch\.as_tensor\(labels\)",
        ),
        (np.arange(8), TypeError, "got ndarray: convert them with torch.as_tensor"),
    ],
)
@pytest.mark.parametrize("cls", LOSSES)
def test_labels_that_are_no_class_ids_are_refused_naming_the_problem(cls, labels, error, message):
    with pytest.raises(error, match=message):
        loss_value(cls, labels)


def test_bool_and_small_integer_labels_are_class_ids():
    labels = torch.tensor([0, 1] * 4)
    expected = loss_value(WEINCELoss, labels)
    assert torch.equal(loss_value(WEINCELoss, labels.bool()), expected)
    assert torch.equal(loss_value(WEINCELoss, labels.to(torch.int16)), expected)


# ----- prepare_trainer reads the label columns before step 1 -----
def pairs(**extra) -> Dataset:
    return Dataset.from_dict({"anchor": TINY_SENTENCES, "positive": TINY_SENTENCES[1:] + TINY_SENTENCES[:1], **extra})


INTENTS = ["card_lost", "card_lost", "top_up", "refund", "top_up", "refund"] * 2


def test_a_text_label_column_is_refused_with_the_encoding_fix(tiny_model, tmp_path):
    trainer = build_trainer(tiny_model, WEINCELoss(tiny_model, false_negative_filter="same_label"), tmp_path,
                            dataset=pairs(label=INTENTS), max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"the train dataset: its loss \(WEINCELoss\) uses false_negative_filter="
                       r"'same_label'.*label column 'label' holds text \(string\).*dataset = "
                       r"dataset\.class_encode_column\('label'\)"):  # fmt: skip
        prepare_trainer(trainer)
    # the fix it names works: the encoded column passes (and trains, test_false_negative_same_label.py)
    encoded = pairs(label=INTENTS).class_encode_column("label")
    assert isinstance(encoded.features["label"], ClassLabel)
    prepare_trainer(build_trainer(tiny_model, WEINCELoss(tiny_model, false_negative_filter="same_label"),
                                  tmp_path / "encoded", dataset=encoded, max_steps=1))  # fmt: skip


def test_float_label_columns_are_refused_with_the_cast(tiny_model, tmp_path):
    trainer = build_trainer(tiny_model, RBSigmoidLoss(tiny_model, false_negative_filter="same_label"), tmp_path,
                            dataset=pairs(score=[0.5, 1.0] * 6), max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"label column 'score' holds float64 numbers.*cast_column\('score', "
                       r"datasets\.Value\('int64'\)\)"):  # fmt: skip
        prepare_trainer(trainer)


def test_a_dataset_of_a_dict_without_labels_is_refused_before_step_1(tiny_model, tmp_path):
    datasets = DatasetDict({"intents": pairs(label=[0, 1, 2] * 4), "wiki": pairs()})
    losses = {
        "intents": WEINCELoss(tiny_model, false_negative_filter="same_label"),
        "wiki": CachedWEINCELoss(tiny_model, false_negative_filter="same_label", mini_batch_size=4),
    }
    trainer = build_trainer(tiny_model, losses, tmp_path, dataset=datasets, max_steps=2, save_steps=1)
    with pytest.raises(ValueError, match=r"the train dataset 'wiki': its loss \(CachedWEINCELoss\) uses "
                       r"false_negative_filter='same_label'.*has no label column"):  # fmt: skip
        prepare_trainer(trainer)
    assert not list(tmp_path.glob("checkpoint-*"))
    # the eval datasets too (the eval loss runs the same rule)
    losses["wiki"] = CachedWEINCELoss(tiny_model, mini_batch_size=4)
    evaluated = build_trainer(tiny_model, losses, tmp_path, dataset=datasets, max_steps=1,
                              eval_dataset=DatasetDict({"intents": pairs(), "wiki": pairs()}))  # fmt: skip
    with pytest.raises(ValueError, match=r"the eval dataset 'intents': its loss \(WEINCELoss\)"):
        prepare_trainer(evaluated)
    # without a same_label loss nothing is required
    prepare_trainer(build_trainer(tiny_model, WEINCELoss(tiny_model), tmp_path / "plain", max_steps=1))
