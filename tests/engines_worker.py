"""Run by tests/training/test_engines.py in 2 processes with torchrun's environment (gloo, CPU;
:func:`tests.forked.run_ranks`), one launch per engine running the four losses (WEINCE, RB-Sigmoid and both cached
variants, gather_across_devices=True) on conftest's tiny BERT without dropout.

- ``ddp``: the sentence-transformers trainer (``use_cpu=True``, DDP, prepare_trainer, AdamW, 3 steps, a checkpoint at
  step 2), recording each rank's batch and gradients at step 1 (model and loss parameters, as the optimizer gets
  them), the loss parameters and the model after 3 steps, the same after a resume from checkpoint-2, and the number of
  DDP gradient all-reduces (a counting comm hook). Then, on the same 2-process group, the trainer without
  ``use_cpu=True`` (NOT_PARALLEL): prepare_trainer's error and the loss's first-step error.
- ``fsdp2``: a training loop of its own with ``fully_shard`` (each BERT layer and the root), SGD with momentum,
  average_loss_gradients and clip_loss_gradients, 3 steps on fixed per-rank slices of one global batch; a
  checkpoint (full model state dict, optimizer state, loss state) after step 2 and a resume from it.

``python -m tests.engines_worker ENGINE OUTPUT_DIR MODEL_DIR``: everything goes to OUTPUT_DIR/ENGINE-rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss

LOSSES = {
    "weince": (WEINCELoss, {}),
    "rb-sigmoid": (RBSigmoidLoss, {}),
    "cached-weince": (CachedWEINCELoss, {"mini_batch_size": 2}),
    "cached-rb-sigmoid": (CachedRBSigmoidLoss, {"mini_batch_size": 2}),
}
# The uncached loss of each: the one-process reference with the global batch
UNCACHED = {"weince": WEINCELoss, "rb-sigmoid": RBSigmoidLoss, "cached-weince": WEINCELoss,
            "cached-rb-sigmoid": RBSigmoidLoss}  # fmt: skip
PER_RANK_BATCH = 4
STEPS = 3
SAVE_STEP = 2


def load_model(model_dir: Path):
    """The tiny BERT without dropout: every forward deterministic, so that two engines can be compared."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def build_loss(name: str, model) -> torch.nn.Module:
    cls, options = LOSSES[name]
    return cls(model, gather_across_devices=True, **options)


def dataset():
    from datasets import Dataset

    from tests.conftest import TINY_SENTENCES

    sentences = TINY_SENTENCES * 2
    return Dataset.from_dict({"anchor": sentences, "positive": sentences[3:] + sentences[:3]})


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ----- DDP through the trainer -----


def ddp_part(output_dir: Path, model_dir: Path) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    from st_weince.training import prepare_trainer

    class Record(TrainerCallback):
        """The step-1 gradients as the optimizer gets them, and DDP's gradient all-reduces (a counting comm hook)."""

        def __init__(self) -> None:
            self.trainer: Any = None
            self.grads: dict[str, torch.Tensor] = {}
            self.allreduces = 0

        def on_step_begin(self, args, state, control, **kwargs):
            ddp = self.trainer.model_wrapped
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and not getattr(ddp, "_counted", False):
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                def counting_hook(process_group, bucket):
                    self.allreduces += 1
                    return allreduce_hook(process_group, bucket)

                ddp.register_comm_hook(None, counting_hook)
                ddp._counted = True

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 0:
                own = {f"loss.{n}": p for n, p in self.trainer.loss.state_tensors().items()}
                named = [*self.trainer.model.named_parameters(), *own.items()]
                self.grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}

    def trainer_run(name: str, run_dir: Path, resume: str | None = None):
        model = load_model(model_dir)
        loss = build_loss(name, model)
        batches: list = []
        loss.register_forward_pre_hook(lambda module, inputs: batches.append(inputs[0]) if not batches else None)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(run_dir), use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=True,
            per_device_train_batch_size=PER_RANK_BATCH, max_steps=STEPS, learning_rate=1e-3,
            lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="steps", save_steps=SAVE_STEP,
            logging_steps=1, report_to=[], disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0,
        )  # fmt: skip
        record = Record()
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset(), loss=loss,
                                             callbacks=[record])  # fmt: skip
        record.trainer = trainer
        prepare_trainer(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return {
            "world_size": args.world_size,
            "batch": [{k: v.clone() for k, v in f.items() if isinstance(v, torch.Tensor)} for f in batches[0]],
            "grads": record.grads,
            "loss_parameters": {n: p.detach().clone() for n, p in loss.state_tensors().items()},
            "model": snapshot(model),
            "allreduces": record.allreduces,
        }

    results: dict[str, Any] = {}
    for name in LOSSES:
        run_dir = output_dir / f"ddp-{name}"
        whole = trainer_run(name, run_dir)
        checkpoint = run_dir / f"checkpoint-{SAVE_STEP}"
        resumed = trainer_run(name, output_dir / f"ddp-{name}-resumed", resume=str(checkpoint))
        results[name] = {"whole": whole, "resumed": resumed}
    results["unparallel"] = unparallel_part(output_dir, model_dir)
    return results


def unparallel_part(output_dir: Path, model_dir: Path) -> dict[str, str | None]:
    """The trainer without use_cpu=True on this 2-process group: transformers trains NOT_PARALLEL."""
    from accelerate.state import AcceleratorState
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from st_weince.training import prepare_trainer

    AcceleratorState._reset_state(reset_partial_state=True)  # as a fresh script: transformers sets accelerate up
    errors: dict[str, str | None] = {}
    for who in ("prepare_trainer", "first_step"):
        model = load_model(model_dir)
        loss = WEINCELoss(model, gather_across_devices=True)
        args = SentenceTransformerTrainingArguments(output_dir=str(output_dir / f"unparallel-{who}"), report_to=[],
                                                    disable_tqdm=True, max_steps=1, per_device_train_batch_size=4,
                                                    save_strategy="no")  # fmt: skip
        errors["world_size"] = str(args.world_size)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset(), loss=loss)
        try:
            if who == "prepare_trainer":
                prepare_trainer(trainer)
            else:
                trainer.train()  # WEINCE needs no prepare_trainer: its first training step checks
        except RuntimeError as error:
            errors[who] = str(error)
        else:
            errors[who] = None
    return errors


# ----- FSDP2 in a loop of its own -----


def global_batch(model) -> list[dict[str, torch.Tensor]]:
    """One tokenized global batch of 2 x PER_RANK_BATCH pairs (the same on every rank)."""
    data = dataset()[: 2 * PER_RANK_BATCH]
    return [model.preprocess(data[column]) for column in ("anchor", "positive")]


def rank_slice(features: list[dict[str, torch.Tensor]], rank: int) -> list[dict[str, torch.Tensor]]:
    rows = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    return [{k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in f.items()} for f in features]


def fsdp_part(output_dir: Path, model_dir: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from st_weince.training import average_loss_gradients, clip_loss_gradients, load_loss_state, save_loss_state

    rank = dist.get_rank()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def setup(name: str):
        model = load_model(model_dir)
        bert = model[0].auto_model
        if getattr(bert, "pooler", None) is not None:  # unused by mean pooling: no gradient, no optimizer state
            bert.pooler.requires_grad_(False)
        for layer in bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        loss = build_loss(name, model)
        loss.mark_state_managed("tests/engines_worker.py: average_loss_gradients, clip_loss_gradients, loss state")
        # The model's (sharded) parameters and the loss's own (whole on every rank) in two optimizers, so that the
        # model's optimizer state goes through torch.distributed.checkpoint's state-dict helpers
        own = list(loss.state_tensors().values())
        optimizers = [torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)]
        optimizers += [torch.optim.SGD(own, lr=3e-2, momentum=0.9)] if own else []
        return model, loss, optimizers

    def step(model, loss, optimizers, features) -> dict[str, torch.Tensor]:
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.train()
        value = loss(rank_slice(features, rank))
        value.backward()
        average_loss_gradients(loss)  # FSDP reduce-scatters the model's; the loss's own need this call
        clip_loss_gradients(loss, 1e6)  # the documented call (max_grad_norm); a bound that does not act here
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        grads.update({f"loss.{n}": p.grad.clone() for n, p in loss.state_tensors().items() if p.grad is not None})
        for optimizer in optimizers:
            optimizer.step()
        loss.after_optimizer_step()
        return grads

    results: dict[str, Any] = {}
    for name in LOSSES:
        model, loss, optimizers = setup(name)
        features = global_batch(model)
        grads = step(model, loss, optimizers, features)
        step(model, loss, optimizers, features)
        checkpoint = output_dir / f"fsdp-{name}-step{SAVE_STEP}"
        model_state = get_model_state_dict(model, options=full)
        optimizer_state = get_optimizer_state_dict(model, optimizers[0], options=full)
        if rank == 0:
            checkpoint.mkdir(parents=True, exist_ok=True)
            own_state = [o.state_dict() for o in optimizers[1:]]
            torch.save({"model": model_state, "optimizer": optimizer_state, "loss_optimizer": own_state},
                       checkpoint / "engine.pt")  # fmt: skip
            save_loss_state(loss, checkpoint)
        dist.barrier()
        step(model, loss, optimizers, features)
        whole = {"model": get_model_state_dict(model, options=full),
                 "loss_parameters": {n: p.detach().clone() for n, p in loss.state_tensors().items()}}  # fmt: skip

        model, loss, optimizers = setup(name)
        saved = torch.load(checkpoint / "engine.pt", weights_only=False)
        loading = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, saved["model"], options=loading)
        set_optimizer_state_dict(model, optimizers[0], saved["optimizer"], options=loading)
        for optimizer, state in zip(optimizers[1:], saved["loss_optimizer"]):
            optimizer.load_state_dict(state)
        load_loss_state(loss, checkpoint)
        step(model, loss, optimizers, features)
        resumed = {"model": get_model_state_dict(model, options=full),
                   "loss_parameters": {n: p.detach().clone() for n, p in loss.state_tensors().items()}}  # fmt: skip
        results[name] = {"grads": grads, "batch": features, "whole": whole, "resumed": resumed}
    return results


def main() -> None:
    engine, output_dir, model_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    part = {"ddp": ddp_part, "fsdp2": fsdp_part}[engine]
    results = part(output_dir, model_dir)
    torch.save(results, output_dir / f"{engine}-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
