from __future__ import annotations

import torch
from torch import Tensor

from st_weince.functional.false_negatives import FilterCounts
from st_weince.functional.sigmoid import constellation_margin_from_extremes
from st_weince.losses._gradcache import GradCachedLoss
from st_weince.losses._sigmoid_blocks import all_gathers, candidate_columns, directional_blocks, key_blocks
from st_weince.losses.rb_sigmoid import RBSigmoidLoss


class CachedRBSigmoidLoss(GradCachedLoss, RBSigmoidLoss):
    """
    :class:`~st_weince.losses.RBSigmoidLoss` with gradient caching (GradCache, Gao et al. 2021), for batches far
    larger than fit in memory, built on sentence-transformers' ``CachedLossMixin`` as
    ``CachedMultipleNegativesRankingLoss`` is:

        (1) embed every mini-batch without gradients;
        (2) compute the loss over row chunks of ``mini_batch_size`` anchors, back-propagating each chunk to the
            embeddings at once, so that one ``[mini_batch_size, candidates]`` block of scores is alive at a
            time (the sigmoid loss has no softmax normalization, so it is exactly the sum of the chunks' losses):
            memory grows linearly with the batch;
        (3) re-embed every mini-batch with gradients and apply the cached embedding gradients.

    Loss, model gradients and loss-parameter gradients equal those of :class:`RBSigmoidLoss` on the same batch
    (tested to 1e-5); the parameters have the same names (``log_t``, ``b_rel`` or ``bias``, ``adapter_logit``),
    so checkpoints, ``learning_rate_mapping`` and :func:`st_weince.training.prepare_trainer` carry over.

    The loss parameters are trained as in the uncached loss: step (2) runs on detached stand-ins of them, and
    their gradients reach the parameters through the trainer's backward, so fp16 loss scaling, gradient
    accumulation and the weights of ``MatryoshkaLoss`` apply to them as to the model's (the mechanism is
    described in :class:`~st_weince.losses._gradcache.GradCachedLoss`).

    Args:
        model: SentenceTransformer model.
        **options: every option of :class:`RBSigmoidLoss` (:class:`~st_weince.functional.RBSigmoidOptions`), with its
            defaults and checks, MNRL's arguments as it takes them, and
            :class:`~st_weince.losses._gradcache.GradCacheOptions`: ``mini_batch_size`` (rows per mini-batch when
            embedding, and anchors per chunk of the loss), ``mini_batch_num_tokens`` and ``show_progress_bar``. The
            signature shows them all. With ``exchange="neighbour"`` each process's candidate block arrives once, and
            all row chunks are scored against it before the next one is received.

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
            trainer = SentenceTransformerTrainer(
                model=model,
                args=args,
                train_dataset=train_dataset,
                loss=CachedRBSigmoidLoss(model, mini_batch_size=64, symmetric=True),
            )
            prepare_trainer(trainer)
            trainer.train()
    """

    def _cached_loss(self, embeddings: list[Tensor], row_keys: list[Tensor] | None, with_backward: bool) -> Tensor:
        """The loss over row chunks of ``mini_batch_size`` anchors; with ``with_backward`` each chunk is
        back-propagated to the embeddings at once, and the loss parameters' gradients are returned as the
        zero-valued term ``sum_p (p - p.detach()) g_p`` added to the detached loss (see the class docstring)."""
        params = self.loss_parameters()
        normalized = self._checked_columns(embeddings)
        if not with_backward:
            total, extremes, guard_counts = self._row_chunk_losses(normalized, params, row_keys, backward=False)
        else:
            stand_ins = {name: value.detach().requires_grad_(value.requires_grad) for name, value in params.items()}
            total, extremes, guard_counts = self._row_chunk_losses(normalized, stand_ins, row_keys, backward=True)
            for name, value in params.items():
                if value.requires_grad and stand_ins[name].grad is not None:
                    total = total + (value - value.detach()) * stand_ins[name].grad
        if self.log_statistics:
            self._record(params, constellation_margin_from_extremes(*extremes)[0], guard_counts)
        return total

    def _row_chunk_losses(
        self, normalized: list[Tensor], params: dict[str, Tensor], row_keys: list[Tensor] | None, backward: bool
    ) -> tuple[Tensor, tuple[Tensor, Tensor], FilterCounts | None]:
        """Sum of the chunk losses (detached when ``backward``), the first block's extremes and its false-negative
        guard counts per anchor (None without the guard).

        With ``backward``, normalization and gathering run once on leaves: each chunk's backward stops at the
        normalized (and gathered) columns, and one backward per column then carries the accumulated gradients
        through the gather and the normalization to the embeddings."""
        options = self.options
        columns = [column.detach().requires_grad_() for column in normalized] if backward else normalized
        gathered, positive_index = candidate_columns(columns, options)
        # Without gathering the candidates are the columns themselves; gathered ones become leaves of their own.
        candidates = gathered
        if all_gathers(options) and backward:
            candidates = [column.detach().requires_grad_() for column in gathered]
        batch_size = columns[0].shape[0]

        total = columns[0].new_zeros(())
        extremes: tuple[Tensor, Tensor] | None = None
        guard_counts: list[FilterCounts] = []
        blocks = zip(directional_blocks(columns, candidates, options), key_blocks(columns, row_keys, options))
        for block_index, ((anchor_column, block, weight), keys) in enumerate(blocks):
            if options.gather_across_devices and options.exchange == "neighbour":
                # Each process block arrives once; the row chunks go through it before the next one is received.
                ring = {"weight": weight, "anchor_chunk": self.mini_batch_size, "backward": backward}
                value, low, high, counts = self._block_loss(
                    columns[anchor_column], block, positive_index, params, keys, **ring
                )
                chunk_results = [(value, low, high, counts)]
            else:
                chunk_results = []
                for begin in range(0, batch_size, self.mini_batch_size):
                    end = min(begin + self.mini_batch_size, batch_size)
                    value, low, high, counts = self._block_loss(
                        columns[anchor_column][begin:end], block, positive_index[begin:end], params, keys
                    )
                    # The block loss is the mean over the chunk's anchors; the loss is the mean over all anchors.
                    value = value * (weight * (end - begin) / batch_size)
                    if backward:
                        value.backward()
                        value = value.detach()
                    chunk_results.append((value, low, high, counts))
            for value, low, high, counts in chunk_results:
                total = total + value
                if block_index == 0:  # the logged margin is the first block's, as in RBSigmoidLoss
                    extremes = (low, high) if extremes is None else _merge(extremes, low, high)
                    if counts is not None:
                        guard_counts.append(counts)
        if backward:
            if all_gathers(options):
                _backward_where_used(gathered, candidates)
            _backward_where_used(normalized, columns)
        # per-anchor counts of the row chunks, in row order
        return total, extremes, FilterCounts.cat(guard_counts) if guard_counts else None


def _merge(extremes: tuple[Tensor, Tensor], low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
    return torch.minimum(extremes[0], low), torch.maximum(extremes[1], high)


def _backward_where_used(outputs: list[Tensor], leaves: list[Tensor]) -> None:
    """Back-propagate the gradients accumulated on detached ``leaves`` through the graph of ``outputs``."""
    pairs = [(output, leaf.grad) for output, leaf in zip(outputs, leaves) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])
