from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import tqdm
from sentence_transformers.base.losses.gradcache import CachedLossMixin, has_static_embedding_input
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_weince.functional.false_negatives import FalseNegativeFilter
from st_weince.functional.layouts import Direction, PartitionMode, mnrl_layout
from st_weince.functional.weince import DEFAULTS, TailFit, WeinceMode, WeinceStatistics, statistics_from_fit
from st_weince.losses._labels import warn_unused_labels
from st_weince.losses.weince import LOSS_BETA_DEFAULT, WEINCE_CITATION, WEINCELoss
from st_weince.utils.hotpath import DeferredChecks

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


class CachedWEINCELoss(CachedLossMixin, WEINCELoss):
    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: PartitionMode = "joint",
        *,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        beta: float | str = LOSS_BETA_DEFAULT,
        mode: WeinceMode = DEFAULTS.mode,
        q: float = DEFAULTS.q,
        kappa_rho: float = DEFAULTS.kappa_rho,
        kappa_aic: float = DEFAULTS.kappa_aic,
        aic_margin: float = DEFAULTS.aic_margin,
        tail_frac: float = DEFAULTS.tail_frac,
        min_tail_points: int = DEFAULTS.min_tail_points,
        eps: float = DEFAULTS.eps,
        false_negative_filter: FalseNegativeFilter | tuple | list | None = None,
        check_inputs: bool = True,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
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
            scale, gather_across_devices, directions, partition_mode: as in :class:`WEINCELoss` (and MNRL).
            mini_batch_size: rows per mini-batch, for embedding and for the loss's row chunks; memory grows with it,
                speed too. The loss is the same for every value.
            mini_batch_num_tokens: if set, embedding mini-batches are packed by token count instead (as in CMNRL);
                the loss's row chunks keep ``mini_batch_size`` rows.
            show_progress_bar: show progress bars over the mini-batches.
            beta, mode, q, kappa_rho, kappa_aic, aic_margin, tail_frac, min_tail_points, eps: the WEINCE options,
                as in :class:`WEINCELoss` (validated at construction by :class:`st_weince.functional.WeinceOptions`).
            false_negative_filter: the in-batch false-negative guard, as in :class:`WEINCELoss` (applied to every
                row chunk before the statistics, so the statistics and the loss equal the uncached ones).
            check_inputs: as in :class:`WEINCELoss` (one host sync per step, or none).
            similarity_fct, hardness_mode, hardness_strength: accepted for MNRL compatibility only at their
                defaults (cos_sim, None, 0.0); refused otherwise with the reason.

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
        WEINCELoss.__init__(
            self,
            model,
            scale=scale,
            gather_across_devices=gather_across_devices,
            directions=directions,
            partition_mode=partition_mode,
            beta=beta,
            mode=mode,
            q=q,
            kappa_rho=kappa_rho,
            kappa_aic=kappa_aic,
            aic_margin=aic_margin,
            tail_frac=tail_frac,
            min_tail_points=min_tail_points,
            eps=eps,
            false_negative_filter=false_negative_filter,
            check_inputs=check_inputs,
            similarity_fct=similarity_fct,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )
        if model is not None and has_static_embedding_input(model):
            raise ValueError(
                "CachedWEINCELoss is not compatible with a StaticEmbedding model, whose inputs cannot be split into "
                "mini-batches along a batch dimension. Use WEINCELoss instead."
            )
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
        if mini_batch_num_tokens is not None and (
            isinstance(mini_batch_num_tokens, bool)
            or not isinstance(mini_batch_num_tokens, int)
            or mini_batch_num_tokens < 1
        ):
            raise ValueError(f"mini_batch_num_tokens must be a positive integer or None, got {mini_batch_num_tokens!r}")
        if not isinstance(show_progress_bar, bool):
            raise TypeError(f"show_progress_bar must be a bool, got {show_progress_bar!r}")
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(
                f"CachedWEINCELoss needs at least 2 input columns (anchor, positive[, negative_1, ...]), "
                f"got {len(sentence_features)}"
            )
        return self.forward_cached(sentence_features, labels)

    def calculate_loss(
        self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool = False
    ) -> Tensor:
        """WEINCE over the whole batch from the per-mini-batch embeddings, in row chunks of ``mini_batch_size``.

        With ``with_backward`` the loss is back-propagated to ``reps`` chunk by chunk and returned detached.
        """
        warn_unused_labels(self, labels)  # no sync: a host-side check
        checks = DeferredChecks() if self.check_inputs else False
        embeddings = [torch.cat(column) for column in reps]
        queries, docs, offset = self._normalized_columns(embeddings, checks)
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
                    queries, docs, self.directions, self.partition_mode, row_start=offset + begin, row_end=offset + end
                )
            )

        # Statistics over the whole score matrix, a row chunk at a time, without gradient.
        chunk_fits, chunk_counts = [], []
        with torch.no_grad():
            for begin, end in chunks:
                layout, counts = layout_of(begin, end)
                chunk_fits.append(self._group_fits(layout))
                chunk_counts.append(counts)
        guard_counts = None
        if self.false_negative_filter is not None:
            guard_counts = tuple(torch.cat([counts[part] for counts in chunk_counts]) for part in range(2))
        fits = [TailFit.cat([fits[group] for fits in chunk_fits]) for group in range(len(chunk_fits[0]))]
        statistics = [statistics_from_fit(fit, self.options, gather=self._gather) for fit in fits]
        if checks:
            checks.raise_if_failed()  # the one host sync of the step, before any backward pass

        total = torch.zeros((), dtype=statistics[0].lam.dtype, device=queries.device)
        for begin, end in tqdm.tqdm(chunks, desc="Calculating loss", disable=not self.show_progress_bar):
            rows = slice(begin, end)
            chunk_loss = self._rows_loss(layout_of(begin, end)[0], [_rows(s, rows) for s in statistics]).sum()
            chunk_loss = chunk_loss / batch_size
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
        self._record(statistics[0], guard_counts)
        return total

    def get_config_dict(self) -> dict[str, Any]:
        return {
            **super().get_config_dict(),
            "mini_batch_size": self.mini_batch_size,
            "mini_batch_num_tokens": self.mini_batch_num_tokens,
            "show_progress_bar": self.show_progress_bar,
        }

    @property
    def citation(self) -> str:
        return WEINCE_CITATION + GRADCACHE_CITATION
