"""false_negative_filter="same_label": the candidates of the rows with the anchor row's label leave the negatives (out
of the tail statistics and the softmax or sigmoid), exactly; mined hard negatives stay; with all labels distinct the
loss is the unguarded one, bit for bit; the cached losses and two processes agree with one uncached process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.forked import run_ranks
from tests.same_label_worker import GLOBAL_BATCH, LABELS, LOSSES, global_batch

# 12 rows in 5 classes: rows 0, 3, 7 share a label, 1 and 9, 2 and 5 and 11, 4 and 10; 6 and 8 are alone
CLASSES = torch.tensor([0, 1, 2, 0, 3, 2, 4, 0, 5, 1, 3, 2])


def columns(num_columns: int = 2, seed: int = 0, batch: int = 12) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randn(batch, 8, generator=generator, dtype=torch.float64)
    out = [anchors, anchors + 0.7 * torch.randn(batch, 8, generator=generator, dtype=torch.float64)]
    return out + [torch.randn(batch, 8, generator=generator, dtype=torch.float64) for _ in range(num_columns - 2)]


def same_label(labels: torch.Tensor) -> torch.Tensor:
    """[B, B] bool: row i's candidate j (another row's positive or anchor) has row i's label, j != i."""
    return (labels[:, None] == labels[None, :]) & ~torch.eye(labels.numel(), dtype=torch.bool)


def masked_infonce(embeddings: list[torch.Tensor], labels: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """InfoNCE (MNRL, query_to_doc) over all positives and hard negatives, the same-label positives left out."""
    queries, *docs = [F.normalize(e, dim=1) for e in embeddings]
    logits = scale * queries @ torch.cat(docs).T
    masked = torch.cat([same_label(labels)] + [torch.zeros_like(same_label(labels))] * (len(docs) - 1), dim=1)
    return F.cross_entropy(logits.masked_fill(masked, float("-inf")), torch.arange(queries.shape[0]))


def masked_sigmoid(loss: RBSigmoidLoss, embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """The sigmoid loss without the masked pairs: per anchor, the sum over its candidates but those of its label."""
    queries, *docs = [F.normalize(e, dim=1) for e in embeddings]
    scores = queries @ torch.cat(docs).T
    t, b_rel = loss.scale.detach().double(), loss.b_rel.detach().double()
    z = t * (scores - b_rel)
    targets = torch.cat([torch.eye(queries.shape[0])] + [torch.zeros_like(scores[:, : queries.shape[0]])] * (
        len(docs) - 1), dim=1).double()  # fmt: skip
    kept = ~torch.cat([same_label(labels)] + [torch.zeros_like(same_label(labels))] * (len(docs) - 1), dim=1)
    per_pair = F.softplus(torch.where(targets == 1, -z, z)) * kept
    return per_pair.sum() / queries.shape[0]


@pytest.mark.parametrize("num_columns", [2, 3])
def test_weince_without_the_blend_is_infonce_without_the_same_label_candidates(num_columns):
    embeddings = columns(num_columns)
    loss = WEINCELoss(None, mode="none", false_negative_filter="same_label")
    value = loss.compute_loss_from_embeddings(embeddings, CLASSES)
    torch.testing.assert_close(value, masked_infonce(embeddings, CLASSES), rtol=1e-12, atol=1e-12)
    # the share removed: the same-label positives among every row's negatives (hard negatives stay)
    negatives = 12 * (12 * (num_columns - 1) - 1)
    removed = int(same_label(CLASSES).sum())
    assert loss.pop_logged_statistics()["weince_fn_masked_share"] == pytest.approx(removed / negatives)


@pytest.mark.parametrize("num_columns", [2, 3])
def test_rb_sigmoid_is_the_sigmoid_loss_without_the_same_label_pairs(num_columns):
    embeddings = columns(num_columns, seed=1)
    loss = RBSigmoidLoss(None, false_negative_filter="same_label").double()
    value = loss.compute_loss_from_embeddings(embeddings, CLASSES)
    torch.testing.assert_close(value, masked_sigmoid(loss, embeddings, CLASSES), rtol=1e-10, atol=1e-12)
    negatives = 12 * (12 * (num_columns - 1) - 1)
    share = loss.pop_logged_statistics()["rb_sigmoid_fn_masked_share"]
    assert share == pytest.approx(int(same_label(CLASSES).sum()) / negatives)


def test_the_blend_leaves_the_same_label_candidates_out_of_its_tail_statistics():
    """WEINCE with the blend: the same loss as WEINCE given the masked candidates as not valid at all."""
    embeddings = columns(2, seed=2, batch=40)
    labels = torch.arange(40) % 7
    loss = WEINCELoss(None, false_negative_filter="same_label")
    value = loss.compute_loss_from_embeddings(embeddings, labels)
    queries, docs = [F.normalize(e, dim=1) for e in embeddings]
    scores = queries @ docs.T
    reference = WEINCELoss(None).loss_from_scores(scores, torch.arange(40), ~same_label(labels))
    torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    assert float(loss.last_statistics.lam.max()) > 0.05  # the blend is on, so the statistics matter


@pytest.mark.parametrize("cls", [WEINCELoss, RBSigmoidLoss, CachedWEINCELoss, CachedRBSigmoidLoss])
def test_all_labels_distinct_give_the_unguarded_loss_bit_for_bit(cls):
    embeddings = columns(3, seed=3)
    distinct = torch.arange(12)

    def value(loss, labels):
        if isinstance(loss, (CachedWEINCELoss, CachedRBSigmoidLoss)):
            return loss.calculate_loss([list(c.split(5)) for c in embeddings], labels)
        return loss.compute_loss_from_embeddings(embeddings, labels)

    options = {"mini_batch_size": 5} if cls in (CachedWEINCELoss, CachedRBSigmoidLoss) else {}
    guarded = value(cls(None, false_negative_filter="same_label", **options).double(), distinct)
    plain = value(cls(None, **options).double(), None)
    assert torch.equal(guarded, plain)


@pytest.mark.parametrize("cls", [WEINCELoss, RBSigmoidLoss])
def test_cached_equals_uncached_with_shared_labels(cls):
    embeddings = columns(3, seed=4)
    cached_cls = CachedWEINCELoss if cls is WEINCELoss else CachedRBSigmoidLoss
    expected = cls(None, false_negative_filter="same_label").double().compute_loss_from_embeddings(embeddings, CLASSES)
    cached = cached_cls(None, false_negative_filter="same_label", mini_batch_size=5).double()
    value = cached.calculate_loss([list(c.split(5)) for c in embeddings], CLASSES)
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", [WEINCELoss, RBSigmoidLoss])
def test_a_missing_label_column_names_the_option_and_the_column(cls):
    with pytest.raises(ValueError, match=r"false_negative_filter='same_label' needs the dataset's 'label' column"):
        cls(None, false_negative_filter="same_label").compute_loss_from_embeddings(columns(), None)
    with pytest.raises(ValueError, match=r"one label per row, a 1-D tensor of 12 class ids, got 5 labels of shape "
                       r"\(5,\) for 12 rows"):  # fmt: skip
        cls(None, false_negative_filter="same_label").compute_loss_from_embeddings(columns(), torch.arange(5))
    with pytest.raises(ValueError, match="score matrix"):
        cls(None, false_negative_filter="same_label").loss_from_scores(
            torch.rand(4, 4), torch.arange(4), torch.ones(4, 4, dtype=torch.bool)
        )


def test_labels_are_still_refused_with_a_warning_by_the_other_settings_and_the_rule_has_no_sync():
    with pytest.warns(UserWarning, match="does not use labels"):
        WEINCELoss(None).compute_loss_from_embeddings(columns(), CLASSES)
    loss = WEINCELoss(None, false_negative_filter="same_label", check_inputs=False)
    plain = WEINCELoss(None, check_inputs=False)
    with count_host_syncs() as guarded_syncs:
        loss.compute_loss_from_embeddings(columns(), CLASSES)
    with count_host_syncs() as plain_syncs:
        plain.compute_loss_from_embeddings(columns(), None)
    assert guarded_syncs.total == plain_syncs.total == 0
    config = WEINCELoss(None, false_negative_filter="same_label").get_config_dict()
    assert config["false_negative_filter"] == "same_label"


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_gathering_equal_one_process(fork_server, tmp_path, one_torch_thread):
    """The labels are gathered with the embeddings: a row's same-label candidates on the other rank are masked."""
    run_ranks(fork_server, "tests.same_label_worker", [tmp_path], tmp_path, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    embeddings = global_batch()
    for name, (cls, statistic, _) in LOSSES.items():
        options = {"mini_batch_size": 3} if name.startswith("Cached") else {}
        single = cls(None, false_negative_filter="same_label", **options).double()
        with torch.no_grad():
            if name.startswith("Cached"):
                value = single.calculate_loss([list(column.split(3)) for column in embeddings], LABELS)
            else:
                value = single.compute_loss_from_embeddings(embeddings, LABELS)
        share = single.pop_logged_statistics()[statistic]
        assert share == pytest.approx(int(same_label(LABELS).sum()) / (GLOBAL_BATCH * (GLOBAL_BATCH - 1)))
        assert float((ranks[0][name]["loss"] + ranks[1][name]["loss"]) / 2) == pytest.approx(value.item(), rel=1e-9)
        assert (ranks[0][name]["masked_share"] + ranks[1][name]["masked_share"]) / 2 == pytest.approx(share)


@pytest.mark.slow
def test_the_trainer_passes_the_label_column(tiny_model, tmp_path, one_torch_thread):
    """sentence-transformers passes a dataset's 'label' column to the loss: the rule reads it in training."""
    from datasets import Dataset

    from st_weince.training import prepare_trainer
    from tests.conftest import SHORT_RUN, TINY_SENTENCES, build_trainer

    dataset = Dataset.from_dict(
        {"anchor": TINY_SENTENCES, "positive": TINY_SENTENCES[1:] + TINY_SENTENCES[:1], "label": [0, 1, 0, 1, 2, 3] * 2}
    )
    loss = WEINCELoss(tiny_model, false_negative_filter="same_label")
    trainer = build_trainer(tiny_model, loss, tmp_path, dataset=dataset, **SHORT_RUN, per_device_train_batch_size=12,
                            max_steps=1)  # fmt: skip
    prepare_trainer(trainer)
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r][0]
    assert logged["weince_fn_masked_share"] > 0  # the labels reached the loss
