"""CachedWEINCELoss equals WEINCELoss (statistics bitwise on identical embeddings; loss, statistics and model
gradients to what float32 guarantees end to end), also under MatryoshkaLoss; configs rebuild; the loss stage never
holds the full score matrix; at most one host sync."""

from __future__ import annotations

import json

import pytest
import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

from benchmarks.lab.profiling import cpu_peak_bytes
from st_weince.functional import weince_statistics
from st_weince.losses import CachedWEINCELoss, WEINCELoss
from st_weince.utils.hotpath import count_host_syncs
from tests.conftest import TINY_SENTENCES, build_trainer
from tests.float32_tolerance import (
    assert_statistics_close,
    query_group,
    row_chunks,
    tail_fit_tolerances,
    ulps_apart,
)

SETTINGS = [
    {},
    {"beta": 1.0, "mode": "rho"},
    {"directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")},
    {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction", "beta": 10.0},
    {"directions": ("query_to_doc", "doc_to_doc"), "gate": {"q": 0.5}, "tail_frac": 0.3, "min_tail_points": 8},
]


def triplet_features(model, batch_size: int = 48, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """(anchor, positive, negative) columns of distinct word sequences over the tiny model's vocabulary."""
    import random

    words = " ".join(TINY_SENTENCES).split()
    rng = random.Random(seed)
    columns = [[" ".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(batch_size)] for _ in range(3)]
    return [model.tokenize(column) for column in columns]


def loss_and_gradients(model, loss, features) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    value = loss(features, None)
    value.backward()
    return float(value.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_gradients_equal(grads, expected_grads, dtype):
    """float64: equal to 1e-9 (the algorithm is exact: differences are about 1e-13); float32: to 5e-5 of each
    tensor's largest gradient. The row-chunk matmuls round the scores differently from one big matmul (about one
    ulp), and the shortfall logit's slope lam beta / (1 - s) amplifies that: measured up to 2e-5 under
    MatryoshkaLoss at dimension 8 (CachedMultipleNegativesRankingLoss vs MNRL: 2e-6)."""
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    for name, grad in grads.items():
        expected = expected_grads[name]
        atol = 1e-9 if dtype == torch.float64 else 5e-5 * max(float(expected.abs().max()), 1.0)
        torch.testing.assert_close(grad, expected, atol=atol, rtol=1e-4 if dtype == torch.float32 else 1e-7, msg=name)


def chunk_scores(loss: WEINCELoss, embeddings: list[torch.Tensor], chunk: int) -> tuple[torch.Tensor, ...]:
    """(scores, positive_index, valid_mask) of the query group as a cached loss computes them: row chunk by chunk."""
    groups = [query_group(loss, embeddings, begin, end) for begin, end in row_chunks(embeddings[0].shape[0], chunk)]
    valid = None if groups[0].valid_mask is None else torch.cat([g.valid_mask for g in groups])
    return torch.cat([g.scores for g in groups]), torch.cat([g.positive_index for g in groups]), valid


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", SETTINGS)
def test_cached_statistics_equal_uncached_exactly_on_identical_embeddings(one_torch_thread, options, dtype):
    """The same embedding tensors through the uncached and the cached statistics path: every bit equal.

    With one row chunk (mini_batch_size = batch) both paths run the same operations. With chunks of 5 rows the cached
    path computes its scores with 5-row matmuls, which a CPU kernel may round differently from one 48-row matmul (it
    does in float64 here); on those same chunk scores its statistics are then bitwise the uncached function's."""
    columns = [torch.cat(column).detach().to(dtype) for column in cached_reps(48, 48, dim=16, seed=4)]
    uncached = WEINCELoss(None, **options)
    uncached.compute_loss_from_embeddings(columns, None)
    assert float(uncached.last_statistics.lam.max()) > 0.05, "the check needs a non-trivial blend"
    for mini_batch_size in (48, 5):
        cached = CachedWEINCELoss(None, mini_batch_size=mini_batch_size, **options)
        cached.calculate_loss([list(column.split(mini_batch_size)) for column in columns], None)
        if mini_batch_size == 48:
            expected = uncached.last_statistics
        else:
            expected = weince_statistics(*chunk_scores(uncached, columns, mini_batch_size), uncached.options)
        for field in ("lam", "beta", "rho", "delta_aic", "rho0", "beta_hat", "fitted"):
            actual = getattr(cached.last_statistics, field)
            assert torch.equal(actual, getattr(expected, field)), (field, mini_batch_size)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", SETTINGS)
def test_cached_equals_uncached_on_a_tiny_bert(tiny_model, one_torch_thread, options, dtype):
    """End to end: the cached loss embeds in mini-batches of 5, so its embeddings, and the scores, need not be bitwise
    those of one full batch (an AVX-512 AMD EPYC: rho one float32 ulp apart, lam 3.1e-6). The statistics are held to
    what the arithmetic can guarantee (tests/float32_tolerance.py): measured here, the scores of the two paths are
    ``m`` ulps apart, and moving every score by one ulp changes each statistic by at most ``sensitivity`` (lam about
    2e-5, delta_aic about 5e-3 in float32); the tolerance is 4 x max(m, 1) x sensitivity, in either dtype. The loss
    and the gradients keep their own bounds (assert_gradients_equal). Exactness on identical embeddings is the test
    above."""
    tiny_model.eval()  # no dropout: both losses see the same inputs
    tiny_model.to(dtype)
    features = triplet_features(tiny_model)
    uncached = WEINCELoss(tiny_model, **options)
    cached = CachedWEINCELoss(tiny_model, mini_batch_size=5, **options)
    expected, expected_grads = loss_and_gradients(tiny_model, uncached, features)
    value, grads = loss_and_gradients(tiny_model, cached, features)
    assert float(uncached.last_statistics.lam.max()) > 0.05, "the check needs a non-trivial blend"
    assert value == pytest.approx(expected, abs=1e-5 if dtype == torch.float32 else 1e-12)
    assert_gradients_equal(grads, expected_grads, dtype)

    with torch.no_grad():
        full_batch = embed_columns(tiny_model, features)
        mini_batches = [
            torch.cat([reps for reps, _ in cached.embed_minibatch_iter(feature, False, False)]) for feature in features
        ]
    group = query_group(uncached, full_batch)
    ulps = ulps_apart(query_group(uncached, mini_batches).scores, group.scores)
    # Rounding only: a wrong row or column would put scores about 1e-2 apart, i.e. about 1e5 ulps. 64 is twice the
    # textbook bound of two summation orders of a 32-term dot product of unit vectors (2 x 32 units of rounding).
    assert ulps <= 64, f"the two paths' scores are {ulps} ulps apart"
    tolerances = tail_fit_tolerances(group.scores, group.positive_index, group.valid_mask, uncached.options, ulps)
    assert_statistics_close(cached.last_statistics, uncached.last_statistics, tolerances)
    assert cached.pop_logged_statistics().keys() == uncached.pop_logged_statistics().keys()


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cached_equals_uncached_under_matryoshka(tiny_model, one_torch_thread, dtype):
    tiny_model.eval()
    tiny_model.to(dtype)
    features = triplet_features(tiny_model, seed=1)
    dims = [32, 16, 8]
    uncached = MatryoshkaLoss(tiny_model, WEINCELoss(tiny_model), dims, matryoshka_weights=[1.0, 0.5, 0.25])
    cached = MatryoshkaLoss(
        tiny_model, CachedWEINCELoss(tiny_model, mini_batch_size=5), dims, matryoshka_weights=[1.0, 0.5, 0.25]
    )
    expected, expected_grads = loss_and_gradients(tiny_model, uncached, features)
    value, grads = loss_and_gradients(tiny_model, cached, features)
    assert value == pytest.approx(expected, abs=1e-5 if dtype == torch.float32 else 1e-12)
    assert_gradients_equal(grads, expected_grads, dtype)


@pytest.mark.numerics
def test_evaluation_without_gradient_gives_the_same_loss(tiny_model, one_torch_thread):
    tiny_model.eval()
    features = triplet_features(tiny_model, batch_size=20, seed=2)
    with torch.no_grad():
        cached = CachedWEINCELoss(tiny_model, mini_batch_size=7)(features, None)
        uncached = WEINCELoss(tiny_model)(features, None)
    assert float(cached) == pytest.approx(float(uncached), abs=1e-6)


def rebuild_configs() -> list[tuple[type, dict]]:
    configs = [(WEINCELoss, dict(options)) for options in SETTINGS]
    configs += [(CachedWEINCELoss, {**options, "mini_batch_size": 7}) for options in SETTINGS]
    configs += [
        (WEINCELoss, {"scale": 2.0, "gather_across_devices": True, "check_inputs": False, "eps": 1e-4}),
        (WEINCELoss, {"gate": {"aic_margin": -3.0, "kappa_aic": 0.0, "kappa_rho": 0.0}, "beta": "auto"}),
        (CachedWEINCELoss, {"mini_batch_num_tokens": 512, "show_progress_bar": True, "check_inputs": False}),
        (WEINCELoss, {"false_negative_filter": ("absolute", 0.1), "mode": "none"}),
        (CachedWEINCELoss, {"false_negative_filter": ["relative", 0.95], "mini_batch_size": 7}),
    ]
    return configs


@pytest.mark.parametrize(("cls", "options"), rebuild_configs())
def test_config_round_trip_rebuilds_the_same_loss(tiny_model, one_torch_thread, cls, options):
    loss = cls(tiny_model, **options)
    config = loss.get_config_dict()
    assert json.loads(json.dumps(config)) == config
    rebuilt = cls(tiny_model, **config)
    assert rebuilt.get_config_dict() == config
    assert rebuilt.options == loss.options
    if not loss.options.gather_across_devices:
        tiny_model.eval()
        features = triplet_features(tiny_model, batch_size=16, seed=3)
        with torch.no_grad():
            assert float(rebuilt(features, None)) == float(loss(features, None))


def test_bad_cached_arguments_are_refused(tiny_model):
    with pytest.raises(ValueError, match="mini_batch_size"):
        CachedWEINCELoss(tiny_model, mini_batch_size=0)
    with pytest.raises(ValueError, match="mini_batch_num_tokens"):
        CachedWEINCELoss(tiny_model, mini_batch_num_tokens=-5)
    with pytest.raises(ValueError, match="kappa_rho must be finite"):
        CachedWEINCELoss(tiny_model, gate={"kappa_rho": float("inf")})
    with pytest.raises(ValueError, match="at least 2 input columns"):
        CachedWEINCELoss(tiny_model)(triplet_features(tiny_model, batch_size=4)[:1], None)


def cached_reps(batch_size: int, mini_batch_size: int, dim: int = 16, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(batch_size, dim, generator=generator)
    columns = [base + torch.randn(batch_size, dim, generator=generator) for _ in range(3)]
    return [[part.clone().requires_grad_() for part in column.split(mini_batch_size)] for column in columns]


@pytest.mark.parametrize("check_inputs", [True, False])
def test_loss_stage_syncs_at_most_once(check_inputs):
    reps = cached_reps(96, 10)
    loss = CachedWEINCELoss(None, mini_batch_size=10, check_inputs=check_inputs)
    with count_host_syncs() as syncs:
        loss.calculate_loss(reps, None, with_backward=True)
    assert syncs.total == (1 if check_inputs else 0)
    assert all(part.grad is not None for column in reps for part in column)
    broken = cached_reps(24, 10)
    with torch.no_grad():
        broken[1][1][0, 0] = float("nan")
    with pytest.raises(ValueError, match="column 1 has NaN or Inf"):
        CachedWEINCELoss(None, mini_batch_size=10).calculate_loss(broken, None, with_backward=True)


def test_loss_stage_never_allocates_the_full_score_matrix():
    """Every tensor the loss stage allocates is at most mini_batch_size x (candidates) elements, plus O(B d)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    batch_size, mini_batch_size, dim = 400, 16, 8
    largest = []

    class LargestOutput(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    largest.append(tensor.numel())
            return out

    reps = cached_reps(batch_size, mini_batch_size, dim=dim)
    loss = CachedWEINCELoss(None, mini_batch_size=mini_batch_size, directions=("query_to_doc", "doc_to_doc"))
    with LargestOutput():
        loss.calculate_loss(reps, None, with_backward=True)
    full_matrix = batch_size * 3 * batch_size
    assert max(largest) <= mini_batch_size * 3 * batch_size
    assert max(largest) < full_matrix / 10


@pytest.mark.slow
def test_trainer_with_prepare_trainer_logs_and_trains(tiny_model, tmp_path, one_torch_thread):
    from datasets import Dataset

    from st_weince.training import prepare_trainer

    sentences = TINY_SENTENCES * 2
    dataset = Dataset.from_dict(
        {"anchor": sentences, "positive": sentences[::-1], "negative": sentences[1:] + sentences[:1]}
    )
    loss = CachedWEINCELoss(tiny_model, mini_batch_size=5)
    trainer = build_trainer(
        tiny_model,
        loss,
        tmp_path / "out",
        dataset=dataset,
        per_device_train_batch_size=24,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
    )
    prepare_trainer(trainer)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, tiny_model.parameters())), "training changed nothing"
    logged = [record for record in trainer.state.log_history if "loss" in record]
    assert len(logged) == 2
    for record in logged:
        assert 0.0 <= record["weince_lambda_mean"] <= 1.0 and record["weince_rho0"] > 0.0
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


def test_the_loss_stage_holds_one_chunk_of_scores_at_a_time(one_torch_thread):
    """Memory is the point of the cached loss: the loss stage may hold the blocks of ONE [mini_batch, B] row chunk
    at a time (the score block and the fused cross-entropy's shortfall, logits and log-probabilities: four) plus
    embedding-sized tensors (the leaves, their gradients, the unit-length copies, theirs). A reference kept from one
    chunk into the next (as a named ``layout.groups[0]`` once did) costs a fifth block."""
    batch, mini_batch, dim = 4096, 256, 4  # the blocks (4 MiB each) dwarf the embeddings (0.125 MiB a column pair)
    generator = torch.Generator().manual_seed(0)
    anchors = torch.randn(batch, dim, generator=generator)
    columns = (anchors, anchors + 0.5 * torch.randn(batch, dim, generator=generator))
    reps = [[c[b : b + mini_batch].clone().requires_grad_() for b in range(0, batch, mini_batch)] for c in columns]
    loss = CachedWEINCELoss(None, mini_batch_size=mini_batch)
    peak = cpu_peak_bytes(lambda: loss.calculate_loss(reps, None, with_backward=True))
    block, embeddings = mini_batch * batch * 4, 2 * batch * dim * 4
    assert peak <= 4 * block + 4 * embeddings, f"peak {peak / block:.2f} blocks of [{mini_batch}, {batch}]"
