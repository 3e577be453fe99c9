"""Small BERT encoders built from a config, offline: for tests, demos and reduced-scale runs."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

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
    hidden_size: int = 32, num_layers: int = 2, num_heads: int = 2, intermediate_size: int = 64,
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
