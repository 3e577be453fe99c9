"""Before/after check of a refactoring of the loss classes: one fixed-seed step of each loss, loss and gradients.

Run it on two checkouts and compare (the script of the newer one; ``PYTHONPATH`` chooses the package)::

    PYTHONPATH=/tmp/before python3 benchmarks/refactor_parity.py --write benchmarks/results/refactor_parity/before.json
    PYTHONPATH=$PWD python3 benchmarks/refactor_parity.py --write benchmarks/results/refactor_parity/after.json \
        --compare benchmarks/results/refactor_parity/before.json

The committed ``after.json`` compares the refactoring of the loss classes into shared modules with ``before.json``
(f4f1bef) and with ``main_d3e8479.json`` (the main branch just before it, written by this script with
``PYTHONPATH`` at that checkout): bit for bit against the latter in every step.

Every vector is stored exactly, as the base64 of its float32 bytes (little-endian), so "bit for bit" means equal
strings. Where the operations of a step changed, the comparison allows 1e-7 relative (about one float32 rounding of
the loss's size); each entry says which of the two held. A deliberate change of the numerics between the two
checkouts is named in ``KNOWN_CHANGES``: the entries of the steps it touches carry its note and their difference,
and are not held to 1e-7. Steps only one side has are listed, not compared. Only constructor keywords and methods
that both versions have are used.
"""

from __future__ import annotations

import argparse
import base64
import json
import platform
from pathlib import Path

import numpy as np
import torch

from st_weince.functional import TopM, nt_xent_layout
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss

RELATIVE_TOLERANCE = 1e-7
# Deliberate changes since before.json (values of f4f1bef), by the steps they touch, found by running this script
# at each commit between (the first three change only the rounding: float32 differences of 1e-7 to 1e-6 relative).
_EXACT_LOG_K = (
    "7a8751a: WEINCE's cross-entropy shifts the logits by their row maximum before the log-sum-exp (exact log K at "
    "extreme scales); same math, float32 rounding (2.8e-7 to 7.3e-7 relative)"
)
_JOINT_SHIFT = (
    "b846641: the joint softmax over two direction groups (mnrl_cross_entropy) shifts the logits by their row "
    "maximum; same math, float32 rounding (9.6e-7 relative)"
)
_LOG_SOFTMAX = (
    "7f3ab13: WEINCE's cross-entropy is fused through log_softmax (shifted by the row maximum in one kernel); same "
    "math, float32 rounding (1.3e-7 to 3.1e-7 relative)"
)
_SIGN_SAFE_GUARD = (
    "68a9603 (merged in bc9702a): the relative false-negative rule is sign-safe, s > s_pos - (1 - r) |s_pos| "
    "instead of s > r s_pos, so rows whose positive scores below 0 remove fewer candidates: a change of behaviour"
)
KNOWN_CHANGES = {
    "weince": [_EXACT_LOG_K, _LOG_SOFTMAX],
    "weince_three_columns_guard": [_EXACT_LOG_K, _JOINT_SHIFT, _SIGN_SAFE_GUARD],
    "weince_per_direction_fixed_beta": [_EXACT_LOG_K, _LOG_SOFTMAX],
    "rb_sigmoid_symmetric_guard": [_SIGN_SAFE_GUARD],
    "cached_weince": [_EXACT_LOG_K, _LOG_SOFTMAX],
    "cached_weince_guard": [_EXACT_LOG_K, _LOG_SOFTMAX, _SIGN_SAFE_GUARD],
    "cached_rb_sigmoid_symmetric": [_SIGN_SAFE_GUARD],
}
# Deliberate changes since a later checkout, by its revision's first 7 characters and the steps they touch.
_MATCHING_GATHERED = (
    "issue 31: RB-Sigmoid's block loss is softplus(z) over every valid entry minus the matching logits (softplus(-z) "
    "= softplus(z) - z), the matching ones gathered; same math, float32 rounding (up to 2.4e-7 relative here)"
)
_RB_STEPS = (
    "rb_sigmoid",
    "rb_sigmoid_symmetric_guard",
    "rb_sigmoid_absolute_adapter",
    "cached_rb_sigmoid",
    "cached_rb_sigmoid_symmetric",
    "rb_sigmoid_scores",
)
LATER_CHANGES = {"455a45a": {step: [_MATCHING_GATHERED] for step in _RB_STEPS}}
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


def _scores_step(loss: torch.nn.Module) -> dict[str, list[float]]:
    """One step of ``loss_from_scores`` on SimCLR's layout (the vision path)."""
    views = _embeddings(2)
    scores, positive_index, valid_mask = nt_xent_layout(*views)
    value = loss.loss_from_scores(scores, positive_index, valid_mask)
    value.backward()
    result = {"loss": [value.item()]}
    result.update({f"grad_view{i}": view.grad.flatten().tolist() for i, view in enumerate(views)})
    for name, parameter in loss.named_parameters():
        if parameter.grad is not None:
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
    top_m = {"top_m": TopM(m=20, shortfall_weight=0.5, infonce_weight=0.5)}
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
        # the top-M terms and the vision path (loss_from_scores)
        "weince_top_m_two_directions": _uncached_step(
            WEINCELoss(None, directions=("query_to_doc", "doc_to_query"), **top_m), 3
        ),
        "cached_weince_top_m": _cached_step(CachedWEINCELoss(None, mini_batch_size=20, **top_m), 2, 20),
        "weince_released_scores": _scores_step(WEINCELoss(None, scale=2.0, beta=1.0, **top_m)),
        "rb_sigmoid_scores": _scores_step(RBSigmoidLoss(None, locked_adapter=True)),
    }


def _encode(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float64))


def compare(before: dict, after: dict, known_changes: dict[str, list[str]]) -> dict[str, dict[str, object]]:
    """Per step: bit-for-bit equal, or the largest relative difference (refused above RELATIVE_TOLERANCE unless
    ``known_changes`` names the step's cause)."""
    report: dict[str, dict[str, object]] = {}
    for step, values in before.items():
        if step not in after:
            report[step] = {"only_in": "the compared file"}
            continue
        if set(values) != set(after[step]):
            raise SystemExit(f"{step}: different entries {sorted(values)} vs {sorted(after[step])}")
        worst = 0.0
        for key in values:
            old, new = _decode(values[key]), _decode(after[step][key])
            worst = max(worst, float((old - new).abs().max() / old.abs().max().clamp_min(1e-30)))
        report[step] = {"bit_for_bit": values == after[step], "max_relative_difference": worst}
        if worst > 0 and step in known_changes:
            report[step]["note"] = known_changes[step]
        elif worst > RELATIVE_TOLERANCE:
            raise SystemExit(f"{step}: relative difference {worst:.3g} > {RELATIVE_TOLERANCE}")
    report.update({step: {"only_in": "this checkout"} for step in after if step not in before})
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, help="JSON file for this checkout's values")
    parser.add_argument(
        "--compare", action="append", default=[], help="a JSON file written by another checkout (repeatable)"
    )
    parser.add_argument("--revision", help="the checkout's commit, recorded in the file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order, so repeated runs are bit-identical
    values = {step: {key: _encode(vector) for key, vector in result.items()} for step, result in steps().items()}
    document = {
        "revision": args.revision,
        "seed": SEED,
        "batch": BATCH,
        "dimension": DIM,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "steps": values,
    }
    document["known_changes_since_before"] = KNOWN_CHANGES
    comparisons = {}
    for path in args.compare:
        other = json.loads(Path(path).read_text())
        # the known changes lie between before.json and the checkouts after them
        revision = str(other.get("revision") or "")[:7]
        known = KNOWN_CHANGES if Path(path).name == "before.json" else LATER_CHANGES.get(revision, {})
        comparisons[path] = {"revision": other.get("revision"), **compare(other["steps"], values, known)}
    if comparisons:
        document["comparisons"] = comparisons
        print(json.dumps(comparisons, indent=1))
    Path(args.write).parent.mkdir(parents=True, exist_ok=True)
    Path(args.write).write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
