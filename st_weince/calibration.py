"""RB-Sigmoid's trained ``t`` and ``b_rel`` carried by the model, and the match probability
``sigmoid(t (s - b_rel))`` they give (docs/rb-sigmoid.md). They travel in the ``config.json`` of the model's
transformer module under ``st_weince_match_probability``, which ``save_pretrained`` and ``SentenceTransformer(path)``
round-trip with nothing else (no custom module, no st-weince needed to load). :func:`st_weince.training.prepare_trainer`
writes them; :func:`match_probability` reads them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from st_weince.functional.layouts import normalize_rows
from st_weince.functional.sigmoid import match_probabilities

__all__ = [
    "CONFIG_KEY",
    "MatchProbability",
    "carried_match_probability",
    "carry_values",
    "mark_carried_values_stale",
    "mark_values_not_carried",
    "match_probability",
]

#: The key of the values in the transformer's ``config.json``.
CONFIG_KEY = "st_weince_match_probability"


@dataclass(frozen=True)
class MatchProbability:
    """RB-Sigmoid's trained match-probability parameters.

    Args:
        t: the trained scale (inverse temperature) ``t``.
        b_rel: the trained relative bias ``b_rel`` (the cosine score of probability 1/2).
        b: ``t * b_rel``, the absolute bias (for SigLIP-style readers).
        delta: the locked adapter's ``delta`` when the loss trained one, else None.
        loss: the class name of the loss that trained them.
        global_step: the training step the values are from (0: the configured starts, before training).
    """

    t: float
    b_rel: float
    b: float
    delta: float | None = None
    loss: str = "RBSigmoidLoss"
    global_step: int = 0

    def __post_init__(self) -> None:
        values = (self.t, self.b_rel, self.b) + (() if self.delta is None else (self.delta,))
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values) or not self.t > 0:
            raise ValueError(f"MatchProbability needs a finite t > 0 and finite biases, got {self}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MatchProbability:
        known = {key: values[key] for key in ("t", "b_rel", "b", "delta", "loss", "global_step") if key in values}
        known.setdefault("b", float(known["t"]) * float(known["b_rel"]))
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def probabilities(self, scores: Tensor) -> Tensor:
        """``sigmoid(t (s - b_rel))`` of cosine ``scores`` (any shape), with these values."""
        return match_probabilities(scores, scale=self.t, relative_bias=self.b_rel, delta=self.delta)


def _hf_config(model: nn.Module) -> Any | None:
    """The Hugging Face configuration of the model's transformer module, or None (e.g. a StaticEmbedding model). A
    model wrapped for data parallelism (``DistributedDataParallel``) is read through its ``module``."""
    model = getattr(model, "module", model)
    for module in model.children() if isinstance(model, nn.Module) else ():
        config = getattr(getattr(module, "auto_model", None), "config", None)
        if config is not None and hasattr(config, "to_dict"):
            return config
    return None


def carry_values(model: nn.Module, values: dict[str, Any]) -> bool:
    """Store trained ``values`` (the fields of :class:`MatchProbability`, checked) in the model's configuration, saved
    with it, replacing any values there; False when the model has no Hugging Face configuration to hold them."""
    config = _hf_config(model)
    if config is None:
        return False
    setattr(config, CONFIG_KEY, MatchProbability.from_dict(values).to_dict())
    return True


def _carried(model: nn.Module) -> dict[str, Any] | None:
    config = _hf_config(model)
    stored = getattr(config, CONFIG_KEY, None) if config is not None else None
    return stored if isinstance(stored, dict) else None


def carried_match_probability(model: nn.Module) -> MatchProbability | None:
    """The trained values the model carries (also values marked stale), or None."""
    stored = _carried(model)
    return None if stored is None or "not_carried" in stored else MatchProbability.from_dict(stored)


def mark_values_not_carried(model: nn.Module, reason: str) -> bool:
    """Record in the model's configuration, in place of any values there, why it carries no trained values although
    sigmoid losses trained some (``reason``, e.g. several of them, whose values differ): :func:`match_probability`
    then names that cause. Whether that changed the configuration (False: the same reason was there already, or the
    model has no Hugging Face configuration)."""
    config = _hf_config(model)
    record = {"not_carried": reason}
    if config is None or getattr(config, CONFIG_KEY, None) == record:
        return False
    setattr(config, CONFIG_KEY, record)
    return True


def mark_carried_values_stale(model: nn.Module, trained_by: str) -> None:
    """Mark the values the model carries as no longer describing it: ``trained_by`` (a loss that trains no ``t`` and
    ``b_rel``) is training the encoder further. The values stay, with what produced them and why they are stale;
    :func:`match_probability` refuses them. Nothing is read from a device."""
    stored = _carried(model)
    if stored is not None and "stale" not in stored and "not_carried" not in stored:
        produced = f"{stored.get('loss', 'an RB-Sigmoid loss')} at step {stored.get('global_step', '?')}"
        stored["stale"] = (
            f"they were trained by {produced}, and the encoder was then trained further with {trained_by}, which "
            "trains no t and b_rel: they no longer describe this model's scores"
        )


def match_probability(model: nn.Module, texts_a: list[str], texts_b: list[str], **encode_kwargs: Any) -> Tensor:
    """The ``[len(texts_a), len(texts_b)]`` matrix of match probabilities ``sigmoid(t (s - b_rel))``, like
    ``model.similarity(model.encode(texts_a), model.encode(texts_b))``, with ``s`` the cosine score and ``t``,
    ``b_rel`` the values the model carries (trained by an RB-Sigmoid loss under
    :func:`st_weince.training.prepare_trainer`). ``encode_kwargs`` go to ``model.encode`` (e.g. ``batch_size``,
    ``prompt_name``). A float32 tensor on the model's device.

    Raises ValueError when the model carries no trained values: a probability needs the ``t`` and ``b_rel`` of a
    sigmoid loss; the cosine score of a model trained otherwise has no calibrated scale.
    """
    stored = _carried(model)
    if stored is None:
        raise ValueError(
            f"this model carries no trained RB-Sigmoid t and b_rel (no {CONFIG_KEY!r} in its transformer's "
            "config.json), so it has no match probability. Train it with st_weince.losses.RBSigmoidLoss (or "
            "CachedRBSigmoidLoss) and call st_weince.training.prepare_trainer(trainer) before trainer.train(); the "
            "saved model then carries them"
        )
    if "not_carried" in stored:
        raise ValueError(f"this model carries no trained RB-Sigmoid t and b_rel: {stored['not_carried']}")
    if "stale" in stored:
        raise ValueError(
            f"this model's t and b_rel ({CONFIG_KEY!r} in its config.json) are stale: {stored['stale']}. Train it "
            "with RBSigmoidLoss last (under st_weince.training.prepare_trainer) to give it a match probability again"
        )
    carried = MatchProbability.from_dict(stored)
    if isinstance(texts_a, str) or isinstance(texts_b, str):
        raise TypeError("texts_a and texts_b must be lists of texts (a single text: wrap it in a list)")
    encode_kwargs = {**encode_kwargs, "convert_to_tensor": True}
    with torch.no_grad():
        a = normalize_rows(model.encode(list(texts_a), **encode_kwargs).float())
        b = normalize_rows(model.encode(list(texts_b), **encode_kwargs).float())
        return carried.probabilities(a @ b.T)
