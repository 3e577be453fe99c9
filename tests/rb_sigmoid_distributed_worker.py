"""Run by tests/losses/test_rb_sigmoid_distributed.py in 2 processes with torchrun's environment (gloo, CPU;
:func:`tests.forked.run_ranks`).

Part 1 (embeddings): each rank takes its slice of one global batch, computes RBSigmoidLoss with
gather_across_devices=True, back-propagates and records its loss, the gradients of its rows and the gradients of the
loss parameters before and after :func:`st_weince.training.average_loss_gradients`.
Also the loss stage of CachedRBSigmoidLoss (``calculate_loss``) on the same rows in mini-batches.
Part 2 (trainer): a tiny BERT trained for a few DDP steps with gather_across_devices=True, with and without
:func:`st_weince.training.prepare_trainer`, and (without dropout, SGD) with RBSigmoidLoss against
CachedRBSigmoidLoss; records t and b_rel on each rank.
Everything goes to OUTPUT_DIR/rank{r}.pt. ``python -m tests.rb_sigmoid_distributed_worker OUTPUT_DIR MODEL_DIR``:
MODEL_DIR, the tiny BERT of ``build_tiny_bert(MODEL_DIR, sentences=TINY_SENTENCES, seed=0)`` (conftest's
``tiny_model_dir``), which every run loads.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from st_weince.losses import CachedRBSigmoidLoss, RBSigmoidLoss
from st_weince.training import average_loss_gradients, prepare_trainer

# (loss options, number of columns): one launch runs them all, since starting processes is slow.
SETTINGS = [
    ({}, 2),
    ({"parametrization": "absolute", "chunk_size": 5}, 3),
    ({"symmetric": True, "locked_adapter": True}, 3),
    ({"columns": "modalities"}, 3),
    ({"false_negative_filter": ("absolute", 0.3), "symmetric": True}, 3),
]
GLOBAL_BATCH = 16
TRAIN_STEPS = 5  # issue 30: t equal on both ranks after 5 trainer steps
# Trainer runs: with and without prepare_trainer; and, without dropout, uncached against cached.
RUNS = ("prepared", "plain", "uncached", "cached")
CACHED_MINI_BATCH = 3  # does not divide the local batch of 8: the last chunk is short


def global_batch(batch_size: int, num_columns: int, dim: int = 12) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(4321)
    base = torch.randn(batch_size, dim, generator=generator)
    return [base + 0.8 * torch.randn(batch_size, dim, generator=generator) for _ in range(num_columns)]


def loss_parameter_grads(loss: RBSigmoidLoss) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in loss.named_parameters()}


def embedding_part(rank: int, world_size: int) -> list[dict]:
    results = []
    local = GLOBAL_BATCH // world_size
    for options, num_columns in SETTINGS:
        columns = global_batch(GLOBAL_BATCH, num_columns)
        mine = [c[rank * local : (rank + 1) * local].clone().requires_grad_(True) for c in columns]
        loss_fn = RBSigmoidLoss(None, gather_across_devices=True, **options)
        loss = loss_fn.compute_loss_from_embeddings(mine)
        loss.backward()
        before = loss_parameter_grads(loss_fn)
        average_loss_gradients(loss_fn)
        result = {
            "loss": loss.detach(),
            "grads": [m.grad for m in mine],
            "param_grads_local": before,
            "param_grads_averaged": loss_parameter_grads(loss_fn),
        }
        # The cached loss stage on the same rows, split into mini-batches as the mixin hands them over.
        cached_fn = CachedRBSigmoidLoss(None, gather_across_devices=True, mini_batch_size=CACHED_MINI_BATCH, **options)
        reps = [[piece.detach().clone().requires_grad_(True) for piece in m.split(CACHED_MINI_BATCH)] for m in mine]
        cached_loss = cached_fn.calculate_loss(reps, with_backward=True)
        cached_loss.backward()  # the loss parameters' term (the embeddings got their gradients inside)
        average_loss_gradients(cached_fn)
        result["cached"] = {
            "loss": cached_loss.detach(),
            "grads": [torch.cat([piece.grad for piece in column]) for column in reps],
            "param_grads_averaged": loss_parameter_grads(cached_fn),
        }
        results.append(result)
    return results


def ddp_training_arguments(output_dir: Path, **options: Any):
    """Training arguments of a short DDP run on CPU (gloo), constant rate, nothing saved or reported; ``options``
    add to or override them."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    defaults = {
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        "report_to": [],
        "seed": 0,
        "use_cpu": True,
        "disable_tqdm": True,
        "ddp_backend": "gloo",
        "ddp_find_unused_parameters": True,
    }
    return SentenceTransformerTrainingArguments(output_dir=str(output_dir), **{**defaults, **options})


def trainer_part(output_dir: Path, rank: int, model_dirs: dict[str, Path]) -> dict[str, list[float]]:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    from tests.conftest import TINY_SENTENCES

    sentences = TINY_SENTENCES * 3
    dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences[5:] + sentences[:5]})
    finals = {}
    for run in RUNS:
        model = SentenceTransformer(str(model_dirs[run]), device="cpu")
        if run != "plain" and run != "prepared":
            # Deterministic forward passes, so the cached and the uncached run can be compared.
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if run == "cached":
            loss = CachedRBSigmoidLoss(model, gather_across_devices=True, mini_batch_size=CACHED_MINI_BATCH)
        else:
            loss = RBSigmoidLoss(model, gather_across_devices=True)
        # Plain SGD for the cached comparison: Adam would hide a wrong gradient scale.
        compared = run in ("cached", "uncached")
        optimizer = {"optim": "sgd", "learning_rate": 1e-3} if compared else {"learning_rate": 5e-2}
        args = ddp_training_arguments(
            output_dir / f"run-{run}",
            per_device_train_batch_size=4,
            max_steps=TRAIN_STEPS,
            logging_steps=1,
            **optimizer,
        )
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
        if run == "plain":  # without prepare_trainer: refused at the first step on every rank, never a drift
            try:
                trainer.train()
            except RuntimeError as error:
                finals[run] = {"error": str(error), "values": [loss.scale.item(), loss.b_rel.item()]}
            else:
                finals[run] = {"error": None, "values": [loss.scale.item(), loss.b_rel.item()]}
            continue
        prepare_trainer(trainer)
        trainer.train()
        finals[run] = [loss.scale.item(), loss.b_rel.item()]
    return finals


def main() -> None:
    output_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    model_dirs = dict.fromkeys(RUNS, Path(sys.argv[2]))
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {"embedding": embedding_part(rank, world_size), "trainer": trainer_part(output_dir, rank, model_dirs)}
    torch.save(results, output_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
