"""The false-negative guard's exact rule, ``false_negative_filter="identical"``, in all four losses: the candidates
whose input (token ids) is identical to the anchor's positive are masked, exactly those (an independent computation
from the token ids), without a threshold; on inputs without duplicates the loss is the unguarded one bit for bit;
cached equals uncached; under gathering 2 processes equal 1 (gloo; forked by tests/forked.py with torchrun's
environment); the keys ignore padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from st_weince.functional import FalseNegativeFilter, input_keys, sigmoid_contrastive_loss
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.forked import run_ranks
from tests.identical_guard_worker import GLOBAL_BATCH, LOSSES, global_batch

ALL_LOSSES = [RBSigmoidLoss, CachedRBSigmoidLoss, WEINCELoss, CachedWEINCELoss]


def test_input_keys_compare_tokens_whatever_the_padding():
    right = torch.tensor([[2, 7, 9, 3, 0, 0], [2, 7, 9, 3, 5, 3], [2, 7, 9, 3, 0, 0]])
    right_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    keys = input_keys(right, right_mask)
    assert keys.dtype == torch.int64 and keys.shape == (3, 5)
    assert torch.equal(keys[0], keys[2]) and not torch.equal(keys[0], keys[1])
    # the same rows padded on the left, or to another length, give the same keys
    left = torch.tensor([[0, 0, 2, 7, 9, 3], [2, 7, 9, 3, 5, 3], [0, 0, 2, 7, 9, 3]])
    assert torch.equal(input_keys(left, (left != 0).long()), keys)
    assert torch.equal(input_keys(right[:, :4][[0]]), keys[[0]])
    # a swap of two tokens, a prefix and an id shifted by one are different inputs
    for other in ([2, 9, 7, 3], [2, 7, 9], [2, 7, 9, 4]):
        assert not torch.equal(input_keys(torch.tensor([other])), keys[[0]])


def test_parse_and_config():
    spec = FalseNegativeFilter.parse("identical")
    assert spec.rule == "identical" and spec.needs_keys and spec.to_config() == "identical"
    assert FalseNegativeFilter.parse(spec.to_config()) == spec
    for cls in ALL_LOSSES:
        loss = cls(None, false_negative_filter="identical")
        assert loss.get_config_dict()["false_negative_filter"] == "identical"
        assert cls(None, **loss.get_config_dict()).options.false_negative_filter == spec


def batch(duplicates: bool, hard_negative: bool = False):
    """(anchor, positive[, negative]) token ids and embeddings ("a model": identical inputs, identical embeddings).
    With ``duplicates``: positive 5 repeats positive 1, positive 6 repeats positive 2, and (with a negative column)
    negative 0 repeats positive 3."""
    generator = torch.Generator().manual_seed(5)
    ids = [torch.randint(5, 90, (8, 5), generator=generator) for _ in range(3 if hard_negative else 2)]
    if duplicates:
        ids[1][5], ids[1][6] = ids[1][1], ids[1][2]
        if hard_negative:
            ids[2][0] = ids[1][3]
    table = torch.randn(90, 16, dtype=torch.float64, generator=generator)
    embeddings = [table[column].sum(1) for column in ids]
    return ids, embeddings


def expected_mask(ids: list[torch.Tensor]) -> torch.Tensor:
    """[A, C] True where candidate c (all positives, then all negatives) has the same token ids as anchor a's
    positive and is not that positive: from the ids themselves, not from the keys."""
    candidates = torch.cat(ids[1:])
    same = (candidates[None, :, :] == ids[1][:, None, :]).all(-1)
    same[torch.arange(len(ids[1])), torch.arange(len(ids[1]))] = False
    return same


def loss_value(cls, embeddings, keys, **options):
    loss_fn = cls(None, **options) if not cls.__name__.startswith("Cached") else cls(None, mini_batch_size=3, **options)
    columns = [e.clone().requires_grad_() for e in embeddings]
    if cls.__name__.startswith("Cached"):
        loss_fn._pending_row_keys = keys
        reps = [[part.clone().requires_grad_() for part in column.detach().split(3)] for column in columns]
        value = loss_fn.calculate_loss(reps, None, with_backward=True)
        grads = [torch.cat([part.grad for part in column]) for column in reps]
    else:
        value = loss_fn.compute_loss_from_embeddings(columns, row_keys=keys)
        grads = torch.autograd.grad(value, columns)
    return value.detach(), grads, loss_fn.pop_logged_statistics()


@pytest.mark.parametrize("hard_negative", [False, True])
def test_exactly_the_duplicates_are_masked_rb_sigmoid(hard_negative):
    ids, embeddings = batch(duplicates=True, hard_negative=hard_negative)
    keys = [input_keys(column) for column in ids]
    mask = expected_mask(ids)
    assert int(mask.sum()) == (5 if hard_negative else 4)  # 1<->5, 2<->6 (both ways) [, negative 0 for anchor 3]
    # independent: the sigmoid loss with those candidates removed by hand
    anchors = F.normalize(embeddings[0], dim=-1)
    candidates = F.normalize(torch.cat(embeddings[1:]), dim=-1)
    scores = anchors @ candidates.T
    targets = torch.zeros_like(scores)
    targets[torch.arange(8), torch.arange(8)] = 1
    reference = RBSigmoidLoss(None)
    expected = sigmoid_contrastive_loss(
        scores, targets, scale=reference.log_t.double().exp(), relative_bias=reference.b_rel.double(), valid_mask=~mask
    )
    for cls in (RBSigmoidLoss, CachedRBSigmoidLoss):
        value, _, stats = loss_value(cls, embeddings, keys, false_negative_filter="identical")
        torch.testing.assert_close(value, expected.detach(), rtol=1e-12, atol=0)
        negatives = 8 * (scores.shape[1] - 1)
        assert stats["rb_sigmoid_fn_masked_share"] == pytest.approx(int(mask.sum()) / negatives, rel=1e-6)


@pytest.mark.parametrize("hard_negative", [False, True])
def test_exactly_the_duplicates_are_masked_weince(hard_negative):
    ids, embeddings = batch(duplicates=True, hard_negative=hard_negative)
    keys = [input_keys(column) for column in ids]
    mask = expected_mask(ids)
    # independent, with lambda = 0 (mode="none"): InfoNCE with those candidates removed by hand
    scores = F.normalize(embeddings[0], dim=-1) @ F.normalize(torch.cat(embeddings[1:]), dim=-1).T
    expected = F.cross_entropy((20.0 * scores).masked_fill(mask, float("-inf")), torch.arange(8))
    for cls in (WEINCELoss, CachedWEINCELoss):
        value, _, stats = loss_value(cls, embeddings, keys, false_negative_filter="identical", mode="none")
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=0)
        assert stats["weince_fn_masked_share"] == pytest.approx(int(mask.sum()) / (8 * (scores.shape[1] - 1)))


@pytest.mark.parametrize("cls", ALL_LOSSES)
def test_no_duplicates_no_change_and_cached_equals_uncached(cls):
    ids, embeddings = batch(duplicates=False, hard_negative=True)
    keys = [input_keys(column) for column in ids]
    guarded, guarded_grads, stats = loss_value(cls, embeddings, keys, false_negative_filter="identical")
    plain, plain_grads, _ = loss_value(cls, embeddings, None)
    assert torch.equal(guarded, plain)
    for grad, plain_grad in zip(guarded_grads, plain_grads):
        assert torch.equal(grad, plain_grad)
    assert max(v for k, v in stats.items() if k.endswith("fn_masked_share")) == 0.0


@pytest.mark.parametrize("options", [{}, {"symmetric": True}, {"columns": "modalities"}])
def test_cached_rb_sigmoid_equals_uncached_with_duplicates(options):
    ids, embeddings = batch(duplicates=True, hard_negative=True)
    keys = [input_keys(column) for column in ids]
    value, grads, _ = loss_value(RBSigmoidLoss, embeddings, keys, false_negative_filter="identical", **options)
    cached, cached_grads, _ = loss_value(
        CachedRBSigmoidLoss, embeddings, keys, false_negative_filter="identical", **options
    )
    torch.testing.assert_close(cached, value, rtol=1e-12, atol=1e-14)
    for grad, cached_grad in zip(grads, cached_grads):
        torch.testing.assert_close(cached_grad, grad, rtol=1e-10, atol=1e-14)


ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


@pytest.mark.parametrize("directions", [("query_to_doc",), ALL_DIRECTIONS])
def test_cached_weince_equals_uncached_with_duplicates(directions):
    ids, embeddings = batch(duplicates=True, hard_negative=True)
    keys = [input_keys(column) for column in ids]
    options = {"false_negative_filter": "identical", "directions": directions}
    value, grads, stats = loss_value(WEINCELoss, embeddings, keys, **options)
    cached, cached_grads, cached_stats = loss_value(CachedWEINCELoss, embeddings, keys, **options)
    assert stats["weince_fn_masked_share"] > 0
    torch.testing.assert_close(cached, value, rtol=1e-10, atol=1e-12)
    for grad, cached_grad in zip(grads, cached_grads):
        torch.testing.assert_close(cached_grad, grad, rtol=1e-8, atol=1e-12)
    assert cached_stats == pytest.approx(stats)


@pytest.mark.parametrize("cls", ALL_LOSSES)
def test_forward_computes_the_keys_from_the_token_ids(cls, tiny_model, one_torch_thread):
    """Through forward (tokenized features): the duplicate text is masked; without token ids, or on embeddings alone,
    the rule says what it needs."""
    tiny_model.eval()  # no dropout: identical texts give identical embeddings
    texts = [["a cat sat", "a dog ran", "the sun"], ["a cat on a mat", "a cat on a mat", "hot sun"]]
    features = [tiny_model.tokenize(column) for column in texts]
    options = {"mini_batch_size": 2} if cls.__name__.startswith("Cached") else {}
    guarded = cls(tiny_model, false_negative_filter="identical", **options).mark_state_managed()  # own loop
    guarded(features, None)
    stats = guarded.pop_logged_statistics()
    assert max(v for k, v in stats.items() if k.endswith("fn_masked_share")) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="compares the inputs' token ids"):
        cls(None, false_negative_filter="identical", **options).compute_loss_from_embeddings(
            [torch.randn(3, 4), torch.randn(3, 4)]
        )
    without_ids = [{"pixel_values": torch.randn(3, 4)} for _ in range(2)]
    with pytest.raises(ValueError, match="this column has none"):
        cls(tiny_model, false_negative_filter="identical", **options).mark_state_managed()(without_ids, None)


def test_no_host_sync_for_the_keys_and_the_mask():
    ids, embeddings = batch(duplicates=True)
    loss_fn = RBSigmoidLoss(None, false_negative_filter="identical", check_inputs=False)
    with count_host_syncs() as syncs:
        keys = [input_keys(column) for column in ids]
        loss_fn.compute_loss_from_embeddings(embeddings, row_keys=keys)
    assert syncs.total == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_gathering_equal_one_process(fork_server, tmp_path, one_torch_thread):
    run_ranks(fork_server, "tests.identical_guard_worker", [tmp_path], tmp_path, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    embeddings, ids = global_batch()
    keys = [input_keys(column) for column in ids]
    for name, (cls, statistic, _) in LOSSES.items():
        options = {"mini_batch_size": 4} if name.startswith("Cached") else {}
        single = cls(None, false_negative_filter="identical", **options)
        with torch.no_grad():
            if name.startswith("Cached"):
                single._pending_row_keys = keys
                value = single.calculate_loss([list(column.split(4)) for column in embeddings], None)
            else:
                value = single.compute_loss_from_embeddings(embeddings, row_keys=keys)
        share = single.pop_logged_statistics()[statistic]
        # positives 2 and 9 are on different ranks: the rule must see the other rank's keys to mask them
        assert share == pytest.approx(4 / (GLOBAL_BATCH * (GLOBAL_BATCH - 1)), rel=1e-6), name
        assert float((ranks[0][name]["loss"] + ranks[1][name]["loss"]) / 2) == pytest.approx(value.item(), rel=1e-9)
        assert (ranks[0][name]["masked_share"] + ranks[1][name]["masked_share"]) / 2 == pytest.approx(share)
