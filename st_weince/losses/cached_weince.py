from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import tqdm
from torch import Tensor, nn

from st_weince.functional.checks import full_precision
from st_weince.functional.composite import BatchTail, composite_loss
from st_weince.functional.false_negatives import FilterCounts
from st_weince.functional.layouts import mnrl_layout
from st_weince.functional.weince import TailFit, WeinceStatistics, statistics_from_fit
from st_weince.losses._gradcache import GradCachedLoss, GradCacheOptions
from st_weince.losses._labels import warn_unused_labels
from st_weince.losses.weince import WEINCE_CITATION, WEINCELoss, WEINCELossOptions
from st_weince.utils.hotpath import DeferredChecks
from st_weince.utils.options import options_from_arguments

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


def _rows(stats: WeinceStatistics, rows: slice) -> WeinceStatistics:
    """The statistics of a block of rows (the pivot is the batch's)."""
    return WeinceStatistics(
        lam=stats.lam[rows],
        beta=stats.beta[rows],
        rho=stats.rho[rows],
        delta_aic=stats.delta_aic[rows],
        rho0=stats.rho0,
        beta_hat=stats.beta_hat[rows],
        fitted=stats.fitted[rows],
    )


class CachedWEINCELoss(GradCachedLoss, WEINCELoss):
    def __init__(
        self,
        model: nn.Module | None,
        scale: float = WEINCELossOptions.scale,
        *,
        mini_batch_size: int = GradCacheOptions.mini_batch_size,
        mini_batch_num_tokens: int | None = GradCacheOptions.mini_batch_num_tokens,
        show_progress_bar: bool = GradCacheOptions.show_progress_bar,
        **options: Any,
    ) -> None:
        """
        :class:`WEINCELoss` with gradient caching (GradCache, Gao et al. 2021), for batches of thousands of
        anchors on one device: what ``CachedMultipleNegativesRankingLoss`` is to MNRL, built on the same public
        :class:`~sentence_transformers.base.losses.gradcache.CachedLossMixin`.

        WEINCE needs large batches most: its tail fit uses each anchor's top 10 % of negatives, at least 32. At
        batch 64 that is half of all negatives; at batch 4,096 it is about 410 true extremes.

        The three GradCache steps, with WEINCE's statistics in the middle one:

        1. embed every mini-batch without gradient;
        2. compute the loss on the cached embeddings: first the statistics, without gradient, over the *whole*
           score matrix taken in row chunks of ``mini_batch_size`` (each anchor's tail fit needs only its own row;
           the pivot ``rho0`` is taken over all rows, gathered across processes), so ``lambda``, ``beta`` and
           ``rho0`` are those of :class:`WEINCELoss` on the same embeddings (to float32 rounding where a kernel
           rounds a mini-batch's embeddings or a row chunk's scores differently); then the loss and its backward
           to the embeddings, chunk by chunk. Memory is linear in the batch: the full B x C matrix is never held,
           with or without gradient;
        3. re-embed every mini-batch with gradient and back-propagate the cached embedding gradients.

        Args:
            model: SentenceTransformer model.
            scale: as in :class:`WEINCELoss` (and MNRL).
            mini_batch_size: rows per mini-batch, for embedding and for the loss's row chunks; memory grows with it,
                speed too. The loss is the same for every value.
            mini_batch_num_tokens: if set, embedding mini-batches are packed by token count instead (as in CMNRL);
                the loss's row chunks keep ``mini_batch_size`` rows.
            show_progress_bar: show progress bars over the mini-batches.
            **options: every other option of :class:`WEINCELoss` (``gather_across_devices``, ``directions``,
                ``partition_mode``, ``beta``, ``mode``, ``q``, ..., ``false_negative_filter``, ``check_inputs``, the
                top-M terms ``top_m``, ``top_m_shortfall_weight``, ``top_m_infonce_weight`` and the batch tail
                index's ``beta_*``), with its defaults and validation
                (:class:`~st_weince.losses.weince.WEINCELossOptions`). The guard is applied to every row chunk
                before the statistics, so the statistics and the loss equal the uncached ones. The top-M terms need
                only a row's own candidates, so they are computed chunk by chunk; the batch tail index is fitted on
                the negatives of all chunks (and processes) first, in the statistics pass.

        References:
            - Erol et al., When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE, ICML 2026.
            - Gao et al., Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup, 2021,
              https://huggingface.co/papers/2101.06983

        Requirements:
            1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
            2. A large ``per_device_train_batch_size`` and a small ``mini_batch_size``. Each step embeds every
               input twice, so a step is slower than :class:`WEINCELoss` at the same batch; use the cached loss
               when that batch does not fit in memory otherwise.

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+

        Relations:
            - Equal to :class:`WEINCELoss` (loss, statistics, gradients) at every ``mini_batch_size``, to rounding.
            - Works inside ``MatryoshkaLoss`` (which recognises cached losses by the mixin).

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_weince.losses import CachedWEINCELoss
                from st_weince.training import prepare_trainer

                model = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                loss = CachedWEINCELoss(model, mini_batch_size=64)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                prepare_trainer(trainer)
                trainer.train()
        """
        WEINCELoss.__init__(self, model, scale, **options)
        self._set_cache_options(model, options_from_arguments(GradCacheOptions, locals()))

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(
                f"CachedWEINCELoss needs at least 2 input columns (anchor, positive[, negative_1, ...]), "
                f"got {len(sentence_features)}"
            )
        # the inputs' keys for the guard's "identical" rule, from the whole batch before it is split into mini-batches
        self._pending_row_keys = self._row_keys(sentence_features)
        try:
            return self.forward_cached(sentence_features, labels)
        finally:
            self._pending_row_keys = None

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """WEINCE over the whole batch from the per-mini-batch embeddings, in row chunks of ``mini_batch_size``.

        With ``with_backward`` the loss is back-propagated to ``reps`` chunk by chunk and returned detached.
        """
        warn_unused_labels(self, labels)  # no sync: a host-side check
        embeddings = self._concatenated_columns(reps)
        with full_precision(*embeddings):
            return self._cached_loss(embeddings, with_backward)

    def _cached_loss(self, embeddings: list[Tensor], with_backward: bool) -> Tensor:
        checks = DeferredChecks() if self.options.check_inputs else False
        keys = self._gathered_keys(getattr(self, "_pending_row_keys", None), len(embeddings))
        queries, docs, offset = self._normalized_columns(embeddings, checks)
        if checks:
            checks.raise_if_failed()  # the one host sync of the step, where the loss receives its inputs
        if with_backward:
            # The chunks' backward passes stop at these leaves; the normalisation (and the gather across
            # processes) is back-propagated once at the end, not once per chunk.
            normalized = [queries, *docs]
            queries = queries.detach().requires_grad_()
            docs = [doc.detach().requires_grad_() for doc in docs]
        batch_size = embeddings[0].shape[0]
        chunks = [(b, min(b + self.mini_batch_size, batch_size)) for b in range(0, batch_size, self.mini_batch_size)]

        def layout_of(begin: int, end: int):
            # with the false-negative guard applied (and its per-row counts), or the plain layout and None
            return self._guarded(
                mnrl_layout(
                    queries,
                    docs,
                    self.options.directions,
                    self.options.partition_mode,
                    row_start=offset + begin,
                    row_end=offset + end,
                ),
                keys,
                offset + begin,
            )

        # Statistics over the whole score matrix, a row chunk at a time, without gradient; with the top-M shortfall
        # term also the batch's negative tail, for its tail index.
        chunk_fits, chunk_counts, chunk_tails = [], [], []
        with torch.no_grad():
            for begin, end in chunks:
                layout, counts = layout_of(begin, end)
                chunk_fits.append(self._group_fits(layout))
                chunk_counts.append(counts)
                if self.batch_beta_ema is not None:
                    chunk_tails.append(self._batch_tail(self._top_m_units(layout), batch_size))
        guard_counts = FilterCounts.cat(chunk_counts) if self.options.false_negative_filter is not None else None
        fits = [TailFit.cat([fits[group] for fits in chunk_fits]) for group in range(len(chunk_fits[0]))]
        statistics = [statistics_from_fit(fit, self.options.math, gather=self._gather) for fit in fits]
        top_m = self.options.has_top_m_terms
        beta_t, beta_fit = self._advance_batch_beta(BatchTail.cat(chunk_tails) if chunk_tails else None)

        total = torch.zeros((), dtype=statistics[0].lam.dtype, device=queries.device)
        # the terms' sums over the rows (detached), for their logged shares
        term_sums = [torch.zeros((), dtype=total.dtype, device=total.device) for _ in range(3)] if top_m else []
        for begin, end in tqdm.tqdm(chunks, desc="Calculating loss", disable=not self.show_progress_bar):
            rows = slice(begin, end)
            layout = layout_of(begin, end)[0]
            rows_loss = self._rows_loss(layout, [_rows(s, rows) for s in statistics])  # the blend
            if top_m:
                shortfall, infonce = self._top_m_rows(self._top_m_units(layout), beta_t)
                for index, term in enumerate((rows_loss, shortfall, infonce)):
                    term_sums[index] = term_sums[index] + term.detach().sum()
                rows_loss = composite_loss(rows_loss, shortfall, infonce, self.options.top_m_options).total
            chunk_loss = rows_loss.sum() / batch_size
            if with_backward:
                chunk_loss.backward()
                chunk_loss = chunk_loss.detach()
            total = total + chunk_loss
        if with_backward:
            leaves = [queries, *docs]
            torch.autograd.backward(
                [n for n, leaf in zip(normalized, leaves) if leaf.grad is not None],
                [leaf.grad for leaf in leaves if leaf.grad is not None],
            )
        composite_values = None
        if top_m:
            means = [term_sum / batch_size for term_sum in term_sums]
            shares = composite_loss(*means, self.options.top_m_options).shares()
            composite_values = self._composite_values(shares, beta_t, beta_fit)
        self._record(statistics[0], guard_counts, composite_values)
        return total

    @property
    def citation(self) -> str:
        return WEINCE_CITATION + GRADCACHE_CITATION
