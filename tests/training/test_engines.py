"""The engine matrix on CPU processes (gloo), issue 53: DDP through the sentence-transformers trainer (2 processes,
``use_cpu=True``) and FSDP2 ``fully_shard`` in a loop of its own (2 processes), each with WEINCE, RB-Sigmoid and both
cached variants under ``gather_across_devices=True`` (tests/engines_worker.py, one launch per engine):

- the gradients at step 1 (the model's and the loss's own parameters, as the optimizer gets them) equal one process
  with the global batch;
- the loss parameters (and, under DDP, the model) are equal on every process after 3 optimizer steps;
- a resume from the checkpoint of step 2 ends bit for bit where the uninterrupted run does;
- the cached losses all-reduce the model's gradients as often as the uncached ones (once per optimizer step: issue
  53 item 6; sentence-transformers 6.2's GradCache did it once per mini-batch);
- the trainer without ``use_cpu=True`` on the same 2-process group (NOT_PARALLEL) is refused, by prepare_trainer and
  by the loss's first training step.

The trainer's FSDP and DeepSpeed paths need a GPU (docs/distributed.md): benchmarks/gpu_check.py runs them there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sentence_transformers.base.losses.merged_forward import embed_columns

from tests.engines_worker import LOSSES, PER_RANK_BATCH, STEPS, UNCACHED, load_model, rank_slice
from tests.forked import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EPS = torch.finfo(torch.float32).eps
# Two float32 paths to one gradient differ in the order of their sums: the all-reduce's (g0 + g1) / 2 against one
# process's sum over the global batch, and the gathered blocks of scores against one matrix. Each term is rounded
# once per addition, and a gradient entry sums over the 2 columns x 8 rows of the global batch, each through a sum
# over its 16 candidates: a relative error of at most about EPS x (2 x 8 x 16) of the gradient's norm.
GRADIENT_TOLERANCE = EPS * 2 * 2 * PER_RANK_BATCH * 16


def launch(fork_server, tmp_path_factory, tiny_model_dir, engine: str) -> list[dict]:
    output_dir = tmp_path_factory.mktemp(f"engine-{engine}")
    run_ranks(fork_server, "tests.engines_worker", [engine, output_dir, tiny_model_dir], output_dir, timeout=560)
    return [torch.load(output_dir / f"{engine}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def ddp(fork_server, tmp_path_factory, tiny_model_dir) -> list[dict]:
    return launch(fork_server, tmp_path_factory, tiny_model_dir, "ddp")


@pytest.fixture(scope="module")
def fsdp2(fork_server, tmp_path_factory, tiny_model_dir) -> list[dict]:
    return launch(fork_server, tmp_path_factory, tiny_model_dir, "fsdp2")


def one_process_gradients(model_dir: Path, name: str, rank_batches: list[list[dict]]) -> dict[str, torch.Tensor]:
    """The gradients of one process with the global batch: each rank's rows embedded as that rank did (its own
    padding), the columns concatenated, the uncached loss without gathering."""
    model = load_model(model_dir)
    loss = UNCACHED[name](model)
    per_rank = [embed_columns(model, batch) for batch in rank_batches]
    columns = [torch.cat([rank[c] for rank in per_rank]) for c in range(len(per_rank[0]))]
    loss.compute_loss_from_embeddings(columns).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads.update({f"loss.{n}": p.grad for n, p in loss.state_tensors().items() if p.grad is not None})
    return grads


def assert_gradients_equal(engine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Each gradient within GRADIENT_TOLERANCE of its norm. A gradient that is zero in exact arithmetic (an attention
    key bias: softmax ignores a shift common to all keys) holds rounding only: it must stay below EPS x the norm of
    all the gradients."""
    assert set(engine) == set(reference)
    total = float(torch.cat([g.reshape(-1) for g in reference.values()]).norm())
    for name, expected in reference.items():
        error, size = float((engine[name] - expected).norm()), float(expected.norm())
        bound = GRADIENT_TOLERANCE * size if size > EPS * total else EPS * total
        assert error <= bound, (name, error, size)


def assert_bit_equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], what: str) -> None:
    assert set(first) == set(second)
    different = [n for n in first if not torch.equal(first[n], second[n])]
    assert not different, f"{what}: {different}"


@pytest.mark.parametrize("name", list(LOSSES))
def test_ddp_trainer_gradients_equal_one_process(ddp, tiny_model_dir, name):
    runs = [ddp[r][name]["whole"] for r in range(2)]
    assert runs[0]["world_size"] == 2
    assert_bit_equal(runs[0]["grads"], runs[1]["grads"], "DDP gradients across ranks")
    reference = one_process_gradients(tiny_model_dir, name, [run["batch"] for run in runs])
    assert any(n.startswith("loss.") for n in reference) == name.endswith("rb-sigmoid")
    assert_gradients_equal(runs[0]["grads"], reference)


@pytest.mark.parametrize("name", list(LOSSES))
def test_ddp_trainer_processes_stay_equal_and_resume_bit_exact(ddp, name):
    whole = [ddp[r][name]["whole"] for r in range(2)]
    assert_bit_equal(whole[0]["loss_parameters"], whole[1]["loss_parameters"], "loss parameters across ranks")
    assert_bit_equal(whole[0]["model"], whole[1]["model"], "model across ranks")
    for rank in range(2):
        resumed = ddp[rank][name]["resumed"]
        assert_bit_equal(whole[rank]["loss_parameters"], resumed["loss_parameters"], f"resumed loss, rank {rank}")
        assert_bit_equal(whole[rank]["model"], resumed["model"], f"resumed model, rank {rank}")
    if name.endswith("rb-sigmoid"):
        start = load_model_free_start(name)
        assert any(not torch.equal(v, start[n]) for n, v in whole[0]["loss_parameters"].items()), "they must train"


def load_model_free_start(name: str) -> dict[str, torch.Tensor]:
    cls, options = LOSSES[name]
    return {n: p.detach() for n, p in cls(None, **options).state_tensors().items()}


@pytest.mark.parametrize("name", ["cached-weince", "cached-rb-sigmoid"])
def test_cached_losses_all_reduce_once_per_optimizer_step(ddp, name):
    """Two mini-batches per column and rank: 4 replays a step, one DDP gradient synchronisation, as uncached."""
    uncached = name.removeprefix("cached-")
    for rank in range(2):
        counts = {run: ddp[rank][name][run]["allreduces"] for run in ("whole", "resumed")}
        reference = {run: ddp[rank][uncached][run]["allreduces"] for run in ("whole", "resumed")}
        assert counts == reference
        buckets = counts["resumed"]  # the resumed run makes one optimizer step
        assert buckets >= 1 and counts["whole"] == STEPS * buckets


def test_the_trainer_without_use_cpu_is_refused_on_a_process_group(ddp):
    """torchrun on a CPU without use_cpu=True: transformers trains NOT_PARALLEL (world size 1) on a 2-process
    group; with gather_across_devices, prepare_trainer and (without it) the loss's first step refuse."""
    for rank in range(2):
        errors = ddp[rank]["unparallel"]
        assert errors["world_size"] == "1"
        for who in ("prepare_trainer", "first_step"):
            assert errors[who] is not None, who
            assert "process group of 2 processes, but the trainer trains on 1" in errors[who]
            assert "use_cpu=True" in errors[who] and "torchrun --nproc_per_node 2" in errors[who]


@pytest.mark.parametrize("name", list(LOSSES))
def test_fsdp2_loop_gradients_equal_one_process(fsdp2, tiny_model_dir, name):
    runs = [fsdp2[r][name] for r in range(2)]
    assert_bit_equal(runs[0]["grads"], runs[1]["grads"], "FSDP2 gradients across ranks")
    batches = [rank_slice(runs[0]["batch"], rank) for rank in range(2)]
    assert_gradients_equal(runs[0]["grads"], one_process_gradients(tiny_model_dir, name, batches))


@pytest.mark.parametrize("name", list(LOSSES))
def test_fsdp2_loop_processes_stay_equal_and_resume_bit_exact(fsdp2, name):
    runs = [fsdp2[r][name] for r in range(2)]
    assert_bit_equal(runs[0]["whole"]["loss_parameters"], runs[1]["whole"]["loss_parameters"], "loss across ranks")
    for rank in range(2):
        assert_bit_equal(runs[rank]["whole"]["loss_parameters"], runs[rank]["resumed"]["loss_parameters"], "resumed")
    assert_bit_equal(runs[0]["whole"]["model"], runs[0]["resumed"]["model"], "resumed model")
