"""Before/after check of a refactoring of the loss classes: one fixed-seed step of each loss, loss and gradients.

Run it on two checkouts and compare::

    PYTHONPATH=/tmp/before python3 benchmarks/refactor_parity.py --write benchmarks/results/refactor_parity/before.json
    PYTHONPATH=$PWD python3 benchmarks/refactor_parity.py --write benchmarks/results/refactor_parity/after.json \
        --compare benchmarks/results/refactor_parity/before.json

Every vector is stored exactly, as the base64 of its float32 bytes (little-endian), so "bit for bit" means equal
strings. Where the operations of a
step changed, the comparison allows 1e-7 relative (about one float32 rounding of the loss's size); each entry says
which of the two held. Only constructor keywords and methods that both versions have are used.
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
from pathlib import Path

import numpy as np
import torch

from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss

RELATIVE_TOLERANCE = 1e-7
SEED = 0
BATCH, DIM = 48, 8  # 47 to 143 negatives per anchor: every anchor has a WEINCE tail fit


def _embeddings(columns: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    anchors = torch.randn(BATCH, DIM, generator=generator)
    # positives near their anchors, so the tails and margins are not trivial
    out = [anchors, anchors + 0.6 * torch.randn(BATCH, DIM, generator=generator)]
    out += [torch.randn(BATCH, DIM, generator=generator) for _ in range(columns - 2)]
    return [column.requires_grad_() for column in out]


def _uncached_step(loss: torch.nn.Module, columns: int) -> dict[str, list[float]]:
    embeddings = _embeddings(columns)
    value = loss.compute_loss_from_embeddings(embeddings, None)
    own = [p for name, p in loss.named_parameters() if p.requires_grad]
    value.backward()
    result = {"loss": [value.item()]}
    result.update({f"grad_column{i}": e.grad.flatten().tolist() for i, e in enumerate(embeddings)})
    for name, parameter in loss.named_parameters():
        if parameter in own:
            result[f"grad_{name}"] = parameter.grad.flatten().tolist()
    return result


def _cached_step(loss: torch.nn.Module, columns: int, mini_batch: int) -> dict[str, list[float]]:
    embeddings = _embeddings(columns)
    reps = [
        [leaf.detach()[b : b + mini_batch].requires_grad_() for b in range(0, BATCH, mini_batch)] for leaf in embeddings
    ]
    value = loss.calculate_loss(reps, None, with_backward=True)
    result = {"loss": [value.item()]}
    for i, column in enumerate(reps):
        result[f"grad_column{i}"] = torch.cat([rep.grad for rep in column]).flatten().tolist()
    # a cached loss's own parameters get their gradient through the zero-valued term of the returned loss
    if value.requires_grad:
        value.backward()
        for name, parameter in loss.named_parameters():
            if parameter.grad is not None:
                result[f"grad_{name}"] = parameter.grad.flatten().tolist()
    return result


def steps() -> dict[str, dict[str, list[float]]]:
    torch.manual_seed(SEED)
    guard = ("relative", 0.9)
    return {
        "weince": _uncached_step(WEINCELoss(None), 2),
        "weince_three_columns_guard": _uncached_step(
            WEINCELoss(None, directions=("query_to_doc", "doc_to_query"), false_negative_filter=guard), 3
        ),
        "weince_per_direction_fixed_beta": _uncached_step(
            WEINCELoss(
                None, scale=12.0, beta=1.0, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
            ),
            2,
        ),
        "rb_sigmoid": _uncached_step(RBSigmoidLoss(None), 2),
        "rb_sigmoid_symmetric_guard": _uncached_step(
            RBSigmoidLoss(None, symmetric=True, false_negative_filter=guard), 3
        ),
        "rb_sigmoid_absolute_adapter": _uncached_step(
            RBSigmoidLoss(None, parametrization="absolute", locked_adapter=True, chunk_size=40), 2
        ),
        "cached_weince": _cached_step(CachedWEINCELoss(None, mini_batch_size=32), 3, 32),
        "cached_weince_guard": _cached_step(
            CachedWEINCELoss(None, mini_batch_size=40, false_negative_filter=guard), 2, 40
        ),
        "cached_rb_sigmoid": _cached_step(CachedRBSigmoidLoss(None, mini_batch_size=32), 3, 32),
        "cached_rb_sigmoid_symmetric": _cached_step(
            CachedRBSigmoidLoss(None, mini_batch_size=40, symmetric=True, false_negative_filter=guard), 2, 40
        ),
    }


def _encode(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float64))


def compare(before: dict, after: dict) -> dict[str, dict[str, object]]:
    """Per step: bit-for-bit equal, or the largest relative difference (refused above RELATIVE_TOLERANCE)."""
    report = {}
    for step, values in before.items():
        if set(values) != set(after[step]):
            raise SystemExit(f"{step}: different entries {sorted(values)} vs {sorted(after[step])}")
        worst = 0.0
        for key in values:
            old, new = _decode(values[key]), _decode(after[step][key])
            worst = max(worst, float((old - new).abs().max() / old.abs().max().clamp_min(1e-30)))
        report[step] = {"bit_for_bit": values == after[step], "max_relative_difference": worst}
        if worst > RELATIVE_TOLERANCE:
            raise SystemExit(f"{step}: relative difference {worst:.3g} > {RELATIVE_TOLERANCE}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, help="JSON file for this checkout's values")
    parser.add_argument("--compare", help="a JSON file written by the other checkout, to compare against")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order, so repeated runs are bit-identical
    values = {step: {key: _encode(vector) for key, vector in result.items()} for step, result in steps().items()}
    document = {
        "seed": SEED,
        "batch": BATCH,
        "dimension": DIM,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "steps": values,
    }
    if args.compare:
        document["compared_with"] = args.compare
        document["comparison"] = compare(json.loads(Path(args.compare).read_text())["steps"], values)
        print(json.dumps(document["comparison"], indent=1))
    Path(args.write).parent.mkdir(parents=True, exist_ok=True)
    Path(args.write).write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
