"""A scale that follows a schedule: the top-M InfoNCE term of one run at the per-step effective scale that another run
logged (the link-or-temperature study, benchmarks/simclr_link_or_temperature.py).

A schedule is fixed before the run that follows it: :func:`fix_schedule` reads the source run's per-step lines
(``"type": "steps"``, written when the study sets ``log_steps``) and writes ``schedules/<run>.json`` beside the run
files, with the source file's SHA-256, commit and CPU. :class:`ScheduledScale` wraps the objective of the run that
follows it and sets the scale before each training step; its step counter is a buffer, so a resumed run continues
where the schedule was.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.lab import runlog

SCHEDULED_STATISTIC = "weince_effective_scale_top_m_shortfall"


def schedule_path(output_dir: Path, source_arm: str, seed: int) -> Path:
    return output_dir / "schedules" / f"{runlog.run_name(source_arm, seed)}.json"


def per_step_values(records: list[dict[str, Any]], name: str) -> list[float]:
    """A run's per-step values of the logged statistic ``name``, epoch after epoch (its ``"steps"`` lines)."""
    steps = sorted((r for r in records if r.get("type") == "steps"), key=lambda r: r["epoch"])
    if [r["epoch"] for r in steps] != list(range(1, len(steps) + 1)):
        raise ValueError(f"the per-step lines cover epochs {[r['epoch'] for r in steps]}, not 1..{len(steps)}")
    return [value for r in steps for value in r["loss_statistics"][name]]


def fix_schedule(output_dir: Path, source_arm: str, seed: int, name: str = SCHEDULED_STATISTIC) -> Path:
    """Write the schedule of ``source_arm``'s finished run of ``seed``: its per-step ``name``, every step of every
    epoch. ValueError when that run has not finished (a schedule is fixed once, from a whole run)."""
    path = output_dir / f"{runlog.run_name(source_arm, seed)}.jsonl"
    records = runlog.read_lines(path)
    if runlog.final_record(records) is None:
        raise ValueError(f"{path} has no final line: a schedule is fixed from a finished run")
    values = per_step_values(records, name)
    header = records[0]
    out = schedule_path(output_dir, source_arm, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    schedule = {
        "source_run": path.name,
        "source_sha256": runlog.file_sha256(path),
        "statistic": name,
        "source_git_commit": header.get("git_commit"),
        "source_cpu": (header.get("machine") or {}).get("cpu"),
        "steps": len(values),
        "values": values,
    }
    out.write_text(json.dumps(schedule) + "\n")
    return out


def load_schedule(output_dir: Path, source_arm: str, seed: int) -> dict[str, Any]:
    """The fixed schedule; FileNotFoundError naming the command that fixes it."""
    path = schedule_path(output_dir, source_arm, seed)
    if not path.exists():
        raise FileNotFoundError(
            f"no schedule {path}: fix it from the finished run {runlog.run_name(source_arm, seed)} first "
            "(--fix-schedules)"
        )
    return {**json.loads(path.read_text()), "sha256": runlog.file_sha256(path)}


class ScheduledScale(nn.Module):
    """``objective`` (a SimCLRObjective on WEINCELoss with the top-M InfoNCE term on) whose top-M InfoNCE scale at
    training step ``i`` is ``schedule["values"][i]``; the steps are counted in the buffer ``step``."""

    def __init__(self, objective: nn.Module, schedule: dict[str, Any]) -> None:
        super().__init__()
        top_m = objective.loss.options.top_m
        if top_m is None or not top_m.infonce_weight > 0:
            raise ValueError("a scheduled scale needs the top-M InfoNCE term on (top_m.infonce_weight > 0)")
        self.objective = objective
        self.schedule = schedule
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, z1: Tensor, z2: Tensor) -> Tensor:
        step = int(self.step)  # a CPU study: reading the counter costs nothing
        if step >= len(self.schedule["values"]):
            raise ValueError(f"the schedule has {len(self.schedule['values'])} steps; step {step} asks for more")
        loss = self.objective.loss
        top_m = loss.options.top_m.replace(infonce_scale=self.schedule["values"][step])
        loss.options = dataclasses.replace(loss.options, top_m=top_m)
        if torch.is_grad_enabled():
            self.step += 1
        return self.objective(z1, z2)

    def pop_logged_statistics(self) -> dict[str, float]:
        return self.objective.pop_logged_statistics()

    def get_config_dict(self) -> dict[str, Any]:
        config = dict(self.objective.get_config_dict())
        config["top_m"] = {**config["top_m"], "infonce_scale": "scheduled"}
        keys = ("source_run", "source_sha256", "statistic", "source_git_commit", "steps", "sha256")
        return {**config, "infonce_scale_schedule": {key: self.schedule[key] for key in keys}}


class Handover(nn.Module):
    """``first`` for the first ``steps`` training steps, then ``then``: a warm start within one run. The run trains
    exactly as ``first``'s own run up to the handover (same network, optimizer, batches and views), so its
    continuation pairs with ``first``'s continuation. The step counter is a buffer (state, saved and restored)."""

    def __init__(self, first: nn.Module, then: nn.Module, steps: int) -> None:
        super().__init__()
        if steps < 1:
            raise ValueError(f"a handover needs at least one step of the first objective, got {steps}")
        self.first, self.then, self.steps = first, then, steps
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, z1: Tensor, z2: Tensor) -> Tensor:
        active = self.first if int(self.step) < self.steps else self.then  # a CPU study: the read costs nothing
        if torch.is_grad_enabled():
            self.step += 1
        return active(z1, z2)

    def pop_logged_statistics(self) -> dict[str, float]:
        return {**self.first.pop_logged_statistics(), **self.then.pop_logged_statistics()}

    def get_config_dict(self) -> dict[str, Any]:
        return {"first": self.first.get_config_dict(), "then": self.then.get_config_dict(), "handover_step": self.steps}
