"""Inputs that once gave a finite or NaN result where an error belongs: each is refused with a message naming the
argument (found by a fuzz of bad and extreme inputs)."""

from __future__ import annotations

import pytest
import torch

from st_weince.functional import sigmoid_contrastive_loss
from st_weince.functional.sigmoid import SigmoidLogits, chunked_sigmoid_contrastive_loss
from st_weince.functional.weince import weince_logits
from st_weince.losses import RBSigmoidLoss, WEINCELoss

FEATURELESS = [torch.zeros(8, 0), torch.zeros(8, 0)]


@pytest.mark.parametrize(
    "make",
    [
        lambda: WEINCELoss(None),
        lambda: WEINCELoss(None, directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")),
        lambda: RBSigmoidLoss(None),
    ],
)
def test_embeddings_without_features_are_refused(make):
    with pytest.raises(ValueError, match="no features"):
        make().compute_loss_from_embeddings(FEATURELESS, None)


def test_rb_sigmoid_modalities_without_features_are_refused():
    loss = RBSigmoidLoss(None, columns="modalities")
    with pytest.raises(ValueError, match="no features"):
        loss.compute_loss_from_embeddings(FEATURELESS, None)


@pytest.mark.parametrize("soft", [2.0, 0.5])
def test_sigmoid_loss_refuses_targets_other_than_0_and_1(soft):
    scores = torch.rand(3, 3)
    targets = torch.eye(3)
    targets[0, 0] = soft
    with pytest.raises(ValueError, match="targets must contain only 0"):
        sigmoid_contrastive_loss(scores, targets, scale=10.0, relative_bias=0.5)
    # the loss classes' own path (check_inputs=False) checks shapes only; valid targets give the same loss either way
    exact = sigmoid_contrastive_loss(scores, torch.eye(3), scale=10.0, relative_bias=0.5)
    unchecked = sigmoid_contrastive_loss(scores, torch.eye(3), scale=10.0, relative_bias=0.5, check_inputs=False)
    assert torch.equal(exact, unchecked)


def test_sigmoid_loss_refuses_a_mask_without_any_entry():
    scores = torch.rand(3, 3)
    with pytest.raises(ValueError, match="valid_mask excludes every entry"):
        sigmoid_contrastive_loss(
            scores, torch.eye(3), scale=10.0, relative_bias=0.5, valid_mask=torch.zeros(3, 3, dtype=torch.bool)
        )


@pytest.mark.parametrize("index", [6, -2])
def test_chunked_sigmoid_loss_refuses_a_positive_index_out_of_range(index):
    anchors, candidates = torch.randn(4, 5), torch.randn(6, 5)
    positive_index = torch.tensor([0, 1, 2, index])
    with pytest.raises(ValueError, match=r"positive_index must lie in \[-1, 5\]"):
        chunked_sigmoid_contrastive_loss(anchors, candidates, positive_index, SigmoidLogits(10.0, relative_bias=0.5))


@pytest.mark.parametrize(
    ("lam", "beta", "message"),
    [
        (float("nan"), 1.0, "lam must lie in"),
        (1.5, 1.0, "lam must lie in"),
        (0.5, float("nan"), "beta must be finite"),
        (0.5, 0.0, "beta must be finite"),
    ],
)
def test_weince_logits_refuse_a_nan_or_out_of_range_lambda_or_beta(lam, beta, message):
    scores = torch.rand(3, 4) * 0.9
    with pytest.raises(ValueError, match=message):
        weince_logits(scores, torch.full((3,), lam), torch.full((3,), beta), scale=2.0)
