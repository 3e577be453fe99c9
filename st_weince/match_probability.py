"""RB-Sigmoid's trained ``t`` and ``b_rel`` carried by the model, and the match probability they give.

The sigmoid loss trains, for every pair, the probability ``sigmoid(t (s - b_rel))`` that it matches. Those two
scalars are the loss's parameters, not the model's, so without help a saved model loses them. Here they travel the
way sentence-transformers lets a model carry its own configuration: a module of the model's pipeline whose
``config.json`` the model saves in its folder and lists in ``modules.json``. :class:`MatchProbability` is that
module: it passes the features through unchanged (embeddings, ``encode`` and ``similarity`` are as without it) and
holds ``t``, ``b_rel`` (and ``b``, the locked adapter's ``delta``). ``SentenceTransformer(path)`` loads it back when
st-weince is installed; the values are plain JSON in ``<model>/<n>_MatchProbability/config.json`` otherwise.

:func:`st_weince.training.prepare_trainer` appends the module to a SentenceTransformer trained with an RB-Sigmoid loss
and writes the trained values into it (and into the model card) at every checkpoint and at the end of training.
"""

from __future__ import annotations

from typing import Any

import torch
from sentence_transformers.base.modules import Module
from torch import Tensor, nn

from st_weince.functional.layouts import normalize_rows
from st_weince.functional.sigmoid import match_probabilities

__all__ = ["MatchProbability", "carried_match_probability", "match_probability"]


class MatchProbability(Module):
    """A pass-through module holding RB-Sigmoid's trained match-probability parameters.

    Args:
        t: the trained scale (inverse temperature) ``t``.
        b_rel: the trained relative bias ``b_rel`` (the cosine score of probability 1/2).
        b: ``t * b_rel``, the absolute bias (for SigLIP-style readers).
        delta: the locked adapter's ``delta`` when the loss trained one, else None.
        loss: the class name of the loss that trained them.
        global_step: the training step the values are from (0: the configured starts, before training).
    """

    config_keys: list[str] = ["t", "b_rel", "b", "delta", "loss", "global_step"]

    def __init__(
        self,
        t: float,
        b_rel: float,
        b: float | None = None,
        delta: float | None = None,
        loss: str = "RBSigmoidLoss",
        global_step: int = 0,
    ) -> None:
        super().__init__()
        self.set_values(t=t, b_rel=b_rel, b=b, delta=delta, loss=loss, global_step=global_step)

    def set_values(
        self,
        *,
        t: float,
        b_rel: float,
        b: float | None = None,
        delta: float | None = None,
        loss: str = "RBSigmoidLoss",
        global_step: int = 0,
    ) -> None:
        t, b_rel = float(t), float(b_rel)
        if not (t > 0 and torch.isfinite(torch.tensor([t, b_rel])).all()):
            raise ValueError(f"MatchProbability needs a finite t > 0 and a finite b_rel, got t={t!r}, b_rel={b_rel!r}")
        self.t, self.b_rel = t, b_rel
        self.b = t * b_rel if b is None else float(b)
        self.delta = None if delta is None else float(delta)
        self.loss = str(loss)
        self.global_step = int(global_step)

    def forward(self, features: dict[str, Tensor | Any], **kwargs) -> dict[str, Tensor | Any]:
        return features

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.save_config(output_path)

    def probabilities(self, scores: Tensor) -> Tensor:
        """``sigmoid(t (s - b_rel))`` of cosine ``scores`` (any shape), with these values."""
        return match_probabilities(scores, scale=self.t, relative_bias=self.b_rel, delta=self.delta)

    def __repr__(self) -> str:
        return f"MatchProbability(t={self.t:.6g}, b_rel={self.b_rel:.6g}, loss={self.loss!r}, step={self.global_step})"


def carried_match_probability(model: nn.Module) -> MatchProbability | None:
    """The model's :class:`MatchProbability` module, or None when it carries none."""
    found = [module for module in model.children() if isinstance(module, MatchProbability)]
    return found[-1] if found else None


def match_probability(model: nn.Module, texts_a: list[str], texts_b: list[str], **encode_kwargs: Any) -> Tensor:
    """The ``[len(texts_a), len(texts_b)]`` matrix of match probabilities ``sigmoid(t (s - b_rel))``, like
    ``model.similarity(model.encode(texts_a), model.encode(texts_b))``, with ``s`` the cosine score and ``t``,
    ``b_rel`` the values the model carries (trained by an RB-Sigmoid loss under
    :func:`st_weince.training.prepare_trainer`). ``encode_kwargs`` go to ``model.encode`` (e.g. ``batch_size``,
    ``prompt_name``). A float32 tensor on the model's device.

    Raises ValueError when the model carries no trained values: a probability needs the ``t`` and ``b_rel`` of a
    sigmoid loss; the cosine score of a model trained otherwise has no calibrated scale.
    """
    carried = carried_match_probability(model)
    if carried is None:
        raise ValueError(
            f"this model carries no trained RB-Sigmoid t and b_rel (no MatchProbability module among "
            f"{[type(module).__name__ for module in model.children()]}), so it has no match probability. Train it "
            "with st_weince.losses.RBSigmoidLoss (or CachedRBSigmoidLoss) and call "
            "st_weince.training.prepare_trainer(trainer) before trainer.train(); the saved model then carries them"
        )
    if isinstance(texts_a, str) or isinstance(texts_b, str):
        raise TypeError("texts_a and texts_b must be lists of texts (a single text: wrap it in a list)")
    encode_kwargs = {**encode_kwargs, "convert_to_tensor": True}
    with torch.no_grad():
        a = normalize_rows(model.encode(list(texts_a), **encode_kwargs).float())
        b = normalize_rows(model.encode(list(texts_b), **encode_kwargs).float())
        return carried.probabilities(a @ b.T)
