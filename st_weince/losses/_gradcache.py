"""What the two cached losses share on top of sentence-transformers' ``CachedLossMixin``: the mini-batch options
(validated once, the one home of their defaults), the check that the model can be split into mini-batches, the
forward pass and the loss stage's entry point; each loss computes ``_cached_loss`` on the whole batch's
embeddings."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from sentence_transformers.base.losses.gradcache import CachedLossMixin, has_static_embedding_input
from torch import Tensor

from st_weince.functional.checks import full_precision
from st_weince.functional.options import Options, operational, options
from st_weince.utils.options import flag_option, positive_int_option

GRADCACHE_CITATION = """
@misc{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


@options
class GradCacheOptions(Options):
    """How a cached loss splits the batch: the cached losses' ``mini_batch_size``, ``mini_batch_num_tokens`` and
    ``show_progress_bar`` (their Args)."""

    mini_batch_size: int = operational(32)
    mini_batch_num_tokens: int | None = operational(None)
    show_progress_bar: bool = operational(False)

    def _check_other_fields(self) -> None:
        self._store("mini_batch_size", positive_int_option("mini_batch_size", self.mini_batch_size))
        self._store(
            "mini_batch_num_tokens",
            positive_int_option("mini_batch_num_tokens", self.mini_batch_num_tokens, optional=True),
        )
        self._store("show_progress_bar", flag_option("show_progress_bar", self.show_progress_bar))


class GradCachedLoss(CachedLossMixin):
    """``CachedLossMixin`` reading its mini-batch settings from one :class:`GradCacheOptions`, in front of an uncached
    loss class (``class CachedX(GradCachedLoss, X)``).

    The loss's own parameters (RB-Sigmoid's ``t`` and bias) get their gradients through the outer backward: the
    mixin runs the loss stage, with its backward, inside ``forward`` and returns the loss detached, so a parameter
    that took part in that backward would get its gradient there, without the loss scaling of fp16 training and the
    division by the gradient-accumulation steps. The loss stage therefore returns the detached loss plus a
    zero-valued term ``sum_p (p - p.detach()) g_p`` carrying them, ``forward`` keeps that term of the outermost call
    of ``calculate_loss`` (a wrapper such as MatryoshkaLoss's, which assigns its own ``calculate_loss`` to the
    loss and weights each call, included) and adds it to the mixin's loss."""

    cache_options_class = GradCacheOptions
    cache_options: GradCacheOptions
    # The parameter terms of the loss stage's calls during one forward; None outside forward.
    _parameter_terms: list[Tensor] | None = None
    # The whole batch's input keys for the guard's "identical" rule, taken before the batch is split into mini-batches.
    _pending_row_keys: list[Tensor] | None = None

    def _set_cache_options(self, cache_options: GradCacheOptions) -> None:
        """Keep ``cache_options``, after the uncached loss's constructor; refuses a model that cannot be split into
        mini-batches."""
        if self.model is not None and has_static_embedding_input(self.model):
            name = type(self).__name__
            raise ValueError(
                f"{name} cannot split the inputs of a StaticEmbedding model into mini-batches (they have no batch "
                f"dimension); use {name.removeprefix('Cached')} instead"
            )
        self.cache_options = cache_options

    @property
    def mini_batch_size(self) -> int:
        return self.cache_options.mini_batch_size

    @property
    def mini_batch_num_tokens(self) -> int | None:
        return self.cache_options.mini_batch_num_tokens

    @property
    def show_progress_bar(self) -> bool:
        return self.cache_options.show_progress_bar

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        if not self._first_training_step_done:
            self._at_first_training_step()
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(
                f"{type(self).__name__} needs at least 2 input columns (anchor, positive[, negative_1, ...]), "
                f"got {len(sentence_features)}"
            )
        guard = self.options.false_negative_filter
        self._pending_row_keys = (
            self._row_keys(sentence_features) if guard is not None and guard.rule == "identical" else None
        )
        self._parameter_terms = []
        try:
            loss = self.forward_cached(sentence_features, labels)
            terms = self._parameter_terms
        finally:
            self._pending_row_keys = self._parameter_terms = None
        # the outermost call returns last: its term is the weighted sum of the inner ones
        return loss + terms[-1] if terms and terms[-1].requires_grad else loss

    @property
    def calculate_loss(self) -> Callable[..., Tensor]:
        """The loss stage as the mixin calls it: ``(reps, labels=None, *, with_backward=False) -> loss``, this
        class's own, or the wrapper assigned to ``calculate_loss`` (MatryoshkaLoss's); its parameter term is kept
        for ``forward`` (see the class docstring)."""
        stage = self.__dict__.get("calculate_loss", self._loss_stage)

        def keep_parameter_term(*args: Any, **kwargs: Any) -> Tensor:
            total = stage(*args, **kwargs)
            if self._parameter_terms is not None:
                self._parameter_terms.append(total - total.detach())
            return total

        return keep_parameter_term

    @calculate_loss.setter
    def calculate_loss(self, wrapper: Callable[..., Tensor]) -> None:
        self.__dict__["calculate_loss"] = wrapper

    def _loss_stage(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """The loss of the whole batch from the per-mini-batch embeddings, in row chunks of ``mini_batch_size``.
        With ``with_backward`` each chunk is back-propagated to ``reps`` at once and the loss returned detached (plus
        the zero-valued term carrying the loss parameters' gradients)."""
        embeddings, row_keys = self._stage_inputs(reps, labels)
        with full_precision(*embeddings):
            return self._cached_loss(embeddings, row_keys, with_backward)

    def _stage_inputs(
        self, reps: list[list[Tensor]], labels: Tensor | None
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        """The loss stage's inputs: each column's embeddings as one matrix (an empty batch refused in the losses' own
        words, not ``torch.cat``'s) and the keys of the false-negative guard."""
        name = type(self).__name__
        if not reps:
            raise ValueError(f"{name}: got no input columns")
        for index, column in enumerate(reps):
            if not all(isinstance(piece, Tensor) for piece in column):
                raise ValueError(f"{name}: column {index} must be a list of embedding tensors")
            if not column or sum(piece.shape[0] if piece.dim() else 0 for piece in column) == 0:
                raise ValueError(f"{name}: the batch is empty (column {index} has no rows)")
        embeddings = [torch.cat(column) for column in reps]
        if labels is None and self.options.false_negative_filter is None:
            return embeddings, None  # nothing to check, nothing to compare
        return embeddings, self._checked_row_keys(self._pending_row_keys, labels, embeddings)

    def _cached_loss(self, embeddings: list[Tensor], row_keys: list[Tensor] | None, with_backward: bool) -> Tensor:
        raise NotImplementedError

    @property
    def citation(self) -> str:
        return super().citation + GRADCACHE_CITATION


def backward_from_leaves(outputs: list[Tensor], leaves: list[Tensor]) -> None:
    """Back-propagate the gradients accumulated on detached ``leaves`` (stand-ins for ``outputs``, at which the loss
    stage's chunks stopped their backward) through the graph of ``outputs``."""
    pairs = [(output, leaf.grad) for output, leaf in zip(outputs, leaves) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
