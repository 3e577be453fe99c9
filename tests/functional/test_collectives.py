"""The exchanges of both losses through torch's functional collectives, in 2 processes (gloo, CPU; torchrun's
environment, forked by tests/forked.py; the worker is tests/collectives_worker.py):

- no FutureWarning or DeprecationWarning from a forward and backward (``torch.distributed.nn.all_gather``, which the
  losses used through sentence-transformers' ``all_gather_with_grad``, warns from torch 2.13 on);
- ``torch.compile(fullgraph=True)`` of each loss with the live process group gives eager's loss and gradients (the
  neighbour exchange's ``dist.P2POp`` and ``torch.distributed.nn.all_gather`` did not compile);
- the all-gathers equal references built from plain ``torch.distributed`` calls bit for bit, values and gradients
  (2 processes: a sum of two is exact in either order)."""

from __future__ import annotations

import pytest
import torch

from tests.collectives_worker import DIM, LOCAL_BATCH, LOSSES
from tests.forked import run_ranks

FLOAT32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def ranks(fork_server, tmp_path_factory) -> list[dict]:
    output_dir = tmp_path_factory.mktemp("collectives")
    run_ranks(fork_server, "tests.collectives_worker", [output_dir], output_dir, nproc=2)
    return [torch.load(output_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_no_deprecation_warnings(ranks, name):
    for rank, result in enumerate(ranks):
        assert result["warnings"][name] == [], f"rank {rank}"


@pytest.mark.distributed
@pytest.mark.kernels
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_compiled_fullgraph_with_a_process_group_equals_eager(ranks, name):
    # Compiled and eager kernels sum in another order: each score is a sum of DIM products and the loss a sum over
    # the 2 x LOCAL_BATCH candidates of every anchor, so both sides round differently by at most a few ulps per term.
    tolerance = 4 * FLOAT32_EPS * (DIM + 2 * LOCAL_BATCH)
    for rank, result in enumerate(ranks):
        compiled = result["compiled"][name]
        assert "error" not in compiled, f"rank {rank}: {compiled.get('error')}"
        got, expected = compiled["loss"]
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=0, msg=f"rank {rank}: loss")
        # both columns, and RB-Sigmoid's log_t and b_rel (WEINCE has no parameters)
        assert len(compiled["grads"]) == (2 if name == "weince" else 4)
        for index, (got, expected) in enumerate(compiled["grads"]):
            atol = tolerance * float(expected.abs().max())  # entries near zero: relative to the largest
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=atol, msg=f"rank {rank}: grad {index}")


@pytest.mark.distributed
def test_collectives_equal_plain_torch_distributed_references_bit_for_bit(ranks):
    """all_gather_with_grad against dist.all_gather (values) and every process's output weights summed over the own
    rows (the gradient sent home), all_gather against sentence-transformers' (int64 keys beyond float32's integers;
    the own rows keep their gradient)."""
    for rank, result in enumerate(ranks):
        assert set(result["exact"]) == {
            "with_grad/values",
            "with_grad/grads",
            "keys",
            "without_grad/values",
            "without_grad/own_grads",
        }
        for name, (got, expected) in result["exact"].items():
            assert got.dtype == expected.dtype and torch.equal(got, expected), f"rank {rank}: {name}"


@pytest.fixture(scope="module")
def ring_memory(fork_server, tmp_path_factory) -> dict[int, list[dict]]:
    results = {}
    for world_size in (1, 4):
        output_dir = tmp_path_factory.mktemp(f"ring-memory-{world_size}")
        run_ranks(fork_server, "tests.ring_memory_worker", [output_dir], output_dir, nproc=world_size)
        results[world_size] = [torch.load(output_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    return results


@pytest.mark.distributed
def test_neighbour_exchange_keeps_for_backward_what_one_process_keeps(ring_memory):
    """RBSigmoidLoss, 256 x 64 per process: the bytes autograd saves in the forward at 4 processes are at most 1.10x
    those at 1 with the neighbour exchange (dc2955f: 3.2x, every received block and its scores kept), while the
    scheme it replaced and the all-gather grow with the world size."""
    one = ring_memory[1][0]
    for rank, result in enumerate(ring_memory[4]):
        assert result["neighbour"]["saved_bytes"] <= 1.10 * one["neighbour"]["saved_bytes"], f"rank {rank}"
        assert result["neighbour-kept"]["saved_bytes"] > 2 * one["neighbour-kept"]["saved_bytes"]  # not vacuous
        assert result["all_gather"]["saved_bytes"] > 2 * one["all_gather"]["saved_bytes"]


@pytest.mark.distributed
def test_recomputing_ring_gradients_equal_the_kept_scheme(ring_memory):
    """Float32: each block's gradient is recomputed by the same kernels on the same values, so only the order in
    which the world size's block contributions are summed differs: a few ulps of the largest entry per term."""
    for world_size, ranks in ring_memory.items():
        tolerance = 2 * world_size * FLOAT32_EPS
        for rank, result in enumerate(ranks):
            pairs = zip(result["neighbour"]["grads"], result["neighbour-kept"]["grads"])
            for index, (got, expected) in enumerate(pairs):
                atol = tolerance * float(expected.abs().max())
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=atol, msg=f"{world_size}/{rank}/{index}")
