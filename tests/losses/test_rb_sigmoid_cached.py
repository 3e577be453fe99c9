"""CachedRBSigmoidLoss against RBSigmoidLoss on a tiny BERT with (anchor, positive, negative) triplets, batch 48,
mini-batches of 5: the loss, the model's gradients and the loss parameters' gradients agree to 1e-5, also under
MatryoshkaLoss, under a scaled backward (as fp16 loss scaling does) and with gradient accumulation over two
micro-batches; its options, config round trip, host-device syncs and the memory of its loss stage."""

from __future__ import annotations

import json
import random

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
from torch import nn

from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss
from st_weince.utils.hotpath import count_host_syncs
from tests.conftest import TINY_SENTENCES

BATCH = 48
MINI_BATCH = 5
CONFIGURATIONS = [
    {},
    {"parametrization": "absolute", "symmetric": True, "locked_adapter": True, "chunk_size": 7},
    {"columns": "modalities", "trainable_bias": False},
]


@pytest.fixture()
def model(tiny_model_dir) -> SentenceTransformer:
    """The tiny BERT in train mode without dropout: the cached and the uncached pass then see the same function
    (with dropout each draws its own masks: the mixin replays them per mini-batch, the uncached pass per batch)."""
    model = SentenceTransformer(str(tiny_model_dir), device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.train()
    return model


def triplets(batch: int = BATCH, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    words = " ".join(TINY_SENTENCES).split()
    return [[" ".join(rng.choices(words, k=rng.randint(2, 9))) for _ in range(batch)] for _ in range(3)]


def step(model, loss_fn, texts, *, factor: float = 1.0) -> tuple[torch.Tensor, dict, dict]:
    """One forward and ``(factor * loss).backward()``; returns the loss and the gradients (model, loss's own)."""
    value = loss_fn([model.tokenize(column) for column in texts], None)
    (factor * value).backward()
    model_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    own_grads = {
        n: p.grad.clone() for n, p in loss_fn.named_parameters() if not ("model." in n or n.startswith("model."))
    }
    return value.detach(), model_grads, own_grads


def zero_grads(*modules: nn.Module) -> None:
    for module in modules:
        for parameter in module.parameters():
            parameter.grad = None


def assert_same_gradients(ours: dict, theirs: dict, rtol: float = 1e-5) -> None:
    assert ours.keys() == theirs.keys()
    # Gradients that are mathematically zero (e.g. attention key biases: softmax ignores a shift) hold only rounding
    # noise; the tolerance is relative to the largest gradient.
    atol = rtol * max(g.abs().max().item() for g in theirs.values())
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("options", CONFIGURATIONS)
def test_loss_and_all_gradients_equal_the_uncached_loss(model, options, one_torch_thread):
    texts = triplets()
    # this test is the training loop: it handles the loss parameters (their gradients) itself
    uncached = RBSigmoidLoss(model, **options).mark_state_managed()
    cached = CachedRBSigmoidLoss(model, mini_batch_size=MINI_BATCH, **options).mark_state_managed()
    assert {n for n, _ in cached.named_parameters()} == {n for n, _ in uncached.named_parameters()}
    expected = step(model, uncached, texts)
    zero_grads(model)
    got = step(model, cached, texts)
    assert got[0].item() == pytest.approx(expected[0].item(), rel=1e-5)
    assert_same_gradients(got[1], expected[1])
    assert_same_gradients(got[2], expected[2])
    # The logged statistics (t, b_rel, b, margin) are the same too.
    assert cached.pop_logged_statistics() == pytest.approx(uncached.pop_logged_statistics(), rel=1e-5, abs=1e-6)


def test_scaled_backward_scales_the_loss_parameter_gradients(model, one_torch_thread):
    """fp16 loss scaling multiplies the loss before backward: the parameters' gradients must scale with it (the
    mixin's own backward inside forward would leave them unscaled)."""
    texts = triplets(seed=1)
    results = {}
    for name, cls, kwargs in (
        ("uncached", RBSigmoidLoss, {}),
        ("cached", CachedRBSigmoidLoss, {"mini_batch_size": MINI_BATCH}),
    ):
        loss_fn = cls(model, **kwargs).mark_state_managed()  # this test is the training loop
        for factor in (1.0, 1024.0):
            zero_grads(model, loss_fn)
            results[name, factor] = step(model, loss_fn, texts, factor=factor)
    for name in ("uncached", "cached"):
        for parameter, grad in results[name, 1024.0][2].items():
            torch.testing.assert_close(grad, 1024.0 * results[name, 1.0][2][parameter], rtol=1e-5, atol=0)
    assert_same_gradients(results["cached", 1024.0][2], results["uncached", 1024.0][2])
    assert_same_gradients(results["cached", 1024.0][1], results["uncached", 1024.0][1])


def test_gradient_accumulation_over_two_micro_batches(model, one_torch_thread):
    texts = triplets(seed=2)
    halves = [[column[:24] for column in texts], [column[24:] for column in texts]]
    accumulated = {}
    for name, loss_fn in (
        ("uncached", RBSigmoidLoss(model).mark_state_managed()),
        ("cached", CachedRBSigmoidLoss(model, mini_batch_size=MINI_BATCH).mark_state_managed()),
    ):
        zero_grads(model, loss_fn)
        for half in halves:
            # As the trainer does: each micro-batch's loss divided by the number of accumulation steps.
            *_, model_grads, own_grads = step(model, loss_fn, half, factor=0.5)
        accumulated[name] = (model_grads, own_grads)
    assert_same_gradients(accumulated["cached"][0], accumulated["uncached"][0])
    assert_same_gradients(accumulated["cached"][1], accumulated["uncached"][1])


def test_under_matryoshka_loss(model, one_torch_thread):
    texts = triplets(seed=3)
    dims, weights = [32, 16, 8], [1.0, 0.5, 2.0]
    uncached = MatryoshkaLoss(model, RBSigmoidLoss(model, locked_adapter=True).mark_state_managed(), dims, weights)
    inner = CachedRBSigmoidLoss(model, mini_batch_size=MINI_BATCH, locked_adapter=True).mark_state_managed()
    cached = MatryoshkaLoss(model, inner, dims, weights)
    expected = step(model, uncached, texts, factor=8.0)
    zero_grads(model)
    got = step(model, cached, texts, factor=8.0)
    assert got[0].item() == pytest.approx(expected[0].item(), rel=1e-5)
    assert set(expected[2]) == {"loss.log_t", "loss.b_rel", "loss.adapter_logit"}
    assert_same_gradients(got[1], expected[1])
    assert_same_gradients(got[2], expected[2])
    # The Matryoshka decorator is still in place after the forward (this loss swaps it only for the call).
    assert type(cached.loss.__dict__["calculate_loss"]).__name__ == "CachedLossDecorator"


def test_evaluation_without_gradients_gives_the_same_loss(model, one_torch_thread):
    texts = triplets(seed=4)
    cached = CachedRBSigmoidLoss(model, mini_batch_size=MINI_BATCH)
    with torch.no_grad():
        value = cached([model.tokenize(column) for column in texts], None)
        expected = RBSigmoidLoss(model)([model.tokenize(column) for column in texts], None)
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)


def test_options_config_round_trip_and_errors():
    cached = CachedRBSigmoidLoss(None, 5.0, mini_batch_size=7, mini_batch_num_tokens=100, symmetric=True)
    config = cached.get_config_dict()
    json.dumps(config)
    assert config["mini_batch_size"] == 7 and config["mini_batch_num_tokens"] == 100
    assert config["show_progress_bar"] is False and config["symmetric"] is True
    with torch.no_grad():
        cached.log_t.add_(0.3)
    assert cached.get_config_dict() == config  # the configured options, not the trained values
    rebuilt = CachedRBSigmoidLoss(None, **config)
    assert rebuilt.get_config_dict() == config
    assert torch.equal(rebuilt.log_t + 0.3, cached.log_t)
    uncached_config = {k: v for k, v in config.items() if k not in ("mini_batch_size", "mini_batch_num_tokens")}
    uncached_config.pop("show_progress_bar")
    assert RBSigmoidLoss(None, **uncached_config).get_config_dict() == uncached_config
    with pytest.raises(ValueError, match="mini_batch_size must be a positive integer"):
        CachedRBSigmoidLoss(None, mini_batch_size=0)
    with pytest.raises(TypeError, match="mini_batch_num_tokens must be a positive integer or None"):
        CachedRBSigmoidLoss(None, mini_batch_num_tokens=2.5)
    with pytest.raises(TypeError, match="show_progress_bar must be True or False"):
        CachedRBSigmoidLoss(None, show_progress_bar="no")
    with pytest.raises(ValueError, match="scale must be > 0"):
        CachedRBSigmoidLoss(None, scale=-1.0)
    with pytest.raises(ValueError, match="partition_mode"):
        CachedRBSigmoidLoss(None, partition_mode="joint")


def minibatched(rows: int, dim: int, seed: int, chunk: int = MINI_BATCH) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    columns = [torch.randn(rows, dim, generator=g) for _ in range(3)]
    return [[piece.clone().requires_grad_() for piece in column.split(chunk)] for column in columns]


@pytest.mark.parametrize("check_inputs,expected", [(True, 1), (False, 0)])
def test_loss_stage_syncs(check_inputs, expected, one_torch_thread):
    cached = CachedRBSigmoidLoss(None, mini_batch_size=MINI_BATCH, check_inputs=check_inputs, symmetric=True)
    reps = minibatched(20, 6, seed=5)
    with count_host_syncs() as syncs:
        cached.calculate_loss(reps, with_backward=True).backward()
    assert syncs.total == expected
    bad = minibatched(20, 6, seed=5)
    with torch.no_grad():
        bad[1][2][0, 0] = float("nan")
    if check_inputs:
        with pytest.raises(ValueError, match="column 1 has NaN or Inf"):
            cached.calculate_loss(bad, with_backward=True)


def test_loss_stage_keeps_one_row_chunk_of_scores_in_memory(one_torch_thread):
    """The largest tensor saved for backward in the loss stage is one [mini_batch_size, candidates] block."""
    rows, dim, mini_batch = 64, 4, 8
    cached = CachedRBSigmoidLoss(None, mini_batch_size=mini_batch, check_inputs=False)
    reps = minibatched(rows, dim, seed=6, chunk=mini_batch)
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cached.calculate_loss(reps, with_backward=True)
    candidates = 2 * rows  # positives and negatives
    assert max(sizes) <= max(mini_batch * candidates, candidates * dim, rows * dim)
    assert max(sizes) < rows * candidates


def test_grad_scaler_unscaled_gradients_equal_the_uncached_ones(model, one_torch_thread):
    """torch.amp.GradScaler multiplies the loss by its scale before backward and divides the gradients by it in
    unscale_: the loss parameters' gradients come out right only if they took part in the scaled backward."""
    texts = triplets(seed=7)
    unscaled = {}
    for name, loss_fn in (
        ("uncached", RBSigmoidLoss(model).mark_state_managed()),
        ("cached", CachedRBSigmoidLoss(model, mini_batch_size=MINI_BATCH).mark_state_managed()),
    ):
        zero_grads(model, loss_fn)
        optimizer = torch.optim.SGD(loss_fn.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        value = loss_fn([model.tokenize(column) for column in texts], None)
        scaler.scale(value).backward()
        scaler.unscale_(optimizer)
        unscaled[name] = {n: p.grad.clone() for n, p in loss_fn.named_parameters() if not n.startswith("model.")}
    assert set(unscaled["cached"]) == {"log_t", "b_rel"}
    assert_same_gradients(unscaled["cached"], unscaled["uncached"])
