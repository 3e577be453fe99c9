"""What the two cached losses share on top of sentence-transformers' ``CachedLossMixin``: the mini-batch options
(validated once, the one home of their defaults) and the check that the model can be split into mini-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sentence_transformers.base.losses.gradcache import CachedLossMixin, has_static_embedding_input
from torch import Tensor, nn

from st_weince.utils.options import flag_option, options_config, positive_int_option


@dataclass(frozen=True)
class GradCacheOptions:
    """How a cached loss splits the batch: ``mini_batch_size`` rows per embedding mini-batch and per row chunk of the
    loss, or embedding mini-batches packed to ``mini_batch_num_tokens`` tokens (as in CMNRL)."""

    mini_batch_size: int = 32
    mini_batch_num_tokens: int | None = None
    show_progress_bar: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mini_batch_size", positive_int_option("mini_batch_size", self.mini_batch_size))
        object.__setattr__(
            self,
            "mini_batch_num_tokens",
            positive_int_option("mini_batch_num_tokens", self.mini_batch_num_tokens, optional=True),
        )
        object.__setattr__(self, "show_progress_bar", flag_option("show_progress_bar", self.show_progress_bar))


class GradCachedLoss(CachedLossMixin):
    """``CachedLossMixin`` reading its mini-batch settings from one :class:`GradCacheOptions`."""

    cache_options: GradCacheOptions

    def _set_cache_options(self, model: nn.Module | None, options: GradCacheOptions) -> None:
        if model is not None and has_static_embedding_input(model):
            name = type(self).__name__
            raise ValueError(
                f"{name} cannot split the inputs of a StaticEmbedding model into mini-batches (they have no batch "
                f"dimension); use {name.removeprefix('Cached')} instead"
            )
        self.cache_options = options

    @property
    def mini_batch_size(self) -> int:
        return self.cache_options.mini_batch_size

    @property
    def mini_batch_num_tokens(self) -> int | None:
        return self.cache_options.mini_batch_num_tokens

    @property
    def show_progress_bar(self) -> bool:
        return self.cache_options.show_progress_bar

    def _concatenated_columns(self, reps: list[list[Tensor]]) -> list[Tensor]:
        """Each column's mini-batch embeddings as one [batch, dimension] matrix. An empty batch (no mini-batch, or a
        column without rows) is refused with the losses' own error, not ``torch.cat``'s."""
        name = type(self).__name__
        if not reps:
            raise ValueError(f"{name}: got no input columns")
        for index, column in enumerate(reps):
            if not all(isinstance(piece, Tensor) for piece in column):
                raise ValueError(f"{name}: column {index} must be a list of embedding tensors")
            if not column or sum(piece.shape[0] if piece.dim() else 0 for piece in column) == 0:
                raise ValueError(f"{name}: the batch is empty (column {index} has no rows)")
        return [torch.cat(column) for column in reps]

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), **options_config(self.cache_options)}
