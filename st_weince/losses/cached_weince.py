from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import tqdm
from torch import Tensor, nn

from st_weince.functional.batch_tail import BatchTail
from st_weince.functional.composite import composite_loss
from st_weince.functional.effective_scale import blend_effective_scale
from st_weince.functional.false_negatives import FalseNegativeFilter, FilterCounts
from st_weince.functional.layouts import Direction, MNRLLayout, PartitionMode
from st_weince.functional.options import Gate, TopM
from st_weince.functional.weince import HardestNegatives, TailFit, WeinceMode, statistics_from_fit
from st_weince.functional.weince_rows import (
    TopMStep,
    Unit,
    batch_beta_step,
    batch_tail,
    layout_tail_fits,
    rows_loss,
    shares_the_sort,
    statistics_rows,
    top_m_effective_scales,
    top_m_rows,
    top_m_units,
)
from st_weince.losses._gradcache import GradCachedLoss, GradCacheOptions
from st_weince.losses.weince import WEINCELoss, WEINCELossOptions
from st_weince.utils.options import options_from_arguments

# WEINCELoss's named arguments, which this class's signature repeats (their defaults read from one place).
_WEINCE_ARGUMENTS = frozenset(inspect.signature(WEINCELoss.__init__).parameters) - {"self", "model", "compatibility"}


class CachedWEINCELoss(GradCachedLoss, WEINCELoss):
    def __init__(
        self,
        model: nn.Module | None,
        scale: float = WEINCELossOptions.scale,
        gather_across_devices: bool = WEINCELossOptions.gather_across_devices,
        directions: tuple[Direction, ...] = WEINCELossOptions.directions,
        partition_mode: PartitionMode = WEINCELossOptions.partition_mode,
        *,
        beta: float | str = WEINCELossOptions.beta,
        mode: WeinceMode = WEINCELossOptions.mode,
        gate: Gate | Mapping[str, Any] = WEINCELossOptions.gate,
        tail_frac: float = WEINCELossOptions.tail_frac,
        min_tail_points: int = WEINCELossOptions.min_tail_points,
        eps: float = WEINCELossOptions.eps,
        false_negative_filter: FalseNegativeFilter | tuple | list | None = WEINCELossOptions.false_negative_filter,
        check_inputs: bool = WEINCELossOptions.check_inputs,
        top_m: TopM | Mapping[str, Any] | None = WEINCELossOptions.top_m,
        mini_batch_size: int = GradCacheOptions.mini_batch_size,
        mini_batch_num_tokens: int | None = GradCacheOptions.mini_batch_num_tokens,
        show_progress_bar: bool = GradCacheOptions.show_progress_bar,
        **compatibility: Any,
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
            gather_across_devices, directions, partition_mode, beta, mode, gate, tail_frac, min_tail_points, eps,
                false_negative_filter, check_inputs, top_m, **compatibility: as in
                :class:`WEINCELoss`, with its defaults and validation (:class:`~st_weince.losses.WEINCELossOptions`).
                The guard is applied to every row chunk before the statistics, so the statistics and the loss equal
                the uncached ones. The top-M terms need only a row's own candidates, so they are computed chunk by
                chunk; the batch tail index is fitted on the negatives of all chunks (and processes) first, in the
                statistics pass.

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
            As :class:`WEINCELoss`: (anchor, positive) pairs, (anchor, positive, negative) triplets or (anchor,
            positive, negative_1, ..., negative_n) tuples of texts; no labels.

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
        weince_arguments = {name: value for name, value in locals().items() if name in _WEINCE_ARGUMENTS}
        WEINCELoss.__init__(self, model, **weince_arguments, **compatibility)
        self._set_cache_options(model, options_from_arguments(GradCacheOptions, locals()))

    def _kept_for_top_m(self, layout: MNRLLayout, units: list[Unit]) -> list[HardestNegatives] | None:
        """What the second pass's top-M terms need of a chunk's sorts: at most M hardest per row, not the tail fit's
        width (None: no top-M terms, or they pick from the groups side by side)."""
        if self.options.top_m is None or not shares_the_sort(layout):
            return None
        return [u.hardest.first(min(self.options.top_m.m, u.hardest.values.shape[1])) for u in units]

    def _cached_loss(self, embeddings: list[Tensor], row_keys: list[Tensor] | None, with_backward: bool) -> Tensor:
        queries, docs, offset, keys = self._columns(embeddings, row_keys)
        if with_backward:
            # The chunks' backward passes stop at these leaves; the normalisation (and the gather across
            # processes) is back-propagated once at the end, not once per chunk.
            normalized = [queries, *docs]
            queries = queries.detach().requires_grad_()
            docs = [doc.detach().requires_grad_() for doc in docs]
        batch_size = embeddings[0].shape[0]
        chunks = [(b, min(b + self.mini_batch_size, batch_size)) for b in range(0, batch_size, self.mini_batch_size)]
        options = self.options

        # Statistics over the whole score matrix, a row chunk at a time, without gradient; with the top-M shortfall
        # term also the batch's negative tail, for its tail index.
        # Each chunk's sort of its rows is kept for the top-M terms of the second pass (their M' per row only).
        chunk_fits, chunk_sorts, chunk_counts, chunk_tails = [], [], [], []
        with torch.no_grad():
            for begin, end in chunks:
                layout, counts = self._layout(queries, docs, keys, offset, begin, end)
                fits, units = layout_tail_fits(layout, options.math, options.top_m)
                chunk_fits.append(fits)
                chunk_sorts.append(self._kept_for_top_m(layout, units))
                chunk_counts.append(counts)
                if self.batch_beta_ema is not None:
                    chunk_tails.append(batch_tail(units, batch_size, options.top_m, options.gather_across_devices))
                del units  # (its scores are this chunk's: not kept into the next one)
        guard_counts = FilterCounts.cat(chunk_counts) if options.false_negative_filter is not None else None
        fits = [TailFit.cat([fits[group] for fits in chunk_fits]) for group in range(len(chunk_fits[0]))]
        statistics = [statistics_from_fit(fit, options.math, gather=self._gather) for fit in fits]
        top_m = options.top_m
        infonce_scale = None if top_m is None else top_m.infonce_logit_scale(options.scale)
        beta_t = beta_fit = None
        if chunk_tails:
            beta_t, beta_fit = batch_beta_step(BatchTail.cat(chunk_tails), self.batch_beta_ema, top_m, self._gather)

        total = torch.zeros((), dtype=statistics[0].lam.dtype, device=queries.device)
        # the terms' sums over the rows (detached), for their logged shares
        zero = torch.zeros((), dtype=total.dtype, device=total.device)
        term_sums = [zero, zero, zero] if top_m is not None else []
        # the effective scales' sums over the query rows (blend, top-M shortfall), for their logged means
        scale_sums = [zero, zero]
        for (begin, end), sorts in zip(
            tqdm.tqdm(chunks, desc="Calculating loss", disable=not self.show_progress_bar), chunk_sorts
        ):
            layout = self._layout(queries, docs, keys, offset, begin, end)[0]
            chunk_statistics = [statistics_rows(s, slice(begin, end)) for s in statistics]
            chunk_rows = rows_loss(layout, chunk_statistics, options.scale, options.math.eps)  # the blend
            # (no name for the query rows: one would keep this chunk's scores alive into the next chunk's forward)
            blend_scale = blend_effective_scale(
                layout.groups[0].scores, layout.groups[0].valid_mask, chunk_statistics[0].lam,
                chunk_statistics[0].beta, scale=options.scale, eps=options.eps,
            )
            scale_sums[0] = scale_sums[0] + blend_scale.mean() * (end - begin)
            if top_m is not None:
                units = top_m_units(layout, sorts)
                shortfall, infonce, shortfall_scale = top_m_rows(units, beta_t, top_m, infonce_scale)
                for index, term in enumerate((chunk_rows, shortfall, infonce)):
                    term_sums[index] = term_sums[index] + term.detach().sum()
                scale_sums[1] = scale_sums[1] + shortfall_scale.sum()
                chunk_rows = composite_loss(chunk_rows, shortfall, infonce, top_m).total
            chunk_loss = chunk_rows.sum() / batch_size
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
        step = TopMStep(total=total)
        if top_m is not None:
            shares = composite_loss(*[s / batch_size for s in term_sums], top_m).shares()
            scales = top_m_effective_scales(scale_sums[1] / batch_size, infonce_scale, top_m)
            step = TopMStep(total, shares, beta_t, beta_fit, scales)
        self._end_step(statistics[0], guard_counts, step, scale_sums[0] / batch_size)
        return total
