from __future__ import annotations

from torch import Tensor

from st_weince.functional.sigmoid import constellation_margin_from_extremes
from st_weince.losses._gradcache import GradCachedLoss
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
        params = used = self.loss_parameters()
        if with_backward:  # the chunks run on detached stand-ins of the parameters (see the class docstring)
            used = {name: value.detach().requires_grad_(value.requires_grad) for name, value in params.items()}
        chunks = {"chunk_rows": self.mini_batch_size, "backward": with_backward}
        total, extremes, guard_counts = self._block_losses(self._checked_columns(embeddings), used, row_keys, **chunks)
        if with_backward:
            for name, value in params.items():
                if value.requires_grad and used[name].grad is not None:
                    total = total + (value - value.detach()) * used[name].grad
        if self.log_statistics:
            self._record(constellation_margin_from_extremes(*extremes)[0], guard_counts)
        return total
