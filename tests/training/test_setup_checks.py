"""Setups that run but do not do what the user expects get one warning from the loss itself, at its first training
step and at no cost to it, with or without prepare_trainer: WEINCE at a batch too small for any tail fit (it is
InfoNCE there), and labels that the losses ignore."""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset

from st_weince.functional import WEINCEOptions
from st_weince.functional.weince import negatives_needed
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.conftest import TINY_SENTENCES, build_trainer


def pairs(batch_size: int, columns: int = 2, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, 16, generator=generator)
    return [base + 0.8 * torch.randn(batch_size, 16, generator=generator) for _ in range(columns)]


def test_the_needed_number_of_negatives_is_where_the_loss_starts_fitting():
    assert negatives_needed(WEINCEOptions()) == 4
    loss = WEINCELoss(None)
    loss.compute_loss_from_embeddings(pairs(4), None)  # 3 negatives per anchor
    assert not loss.last_statistics.fitted.any() and float(loss.last_statistics.lam.abs().max()) == 0.0
    loss.compute_loss_from_embeddings(pairs(5), None)  # 4
    assert loss.last_statistics.fitted.all() and float(loss.last_statistics.lam.min()) > 0.0


@pytest.mark.parametrize(
    ("options", "columns", "batch", "needed"),
    [
        ({}, 2, 2, 5),
        ({}, 2, 4, 5),
        ({}, 3, 2, 3),  # a hard-negative column: 2 x batch - 1 negatives
        ({"directions": ("query_to_doc", "query_to_query")}, 2, 2, 3),
    ],
)
def test_the_first_training_step_warns_naming_the_batch_that_fits(options, columns, batch, needed):
    loss = WEINCELoss(None, **options)  # in training mode, as nn.Module starts
    with pytest.warns(UserWarning, match=rf"at a batch of {batch} .*needs at least 4 negatives.*at least {needed} "):
        loss.compute_loss_from_embeddings(pairs(batch, columns), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss.compute_loss_from_embeddings(pairs(batch, columns), None)  # once
        WEINCELoss(None, **options).compute_loss_from_embeddings(pairs(needed, columns), None)
        WEINCELoss(None, mode="none", **options).compute_loss_from_embeddings(pairs(batch, columns), None)
        WEINCELoss(None, **options).eval().compute_loss_from_embeddings(pairs(batch, columns), None)
        with torch.no_grad():
            WEINCELoss(None, **options).compute_loss_from_embeddings(pairs(batch, columns), None)
    loss = WEINCELoss(None, **options)
    loss.compute_loss_from_embeddings(pairs(needed, columns), None)
    assert loss.last_statistics.fitted.any()
    loss.compute_loss_from_embeddings(pairs(needed - 1, columns), None)
    assert not loss.last_statistics.fitted.any()


def make_trainer(model, tmp_path, rows: int, loss, extra_columns: dict | None = None, batch_size: int = 8):
    sentences = (TINY_SENTENCES * 2)[:rows]
    data = {"anchor": sentences, "positive": sentences[::-1], **(extra_columns or {})}
    return build_trainer(
        model,
        loss,
        tmp_path / "out",
        dataset=Dataset.from_dict(data),
        per_device_train_batch_size=batch_size,
        max_steps=1,
        dataloader_pin_memory=False,
    )


def test_plain_sentence_transformers_training_warns_once_about_a_batch_that_fits_no_tail(tiny_model, tmp_path):
    """No prepare_trainer: the loss warns at its first training step (issue 44: it trained InfoNCE silently)."""
    with pytest.warns(UserWarning, match=r"WEINCELoss at a batch of 2 .* Use a batch of at least 5"):
        make_trainer(tiny_model, tmp_path, rows=2, loss=WEINCELoss(tiny_model)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        make_trainer(tiny_model, tmp_path, rows=8, loss=WEINCELoss(tiny_model)).train()
    with pytest.warns(UserWarning, match=r"CachedWEINCELoss at a batch of 4"):
        loss = CachedWEINCELoss(tiny_model, mini_batch_size=2)
        make_trainer(tiny_model, tmp_path, rows=24, loss=loss, batch_size=4).train()


@pytest.mark.parametrize("cls", [WEINCELoss, CachedWEINCELoss, RBSigmoidLoss, CachedRBSigmoidLoss])
def test_labels_are_refused_with_one_warning_naming_the_columns(cls):
    """The loss warns once, naming the collator's label columns; the check reads nothing from the device."""
    columns = pairs(8)

    def compute(loss, labels):
        if isinstance(loss, (CachedWEINCELoss, CachedRBSigmoidLoss)):
            return loss.calculate_loss([list(column.split(4)) for column in columns], labels)
        return loss.compute_loss_from_embeddings(columns, labels)

    with count_host_syncs() as without_labels:
        compute(cls(None, check_inputs=False), None)
    loss = cls(None, check_inputs=False)
    with pytest.warns(UserWarning, match=r"ignores the 'label' or 'score' column.*AnglELoss") as record:
        with count_host_syncs() as with_labels:
            compute(loss, torch.zeros(8))
        compute(loss, torch.zeros(8))
    assert len([w for w in record if "does not use labels" in str(w.message)]) == 1
    assert with_labels.total == without_labels.total
