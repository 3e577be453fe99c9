"""The one runner of the SimCLR studies: a configuration, a list of runs, resumable JSON lines.

benchmarks/simclr_ablation.py is a configuration of it (so were studies 1-3, simclr_study/grid/negatives.py, which
rerun from commit 82267c0): it gives ``STUDY`` keys to change, the runs (``(arm, seed)``: an arm is a loss name or
an entry of ``config["arms"]``) and its own summary.

Per seed, every arm sees the identical batches and augmentations: the data order of epoch ``e`` comes from a
generator seeded with ``(seed, e)``, the augmentations from a generator seeded with ``seed`` that only the
augmentation draws from, and the network starts from ``torch.manual_seed(seed)``; nothing depends on the loss.

Checkpoints (at epoch 0, i.e. before training, and after every epoch) each append one JSON line to
``<output-dir>/<arm>-seed<k>.jsonl``: probes on a fixed subset of training images (on all of them, too, at
``full_eval_epochs`` and at the end: ``"type": "full"`` / ``"final"``), POT shapes, WEINCE's statistics of the
encoder on a fixed batch (benchmarks/lab/simclr_eval.py), the loss's own statistics (means over the epoch), step,
epoch, images seen, elapsed and training seconds. The first line is a header (configuration, run, seed, provenance).
After every epoch the training state goes to ``<state-dir>/<run>/state.pt`` (outside the git tree); a restart
continues from it (lines after the saved epoch are dropped, a ``"type": "resume"`` line is added), a run whose final
line is present is skipped, and an unfinished run without a state restarts from scratch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.lab import runlog
from benchmarks.lab.arms import build_run
from benchmarks.lab.schedules import Handover, ScheduledScale, load_schedule
from benchmarks.lab.simclr_eval import DEFAULT_DATA, EvalData, evaluate, load_data
from benchmarks.lab.summaries import update_docs
from st_weince.training import loss_state_record, restore_loss_state
from st_weince.utils.provenance import provenance

from simclr_tools.augment import SimCLRAugment
from simclr_tools.setups import SETUPS
from simclr_tools.training import SimCLRTraining, data_order

STUDY: dict[str, Any] = {
    "dataset": "cifar10",
    "backbone": "resnet18",
    "width": 16,
    "hidden_dim": SETUPS["batchnorm-head"].hidden_dim,
    "projection_dim": 64,
    "batch_size": 256,
    "epochs": 10,
    "lr": SETUPS["batchnorm-head"].lr,
    "weight_decay": SETUPS["batchnorm-head"].weight_decay,
    "temperature": 0.5,
    "beta": 1.0,
    "channels_last": True,
    "encode_views_separately": False,  # True: one forward pass per view (the released code's BatchNorm statistics)
    "limit_train": None,  # None: all 50,000 training images
    "limit_test": None,  # None: all 10,000 test images
    "probe_subset": 10000,  # training images for the probes at intermediate checkpoints (None: all)
    "full_eval_epochs": [5, 10],  # probes on all training images here too (the last epoch always)
    "probe_epochs": 100,
    "pot_images": 4000,
    "pot_quantile": 0.999,
    "subset_seed": 0,
    "holdout": None,  # int: class-balanced training images held out and evaluated on in place of the test set
    # WEINCE options beyond the vision defaults, e.g. {"gate": {"aic_margin": 0.0, "kappa_rho": 5.0}}
    "weince_options": {},
    "eval_at_start": True,  # the epoch-0 checkpoint (the same for every loss of a seed)
    "setup": "batchnorm-head",  # or "released": augmentations, projection head and probe protocol (SETUPS)
    "arms": {},  # run name prefix -> {"loss", optional "temperature", optional "options"}; {}: the loss names
    "log_steps": False,  # True: one "steps" line per epoch with every step's loss and logged statistics
}
# Keys added to STUDY after the first states were written, with the value those states were trained under.
LATER_KEYS: dict[str, Any] = {
    "full_eval_epochs": [5, 10],
    "holdout": None,
    "weince_options": {},
    "eval_at_start": True,
    "setup": "batchnorm-head",
    "arms": {},
    "encode_views_separately": False,
    "log_steps": False,
}
LOSSES = ("infonce", "weince", "rb-sigmoid")


def run_groups(runs: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """Consecutive runs of the same seed form a group whose runs advance one epoch at a time in turn, so the
    paired comparison of a seed grows epoch by epoch instead of waiting for the first loss to finish."""
    groups: list[list[tuple[str, int]]] = []
    for arm, seed in runs:
        if groups and groups[-1][-1][1] == seed:
            groups[-1].append((arm, seed))
        else:
            groups.append([(arm, seed)])
    return groups


def run_config(config: dict[str, Any], arm: str) -> dict[str, Any]:
    """What a saved state of run prefix ``arm`` must agree with: the configuration, with ``arms`` narrowed to
    that run's own arm (arms added to a study later do not invalidate the states of the runs already going)."""
    if not config.get("arms"):
        return config
    return {**config, "arms": {arm: config["arms"].get(arm)}}


class StepLog:
    """Every training step's loss and the objective's logged statistics (read each step: a CPU study, where reading
    a value costs nothing), and their epoch means as the loss's own running means give them (non-finite values left
    out)."""

    def __init__(self, objective: Any) -> None:
        self.objective = objective
        self.loss: list[float] = []
        self.statistics: dict[str, list[float]] = {}

    def on_step(self, step: int, loss: torch.Tensor) -> None:
        self.loss.append(float(loss))
        for key, value in self.objective.pop_logged_statistics().items():
            self.statistics.setdefault(key, [float("nan")] * (len(self.loss) - 1)).append(value)
        for values in self.statistics.values():  # a statistic missing this step
            values.extend([float("nan")] * (len(self.loss) - len(values)))

    def record(self) -> dict[str, Any]:
        return {"loss": self.loss, "loss_statistics": self.statistics}

    def means(self) -> dict[str, float]:
        means = {}
        for key, values in self.statistics.items():
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                means[key] = sum(finite) / len(finite)
        return means


@dataclass
class StudyRuns:
    """The runs of one study configuration: their data, where their lines and states go, and the command that
    started them (recorded in the headers and resume lines)."""

    config: dict[str, Any]
    data: EvalData
    output_dir: Path
    state_dir: Path
    argv: list[str]

    def run_all(
        self,
        runs: list[tuple[str, int]],
        stop_after_epoch: int | None = None,
        after_epoch: Callable[[], Any] | None = None,
    ) -> None:
        """Train the runs in order; consecutive runs of one seed in lockstep (every run of the group reaches epoch
        e before any goes on to e + 1); ``after_epoch()`` (a summary) after every round."""
        for group in run_groups(runs):
            active = list(group)
            announced: set[tuple[str, int]] = set()
            for target in range(1, self.config["epochs"] + 1) if len(group) > 1 else [None]:
                for run in list(active):
                    status = self.train(
                        *run, stop_after_epoch, until_epoch=target, announce_resume=run not in announced
                    )
                    if status != "waiting":
                        announced.add(run)
                    if status not in ("paused", "waiting"):
                        active.remove(run)
                if after_epoch is not None:
                    after_epoch()

    def train(
        self,
        arm: str,
        seed: int,
        stop_after_epoch: int | None = None,
        until_epoch: int | None = None,
        announce_resume: bool = True,
    ) -> str:
        """Train (or continue) one run; returns "skipped", "finished", "stopped" (``stop_after_epoch`` reached) or
        "paused" (epoch ``until_epoch`` reached; the next call continues from the saved state) or "waiting" (the
        saved state is at ``until_epoch`` or beyond already; nothing is done).

        ``announce_resume``: a continuation by a new process adds a ``"type": "resume"`` line; one by the same
        process (interleaved runs) adds nothing, as the state it continues from is exact."""
        config, data, argv = self.config, self.data, self.argv
        name = runlog.run_name(arm, seed)
        path = self.output_dir / f"{name}.jsonl"
        state_path = self.state_dir / name / "state.pt"
        records = runlog.read_lines(path)
        if any(r.get("type") == "final" for r in records):
            print(f"[skip] {name}: final line present", flush=True)
            return "skipped"

        model, objective, optimizer = build_run(arm, seed, config)  # the same initial network for every arm of a seed
        arm_entry = config.get("arms", {}).get(arm) or {}
        source = arm_entry.get("infonce_scale_schedule")
        if source is not None:  # the top-M InfoNCE scale follows another run's logged per-step effective scale
            objective = ScheduledScale(objective, load_schedule(self.output_dir, source, seed))
        if (warm := arm_entry.get("warm_start")) is not None:
            # The first epochs train as arm warm["arm"] does (built last, so that the global random state is its
            # run's too), then this arm's objective takes over; a schedule goes on from the step of the handover.
            handover = warm["epochs"] * (data.train.images.shape[0] // config["batch_size"])
            if isinstance(objective, ScheduledScale):
                objective.step.fill_(handover)
            model, first, optimizer = build_run(warm["arm"], seed, config)
            objective = Handover(first, objective, handover)
        augment_generator = torch.Generator().manual_seed(seed)
        augment = SimCLRAugment(data.setup.augment, generator=augment_generator)
        # An arm's entry may set the encoding too (the ablation's per-view check), else the study's setting.
        per_view = (config.get("arms", {}).get(arm) or {}).get(
            "encode_views_separately", config.get("encode_views_separately", False)
        )
        training = SimCLRTraining(
            model, objective, optimizer, augment, config["channels_last"], encode_views_separately=per_view
        )
        start_epoch, elapsed, train_seconds = 0, 0.0, 0.0
        state = torch.load(state_path, weights_only=False) if state_path.exists() else None
        if state is not None:
            saved = run_config({**{k: v for k, v in LATER_KEYS.items() if k in config}, **state["config"]}, arm)
            mine = run_config(config, arm)
            if saved != mine:
                changed = sorted(k for k in set(mine) | set(saved) if mine.get(k) != saved.get(k))
                raise ValueError(f"{state_path} was written with a different configuration ({changed}); move it away")
            if until_epoch is not None and state["epoch"] >= until_epoch and records:
                return "waiting"  # already there: nothing done, nothing written
        script_sha256 = runlog.file_sha256(Path(__file__))
        if state is not None and records and records[0].get("type") == "header":
            model.load_state_dict(state["model"])
            restore_loss_state(objective, state["objective"], str(state_path))
            optimizer.load_state_dict(state["optimizer"])
            augment_generator.set_state(state["augment_rng"])
            start_epoch, elapsed, train_seconds = state["epoch"], state["elapsed"], state["train_seconds"]
            kept = [
                r for r in records if r.get("type") not in ("checkpoint", "full", "steps") or r["epoch"] <= start_epoch
            ]
            if announce_resume:
                kept.append(
                    {"type": "resume", "from_epoch": start_epoch, "script_sha256": script_sha256, **provenance(argv)}
                )
                print(f"[resume] {name} from epoch {start_epoch}", flush=True)
            runlog.write_lines(path, kept)
        else:
            header = {"type": "header", "run": name, "loss": arm, "seed": seed, "config": config}
            header.update(
                {"objective": objective.get_config_dict(), "script_sha256": script_sha256, **provenance(argv)}
            )
            runlog.write_lines(path, [header])
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
            runlog.append_line(path, {"type": "checkpoint", **evaluation["subset"], **base})
            if full:  # "final" at the last epoch, "full" at the milestones before it
                runlog.append_line(path, {"type": "final" if final else "full", **evaluation["full"], **base})
            print(
                f"[{name}] epoch {epoch}: linear {evaluation['subset']['linear_top1']:.2f} "
                f"k-NN {evaluation['subset']['knn_top1']:.2f} xi {evaluation['pot_projection']['xi']} "
                f"lambda {evaluation['encoder_weince_statistics']['lambda_mean']:.3f} "
                f"({time.perf_counter() - session_start:.0f} s)",
                flush=True,
            )

        if start_epoch == 0 and config["eval_at_start"]:
            checkpoint(0, None, {})
        for epoch in range(start_epoch, config["epochs"]):
            tick = time.perf_counter()
            steps = StepLog(objective) if config.get("log_steps") else None
            try:
                loss_mean = training.epoch(
                    images, data_order(num_images, seed, epoch), batch_size, on_step=steps and steps.on_step
                )
            except ValueError as error:
                raise ValueError(f"{name}, epoch {epoch + 1}: {error}") from None
            train_seconds += time.perf_counter() - tick
            if steps is not None:
                runlog.append_line(path, {"type": "steps", "epoch": epoch + 1, **steps.record()})
            checkpoint(epoch + 1, loss_mean, steps.means() if steps else objective.pop_logged_statistics())
            runlog.save_state(
                state_path,
                {
                    "config": config,
                    "epoch": epoch + 1,
                    "model": model.state_dict(),
                    "objective": loss_state_record(objective, epoch + 1),  # the loss's state (the one record format)
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
# the command line every study shares


def study_parser(doc: str | None, output: Path, state: Path, runs: bool = False) -> argparse.ArgumentParser:
    """The arguments of every study script; ``runs``: also ``--runs`` and ``--stop-after-epoch``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA, help="CIFAR-10 ImageFolder directory or zip")
    parser.add_argument("--output-dir", type=Path, default=output)
    parser.add_argument("--state-dir", type=Path, default=state, help="training states (outside git)")
    parser.add_argument("--override", default="{}", help="JSON of STUDY keys to change (tests, other scales)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--summarize", action="store_true", help="only write the summary from the run files")
    parser.add_argument("--docs", type=Path, default=None, help="with --summarize: also put summary.md in this file")
    if runs:
        parser.add_argument("--runs", nargs="+", default=None, help="e.g. infonce-seed0 weince-seed0 (default: all)")
        parser.add_argument("--stop-after-epoch", type=int, default=None, help="stop each run after this epoch")
    return parser


def parse_override(text: str) -> dict[str, Any]:
    """``--override``: JSON of STUDY keys; ValueError naming the problem."""
    try:
        override = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--override must be JSON: {error}") from None
    unknown = sorted(set(override) - set(STUDY))
    if unknown:
        raise ValueError(f"--override has unknown keys {unknown}; known: {sorted(STUDY)}")
    return override


def start(parser: argparse.ArgumentParser, args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    """The configuration (``base`` with ``--override``; a bad override is a usage error) and torch's threads."""
    try:
        config = {**base, **parse_override(args.override)}
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    return config


def command_line(argv: list[str] | None) -> list[str]:
    """The command as the provenance records it."""
    return [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]


def main(
    argv: list[str] | None,
    study: Any,
    config: dict[str, Any],
    arms: list[str] | tuple[str, ...],
    block: str,
    summarize_each_epoch: bool = False,
) -> None:
    """The command line of a study of named runs (``--runs arm-seedK``): ``study`` is the script's module with its
    ``__doc__``, ``OUTPUT``, ``STATE``, ``RUN_ORDER``, ``summarize(output_dir)`` and ``markdown(summary)``."""
    parser = study_parser(study.__doc__, study.OUTPUT, study.STATE, runs=True)
    args = parser.parse_args(argv)
    if args.summarize:
        summary = study.summarize(args.output_dir)
        if args.docs is not None:
            update_docs(args.docs, study.markdown(summary), block=block)
        return
    config = start(parser, args, config)
    try:
        runs = list(study.RUN_ORDER) if args.runs is None else runlog.parse_run_names(args.runs, arms)
    except ValueError as error:
        parser.error(str(error))
    data = load_data(config, args.data_dir)
    after_epoch = (lambda: study.summarize(args.output_dir)) if summarize_each_epoch else None
    study_runs = StudyRuns(config, data, args.output_dir, args.state_dir, command_line(argv))
    study_runs.run_all(runs, args.stop_after_epoch, after_epoch)
