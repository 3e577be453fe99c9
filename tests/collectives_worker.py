"""Run by tests/functional/test_collectives.py in 2 processes with torchrun's environment (gloo, CPU).

Records, for WEINCELoss (``gather_across_devices=True``), RBSigmoidLoss with ``exchange="all_gather"`` and with
``exchange="neighbour"``:

- ``warnings``: the FutureWarning and DeprecationWarning messages of one forward and backward;
- ``compiled``: ``torch.compile(compute_loss_from_embeddings, fullgraph=True)`` with the live process group
  (``check_inputs=False``) against eager: ``(compiled, eager)`` loss and gradient pairs, or the compile error;

and the collectives against references built from plain ``torch.distributed`` calls (no deprecated API): the
gathered values against ``dist.all_gather`` into a list, the gradient sent home against the sum of every
process's output weights over this process's rows (with 2 processes one addition, so the order cannot differ), and
the no-gradient gather against sentence-transformers' ``all_gather``: ``exact`` pairs of values and gradients that
must be equal bit for bit. Written to OUTPUT_DIR/rank{r}.pt. Arguments: OUTPUT_DIR.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from st_weince.losses import RBSigmoidLoss, WEINCELoss

LOCAL_BATCH = 32  # 64 candidates in all: WEINCE's tail fits run (no InfoNCE fallback)
DIM = 16
LOSSES = {
    "weince": lambda **options: WEINCELoss(None, gather_across_devices=True, **options),
    "rb_sigmoid-all_gather": lambda **options: RBSigmoidLoss(None, gather_across_devices=True, **options),
    "rb_sigmoid-neighbour": lambda **options: RBSigmoidLoss(
        None, gather_across_devices=True, exchange="neighbour", **options
    ),
}


def local_columns(rank: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 100 * rank)
    base = torch.randn(LOCAL_BATCH, DIM, generator=generator)
    return [(base + 0.7 * torch.randn(LOCAL_BATCH, DIM, generator=generator)).requires_grad_() for _ in range(2)]


def step(loss_fn, call, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    columns = local_columns(rank)
    value = call(columns)
    value.backward()
    grads = [column.grad for column in columns]
    grads += [parameter.grad for _, parameter in sorted(loss_fn.named_parameters()) if parameter.grad is not None]
    return value.detach(), grads


def warning_messages(name: str, rank: int) -> list[str]:
    loss_fn = LOSSES[name]().train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(loss_fn, loss_fn.compute_loss_from_embeddings, rank)
    deprecations = (FutureWarning, DeprecationWarning)
    return [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, deprecations)]


def compiled_against_eager(name: str, rank: int) -> dict:
    torch._dynamo.reset()
    eager_fn, compiled_fn = LOSSES[name](check_inputs=False).train(), LOSSES[name](check_inputs=False).train()
    eager = step(eager_fn, eager_fn.compute_loss_from_embeddings, rank)
    try:
        compiled = step(compiled_fn, torch.compile(compiled_fn.compute_loss_from_embeddings, fullgraph=True), rank)
    except Exception as error:  # recorded: the test shows it
        return {"error": "".join(traceback.format_exception_only(error))[-2000:]}
    return {"loss": (compiled[0], eager[0]), "grads": list(zip(compiled[1], eager[1]))}


def exact_pairs(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The collectives against independent references on the same inputs and output weights."""
    from sentence_transformers.util import all_gather as sentence_transformers_all_gather

    from st_weince.functional.exchange import all_gather, all_gather_with_grad

    world_size = dist.get_world_size()
    generator = torch.Generator().manual_seed(7 + rank)
    rows = torch.randn(5, 3, generator=generator, dtype=torch.float32)
    weights = torch.randn(5 * world_size, 3, generator=generator, dtype=torch.float32)
    pairs = {}
    new_rows = rows.clone().requires_grad_()
    new = all_gather_with_grad(new_rows)
    (new * weights).sum().backward()
    gathered = [torch.empty_like(rows) for _ in range(world_size)]
    dist.all_gather(gathered, rows)
    # d(sum over processes p of <gathered, weights_p>) / d(own rows) = the sum over p of weights_p's own-rows slice
    every_weights = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(every_weights, weights)
    own = slice(rank * rows.shape[0], (rank + 1) * rows.shape[0])
    own_rows_gradient = torch.stack([process_weights[own] for process_weights in every_weights]).sum(dim=0)
    pairs["with_grad/values"] = (new.detach(), torch.cat(gathered))
    pairs["with_grad/grads"] = (new_rows.grad, own_rows_gradient)
    old_rows = rows.clone().requires_grad_()
    keys = torch.arange(4, dtype=torch.int64) * 10 + rank + 2**40  # beyond float32's integers
    pairs["keys"] = (all_gather(keys), sentence_transformers_all_gather(keys))
    new_rows.grad = None
    new, old = all_gather(new_rows), sentence_transformers_all_gather(old_rows)
    (new * weights).sum().backward()
    (old * weights).sum().backward()
    pairs["without_grad/values"] = (new.detach(), old.detach())
    pairs["without_grad/own_grads"] = (new_rows.grad, old_rows.grad)
    return pairs


def main() -> None:
    output_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {
        "warnings": {name: warning_messages(name, rank) for name in LOSSES},
        "compiled": {name: compiled_against_eager(name, rank) for name in LOSSES},
    }
    try:
        result["exact"] = exact_pairs(rank)
    except ImportError as error:  # the collectives are not there (before they existed): the test shows it
        result["exact"] = {"error": (str(error), "")}
    torch.save(result, output_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
