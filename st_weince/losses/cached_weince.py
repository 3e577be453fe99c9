from __future__ import annotations

from collections.abc import Iterable

import tqdm
from torch import Tensor

from st_weince.losses._gradcache import GradCachedLoss, backward_from_leaves
from st_weince.losses.weince import WEINCELoss


class CachedWEINCELoss(GradCachedLoss, WEINCELoss):
    """
    :class:`WEINCELoss` with gradient caching (GradCache, Gao et al. 2021), for batches of thousands of anchors on one
    device: what ``CachedMultipleNegativesRankingLoss`` is to MNRL, built on the same public
    :class:`~sentence_transformers.base.losses.gradcache.CachedLossMixin`.

    WEINCE needs large batches most: its tail fit uses each anchor's top 10 % of negatives, at least 32. At batch 64
    that is half of all negatives; at batch 4,096 it is about 410 true extremes.

    The three GradCache steps, with WEINCE's statistics in the middle one:

    1. embed every mini-batch without gradient;
    2. compute the loss on the cached embeddings with :func:`~st_weince.functional.weince_step.weince_step` in row
       chunks of ``mini_batch_size``: first the statistics, without gradient, over the *whole* score matrix (each
       anchor's tail fit needs only its own row; the pivot ``rho0`` and the batch tail index are taken over all rows,
       gathered across processes), so ``lambda``, ``beta`` and ``rho0`` are those of :class:`WEINCELoss` on the same
       embeddings (to float32 rounding where a kernel rounds a mini-batch's embeddings or a row chunk's scores
       differently); then the loss and its backward to the embeddings, chunk by chunk. Memory is linear in the
       batch: the full B x C matrix is never held, with or without gradient;
    3. re-embed every mini-batch with gradient and back-propagate the cached embedding gradients.

    Args:
        model: SentenceTransformer model.
        **options: every option of :class:`WEINCELoss` (:class:`~st_weince.functional.WEINCEOptions`), with its
            defaults and checks, and of :class:`~st_weince.losses._gradcache.GradCacheOptions`: ``mini_batch_size``
            (rows per mini-batch, for embedding and for the loss's row chunks), ``mini_batch_num_tokens`` and
            ``show_progress_bar``. The signature shows them all.

    References:
        - Erol et al., When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE, ICML 2026.
        - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021,
          https://huggingface.co/papers/2101.06983

    Requirements:
        1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
        2. A large ``per_device_train_batch_size`` and a small ``mini_batch_size``. Each step embeds every input
           twice, so a step is slower than :class:`WEINCELoss` at the same batch; use the cached loss when that batch
           does not fit in memory otherwise.

    Inputs:
        As :class:`WEINCELoss`.

    Relations:
        - Equal to :class:`WEINCELoss` (loss, statistics, gradients) at every ``mini_batch_size``, to rounding.
        - Works inside ``MatryoshkaLoss`` (which recognises cached losses by the mixin).

    Example:
        ::

            from datasets import load_dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from sentence_transformers import SentenceTransformerTrainingArguments
            from st_weince.losses import CachedWEINCELoss
            from st_weince.training import prepare_trainer

            model = SentenceTransformer("all-MiniLM-L6-v2")
            train_dataset = load_dataset("sentence-transformers/all-nli", "pair", split="train")
            loss = CachedWEINCELoss(model, mini_batch_size=64)  # 4096 anchors, 64 at a time
            args = SentenceTransformerTrainingArguments(output_dir="out", per_device_train_batch_size=4096)
            trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, loss=loss)
            prepare_trainer(trainer)
            trainer.train()
    """

    def _cached_loss(self, embeddings: list[Tensor], row_keys: list[Tensor] | None, with_backward: bool) -> Tensor:
        layout_of, columns, leaves = self._layout_of(embeddings, row_keys, leaves=with_backward)
        chunks = {"chunk_rows": self.mini_batch_size, "backward": with_backward, "progress": self._progress}
        loss = self._step(layout_of, embeddings[0].shape[0], **chunks)
        if with_backward:  # the chunks' gradients, accumulated on the leaves, through the normalisation and gather
            backward_from_leaves(columns, leaves)
        return loss

    def _progress(self, chunks: list[tuple[int, int]]) -> Iterable[tuple[int, int]]:
        return tqdm.tqdm(chunks, desc="Calculating loss", disable=not self.show_progress_bar)
