"""Run by tests/losses/test_rb_sigmoid_exchange.py in N processes with torchrun's environment (gloo, CPU), N = 2 and 4.

Everything in float64 (embeddings and loss parameters), so that two code paths agree to rounding. Each rank takes its
slice of one global batch and records ``checks[name] = (distributed value, reference value)`` pairs:

- embeddings: RBSigmoidLoss with ``exchange="neighbour"`` and with ``"all_gather"``, and the loss stage of
  CachedRBSigmoidLoss with ``"neighbour"``, against the single-process RBSigmoidLoss on the global batch: the global
  loss (mean of the rank losses), the gradients of this rank's rows (scaled as the global mean's), the loss
  parameters' gradients averaged over ranks and the guard's masked share; the logged margin (of the local anchors)
  against the all-gather run's;
- a tiny BERT: MatryoshkaLoss and gradient accumulation over two micro-batches (with hard negatives and the
  false-negative guard), uncached and cached, neighbour against all-gather and against one process: the model's
  gradients averaged over ranks (as DDP averages them) and the loss parameters' gradients;
- the exchange itself: ``ring_blocks`` delivers every rank's block exactly once, and ``ring_shift``'s backward
  returns each gradient to its sender;
- the host-device syncs of a step, and the largest candidate matrix a process holds, by exchange.

Also a DDP trainer run (SGD, no dropout) with the neighbour exchange against one with all-gather: the same ``t`` and
``b_rel`` after a few steps. Written to OUTPUT_DIR/rank{r}.pt. Arguments: OUTPUT_DIR MODEL_DIR, MODEL_DIR the tiny
BERT of ``build_tiny_bert(MODEL_DIR, sentences=TINY_SENTENCES, seed=0)`` (conftest's ``tiny_model_dir``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from st_weince.functional.exchange import ring_blocks, ring_shift
from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss
from st_weince.utils.hotpath import count_host_syncs
from tests.rb_sigmoid_distributed_worker import ddp_training_arguments

# (loss options, number of columns): hard-negative columns, both parametrizations, symmetric, the locked adapter,
# candidate chunks, modalities and the false-negative guard (both rules).
SETTINGS = [
    ({}, 2),
    ({"parametrization": "absolute", "chunk_size": 5}, 3),
    ({"symmetric": True, "locked_adapter": True}, 4),
    ({"columns": "modalities"}, 3),
    ({"false_negative_filter": ("absolute", 0.3), "symmetric": True}, 3),
    ({"false_negative_filter": ("relative", 0.6), "chunk_size": 3}, 3),
]
GLOBAL_BATCH = 16
EMBEDDING_DIM = 12
CACHED_MINI_BATCH = 3  # does not divide the local batches of 8 and 4: the last chunk is short
MODEL_BATCH = 12
MODEL_OPTIONS = {"false_negative_filter": ("absolute", 0.2)}
MATRYOSHKA = ([32, 16], [1.0, 0.5])
TRAIN_STEPS = 3

Checks = dict[str, tuple[torch.Tensor, torch.Tensor]]


def global_batch(batch_size: int, num_columns: int, dim: int = EMBEDDING_DIM) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(4321)
    base = torch.randn(batch_size, dim, generator=generator, dtype=torch.float64)
    return [
        base + 0.8 * torch.randn(batch_size, dim, generator=generator, dtype=torch.float64) for _ in range(num_columns)
    ]


def averaged(tensor: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (DDP's gradient averaging; the global loss as the mean of the rank losses)."""
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def own_grads(loss_fn: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in loss_fn.named_parameters() if not n.startswith("model.")}


def embedding_checks(rank: int, world_size: int) -> tuple[Checks, dict]:
    checks: Checks = {}
    extra: dict = {"masked_share": {}, "local_log_t_grad": {}}
    local = GLOBAL_BATCH // world_size
    rows = slice(rank * local, (rank + 1) * local)
    for number, (options, num_columns) in enumerate(SETTINGS):
        columns = [c.requires_grad_(True) for c in global_batch(GLOBAL_BATCH, num_columns)]
        reference_fn = RBSigmoidLoss(None, **options).double()
        reference = reference_fn.compute_loss_from_embeddings(columns)
        reference.backward()
        reference_stats = reference_fn.pop_logged_statistics()
        runs = (("all_gather", RBSigmoidLoss), ("neighbour", RBSigmoidLoss), ("neighbour", CachedRBSigmoidLoss))
        for exchange, cls in runs:
            name = f"setting{number}-{exchange}-{'cached' if cls is CachedRBSigmoidLoss else 'uncached'}"
            extra_options = {"mini_batch_size": CACHED_MINI_BATCH} if cls is CachedRBSigmoidLoss else {}
            loss_fn = cls(None, gather_across_devices=True, exchange=exchange, **extra_options, **options).double()
            mine = [c[rows].detach().clone().requires_grad_(True) for c in columns]
            if cls is CachedRBSigmoidLoss:
                reps = [
                    [piece.detach().clone().requires_grad_(True) for piece in m.split(CACHED_MINI_BATCH)] for m in mine
                ]
                loss = loss_fn.calculate_loss(reps, with_backward=True)
                loss.backward()  # the loss parameters' term (the embeddings got their gradients inside)
                row_grads = [torch.cat([piece.grad for piece in column]) for column in reps]
            else:
                loss = loss_fn.compute_loss_from_embeddings(mine)
                loss.backward()
                row_grads = [m.grad for m in mine]
            checks[f"{name}/loss"] = (averaged(loss), reference.detach())
            for index, grad in enumerate(row_grads):
                # This rank's rows receive d(sum of rank losses)/d(rows) = world_size x d(global mean)/d(rows).
                checks[f"{name}/row_grads{index}"] = (grad / world_size, columns[index].grad[rows])
            local_grads = own_grads(loss_fn)
            extra["local_log_t_grad"][name] = local_grads["log_t"]
            for parameter, grad in local_grads.items():
                checks[f"{name}/{parameter}.grad"] = (averaged(grad), reference_fn.get_parameter(parameter).grad)
            statistics = loss_fn.pop_logged_statistics()
            if "false_negative_filter" in options:
                extra["masked_share"][name] = statistics["rb_sigmoid_fn_masked_share"]
                # The guard's shares are those of the local anchors: against the reference's rows via their mean.
                share = torch.tensor(statistics["rb_sigmoid_fn_masked_share"], dtype=torch.float64)
                checks[f"{name}/masked_share"] = (
                    averaged(share),
                    torch.tensor(reference_stats["rb_sigmoid_fn_masked_share"], dtype=torch.float64),
                )
            # The margin is that of the local anchors' block (its extremes): against the all-gather run's, same rank.
            if exchange == "all_gather":
                all_gather_margin = torch.tensor(statistics["rb_sigmoid_margin"], dtype=torch.float64)
            else:
                margin = torch.tensor(statistics["rb_sigmoid_margin"], dtype=torch.float64)
                checks[f"{name}/margin"] = (margin, all_gather_margin)
    return checks, extra


def exchange_checks(rank: int, world_size: int) -> Checks:
    """The ring itself: every block exactly once, from the right source; gradients back to their senders."""
    checks: Checks = {}
    block = torch.full((2, 3), float(rank), dtype=torch.float64, requires_grad=True)
    sources, weights = [], []
    total = block.new_zeros(())
    for source, received in ring_blocks(block):
        sources.append(source)
        checks[f"ring/block-from-{source}"] = (
            received.detach(),
            torch.full((2, 3), float(source), dtype=torch.float64),
        )
        # Rank r weights the block of rank s by (r + 1) * (s + 2): the owner s then receives sum_r (r + 1) (s + 2).
        weight = (rank + 1) * (source + 2)
        weights.append(weight)
        total = total + weight * received.sum()
    total.backward()
    checks["ring/sources"] = (torch.tensor(sorted(sources)), torch.arange(world_size))
    expected = sum(r + 1 for r in range(world_size)) * (rank + 2)
    checks["ring/gradient-home"] = (block.grad, torch.full((2, 3), float(expected), dtype=torch.float64))
    # Two tensors at once, in opposite directions (as a bidirectional step sends them).
    left, right = ring_shift((block.detach() + 0.5, block.detach() - 0.5), (1, -1))
    checks["ring/shift-left"] = (left, torch.full((2, 3), (rank - 1) % world_size + 0.5, dtype=torch.float64))
    checks["ring/shift-right"] = (right, torch.full((2, 3), (rank + 1) % world_size - 0.5, dtype=torch.float64))
    return checks


def hard_negative_columns(rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's slice of a global (anchor, positive, negative) batch."""
    local = GLOBAL_BATCH // world_size
    return [c[rank * local : (rank + 1) * local].detach() for c in global_batch(GLOBAL_BATCH, 3)]


def hard_negative_step(loss_fn: RBSigmoidLoss, columns: list[torch.Tensor]) -> None:
    """Forward and backward on ``columns``; the cached loss's stage in mini-batches."""
    if isinstance(loss_fn, CachedRBSigmoidLoss):
        reps = [[piece.requires_grad_() for piece in c.split(CACHED_MINI_BATCH)] for c in columns]
        loss_fn.calculate_loss(reps, with_backward=True).backward()
    else:
        loss_fn.compute_loss_from_embeddings([c.requires_grad_() for c in columns]).backward()


def host_syncs(rank: int, world_size: int) -> dict[str, int]:
    """Host-device syncing ops in one forward and backward (guard and hard negatives on), by exchange, loss and
    ``check_inputs``."""
    counts = {}
    for exchange in ("all_gather", "neighbour"):
        for cls in (RBSigmoidLoss, CachedRBSigmoidLoss):
            for check_inputs in (True, False):
                options = {"mini_batch_size": CACHED_MINI_BATCH} if cls is CachedRBSigmoidLoss else {}
                loss_fn = cls(
                    None,
                    gather_across_devices=True,
                    exchange=exchange,
                    check_inputs=check_inputs,
                    false_negative_filter=("absolute", 0.3),
                    **options,
                )
                columns = hard_negative_columns(rank, world_size)
                with count_host_syncs() as syncs:
                    hard_negative_step(loss_fn, columns)
                counts[f"{exchange}-{cls.__name__}-check_inputs={check_inputs}"] = syncs.total
    return counts


class EmbeddingRows(TorchDispatchMode):
    """The most rows of any [rows, dim] tensor an op produces (the all-gathered candidate matrix, if any)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim, self.rows = dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] == self.dim:
                self.rows = max(self.rows, tensor.shape[0])
        return output


def largest_candidate_matrices(rank: int, world_size: int) -> dict[str, int]:
    """Rows of the largest [rows, dim] tensor in a forward and backward with a hard-negative column, by exchange and
    loss: with the neighbour exchange one process's block of candidates (2 x local batch), never the global matrix."""
    rows = {}
    for exchange in ("all_gather", "neighbour"):
        for cls in (RBSigmoidLoss, CachedRBSigmoidLoss):
            options = {"mini_batch_size": CACHED_MINI_BATCH} if cls is CachedRBSigmoidLoss else {}
            loss_fn = cls(None, gather_across_devices=True, exchange=exchange, symmetric=True, **options)
            columns = hard_negative_columns(rank, world_size)
            with EmbeddingRows(EMBEDDING_DIM) as recorder:
                hard_negative_step(loss_fn, columns)
            rows[f"{exchange}-{cls.__name__}"] = recorder.rows
    return rows


def texts(batch: int, seed: int) -> list[list[str]]:
    from tests.conftest import TINY_SENTENCES

    rng = random.Random(seed)
    words = " ".join(TINY_SENTENCES).split()
    return [[" ".join(rng.choices(words, k=rng.randint(2, 9))) for _ in range(batch)] for _ in range(3)]


def load_model(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.train()
    return model.double()


def wrapped_loss(model, cls, matryoshka: bool, **options):
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    if cls is CachedRBSigmoidLoss:
        options["mini_batch_size"] = 2
    inner = cls(model, **MODEL_OPTIONS, **options).double().mark_state_managed()  # model_step is the loop
    return (MatryoshkaLoss(model, inner, *MATRYOSHKA) if matryoshka else inner), inner


def model_step(model, loss_fn, inner, batches: list[list[list[str]]]) -> tuple[dict, dict]:
    """Forward and backward of each micro-batch with its loss divided by their number (as the trainer's gradient
    accumulation does); the model's and the loss parameters' gradients."""
    model.zero_grad(set_to_none=True)
    inner.zero_grad(set_to_none=True)
    for batch in batches:
        value = loss_fn([model.tokenize(column) for column in batch], None)
        (value / len(batches)).backward()
    model_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return model_grads, own_grads(inner)


def model_checks(rank: int, world_size: int, model_dir: Path) -> Checks:
    checks: Checks = {}
    model = load_model(model_dir)
    local = MODEL_BATCH // world_size
    scenarios = {
        "matryoshka": (True, [texts(MODEL_BATCH, seed=5)]),
        "accumulation": (False, [texts(MODEL_BATCH, seed=6), texts(MODEL_BATCH, seed=7)]),
    }
    for scenario, (matryoshka, global_batches) in scenarios.items():
        mine = [[column[rank * local : (rank + 1) * local] for column in batch] for batch in global_batches]
        reference = model_step(model, *wrapped_loss(model, RBSigmoidLoss, matryoshka), global_batches)
        runs = (
            ("neighbour", RBSigmoidLoss),
            ("all_gather", RBSigmoidLoss),
            ("neighbour", CachedRBSigmoidLoss),
            ("all_gather", CachedRBSigmoidLoss),
        )
        for exchange, cls in runs:
            name = f"model-{scenario}-{exchange}-{'cached' if cls is CachedRBSigmoidLoss else 'uncached'}"
            loss_fn, inner = wrapped_loss(model, cls, matryoshka, gather_across_devices=True, exchange=exchange)
            model_grads, loss_grads = model_step(model, loss_fn, inner, mine)
            assert model_grads.keys() == reference[0].keys()
            for parameter, grad in model_grads.items():
                checks[f"{name}/model.{parameter}.grad"] = (averaged(grad), reference[0][parameter])
            for parameter, grad in loss_grads.items():
                checks[f"{name}/{parameter}.grad"] = (averaged(grad), reference[1][parameter])
    return checks


def trainer_run(output_dir: Path, model_dir: Path, exchange: str) -> list[float]:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer

    from st_weince.training import prepare_trainer
    from tests.conftest import TINY_SENTENCES

    model = load_model(model_dir).float()
    sentences = TINY_SENTENCES * 3
    dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences[5:] + sentences[:5]})
    loss = RBSigmoidLoss(model, gather_across_devices=True, exchange=exchange)
    args = ddp_training_arguments(
        output_dir / f"run-{exchange}",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=TRAIN_STEPS,
        optim="sgd",
        learning_rate=1e-3,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    prepare_trainer(trainer)
    trainer.train()
    return [loss.scale.item(), loss.b_rel.item()]


def main() -> None:
    output_dir = Path(sys.argv[1])
    model_dir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checks, extra = embedding_checks(rank, world_size)
    checks.update(exchange_checks(rank, world_size))
    extra["host_syncs"] = host_syncs(rank, world_size)
    extra["candidate_rows"] = largest_candidate_matrices(rank, world_size)
    checks.update(model_checks(rank, world_size, model_dir))
    trainer = {exchange: trainer_run(output_dir, model_dir, exchange) for exchange in ("neighbour", "all_gather")}
    torch.save({"checks": checks, "extra": extra, "trainer": trainer}, output_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
