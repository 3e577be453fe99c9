from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from sentence_transformers.util import all_gather, all_gather_with_grad, get_rank
from torch import Tensor, nn

from st_weince.functional.batch_tail import initial_beta_ema
from st_weince.functional.checks import full_precision
from st_weince.functional.effective_scale import blend_effective_scale
from st_weince.functional.false_negatives import FalseNegativeFilter, FilterCounts, apply_false_negative_filter
from st_weince.functional.layouts import Direction, MNRLLayout, PartitionMode, guard_layout, mnrl_layout
from st_weince.functional.options import Gate, TopM
from st_weince.functional.weince import (
    DEFAULTS,
    WeinceMode,
    WeinceStatistics,
    statistics_from_fit,
    weince_cross_entropy,
    weince_statistics,
)
from st_weince.functional.weince_rows import (
    TopMStep,
    Unit,
    layout_tail_fits,
    rows_loss,
    sorted_tail_fit,
    top_m_step,
)
from st_weince.losses._common import ColumnsLoss, guard_share_values, refuse_mnrl_arguments
from st_weince.losses.options import WEINCELossOptions, deprecated_flat_options
from st_weince.utils.options import options_from_arguments


def logged_values(
    stats: WeinceStatistics, guard_counts: FilterCounts | None, step: TopMStep, blend_scale: Tensor
) -> dict[str, Tensor]:
    """The logged statistics of the query rows (device tensors: no step reads them on the host): the blend's
    effective scale (mean over those rows), the gate and tail statistics, the guard's shares and, with the top-M
    terms, each term's share, their effective scales, the batch tail index and its fit's R^2."""
    fitted = stats.fitted.to(stats.lam.dtype)
    values = {
        "weince_effective_scale_blend": blend_scale.detach(),
        "weince_lambda_mean": stats.lam.mean(),
        "weince_lambda_gt_half": (stats.lam > 0.5).to(stats.lam.dtype).mean(),
        "weince_rho0": stats.rho0,
        "weince_delta_aic_mean": (stats.delta_aic * fitted).sum() / fitted.sum().clamp_min(1.0),
        "weince_beta_mean": stats.beta.mean(),
        **guard_share_values("weince", guard_counts),  # of the query-anchored rows, like the statistics above
    }
    values.update({f"weince_share_{name}": share for name, share in step.shares.items()})
    for name, value in step.effective_scales.items():
        values[f"weince_effective_scale_{name}"] = value.detach()
    if step.beta_t is not None and step.fit is not None:
        values["weince_batch_beta"] = step.beta_t.detach()
        values["weince_batch_beta_r2"] = step.fit.r_squared
    return values


WEINCE_CITATION = """
@inproceedings{erol2026weince,
    title={When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE},
    author={Erol and others},
    booktitle={Proceedings of the 43rd International Conference on Machine Learning (ICML)},
    year={2026},
    eprint={2606.00262},
    archivePrefix={arXiv},
}
"""


#: The released vision composite's top-M terms: both at weight 0.5 with M = 50 (TopM's default).
RELEASED_TOP_M = TopM(shortfall_weight=0.5, infonce_weight=0.5)

#: The released vision composite (docs/algorithms.md, "the released recipe"): temperature 0.5 (scale 2), beta 1 in the
#: blend (the released implementation's, WeinceOptions), and :data:`RELEASED_TOP_M`.
RELEASED_COMPOSITE: dict[str, Any] = {"scale": 2.0, "beta": DEFAULTS.beta, "top_m": RELEASED_TOP_M}


# Why MultipleNegativesRankingLoss's arguments other than their no-op values do not apply to WEINCE.
_MNRL_REASONS = {
    "similarity_fct": "WEINCE needs cosine scores (only cos_sim): its shortfall logit -beta log(1 - s) and its tail "
    "fit assume scores capped at the endpoint 1, which other similarities (dot product, Euclidean, Manhattan) lack",
    "hardness_mode": "MNRL's hardness weighting adds alpha * s to the negative logits, so the softmax would no longer "
    "be the choice model whose tail WEINCE fits; WEINCE's own lambda already up-weights anchors with hard negatives",
}
_MNRL_REASONS["hardness_strength"] = _MNRL_REASONS["hardness_mode"]


class WEINCELoss(ColumnsLoss):
    evolving_buffers = ("batch_beta_ema",)  # the released composite's batch tail index (its moving average)

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
        **compatibility: Any,
    ) -> None:
        """
        WEINCE (Weibull-enhanced InfoNCE): a drop-in replacement for
        :class:`~sentence_transformers.sentence_transformer.losses.MultipleNegativesRankingLoss`.

        InfoNCE's softmax is a top-1 choice model with Gumbel noise, whose tail is unbounded, while cosine scores
        stop at 1. For every anchor, WEINCE fits the tail of its hardest negatives and blends the usual logit
        ``s / tau`` with a shortfall logit ``-beta log(1 - s)`` (a Weibull-domain tail with endpoint 1), weighted by
        ``lambda(a)``, which is large for anchors whose hardest negative lies closer to the cap than the batch pivot
        ``rho0`` and whose tail fits the Weibull line better than the Gumbel one. The statistics are computed without
        gradient; the loss has no trainable parameters. With ``lambda = 0`` it is exactly MNRL.

        Args:
            model: SentenceTransformer model (None for :meth:`compute_loss_from_embeddings` /
                :meth:`loss_from_scores` only).
            scale: inverse temperature, ``scale = 1 / temperature`` (as in MNRL; 20 = temperature 0.05).
            gather_across_devices: gather embeddings across processes (local anchors x global candidates); the pivot
                ``rho0`` is then taken over the anchors of the global batch, so results do not depend on the split.
            directions: as in MNRL: "query_to_doc" (required), "query_to_query", "doc_to_query", "doc_to_doc".
                Rows anchored at queries (query_to_doc, query_to_query) share one set of statistics per query;
                rows anchored at documents (doc_to_query, doc_to_doc) get their own.
            partition_mode: "joint" (one softmax over all directions) or "per_direction" (one per direction,
                averaged), as in MNRL.
            beta: tail index in the shortfall logit. "auto" (this class's default) uses each anchor's estimate,
                clamped to [0.5, 16]; the reference implementation's 1.0 was tuned at temperature 0.5 and is
                10-20x too soft at SimCSE's 0.05 (see docs/weince.md).
            mode: "both" (hardness x geometry gate, default), "rho" (hardness only), "aic" (geometry only) or
                "none" (lambda = 0: exactly MultipleNegativesRankingLoss through this class's code path, e.g. to
                compare "InfoNCE with the false-negative guard" against WEINCE with it).
            gate: the gate lambda's four settings as one :class:`~st_weince.functional.Gate` (or its dict, as
                ``get_config_dict`` writes it): ``q``, the quantile of the hardest-negative shortfalls that defines
                the pivot ``rho0``; ``kappa_rho`` and ``kappa_aic``, the slopes of the hardness and geometry (AIC)
                gates; ``aic_margin``, the AIC difference at which the geometry gate is one half. E.g.
                ``gate=Gate(q=0.4)``; the defaults are the released implementation's.
            tail_frac: share of an anchor's negatives used for the tail fit.
            min_tail_points: minimum tail size.
            eps: floor of the shortfall ``1 - s``.
            false_negative_filter: the in-batch false-negative guard (off by default), applied to each row's
                candidates before the tail statistics and the softmax (removed candidates are neither fitted nor
                pushed away; the positive never is): ``("absolute", m)`` removes those with score > s_pos - m,
                ``("relative", r)`` those with score > s_pos - (1 - r) |s_pos|, ``"identical"`` those whose input
                (token ids) equals the row's positive's (for rows anchored at documents: the row's query's), also
                across processes and mini-batches. Rows without a positive of their own (``doc_to_doc`` without
                ``doc_to_query``) use their query_to_doc pair's score. Logged as ``weince_fn_masked_share`` and
                ``weince_fn_anchors_share``. See ``docs/false-negatives.md``.
            check_inputs: check the embeddings for NaN/Inf in every forward pass, with one host-device sync. False
                makes the hot path free of host syncs, so ``torch.compile(loss.compute_loss_from_embeddings,
                fullgraph=True)`` and CUDA graphs work; a NaN embedding then gives a NaN loss instead of an error.
            top_m: the released composite's two top-M terms and the batch tail index of its shortfall term, as one
                :class:`~st_weince.functional.TopM` (or its dict, as ``get_config_dict`` writes it); None (the
                default): off, the loss is the blend alone. ``TopM(shortfall_weight=0.5, infonce_weight=0.5)`` is the
                released pair (M = 50): a shortfall softmax, logits ``-beta_t log(1 - s)``, and InfoNCE, logits
                ``scale * s`` (or ``TopM.infonce_scale``), each over the positive and the M hardest negatives of
                each anchor. ``beta_t`` is a moving average of the batch's fitted tail index, the buffer
                ``batch_beta_ema``: in the ``state_dict``, hence in every checkpoint; it advances on training steps
                only (grad enabled, loss in training mode). The floor of the shortfall is this loss's ``eps``.
            **compatibility: ``similarity_fct``, ``hardness_mode`` and ``hardness_strength``, accepted for
                MultipleNegativesRankingLoss compatibility at their no-op values (``cos_sim``, None, 0.0) and refused
                otherwise with the reason: WEINCE needs scores with endpoint 1, and MNRL's hardness weighting would
                change the choice model whose tail WEINCE fits. Also, until 0.3, 0.1's flat top-M options
                (``top_m`` as the integer M, ``top_m_shortfall_weight``, ``top_m_infonce_weight``,
                ``top_m_infonce_scale``, ``beta_ema_*``, ``beta_min*``, ``beta_max``, ``beta_tail_*``) and flat gate
                options (``q``, ``kappa_rho``, ``kappa_aic``, ``aic_margin``), folded into ``top_m`` and ``gate``
                with a DeprecationWarning.

        The released vision composite (docs/algorithms.md), :meth:`WEINCELoss.released`, is ``L = L_blend +
        0.5 L_shortfall_topM + 0.5 L_infonce_topM`` (M = 50, scale 2, beta 1) on the SimCLR layout
        (:meth:`loss_from_scores` with :func:`st_weince.functional.nt_xent_layout`). With ``top_m=None`` (the
        default) the loss is the blend alone; with either top-M term on, the logs add ``weince_batch_beta``,
        ``weince_batch_beta_r2`` and each term's share (``weince_share_blend``, ``weince_share_top_m_shortfall``,
        ``weince_share_top_m_infonce``). :class:`~st_weince.losses.WEINCELossOptions` holds the defaults and
        validates every option at construction; the loss reads them as ``loss.options.<name>``.

        References:
            - Erol et al., When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE, ICML 2026,
              arXiv 2606.00262.
            - ``docs/algorithms.md`` section 1 of this project for the exact statistics.

        Requirements:
            1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
            2. Batches with many in-batch negatives: anchors with fewer than 4 negatives fall back to InfoNCE.
               For batches in the thousands use :class:`st_weince.losses.CachedWEINCELoss`.

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

        Recommendations:
            - Use ``BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.
            - Call :func:`st_weince.training.prepare_trainer` on the trainer to log the mean lambda, the share
              of anchors with lambda > 0.5, rho0 and the mean dAIC.

        Example:
            ::

                from datasets import load_dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_weince.losses import WEINCELoss
                from st_weince.training import prepare_trainer

                model = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = load_dataset("sentence-transformers/all-nli", "triplet", split="train")
                loss = WEINCELoss(model, false_negative_filter=("relative", 0.05))
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                prepare_trainer(trainer)
                trainer.train()
        """
        arguments = deprecated_flat_options(type(self).__name__, {"top_m": top_m, "gate": gate, **compatibility})
        top_m, gate = arguments.pop("top_m"), arguments.pop("gate")
        refuse_mnrl_arguments(type(self).__name__, _MNRL_REASONS, **arguments)
        super().__init__(model, options_from_arguments(WEINCELossOptions, locals()))
        self.last_statistics: WeinceStatistics | None = None
        self.batch_beta_ema: Tensor | None
        if self.options.top_m is not None and self.options.top_m.shortfall_weight > 0:
            # State carried across steps: in the state_dict, hence in every checkpoint (training/loss_state.py).
            self.register_buffer("batch_beta_ema", initial_beta_ema(self.options.top_m))
        else:
            self.batch_beta_ema = None

    @classmethod
    def released(cls, model: nn.Module | None, **overrides: Any) -> WEINCELoss:
        """The released vision composite (:data:`RELEASED_COMPOSITE`, the other options at their defaults) with
        ``overrides`` applied (e.g. ``gather_across_devices=True``; ``top_m=RELEASED_TOP_M.replace(m=20)`` for other
        top-M settings). Use it on the SimCLR layout (:meth:`loss_from_scores`); on the text layout it is the same
        loss on MNRL's candidates."""
        return cls(model, **{**RELEASED_COMPOSITE, **overrides})

    @property
    def scale(self) -> float:
        """``1 / temperature``, as MNRL's ``scale`` (read from the options)."""
        return self.options.scale

    @property
    def _gather(self) -> Callable[[Tensor], Tensor] | None:
        """How a per-anchor tensor of this process becomes the global batch's (no gradient): ``all_gather`` when
        gathering across devices, else None (this process's batch is the batch)."""
        return all_gather if self.options.gather_across_devices else None

    def statistics(
        self, scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None = None
    ) -> WeinceStatistics:
        """Statistics of rows held by this process; the pivot rho0 is taken over all processes' rows."""
        return weince_statistics(scores, positive_index, valid_mask, self.options.math, gather=self._gather)

    # -- the steps shared with CachedWEINCELoss
    def _columns(
        self, embeddings: list[Tensor], row_keys: list[Tensor] | None
    ) -> tuple[Tensor, list[Tensor], int, list[Tensor] | None]:
        """Checked, (gathered,) unit-length query and document columns, the global row of this process's first
        anchor, and the columns' input keys of the global batch (for the guard's "identical" rule, else None)."""
        gather = self.options.gather_across_devices
        keys = row_keys if row_keys is None or not gather else [all_gather(keys) for keys in row_keys]
        queries, *docs = self._checked_columns(embeddings, all_gather_with_grad if gather else None)
        offset = get_rank() * embeddings[0].shape[0] if gather else 0
        return queries, docs, offset, keys

    def _layout(
        self, queries: Tensor, docs: list[Tensor], keys: list[Tensor] | None, offset: int, begin: int, end: int
    ) -> tuple[MNRLLayout, FilterCounts | None]:
        """The MNRL layout of this process's rows ``begin:end`` with the false-negative guard applied, and the
        guard's per-row counts (None without it)."""
        options = self.options
        rows = {"row_start": offset + begin, "row_end": offset + end}
        layout = mnrl_layout(queries, docs, options.directions, options.partition_mode, **rows)
        return guard_layout(layout, options.false_negative_filter, keys, offset + begin)

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Cross-entropy over one score matrix, e.g. the SimCLR 2N x 2N layout of
        :func:`st_weince.functional.nt_xent_layout`. Used by the vision adapter."""
        self._check_scores(scores, positive_index, valid_mask, every_row_has_positive=True)
        positive_index = positive_index.long()
        options = self.options
        with full_precision(scores):
            valid_mask, counts = apply_false_negative_filter(
                scores, positive_index, valid_mask, options.false_negative_filter
            )
            fit, hardest = sorted_tail_fit(scores, positive_index, valid_mask, options.math, options.top_m)
            stats = statistics_from_fit(fit, options.math, gather=self._gather)
            blend = weince_cross_entropy(
                scores,
                positive_index,
                valid_mask,
                options.math,
                scale=options.scale,
                statistics=stats,
                check_inputs=False,  # checked above, with the loss's own switch
            )
            blend_scale = blend_effective_scale(
                scores, valid_mask, stats.lam, stats.beta, scale=options.scale, eps=options.eps
            )
            units = [Unit(scores, positive_index, valid_mask, hardest)]
            step = top_m_step(
                blend, units, options.top_m, self.batch_beta_ema,
                scale=options.scale, step_rows=scores.shape[0], gather=self._gather,
            )
            self._end_step(stats, counts, step, blend_scale.mean())
            return step.total

    def _loss_from_embeddings(self, embeddings: list[Tensor], row_keys: list[Tensor] | None) -> Tensor:
        options = self.options
        queries, docs, offset, keys = self._columns(embeddings, row_keys)
        layout, counts = self._layout(queries, docs, keys, offset, 0, embeddings[0].shape[0])
        fits, units = layout_tail_fits(layout, options.math, options.top_m)
        statistics = [statistics_from_fit(fit, options.math, gather=self._gather) for fit in fits]
        blend = rows_loss(layout, statistics, options.scale, options.eps).mean()
        query_rows, query_stats = layout.groups[0], statistics[0]  # the logged values are the query rows'
        blend_scale = blend_effective_scale(
            query_rows.scores, query_rows.valid_mask, query_stats.lam, query_stats.beta, scale=options.scale,
            eps=options.eps,
        )
        step = top_m_step(
            blend, units, options.top_m, self.batch_beta_ema,
            scale=options.scale, step_rows=layout.num_rows, gather=self._gather,
        )
        self._end_step(query_stats, counts, step, blend_scale.mean())
        return step.total

    def _end_step(
        self, stats: WeinceStatistics, guard_counts: FilterCounts | None, step: TopMStep, blend_scale: Tensor
    ) -> None:
        """Store the step's ``beta_t`` in the buffer on training steps (grad enabled, loss in training mode), and
        keep the statistics of the query rows: the latest ones, and their running means for the trainer's logs (on
        the device, so no step reads them on the host); ``blend_scale``: the blend's effective scale, mean over
        those rows."""
        if step.beta_t is not None and self.batch_beta_ema is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.batch_beta_ema.copy_(step.beta_t)
        if not torch.compiler.is_compiling():
            self.last_statistics = stats
        self.logged_statistics.add(logged_values(stats, guard_counts, step, blend_scale))

    @property
    def citation(self) -> str:
        return WEINCE_CITATION
