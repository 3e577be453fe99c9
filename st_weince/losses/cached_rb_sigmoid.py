from __future__ import annotations

from collections.abc import Callable

from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_weince.functional.false_negatives import FalseNegativeFilter
from st_weince.functional.options import ColumnMode, Exchange, Parametrization, RBSigmoidOptions, defaults_of
from st_weince.losses._gradcache import GradCachedLoss, GradCacheOptions
from st_weince.losses.rb_sigmoid import RBSigmoidLoss

_DEFAULTS = defaults_of(RBSigmoidOptions)  # the signature's defaults: read from the options classes, their one home
_CACHE_DEFAULTS = defaults_of(GradCacheOptions)


class CachedRBSigmoidLoss(GradCachedLoss, RBSigmoidLoss):
    """
    :class:`~st_weince.losses.RBSigmoidLoss` with gradient caching (GradCache, Gao et al. 2021), for batches far
    larger than fit in memory, built on sentence-transformers' ``CachedLossMixin`` as
    ``CachedMultipleNegativesRankingLoss`` is: (1) embed every mini-batch without gradients; (2) compute the loss over
    row chunks of ``mini_batch_size`` anchors, back-propagating each chunk to the embeddings at once (the sigmoid loss
    has no softmax normalization, so it is exactly the sum of the chunks'); (3) re-embed every mini-batch with
    gradients and apply the cached ones. Memory grows linearly with the batch.

    Loss and gradients equal :class:`RBSigmoidLoss`'s on the same batch (tested to 1e-5), with the same parameter
    names, so checkpoints and :func:`st_weince.training.prepare_trainer` carry over. Step (2) runs on detached
    stand-ins of the loss parameters, whose gradients reach them through the trainer's backward, so fp16 loss scaling,
    gradient accumulation and ``MatryoshkaLoss``'s weights apply to them as to the model's
    (:class:`~st_weince.losses._gradcache.GradCachedLoss`).

    Args:
        model: SentenceTransformer model.
        scale: as :class:`RBSigmoidLoss`'s.
        max_scale: as :class:`RBSigmoidLoss`'s.
        parametrization: as :class:`RBSigmoidLoss`'s.
        relative_bias: as :class:`RBSigmoidLoss`'s.
        bias: as :class:`RBSigmoidLoss`'s.
        trainable_scale: as :class:`RBSigmoidLoss`'s.
        trainable_bias: as :class:`RBSigmoidLoss`'s.
        gather_across_devices: as :class:`RBSigmoidLoss`'s.
        exchange: as :class:`RBSigmoidLoss`'s.
        symmetric: as :class:`RBSigmoidLoss`'s.
        columns: as :class:`RBSigmoidLoss`'s.
        locked_adapter: as :class:`RBSigmoidLoss`'s.
        adapter_logit: as :class:`RBSigmoidLoss`'s.
        chunk_size: as :class:`RBSigmoidLoss`'s.
        check_inputs: as :class:`RBSigmoidLoss`'s.
        false_negative_filter: as :class:`RBSigmoidLoss`'s.
        mini_batch_size: anchors per row chunk of the loss and rows per embedding mini-batch; memory grows with it,
            speed too. The loss is the same for every value.
        mini_batch_num_tokens: if set, embedding mini-batches are packed by this many non-padding tokens instead (as
            in ``CachedMultipleNegativesRankingLoss``); the loss's row chunks keep ``mini_batch_size`` anchors.
        show_progress_bar: show progress bars over the mini-batches.
        directions: as :class:`RBSigmoidLoss`'s (MNRL's, as ``symmetric``).
        similarity_fct: as :class:`RBSigmoidLoss`'s (only ``cos_sim``).
        hardness_mode: as :class:`RBSigmoidLoss`'s (only None).
        hardness_strength: as :class:`RBSigmoidLoss`'s (only 0).
        partition_mode: as :class:`RBSigmoidLoss`'s (only None).

    With ``exchange="neighbour"`` each process's candidate block arrives once, and all row chunks are scored against
    it before the next one is received.

    References:
        - Gao, Zhang, Han, Callan: Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup
          (GradCache), RepL4NLP 2021.
        - See :class:`RBSigmoidLoss` for the loss itself.

    Requirements:
        1. As :class:`RBSigmoidLoss`; a model whose inputs can be split into mini-batches (not a
           StaticEmbedding).

    Inputs:
        As :class:`RBSigmoidLoss`: (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n)
        tuples of texts, or with ``columns="modalities"`` (modality_1, ..., modality_k); no labels.

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from sentence_transformers import SentenceTransformerTrainingArguments
            from st_weince.losses import CachedRBSigmoidLoss
            from st_weince.training import prepare_trainer

            model = SentenceTransformer("all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({"anchor": questions, "positive": answers})  # lists of texts
            args = SentenceTransformerTrainingArguments(output_dir="out", per_device_train_batch_size=4096)
            loss = CachedRBSigmoidLoss(model, mini_batch_size=64, symmetric=True)
            trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss)
            prepare_trainer(trainer)
            trainer.train()
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        scale: float = _DEFAULTS.scale,
        *,
        max_scale: float = _DEFAULTS.max_scale,
        parametrization: Parametrization = _DEFAULTS.parametrization,
        relative_bias: float | None = _DEFAULTS.relative_bias,
        bias: float | None = _DEFAULTS.bias,
        trainable_scale: bool = _DEFAULTS.trainable_scale,
        trainable_bias: bool = _DEFAULTS.trainable_bias,
        gather_across_devices: bool = _DEFAULTS.gather_across_devices,
        exchange: Exchange = _DEFAULTS.exchange,
        symmetric: bool = _DEFAULTS.symmetric,
        columns: ColumnMode = _DEFAULTS.columns,
        locked_adapter: bool = _DEFAULTS.locked_adapter,
        adapter_logit: float = _DEFAULTS.adapter_logit,
        chunk_size: int | None = _DEFAULTS.chunk_size,
        check_inputs: bool = _DEFAULTS.check_inputs,
        false_negative_filter: FalseNegativeFilter | tuple[str, float] | str | None = _DEFAULTS.false_negative_filter,
        mini_batch_size: int = _CACHE_DEFAULTS.mini_batch_size,
        mini_batch_num_tokens: int | None = _CACHE_DEFAULTS.mini_batch_num_tokens,
        show_progress_bar: bool = _CACHE_DEFAULTS.show_progress_bar,
        directions: tuple[str, ...] | None = None,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        partition_mode: str | None = None,
    ) -> None:
        cache_options = GradCacheOptions(
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
        )
        super().__init__(
            model,
            scale,
            max_scale=max_scale,
            parametrization=parametrization,
            relative_bias=relative_bias,
            bias=bias,
            trainable_scale=trainable_scale,
            trainable_bias=trainable_bias,
            gather_across_devices=gather_across_devices,
            exchange=exchange,
            symmetric=symmetric,
            columns=columns,
            locked_adapter=locked_adapter,
            adapter_logit=adapter_logit,
            chunk_size=chunk_size,
            check_inputs=check_inputs,
            false_negative_filter=false_negative_filter,
            directions=directions,
            similarity_fct=similarity_fct,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
            partition_mode=partition_mode,
        )
        self._set_cache_options(cache_options)

    def _cached_loss(self, embeddings: list[Tensor], row_keys: list[Tensor] | None, with_backward: bool) -> Tensor:
        """The loss over row chunks of ``mini_batch_size`` anchors; with ``with_backward`` each chunk is
        back-propagated to the embeddings at once, on detached stand-ins of the loss parameters, whose gradients are
        returned as the zero-valued term ``sum_p (p - p.detach()) g_p`` added to the detached loss."""
        params = used = self.loss_parameters()
        if with_backward:
            used = {name: value.detach().requires_grad_(value.requires_grad) for name, value in params.items()}
        chunks = {"chunk_rows": self.mini_batch_size, "backward": with_backward}
        total, extremes, guard_counts = self._block_losses(self._checked_columns(embeddings), used, row_keys, **chunks)
        if with_backward:
            for name, value in params.items():
                if value.requires_grad and used[name].grad is not None:
                    total = total + (value - value.detach()) * used[name].grad
        if self.log_statistics:
            self._record(extremes, guard_counts)
        return total
