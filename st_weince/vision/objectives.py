"""The text-side loss classes, used unchanged on image projections in SimCLR's NT-Xent 2N layout.

No loss math lives here: each objective only arranges two views ``z1, z2`` [N, D] for an existing loss class.

- ``infonce``: sentence-transformers' ``MultipleNegativesRankingLoss`` with
  ``directions=("query_to_doc", "query_to_query")``. Called on ``[z1, z2]``, anchor ``z1[i]`` sees the candidates
  ``z2`` (positive ``z2[i]``) and ``z1`` without itself: the NT-Xent row of view ``i``. Called on ``[z2, z1]`` it gives
  the rows of the second views; the mean of the two calls is NT-Xent over all 2N anchors.
- ``weince``: :class:`st_weince.losses.WEINCELoss` on :func:`st_weince.functional.nt_xent_layout`
  (``loss_from_scores``), reference setting ``beta = 1``.
- ``rb-sigmoid``: :class:`st_weince.losses.RBSigmoidLoss` on the same layout; its trainable ``t`` and ``b_rel`` are
  parameters of the objective, so ``objective.parameters()`` must go into the optimizer.
"""

from __future__ import annotations

import math
from typing import Any

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import Tensor, nn

from st_weince.functional import nt_xent_layout
from st_weince.functional.options import RELEASED_COMPOSITE
from st_weince.losses import RBSigmoidLoss, WEINCELoss

LOSSES = ("infonce", "weince", "rb-sigmoid")
# SimCLR's temperature 0.5 on images and the released implementation's tail index: the released composite's values
SIMCLR_SCALE = RELEASED_COMPOSITE.scale
SIMCLR_BETA = RELEASED_COMPOSITE.beta


class SimCLRObjective(nn.Module):
    """``objective(z1, z2)`` -> scalar loss of one of the shared loss classes in the NT-Xent layout.

    Args:
        name: "infonce", "weince" or "rb-sigmoid".
        scale: the factor on cosine scores of InfoNCE and WEINCE (``1 / temperature``; SimCLR on images: 2.0, i.e.
            temperature 0.5). Not used by RB-Sigmoid, whose scale ``t`` is its own trainable parameter (its start
            value goes in ``loss_kwargs``).
        beta: WEINCE's tail index in the shortfall logit; the vision setting is the released implementation's
            (``RELEASED_COMPOSITE``), not the text loss class's "auto".
        loss_kwargs: extra keyword arguments for the loss class, validated by it (e.g. RB-Sigmoid's start values).
    """

    def __init__(
        self,
        name: str,
        *,
        scale: float = SIMCLR_SCALE,
        beta: float | str = SIMCLR_BETA,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if name not in LOSSES:
            raise ValueError(f"unknown loss {name!r}; choose one of {LOSSES}")
        if not (isinstance(scale, int | float) and 0 < scale < math.inf):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        self.name = name
        kwargs = dict(loss_kwargs or {})
        if name == "infonce":
            self.loss: nn.Module = MultipleNegativesRankingLoss(
                None, scale=scale, directions=("query_to_doc", "query_to_query"), **kwargs
            )
        elif name == "weince":
            self.loss = WEINCELoss(None, scale=scale, beta=beta, **kwargs)
        else:
            self.loss = RBSigmoidLoss(None, **kwargs)

    def forward(self, z1: Tensor, z2: Tensor) -> Tensor:
        if z1.shape != z2.shape or z1.dim() != 2 or z1.shape[0] < 2:  # one pair: InfoNCE would give 0 silently
            raise ValueError(
                f"both views must be [N, D] with the same shape and N >= 2, got {tuple(z1.shape)}, {tuple(z2.shape)}"
            )
        if self.name == "infonce":
            return 0.5 * (
                self.loss.compute_loss_from_embeddings([z1, z2], None)
                + self.loss.compute_loss_from_embeddings([z2, z1], None)
            )
        return self.loss.loss_from_scores(*nt_xent_layout(z1, z2))

    def pop_logged_statistics(self) -> dict[str, float]:
        """The wrapped loss's statistics since the last call (WEINCE's lambda, RB-Sigmoid's t and b_rel ...)."""
        pop = getattr(self.loss, "pop_logged_statistics", None)
        return pop() if pop is not None else {}

    def get_config_dict(self) -> dict[str, Any]:
        return {"name": self.name, "loss_class": type(self.loss).__name__, **self.loss.get_config_dict()}
