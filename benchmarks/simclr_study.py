"""The long SimCLR study: InfoNCE, WEINCE and RB-Sigmoid (3 seeds each) on all of CIFAR-10.

One CPU core per run. The configuration (``STUDY``) is the largest that fits about 45 minutes per run on one core of
this machine (timings in docs/evidence.md): CIFAR-stem ResNet-18 of width 16, batch 256 pairs, 10 epochs over all
50,000 training images, channels_last, the vision defaults of the losses (temperature 0.5, WEINCE beta 1, RB-Sigmoid
from its class defaults), Adam lr 1e-3, weight decay 1e-6.

Per seed, every loss sees the identical batches and augmentations: the data order of epoch ``e`` comes from a
generator seeded with ``(seed, e)``, the augmentations from a generator seeded with ``seed`` that only the
augmentation draws from, and the network starts from ``torch.manual_seed(seed)``; nothing depends on the loss.

Runs go in the order of ``RUN_ORDER``; consecutive runs of the same seed (InfoNCE and WEINCE of seed k) advance one
epoch at a time in turn, so the paired comparison of a seed grows epoch by epoch (the continuation from the saved
state is exact: the tests check that interleaved, resumed and uninterrupted runs give identical lines).

Checkpoints (at epoch 0, i.e. before training, and after every epoch) each append one JSON line to
``<output-dir>/<loss>-seed<k>.jsonl``:

- linear-probe top-1 and weighted k-NN top-1 (k = 20, temperature 0.1; all k kept) on frozen backbone features of
  the 10,000 test images. At intermediate checkpoints the probes train on a fixed class-balanced subset of
  ``probe_subset`` training images (the same for every run); the final line (``"type": "final"``) repeats the
  evaluation with all 50,000 training images;
- the training loss's own statistics, means over the epoch (WEINCE: mean lambda, share of lambda > 0.5, rho0, beta;
  RB-Sigmoid: t, b_rel, b, margin);
- WEINCE's statistics of the encoder on one fixed augmented batch (same images and views for every run and
  checkpoint), so lambda along training is comparable between losses, InfoNCE included;
- the POT/GPD shape xi (st_weince.diagnostics.pot_fit) of the negative cosine scores of all pairs of
  ``pot_images`` class-balanced test images, of the projections (what the loss sees) and of the backbone features,
  at the threshold quantile 0.999 of docs/diagnostics.md;
- step, epoch, images seen, elapsed and training seconds.

The first line of every file is a header (``"type": "header"``: configuration, run, seed, provenance with machine,
versions, git commit and command). Resumable: after every epoch the training state (model, optimizer, loss
parameters, augmentation RNG, epoch, clocks) goes to ``<state-dir>/<run>/state.pt`` (outside the git tree); a restart
continues from it (lines after the saved epoch are dropped, a ``"type": "resume"`` line is added), a run whose final
line is present is skipped, and an unfinished run without a state restarts from scratch.

    # the study, in the background, one core (runs in the order of RUN_ORDER)
    OMP_NUM_THREADS=1 setsid nohup python benchmarks/simclr_study.py > /work/st-weince-study.log 2>&1 &
    # tables, paired differences and curves from whatever has landed
    python benchmarks/simclr_study.py --summarize
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from st_weince.diagnostics import pot_fit
from st_weince.diagnostics.collect import negative_pool
from st_weince.functional import nt_xent_layout
from st_weince.losses import WEINCELoss
from st_weince.utils.provenance import provenance
from st_weince.vision import (
    KNN_KS,
    KNN_TEMPERATURE,
    PREVIOUS_PROTOCOL,
    RELEASED_AUGMENT,
    RELEASED_PROTOCOL,
    ImageTensorDataset,
    ProbeProtocol,
    SimCLRAugment,
    SimCLRAugmentConfig,
    SimCLRModel,
    SimCLRObjective,
    balanced_subset,
    eval_transform,
    evaluate_frozen_features,
    extract_features,
    knn_evaluate,
    linear_probe,
    load_dataset,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "cifar10" / "cifar10-jpg.zip"
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "simclr_study"
DEFAULT_STATE = Path("/work/st-weince-study-state")
KNN_HEADLINE_K = 20
STATS_AUGMENT_SEED = 12345  # the fixed augmented batch for WEINCE's statistics of the encoder

STUDY: dict[str, Any] = {
    "dataset": "cifar10",
    "backbone": "resnet18",
    "width": 16,
    "hidden_dim": 512,
    "projection_dim": 64,
    "batch_size": 256,
    "epochs": 10,
    "lr": 1e-3,
    "weight_decay": 1e-6,
    "temperature": 0.5,
    "beta": 1.0,
    "channels_last": True,
    "limit_train": None,  # None: all 50,000 training images
    "limit_test": None,  # None: all 10,000 test images
    "probe_subset": 10000,  # training images for the probes at intermediate checkpoints (None: all)
    "full_eval_epochs": [5, 10],  # probes on all training images here too (the last epoch always)
    "probe_epochs": 100,
    "pot_images": 4000,
    "pot_quantile": 0.999,
    "subset_seed": 0,
    # The negatives and grid studies run this same loop at other settings (simclr_negatives.py, simclr_grid.py):
    "holdout": None,  # int: class-balanced training images held out and evaluated on in place of the test set
    "weince_options": {},  # WEINCE options beyond the vision defaults, e.g. {"aic_margin": 0.0, "kappa_rho": 5.0}
    "eval_at_start": True,  # the epoch-0 checkpoint (the same for every loss of a seed)
    # The released-setup ablation (benchmarks/simclr_ablation.py) runs this same loop with:
    "setup": "previous",  # "previous" or "released": augmentations, projection head and probe protocol (SETUPS)
    "arms": {},  # run name prefix -> {"loss", optional "temperature", optional "options"}; {}: the loss names
}
# Most informative first: a complete InfoNCE/WEINCE pair per seed, RB-Sigmoid last.
RUN_ORDER = [
    ("infonce", 0),
    ("weince", 0),
    ("infonce", 1),
    ("weince", 1),
    ("infonce", 2),
    ("weince", 2),
    ("rb-sigmoid", 0),
    ("rb-sigmoid", 1),  # seeds 1 and 2 added after the first 7 runs: RB-Sigmoid's k-NN gain needed a spread
    ("rb-sigmoid", 2),
]
LOSSES = ("infonce", "weince", "rb-sigmoid")
# Keys added to STUDY after the first states were written, with the value those states were trained under.
LATER_KEYS: dict[str, Any] = {
    "full_eval_epochs": [5, 10],
    "holdout": None,
    "weince_options": {},
    "eval_at_start": True,
    "setup": "previous",
    "arms": {},
}


@dataclass(frozen=True)
class Setup:
    """What ``config["setup"]`` selects besides the optimizer settings (``lr``, ``weight_decay``, ``hidden_dim``
    stay config keys): the augmentations (their mean/std also normalise the evaluation images), the projection
    head's BatchNorm and output bias, and the probe protocol of st_weince.vision."""

    augment: SimCLRAugmentConfig
    head_batch_norm: bool
    head_output_bias: bool
    probe: ProbeProtocol


# "released": ALGORITHMS.md 1.2b, as recipes/simclr.py --preset released (docs/vision.md's table).
SETUPS = {
    "previous": Setup(SimCLRAugmentConfig(), head_batch_norm=True, head_output_bias=True, probe=PREVIOUS_PROTOCOL),
    "released": Setup(RELEASED_AUGMENT, head_batch_norm=False, head_output_bias=False, probe=RELEASED_PROTOCOL),
}


# ----------------------------------------------------------------------------------------------------------------
# files


def run_name(loss: str, seed: int) -> str:
    return f"{loss}-seed{seed}"


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a run file; a truncated last line (killed while writing) is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def final_record(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``"type": "final"`` line among a run file's records, None while the run is unfinished."""
    return next((r for r in records if r.get("type") == "final"), None)


def final_line(path: Path) -> dict[str, Any] | None:
    return final_record(read_lines(path))


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


def append_line(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def save_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill during the write leaves the previous state


def script_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def run_groups(runs: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """Consecutive runs of the same seed form a group whose runs advance one epoch at a time in turn, so the
    paired comparison of a seed grows epoch by epoch instead of waiting for the first loss to finish."""
    groups: list[list[tuple[str, int]]] = []
    for loss, seed in runs:
        if groups and groups[-1][-1][1] == seed:
            groups[-1].append((loss, seed))
        else:
            groups.append([(loss, seed)])
    return groups


def data_order(num_images: int, seed: int, epoch: int) -> Tensor:
    """The permutation of epoch ``epoch`` for seed ``seed``: the same for every loss, and recomputable on resume."""
    generator = torch.Generator().manual_seed(1_000_003 * (seed + 1) + epoch)
    return torch.randperm(num_images, generator=generator)


# ----------------------------------------------------------------------------------------------------------------
# evaluation


class EvalData:
    """The images and fixed subsets every checkpoint of every run evaluates on."""

    def __init__(self, train: Any, test: Any, config: dict[str, Any]) -> None:
        self.train, self.test = train, test
        seed = config["subset_seed"]
        self.probe_index = torch.tensor(balanced_subset(train.labels, config["probe_subset"], seed))
        self.pot_index = torch.tensor(balanced_subset(test.labels, config["pot_images"], seed))
        stats_index = torch.tensor(balanced_subset(train.labels, config["batch_size"], seed))
        self.setup = SETUPS[config["setup"]]
        augment = SimCLRAugment(self.setup.augment, generator=torch.Generator().manual_seed(STATS_AUGMENT_SEED))
        self.stats_views = augment(train.images[stats_index])
        self.num_classes = len(train.classes)


def to_memory_format(images: Tensor, channels_last: bool) -> Tensor:
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def pot_shape(embeddings: Tensor, quantile: float) -> dict[str, Any]:
    """xi of the pooled negative scores (all pairs); a failed fit is recorded with its reason, not hidden."""
    try:
        fit = pot_fit(negative_pool(embeddings), quantile)
    except ValueError as error:
        return {"xi": None, "error": str(error)}
    return {
        "xi": fit.xi,
        "xi_ci": list(fit.xi_ci),
        "threshold": fit.threshold,
        "num_exceedances": fit.num_exceedances,
        "p_value_xi0": fit.p_value_xi0,
        "endpoint": fit.endpoint,
    }


@torch.no_grad()
def encoder_weince_statistics(model: SimCLRModel, data: EvalData, config: dict[str, Any]) -> dict[str, float]:
    """WEINCE's per-anchor statistics on the fixed augmented batch, for any loss's encoder (eval mode)."""
    was_training = model.training
    model.eval()
    view_a, view_b = (to_memory_format(v, config["channels_last"]) for v in data.stats_views)
    z1, z2 = model(torch.cat([view_a, view_b])).float().chunk(2)
    model.train(was_training)
    probe_loss = WEINCELoss(None, scale=1.0 / config["temperature"], beta=config["beta"])
    stats = probe_loss.statistics(*nt_xent_layout(z1, z2))
    return {
        "lambda_mean": float(stats.lam.mean()),
        "lambda_gt_half": float((stats.lam > 0.5).float().mean()),
        "rho0": float(stats.rho0),
        "beta_mean": float(stats.beta.mean()),
    }


def protocol_evaluation(
    features: Tensor, labels: Tensor, test_features: Tensor, data: EvalData, config: dict[str, Any], seed: int
) -> dict[str, Any]:
    """The setup's probe protocol (st_weince.vision.evaluate_frozen_features) in the study's record keys, plus the
    protocol's own figures (validation accuracies, every k-NN split seed)."""
    result = evaluate_frozen_features(
        features,
        labels,
        test_features,
        data.test.labels,
        data.setup.probe,
        epochs=config["probe_epochs"],
        num_classes=data.num_classes,
        seed=seed,
    )
    return {
        "probe_train_images": len(labels),
        "probe_protocol": result["protocol"],
        "linear_top1": result["linear_top1"],
        "linear_top5": result["linear_top5"],
        "linear_train_top1": result["linear_train_top1"],
        "linear_val_top1": result.get("linear_val_top1"),
        "knn_top1": result["knn_top1"],
        "knn_k": result["knn_headline_k"],
        "knn_top1_by_k": {str(k): v for k, v in result["knn"]["top1"].items()},
        "knn_val_top1_by_k": {str(k): v for k, v in result["knn_val"]["top1"].items()} if "knn_val" in result else None,
        "knn_splits": result.get("knn_splits"),
    }


def evaluate(model: SimCLRModel, data: EvalData, config: dict[str, Any], seed: int, full: bool) -> dict[str, Any]:
    """Probes on the subset (and, when ``full``, on all training images), POT shapes, WEINCE statistics."""
    tick = time.perf_counter()
    channels_last = config["channels_last"]
    augment_config = data.setup.augment

    def transform(images: Tensor) -> Tensor:
        return to_memory_format(eval_transform(images, augment_config.mean, augment_config.std), channels_last)

    test_features = extract_features(model.encoder, data.test.images, transform, 500)
    subset_labels = data.train.labels[data.probe_index]
    if full:  # one pass over all training images serves both the subset probes and the full ones
        train_features = extract_features(model.encoder, data.train.images, transform, 500)
        subsets = {
            "subset": (train_features[data.probe_index], subset_labels),
            "full": (train_features, data.train.labels),
        }
    else:
        train_images = data.train.images[data.probe_index]
        subsets = {"subset": (extract_features(model.encoder, train_images, transform, 500), subset_labels)}
    out: dict[str, Any] = {}
    for name, (features, labels) in subsets.items():
        if data.setup.probe is not PREVIOUS_PROTOCOL:
            out[name] = protocol_evaluation(features, labels, test_features, data, config, seed)
            continue
        ks = [k for k in KNN_KS if k <= len(labels)]
        knn = knn_evaluate(features, labels, test_features, data.test.labels, ks, KNN_TEMPERATURE, data.num_classes)
        linear = linear_probe(
            features,
            labels,
            test_features,
            data.test.labels,
            epochs=config["probe_epochs"],
            num_classes=data.num_classes,
            seed=seed,
        )
        headline = KNN_HEADLINE_K if KNN_HEADLINE_K in knn.top1 else max(knn.top1)
        out[name] = {
            "probe_train_images": len(labels),
            "linear_top1": linear["top1"],
            "linear_top5": linear["top5"],
            "linear_train_top1": linear["train_top1"],
            "knn_top1": knn.top1[headline],
            "knn_k": headline,
            "knn_top1_by_k": {str(k): v for k, v in knn.top1.items()},
        }
    pot_images = transform(data.test.images[data.pot_index])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        backbone = model.encoder(pot_images).float()
        projection = model.head(backbone).float()
    model.train(was_training)
    out["pot_projection"] = pot_shape(projection, config["pot_quantile"])
    out["pot_backbone"] = pot_shape(backbone, config["pot_quantile"])
    out["encoder_weince_statistics"] = encoder_weince_statistics(model, data, config)
    out["test_images"] = len(data.test)
    out["eval_seconds"] = time.perf_counter() - tick
    return out


# ----------------------------------------------------------------------------------------------------------------
# one run


def arm_objective(loss: str, config: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """(loss class name of SimCLRObjective, temperature, loss options) of the run prefix ``loss``: its entry in
    ``config["arms"]`` when there is one, else the loss of that name with the study's temperature."""
    arm = config["arms"].get(loss)
    if arm is not None:
        return arm["loss"], arm.get("temperature", config["temperature"]), dict(arm.get("options", {}))
    return loss, config["temperature"], dict(config["weince_options"]) if loss == "weince" else {}


def run_config(config: dict[str, Any], loss: str) -> dict[str, Any]:
    """What a saved state of run prefix ``loss`` must agree with: the configuration, with ``arms`` narrowed to
    that run's own arm (arms added to a study later do not invalidate the states of the runs already going)."""
    if not config.get("arms"):
        return config
    return {**config, "arms": {loss: config["arms"].get(loss)}}


def build(loss: str, seed: int, config: dict[str, Any]) -> tuple[SimCLRModel, SimCLRObjective, torch.optim.Optimizer]:
    torch.manual_seed(seed)  # the same initial network for every loss
    setup = SETUPS[config["setup"]]
    model = SimCLRModel(
        config["backbone"],
        width=config["width"],
        hidden_dim=config["hidden_dim"],  # None: as wide as the features (the released head)
        projection_dim=config["projection_dim"],
        head_batch_norm=setup.head_batch_norm,
        head_output_bias=setup.head_output_bias,
    )
    if config["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    name, temperature, loss_kwargs = arm_objective(loss, config)
    beta = loss_kwargs.pop("beta", config["beta"])  # a grid point may set WEINCE's beta too
    objective = SimCLRObjective(name, scale=1.0 / temperature, beta=beta, loss_kwargs=loss_kwargs)
    groups = [{"params": list(model.parameters())}]
    loss_parameters = [p for p in objective.parameters() if p.requires_grad]
    if loss_parameters:
        groups.append({"params": loss_parameters, "weight_decay": 0.0})  # no decay on RB-Sigmoid's t, b_rel
    optimizer = torch.optim.Adam(groups, lr=config["lr"], weight_decay=config["weight_decay"])
    return model, objective, optimizer


def train_run(
    loss: str,
    seed: int,
    config: dict[str, Any],
    data: EvalData,
    output_dir: Path,
    state_dir: Path,
    argv: list[str],
    stop_after_epoch: int | None = None,
    until_epoch: int | None = None,
    announce_resume: bool = True,
) -> str:
    """Train (or continue) one run; returns "skipped", "finished", "stopped" (``stop_after_epoch`` reached) or
    "paused" (epoch ``until_epoch`` reached; the next call continues from the saved state) or "waiting" (the saved
    state is at ``until_epoch`` or beyond already; nothing is done).

    ``announce_resume``: a continuation by a new process adds a ``"type": "resume"`` line; one by the same process
    (interleaved runs) adds nothing, as the state it continues from is exact."""
    name = run_name(loss, seed)
    path = output_dir / f"{name}.jsonl"
    state_path = state_dir / name / "state.pt"
    records = read_lines(path)
    if any(r.get("type") == "final" for r in records):
        print(f"[skip] {name}: final line present", flush=True)
        return "skipped"

    model, objective, optimizer = build(loss, seed, config)
    augment_generator = torch.Generator().manual_seed(seed)
    augment = SimCLRAugment(data.setup.augment, generator=augment_generator)
    start_epoch, elapsed, train_seconds = 0, 0.0, 0.0
    state = torch.load(state_path, weights_only=False) if state_path.exists() else None
    if state is not None:
        saved = run_config({**{k: v for k, v in LATER_KEYS.items() if k in config}, **state["config"]}, loss)
        mine = run_config(config, loss)
        if saved != mine:
            changed = sorted(k for k in set(mine) | set(saved) if mine.get(k) != saved.get(k))
            raise ValueError(f"{state_path} was written with a different configuration ({changed}); move it away")
        if until_epoch is not None and state["epoch"] >= until_epoch and records:
            return "waiting"  # already there: nothing done, nothing written
    header = {"type": "header", "run": name, "loss": loss, "seed": seed, "config": config}
    if state is not None and records and records[0].get("type") == "header":
        model.load_state_dict(state["model"])
        objective.load_state_dict(state["objective"])
        optimizer.load_state_dict(state["optimizer"])
        augment_generator.set_state(state["augment_rng"])
        start_epoch, elapsed, train_seconds = state["epoch"], state["elapsed"], state["train_seconds"]
        kept = [r for r in records if r.get("type") not in ("checkpoint", "full") or r["epoch"] <= start_epoch]
        if announce_resume:
            kept.append(
                {"type": "resume", "from_epoch": start_epoch, "script_sha256": script_hash(), **provenance(argv)}
            )
            print(f"[resume] {name} from epoch {start_epoch}", flush=True)
        write_lines(path, kept)
    else:
        header.update(
            {
                "objective": objective.get_config_dict(),
                "script_sha256": script_hash(),
                **provenance(argv),
            }
        )
        write_lines(path, [header])
        print(f"[start] {name}", flush=True)

    images = data.train.images
    num_images, batch_size = images.shape[0], config["batch_size"]
    steps_per_epoch = num_images // batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"batch_size {batch_size} needs at least that many training images, got {num_images}")
    session_start = time.perf_counter() - elapsed

    def checkpoint(epoch: int, loss_mean: float | None, loss_statistics: dict[str, float]) -> None:
        final = epoch == config["epochs"]
        full = final or epoch in config["full_eval_epochs"]
        evaluation = evaluate(model, data, config, seed, full=full)
        base = {
            "epoch": epoch,
            "step": epoch * steps_per_epoch,
            "images_seen": epoch * steps_per_epoch * batch_size,
            "train_loss": loss_mean,
            "loss_statistics": loss_statistics,
            "pot_projection": evaluation["pot_projection"],
            "pot_backbone": evaluation["pot_backbone"],
            "encoder_weince_statistics": evaluation["encoder_weince_statistics"],
            "loss_parameters": {n: float(p.detach().reshape(-1)[0]) for n, p in objective.named_parameters()},
            "train_seconds": train_seconds,
            "eval_seconds": evaluation["eval_seconds"],
            "elapsed_seconds": time.perf_counter() - session_start,
            "load_average": list(os.getloadavg()),  # the machine is shared: read timings next to it
        }
        append_line(path, {"type": "checkpoint", **evaluation["subset"], **base})
        if full:  # "final" at the last epoch, "full" at the milestones before it
            append_line(path, {"type": "final" if final else "full", **evaluation["full"], **base})
        print(
            f"[{name}] epoch {epoch}: linear {evaluation['subset']['linear_top1']:.2f} "
            f"k-NN {evaluation['subset']['knn_top1']:.2f} xi {evaluation['pot_projection']['xi']} "
            f"lambda {evaluation['encoder_weince_statistics']['lambda_mean']:.3f} "
            f"({time.perf_counter() - session_start:.0f} s)",
            flush=True,
        )

    if start_epoch == 0 and config["eval_at_start"]:
        checkpoint(0, None, {})
    model.train()
    for epoch in range(start_epoch, config["epochs"]):
        tick = time.perf_counter()
        order = data_order(num_images, seed, epoch)
        loss_sum = torch.zeros(())
        for step in range(steps_per_epoch):
            batch = order[step * batch_size : (step + 1) * batch_size]
            view_a, view_b = augment(images[batch])
            projections = model(to_memory_format(torch.cat([view_a, view_b]), config["channels_last"]))
            z1, z2 = projections.chunk(2)
            loss_value = objective(z1, z2)
            optimizer.zero_grad(set_to_none=True)
            loss_value.backward()
            optimizer.step()
            loss_sum += loss_value.detach()
        train_seconds += time.perf_counter() - tick
        loss_mean = float(loss_sum) / steps_per_epoch
        if not math.isfinite(loss_mean):
            raise ValueError(f"{name}: the training loss became {loss_mean} in epoch {epoch + 1}")
        checkpoint(epoch + 1, loss_mean, objective.pop_logged_statistics())
        save_state(
            state_path,
            {
                "config": config,
                "epoch": epoch + 1,
                "model": model.state_dict(),
                "objective": objective.state_dict(),
                "optimizer": optimizer.state_dict(),
                "augment_rng": augment_generator.get_state(),
                "elapsed": time.perf_counter() - session_start,
                "train_seconds": train_seconds,
            },
        )
        if stop_after_epoch is not None and epoch + 1 >= stop_after_epoch and epoch + 1 < config["epochs"]:
            print(f"[stop] {name} after epoch {epoch + 1} (--stop-after-epoch)", flush=True)
            return "stopped"
        if until_epoch is not None and epoch + 1 >= until_epoch and epoch + 1 < config["epochs"]:
            return "paused"
    print(f"[done] {name}", flush=True)
    return "finished"


# ----------------------------------------------------------------------------------------------------------------
# summary


def mean_std(values: list[float]) -> dict[str, float | int]:
    return {
        "mean": statistics.fmean(values) if values else float("nan"),
        "std": statistics.stdev(values) if len(values) > 1 else float("nan"),
        "n": len(values),
    }


def format_stat(stat: dict[str, float | int], digits: int = 2, sign: bool = False) -> str:
    if not stat["n"]:
        return "-"
    mean = f"{stat['mean']:+.{digits}f}" if sign else f"{stat['mean']:.{digits}f}"
    return mean if stat["n"] < 2 else f"{mean} +- {stat['std']:.{digits}f}"


def compare_full(records: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per loss mean +- std and paired (same seed) differences to InfoNCE of full evaluations at one epoch."""
    metrics = ("linear_top1", "knn_top1")
    by_loss: dict[str, dict[int, dict[str, Any]]] = {}
    for name, record in records.items():
        by_loss.setdefault(runs[name]["loss"], {})[runs[name]["seed"]] = record
    per_loss: dict[str, Any] = {}
    for loss in LOSSES:
        done = by_loss.get(loss, {})
        if done:
            per_loss[loss] = {
                "seeds": sorted(done),
                **{m: mean_std([r[m] for r in done.values()]) for m in metrics},
                "xi_projection": mean_std([r["pot_projection"]["xi"] for r in done.values()]),
                "encoder_lambda_mean": mean_std([r["encoder_weince_statistics"]["lambda_mean"] for r in done.values()]),
                "train_seconds": mean_std([r["train_seconds"] for r in done.values()]),
            }
    paired: dict[str, Any] = {}
    for loss in ("weince", "rb-sigmoid"):
        mine, base = by_loss.get(loss, {}), by_loss.get("infonce", {})
        common = sorted(set(mine) & set(base))
        if common:
            per_seed = {str(s): {m: mine[s][m] - base[s][m] for m in metrics} for s in common}
            paired[f"{loss}_minus_infonce"] = {
                "seeds": common,
                "per_seed": per_seed,
                **{m: mean_std([per_seed[str(s)][m] for s in common]) for m in metrics},
            }
    return {"per_loss": per_loss, "paired": paired}


def summarize(output_dir: Path) -> dict[str, Any]:
    """summary.json, summary.md and curves.png from the run files in ``output_dir``."""
    runs: dict[str, dict[str, Any]] = {}
    for path in sorted(output_dir.glob("*.jsonl")):
        records = read_lines(path)
        if not records or records[0].get("type") != "header":
            continue
        header = records[0]
        runs[path.stem] = {
            "loss": header["loss"],
            "seed": header["seed"],
            "config": header["config"],
            "header": {k: header.get(k) for k in ("date_utc", "git_commit", "machine", "versions", "command")},
            "checkpoints": [r for r in records if r.get("type") == "checkpoint"],
            "final": final_record(records),
            "full": [r for r in records if r.get("type") in ("full", "final")],
            "resumes": sum(r.get("type") == "resume" for r in records),
        }
    finals = {name: run for name, run in runs.items() if run["final"] is not None}
    metrics = ("linear_top1", "knn_top1")
    full_epochs = sorted({r["epoch"] for run in runs.values() for r in run["full"]})
    full_evaluations = {
        str(epoch): compare_full(
            {
                name: next(r for r in run["full"] if r["epoch"] == epoch)
                for name, run in runs.items()
                if any(r["epoch"] == epoch for r in run["full"])
            },
            runs,
        )
        for epoch in full_epochs
    }
    last = full_evaluations.get(str(max(run["config"]["epochs"] for run in runs.values()))) if runs else None
    per_loss, paired = (last["per_loss"], last["paired"]) if last else ({}, {})
    # Curves along training (subset probes), per run and mean per loss at every epoch reached by all its runs.
    curves: dict[str, Any] = {}
    for name, run in sorted(runs.items()):
        curves[name] = {
            "epoch": [c["epoch"] for c in run["checkpoints"]],
            "linear_top1": [c["linear_top1"] for c in run["checkpoints"]],
            "knn_top1": [c["knn_top1"] for c in run["checkpoints"]],
            "xi_projection": [c["pot_projection"]["xi"] for c in run["checkpoints"]],
            "xi_backbone": [c["pot_backbone"]["xi"] for c in run["checkpoints"]],
            "encoder_lambda_mean": [c["encoder_weince_statistics"]["lambda_mean"] for c in run["checkpoints"]],
            "train_lambda_mean": [c["loss_statistics"].get("weince_lambda_mean") for c in run["checkpoints"]],
            "train_loss": [c["train_loss"] for c in run["checkpoints"]],
            "train_seconds": [c["train_seconds"] for c in run["checkpoints"]],
        }
    paired_curves: dict[str, Any] = {}
    for run in runs.values():
        if run["loss"] != "weince" or run_name("infonce", run["seed"]) not in runs:
            continue
        base = {c["epoch"]: c for c in runs[run_name("infonce", run["seed"])]["checkpoints"]}
        mine = {c["epoch"]: c for c in run["checkpoints"]}
        epochs = sorted(set(base) & set(mine))
        paired_curves[f"seed{run['seed']}"] = {
            "epoch": epochs,
            **{f"{m}_difference": [mine[e][m] - base[e][m] for e in epochs] for m in metrics},
        }
    # Mean +- std over the seeds that reached each epoch with both losses (subset probes).
    paired_along_training: list[dict[str, Any]] = []
    for epoch in sorted({e for curve in paired_curves.values() for e in curve["epoch"]}):
        seeds = [key for key, curve in sorted(paired_curves.items()) if epoch in curve["epoch"]]
        row: dict[str, Any] = {"epoch": epoch, "seeds": seeds}
        for m in metrics:
            values = [paired_curves[k][f"{m}_difference"][paired_curves[k]["epoch"].index(epoch)] for k in seeds]
            row[m] = mean_std(values)
            row[f"{m}_per_seed"] = values
        paired_along_training.append(row)
    any_run = next(iter(runs.values()), None)
    summary = {
        "description": (
            "issue 14 study 1: SimCLR on CIFAR-10 (JPEG copy), CPU, one thread per run; accuracies in percent on "
            "the 10,000 test images; final metrics with probes trained on all 50,000 training images, curves with "
            "probes on the fixed class-balanced subset of config.probe_subset images; k-NN weighted, k = 20, "
            "temperature 0.1; mean +- sample std over seeds; paired = same seed (same init, batches, views)."
        ),
        "config": any_run["config"] if any_run else STUDY,
        "runs_present": sorted(runs),
        "runs_finished": sorted(finals),
        "runs_missing": [run_name(loss, s) for loss, s in RUN_ORDER if run_name(loss, s) not in finals],
        "per_loss_final": per_loss,
        "paired_final": paired,
        "full_evaluations": full_evaluations,
        "paired_curves": paired_curves,
        "paired_along_training": paired_along_training,
        "curves": curves,
        "finals": {
            name: {
                "linear_top1": run["final"]["linear_top1"],
                "knn_top1": run["final"]["knn_top1"],
                "xi_projection": run["final"]["pot_projection"]["xi"],
                "xi_backbone": run["final"]["pot_backbone"]["xi"],
                "encoder_weince_statistics": run["final"]["encoder_weince_statistics"],
                "loss_statistics": run["final"]["loss_statistics"],
                "train_seconds": run["final"]["train_seconds"],
                "elapsed_seconds": run["final"]["elapsed_seconds"],
                "resumes": run["resumes"],
            }
            for name, run in sorted(finals.items())
        },
        "provenance_of_runs": {name: run["header"] for name, run in sorted(runs.items())},
        "summary_provenance": provenance(),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "summary.md").write_text(summary_markdown(summary) + "\n")
    plot_curves(runs, output_dir / "curves.png")
    print(summary_markdown(summary), flush=True)
    return summary


def paired_table(paired: dict[str, Any]) -> list[str]:
    """Markdown table of paired differences (``{name: {"seeds", "per_seed", "linear_top1", "knn_top1"}}``): mean
    +- sample std over seeds and every seed's value, in points."""
    lines = [
        "| comparison | seeds | linear top-1 | k-NN top-1 | per seed (linear / k-NN) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, diff in paired.items():
        per_seed = "; ".join(
            f"seed {s}: {d['linear_top1']:+.2f} / {d['knn_top1']:+.2f}" for s, d in diff["per_seed"].items()
        )
        lines.append(
            f"| {name} | {len(diff['seeds'])} | {format_stat(diff['linear_top1'], sign=True)} "
            f"| {format_stat(diff['knn_top1'], sign=True)} | {per_seed} |"
        )
    return lines


def summary_markdown(summary: dict[str, Any]) -> str:
    lines: list[str] = []
    if not summary["full_evaluations"]:
        lines += ["No full evaluation yet (they come at the epochs in config.full_eval_epochs and at the end).", ""]
    for epoch, block in summary["full_evaluations"].items():
        lines += [
            f"Epoch {epoch}: probes on all training images, 10,000 test images; mean +- sample std over seeds",
            "",
            "| loss | seeds | linear top-1 (%) | k-NN top-1, k=20 (%) | xi (projections) | encoder mean lambda |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for loss, stats in block["per_loss"].items():
            lines.append(
                f"| {loss} | {', '.join(map(str, stats['seeds']))} | {format_stat(stats['linear_top1'])} "
                f"| {format_stat(stats['knn_top1'])} | {format_stat(stats['xi_projection'], 3)} "
                f"| {format_stat(stats['encoder_lambda_mean'], 3)} |"
            )
        lines += ["", f"Epoch {epoch}, paired by seed (same initialisation, batches and augmentations), points", ""]
        lines += paired_table(block["paired"])
        lines.append("")
    lines += ["WEINCE - InfoNCE along training, paired by seed (probes on the fixed subset), points", ""]
    lines += [
        "| epoch | seeds | linear top-1 | k-NN top-1 | per seed (linear / k-NN) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in summary["paired_along_training"]:
        per_seed = "; ".join(
            f"{seed}: {lin:+.2f} / {knn:+.2f}"
            for seed, lin, knn in zip(row["seeds"], row["linear_top1_per_seed"], row["knn_top1_per_seed"])
        )
        lines.append(
            f"| {row['epoch']} | {len(row['seeds'])} | {format_stat(row['linear_top1'], sign=True)} "
            f"| {format_stat(row['knn_top1'], sign=True)} | {per_seed} |"
        )
    lines += ["", "Along training, per run (probes on the fixed subset; lambda: WEINCE's statistics)", ""]
    lines += [
        "| run | epoch | linear top-1 | k-NN top-1 | xi projections | xi backbone | lambda encoder (fixed batch) "
        "| lambda in training | train loss | train s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for name, curve in summary["curves"].items():
        for i, epoch in enumerate(curve["epoch"]):
            lines.append(
                f"| {name} | {epoch} | {curve['linear_top1'][i]:.2f} | {curve['knn_top1'][i]:.2f} "
                f"| {number(curve['xi_projection'][i], 3)} | {number(curve['xi_backbone'][i], 3)} "
                f"| {curve['encoder_lambda_mean'][i]:.3f} | {number(curve['train_lambda_mean'][i], 3)} "
                f"| {number(curve['train_loss'][i], 4)} | {curve['train_seconds'][i]:.0f} |"
            )
    if summary["runs_missing"]:
        lines += ["", f"Not finished yet: {', '.join(summary['runs_missing'])}"]
    return "\n".join(lines)


def update_docs(path: Path, markdown: str, block: str = "simclr_study") -> None:
    """Replace the text between the two markers of ``block`` in ``path`` by ``markdown`` (generated, never edited
    by hand)."""
    start, end = f"<!-- {block} summary: start -->", f"<!-- {block} summary: end -->"
    text = path.read_text()
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"{path} needs exactly one {start!r} and one {end!r} line")
    head, rest = text.split(start)
    _, tail = rest.split(end)
    path.write_text(f"{head}{start}\n{markdown}\n{end}{tail}")


def plot_curves(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"infonce": "tab:blue", "weince": "tab:red", "rb-sigmoid": "tab:green"}
    panels = [
        ("linear_top1", "linear top-1 (%, subset probe)", lambda c: c["linear_top1"]),
        ("knn_top1", "k-NN top-1 (%, k=20, subset)", lambda c: c["knn_top1"]),
        ("xi", "POT shape xi (projections)", lambda c: c["pot_projection"]["xi"]),
        (
            "lambda",
            "WEINCE mean lambda (encoder, fixed batch)",
            lambda c: c["encoder_weince_statistics"]["lambda_mean"],
        ),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (_, title, value) in zip(axes, panels):
        for name, run in sorted(runs.items()):
            points = [(c["epoch"], value(c)) for c in run["checkpoints"] if value(c) is not None]
            if points:
                ax.plot(*zip(*points), color=colors[run["loss"]], marker=".", alpha=0.8, label=name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------


def parse_override(text: str) -> dict[str, Any]:
    """``--override``: JSON of STUDY keys (this script's and the studies built on it); ValueError naming the problem."""
    try:
        override = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--override must be JSON: {error}") from None
    unknown = sorted(set(override) - set(STUDY))
    if unknown:
        raise ValueError(f"--override has unknown keys {unknown}; known: {sorted(STUDY)}")
    return override


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="CIFAR-10 ImageFolder directory or zip")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE, help="training states (outside git)")
    parser.add_argument("--runs", nargs="+", default=None, help="e.g. infonce-seed0 weince-seed0 (default: all)")
    parser.add_argument("--override", default="{}", help="JSON of STUDY keys to change (tests, other scales)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--stop-after-epoch", type=int, default=None, help="stop each run after this epoch")
    parser.add_argument("--summarize", action="store_true", help="only write summary.json / .md / curves.png")
    parser.add_argument(
        "--docs", type=Path, default=None, help="with --summarize: also put summary.md between the markers of this file"
    )
    args = parser.parse_args(argv)
    try:
        override = parse_override(args.override)
    except ValueError as error:
        parser.error(str(error))
    args.config = {**STUDY, **override}
    known = {run_name(loss, seed) for loss, seed in RUN_ORDER}
    if args.runs is not None:
        parsed = []
        for name in args.runs:
            loss, _, seed = name.rpartition("-seed")
            if loss not in LOSSES or not seed.isdigit():
                parser.error(f"run names look like infonce-seed0 ({sorted(known)}), got {name!r}")
            parsed.append((loss, int(seed)))
        args.run_list = parsed
    else:
        args.run_list = list(RUN_ORDER)
    return args


def load_data(config: dict[str, Any], data_dir: Path) -> EvalData:
    """The training images and the evaluation images: the test split, or with ``config["holdout"]`` a
    class-balanced part of the training split that is then not trained on (for choosing settings)."""
    tick = time.perf_counter()
    train = load_dataset(config["dataset"], "train", data_dir, limit=config["limit_train"], download=False)
    if config["holdout"] is None:
        evaluation = load_dataset(config["dataset"], "test", data_dir, limit=config["limit_test"], download=False)
    else:
        holdout = config["holdout"]
        if isinstance(holdout, bool) or not (isinstance(holdout, int) and 0 < holdout < len(train)):
            raise ValueError(f"holdout must be a number of images in 1..{len(train) - 1}, got {config['holdout']!r}")
        held = torch.zeros(len(train), dtype=torch.bool)
        held[balanced_subset(train.labels, config["holdout"], config["subset_seed"])] = True
        evaluation = ImageTensorDataset(train.images[held], train.labels[held], train.classes)
        train = ImageTensorDataset(train.images[~held], train.labels[~held], train.classes)
    split = "test" if config["holdout"] is None else "held-out training"
    print(
        f"data: {len(train)} train, {len(evaluation)} {split} images ({time.perf_counter() - tick:.0f} s)", flush=True
    )
    return EvalData(train, evaluation, config)


def run_all(
    run_list: list[tuple[str, int]],
    config: dict[str, Any],
    data: EvalData,
    output_dir: Path,
    state_dir: Path,
    argv: list[str],
    stop_after_epoch: int | None = None,
    summarize_each_epoch: bool = True,
) -> None:
    """Train the runs in order; consecutive runs of one seed in lockstep (every run of the group reaches epoch e
    before any goes on to e + 1)."""
    for group in run_groups(run_list):
        active = list(group)
        announced: set[tuple[str, int]] = set()
        targets = range(1, config["epochs"] + 1) if len(group) > 1 else [None]
        for target in targets:
            for run in list(active):
                status = train_run(
                    *run,
                    config,
                    data,
                    output_dir,
                    state_dir,
                    argv,
                    stop_after_epoch=stop_after_epoch,
                    until_epoch=target,
                    announce_resume=run not in announced,
                )
                if status != "waiting":
                    announced.add(run)
                if status not in ("paused", "waiting"):
                    active.remove(run)
            if summarize_each_epoch:
                summarize(output_dir)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    full_argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    if args.summarize:
        summary = summarize(args.output_dir)
        if args.docs is not None:
            update_docs(args.docs, summary_markdown(summary))
        return
    torch.set_num_threads(args.threads)
    data = load_data(args.config, args.data_dir)
    run_all(args.run_list, args.config, data, args.output_dir, args.state_dir, full_argv, args.stop_after_epoch)


if __name__ == "__main__":
    main()
