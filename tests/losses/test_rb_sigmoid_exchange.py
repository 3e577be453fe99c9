"""RB-Sigmoid's neighbour exchange (``exchange="neighbour"``) in 2 and 4 processes (gloo, CPU; torchrun's environment,
forked by tests/forked.py), in
float64: loss, row gradients, model gradients and the gradients of ``t`` / ``b_rel`` equal the all-gather version and
one process on the same global batch to 1e-6, uncached and cached, with hard-negative columns, symmetric, modalities,
the locked adapter, the false-negative guard, under MatryoshkaLoss and with gradient accumulation; the ring delivers
every block once and returns every gradient to its sender; a DDP trainer run ends where the all-gather one does.
The worker is tests/rb_sigmoid_exchange_worker.py (one launch per process count checks everything)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss
from tests.forked import run_ranks
from tests.rb_sigmoid_exchange_worker import GLOBAL_BATCH, SETTINGS

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-6  # float64 on both paths: only the order of the sums differs


def launch(fork_server, tmp_path_factory, world_size: int, model_dir) -> list[dict]:
    output_dir = tmp_path_factory.mktemp(f"rb-sigmoid-exchange-{world_size}")
    argv = [output_dir, model_dir]  # every rank loads conftest's tiny BERT (build_tiny_bert, seed 0)
    run_ranks(fork_server, "tests.rb_sigmoid_exchange_worker", argv, output_dir, nproc=world_size)
    return [torch.load(output_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def ranks(request, fork_server, tmp_path_factory, tiny_model_dir) -> list[dict]:
    return launch(fork_server, tmp_path_factory, request.param, tiny_model_dir)


def assert_pairs(ranks: list[dict], prefix: str) -> int:
    compared = 0
    for rank, result in enumerate(ranks):
        for name, (got, expected) in result["checks"].items():
            if not name.startswith(prefix):
                continue
            # Entries that are mathematically zero hold only rounding noise: absolute tolerance from the largest.
            atol = TOLERANCE * max(float(expected.abs().max()), 1e-12)
            torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=atol, msg=f"rank {rank}: {name}")
            compared += 1
    return compared


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("path", ["neighbour-uncached", "all_gather-uncached", "neighbour-cached"])
def test_embeddings_equal_one_process(ranks, path):
    """Loss, every rank's row gradients, the averaged t / b_rel (/ adapter) gradients, margin and guard share."""
    compared = sum(assert_pairs(ranks, f"setting{number}-{path}/") for number in range(len(SETTINGS)))
    assert compared >= len(ranks) * len(SETTINGS) * 5
    # Not vacuous: before averaging the ranks' t gradients differ, and the guard removes candidates.
    local = [result["extra"]["local_log_t_grad"][f"setting0-{path}"] for result in ranks]
    assert not torch.allclose(local[0], local[1])
    for number, (options, _) in enumerate(SETTINGS):
        if "false_negative_filter" in options:
            assert ranks[0]["extra"]["masked_share"][f"setting{number}-{path}"] > 0.01


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["matryoshka", "accumulation"])
@pytest.mark.parametrize("path", ["neighbour-uncached", "all_gather-uncached", "neighbour-cached", "all_gather-cached"])
def test_model_gradients_equal_one_process(ranks, scenario, path):
    """A tiny BERT with hard negatives and the guard: model and loss-parameter gradients averaged over ranks equal
    one process on the global batch, under MatryoshkaLoss and with two accumulated micro-batches."""
    compared = assert_pairs(ranks, f"model-{scenario}-{path}/")
    assert compared > len(ranks) * 20
    names = ranks[0]["checks"].keys()
    assert {f"model-{scenario}-{path}/log_t.grad", f"model-{scenario}-{path}/b_rel.grad"} <= set(names)


@pytest.mark.distributed
@pytest.mark.slow
def test_ring_delivers_every_block_and_returns_gradients(ranks):
    assert assert_pairs(ranks, "ring/") == len(ranks) * (len(ranks) + 4)


@pytest.mark.distributed
@pytest.mark.slow
def test_no_host_syncs_added(ranks):
    """The exchange adds no host-device sync: as many as all-gather (the input check's one), none without checks."""
    for result in ranks:
        counts = result["extra"]["host_syncs"]
        for cls in ("RBSigmoidLoss", "CachedRBSigmoidLoss"):
            for check_inputs in (True, False):
                key = f"{cls}-check_inputs={check_inputs}"
                assert counts[f"neighbour-{key}"] == counts[f"all_gather-{key}"], (key, counts)
            assert counts[f"neighbour-{cls}-check_inputs=False"] == 0, counts


@pytest.mark.distributed
@pytest.mark.slow
def test_no_process_holds_the_global_candidate_matrix(ranks):
    """With a hard-negative column (symmetric: the anchors are candidates too) the largest [rows, dim] tensor is one
    process's block of positives and negatives under the neighbour exchange, the global matrix under all-gather."""
    world_size = len(ranks)
    local = GLOBAL_BATCH // world_size
    for result in ranks:
        rows = result["extra"]["candidate_rows"]
        for cls in ("RBSigmoidLoss", "CachedRBSigmoidLoss"):
            assert rows[f"neighbour-{cls}"] == 2 * local, rows
            assert rows[f"all_gather-{cls}"] == 2 * local * world_size, rows


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_trainer_run_equals_all_gather(ranks):
    """DDP with gradient accumulation and prepare_trainer: the exchange's backward transfers run beside DDP's
    gradient all-reduce, and t and b_rel end where the all-gather run ends, on every rank."""
    for result in ranks:
        assert result["trainer"]["neighbour"] == pytest.approx(result["trainer"]["all_gather"], rel=1e-6, abs=1e-7)
        assert result["trainer"]["neighbour"][0] != pytest.approx(10.0, rel=1e-5), "t must have moved"
        assert result["trainer"]["neighbour"] == pytest.approx(ranks[0]["trainer"]["neighbour"], rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("cls", [RBSigmoidLoss, CachedRBSigmoidLoss])
def test_exchange_option(cls):
    assert cls(None).get_config_dict()["exchange"] == "all_gather"
    loss = cls(None, gather_across_devices=True, exchange="neighbour")
    config = loss.get_config_dict()
    assert config["exchange"] == "neighbour"
    assert cls(None, **config).get_config_dict() == config
    with pytest.raises(ValueError, match="exchange='neighbour' .* needs gather_across_devices=True"):
        cls(None, exchange="neighbour")
    with pytest.raises(ValueError, match="exchange must be one of 'all_gather', 'neighbour', got 'ring'"):
        cls(None, gather_across_devices=True, exchange="ring")


def test_single_process_neighbour_exchange_is_the_local_loss():
    """Without a process group the ring holds only the local block: the loss is the plain one, guard included."""
    generator = torch.Generator().manual_seed(0)
    columns = [torch.randn(6, 8, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    options = {"false_negative_filter": ("absolute", 0.5), "symmetric": True}
    plain = RBSigmoidLoss(None, **options).double()
    exchanged = RBSigmoidLoss(None, gather_across_devices=True, exchange="neighbour", **options).double()
    expected = plain.compute_loss_from_embeddings(columns)
    got = exchanged.compute_loss_from_embeddings(columns)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert exchanged.pop_logged_statistics() == pytest.approx(plain.pop_logged_statistics(), rel=1e-12)


def test_ring_block_losses_without_processes_match_the_dense_loss():
    """One process: the ring holds the local block only; anchor chunks with their backward at once (the cached
    loss's stage) give the dense loss and its gradients, guard counts included."""
    from st_weince.functional.exchange import ring_block_losses, ring_shift
    from st_weince.functional.sigmoid import CandidateGuard, SigmoidLogits, chunked_sigmoid_contrastive_loss

    generator = torch.Generator().manual_seed(1)
    anchors = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    candidates = torch.randn(9, 5, generator=generator, dtype=torch.float64)
    positive_index = torch.tensor([0, 1, 2, 3, 4, 5, -1])
    logits, rule = SigmoidLogits(4.0, relative_bias=0.1), ("absolute", 1.0)
    dense_anchors, dense_candidates = anchors.clone().requires_grad_(), candidates.clone().requires_grad_()
    expected = chunked_sigmoid_contrastive_loss(
        dense_anchors, dense_candidates, positive_index, logits, guard=CandidateGuard(rule)
    )
    expected[0].backward()

    def block_loss(params, rows, block, index, positive_scores):
        guard = CandidateGuard(rule, positive_scores=positive_scores)
        return chunked_sigmoid_contrastive_loss(rows, block, index, logits, guard=guard)

    ring_anchors, ring_candidates = anchors.clone().requires_grad_(), candidates.clone().requires_grad_()
    got = ring_block_losses(ring_anchors, ring_candidates, positive_index, block_loss, anchor_chunk=3, backward=True)
    assert not got[0].requires_grad  # back-propagated chunk by chunk
    for value, reference in zip(got[:3], expected[:3]):
        torch.testing.assert_close(value, reference.detach(), rtol=1e-12, atol=0)
    assert torch.equal(got[3].masked, expected[3].masked) and torch.equal(got[3].negatives, expected[3].negatives)
    assert int(got[3].masked.sum()) > 0, "the guard must act for the counts to mean something"
    torch.testing.assert_close(ring_anchors.grad, dense_anchors.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ring_candidates.grad, dense_candidates.grad, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="give one shift per tensor"):
        ring_shift((anchors,), (1, -1))
