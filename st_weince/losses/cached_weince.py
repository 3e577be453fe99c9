from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tqdm
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_weince.functional.checks import full_precision
from st_weince.functional.exchange import all_gather
from st_weince.functional.false_negatives import FalseNegativeFilter
from st_weince.functional.layouts import Direction, PartitionMode
from st_weince.functional.options import Gate, TopM, WEINCEMode, WEINCEOptions, defaults_of
from st_weince.functional.weince_step import weince_step
from st_weince.losses._gradcache import GradCachedLoss, GradCacheOptions, backward_from_leaves
from st_weince.losses.weince import WEINCELoss

_DEFAULTS = defaults_of(WEINCEOptions)  # the signature's defaults: read from the options classes, their one home
_CACHE_DEFAULTS = defaults_of(GradCacheOptions)


class CachedWEINCELoss(GradCachedLoss, WEINCELoss):
    """
    :class:`WEINCELoss` with gradient caching (GradCache, Gao et al. 2021), for batches of thousands of anchors on one
    device: what ``CachedMultipleNegativesRankingLoss`` is to MNRL, built on the same public
    :class:`~sentence_transformers.base.losses.gradcache.CachedLossMixin`.

    WEINCE needs large batches most: its tail fit uses each anchor's top 10 % of negatives, at least 32. The loss
    stage takes the score matrix in row chunks of ``mini_batch_size``: first every row's tail fit and the pivot over
    all rows, without gradient, so ``lambda``, ``beta`` and ``rho0`` are :class:`WEINCELoss`'s on the same embeddings;
    then the loss and its backward, chunk by chunk. The full B x C matrix is never held (docs/weince.md, "Cached
    WEINCE for large batches").

    Args:
        model: SentenceTransformer model.
        scale: as :class:`WEINCELoss`'s.
        gather_across_devices: as :class:`WEINCELoss`'s.
        directions: as :class:`WEINCELoss`'s.
        partition_mode: as :class:`WEINCELoss`'s.
        beta: as :class:`WEINCELoss`'s.
        mode: as :class:`WEINCELoss`'s.
        gate: as :class:`WEINCELoss`'s.
        tail_frac: as :class:`WEINCELoss`'s.
        min_tail_points: as :class:`WEINCELoss`'s.
        eps: as :class:`WEINCELoss`'s.
        false_negative_filter: as :class:`WEINCELoss`'s.
        check_inputs: as :class:`WEINCELoss`'s.
        top_m: as :class:`WEINCELoss`'s.
        mini_batch_size: rows per mini-batch, for embedding and for the loss's row chunks; memory grows with it,
            speed too. The loss is the same for every value.
        mini_batch_num_tokens: if set, embedding mini-batches are packed by this many non-padding tokens instead (as
            in ``CachedMultipleNegativesRankingLoss``); the loss's row chunks keep ``mini_batch_size`` rows.
        show_progress_bar: show progress bars over the mini-batches.
        similarity_fct: as :class:`WEINCELoss`'s (only ``cos_sim``).
        hardness_mode: as :class:`WEINCELoss`'s (only None).
        hardness_strength: as :class:`WEINCELoss`'s (only 0).

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

    def __init__(
        self,
        model: nn.Module | None = None,
        scale: float = _DEFAULTS.scale,
        *,
        gather_across_devices: bool = _DEFAULTS.gather_across_devices,
        directions: tuple[Direction, ...] = _DEFAULTS.directions,
        partition_mode: PartitionMode = _DEFAULTS.partition_mode,
        beta: float | str = _DEFAULTS.beta,
        mode: WEINCEMode = _DEFAULTS.mode,
        gate: Gate | dict[str, float] = _DEFAULTS.gate,
        tail_frac: float = _DEFAULTS.tail_frac,
        min_tail_points: int = _DEFAULTS.min_tail_points,
        eps: float = _DEFAULTS.eps,
        false_negative_filter: FalseNegativeFilter | tuple[str, float] | str | None = _DEFAULTS.false_negative_filter,
        check_inputs: bool = _DEFAULTS.check_inputs,
        top_m: TopM | dict[str, Any] | None = _DEFAULTS.top_m,
        mini_batch_size: int = _CACHE_DEFAULTS.mini_batch_size,
        mini_batch_num_tokens: int | None = _CACHE_DEFAULTS.mini_batch_num_tokens,
        show_progress_bar: bool = _CACHE_DEFAULTS.show_progress_bar,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        cache_options = GradCacheOptions(
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
        )
        super().__init__(
            model,
            scale,
            gather_across_devices=gather_across_devices,
            directions=directions,
            partition_mode=partition_mode,
            beta=beta,
            mode=mode,
            gate=gate,
            tail_frac=tail_frac,
            min_tail_points=min_tail_points,
            eps=eps,
            false_negative_filter=false_negative_filter,
            check_inputs=check_inputs,
            top_m=top_m,
            similarity_fct=similarity_fct,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )
        self._set_cache_options(cache_options)

    def _loss_stage(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        embeddings, row_keys = self._stage_inputs(reps, labels)
        with full_precision(*embeddings):
            batch, columns = self._mnrl_columns(embeddings, row_keys, leaves=with_backward)
            gather = all_gather if self.options.gather_across_devices else None
            progress = functools.partial(tqdm.tqdm, desc="Calculating loss") if self.show_progress_bar else iter
            step = weince_step(
                batch,
                self.options,
                self.batch_beta_ema,
                chunk_rows=self.mini_batch_size,
                gather=gather,
                backward=with_backward,
                effective_scales=self.log_statistics,
                progress=progress,
            )
            if with_backward:  # the chunks' gradients, accumulated on the leaves, through the normalisation and gather
                backward_from_leaves(columns, [batch.queries, *batch.docs])
            return self._end_step(step)
