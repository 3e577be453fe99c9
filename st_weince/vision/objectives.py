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

from typing import Any

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import Tensor, nn

from st_weince.functional import nt_xent_layout
from st_weince.losses import WEINCELoss

LOSSES = ("infonce", "weince", "rb-sigmoid")


class SimCLRObjective(nn.Module):
    """``objective(z1, z2)`` -> scalar loss of one of the shared loss classes in the NT-Xent layout.

    Args:
        name: "infonce", "weince" or "rb-sigmoid".
        temperature: softmax temperature of InfoNCE and WEINCE (``scale = 1 / temperature``; SimCLR vision: 0.5).
            Not used by RB-Sigmoid, whose inverse temperature ``t`` is its own (trainable) parameter.
        beta: WEINCE's tail index in the shortfall logit (reference implementation: 1.0).
        loss_kwargs: extra keyword arguments for the loss class (e.g. RB-Sigmoid's initial ``t`` / ``b_rel``).
    """

    def __init__(
        self,
        name: str,
        temperature: float = 0.5,
        beta: float | str = 1.0,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if name not in LOSSES:
            raise ValueError(f"unknown loss {name!r}; choose one of {LOSSES}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.name = name
        kwargs = dict(loss_kwargs or {})
        if name == "infonce":
            self.loss: nn.Module = MultipleNegativesRankingLoss(
                None, scale=1.0 / temperature, directions=("query_to_doc", "query_to_query"), **kwargs
            )
        elif name == "weince":
            self.loss = WEINCELoss(None, scale=1.0 / temperature, beta=beta, **kwargs)
        else:
            from st_weince.losses import RBSigmoidLoss  # written alongside; imported lazily

            self.loss = RBSigmoidLoss(None, **kwargs)

    def forward(self, z1: Tensor, z2: Tensor) -> Tensor:
        if z1.shape != z2.shape or z1.dim() != 2:
            raise ValueError(f"both views must be [N, D] with the same shape, got {tuple(z1.shape)}, {tuple(z2.shape)}")
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
