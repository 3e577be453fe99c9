from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.util import all_gather, all_gather_with_grad, cos_sim, get_rank
from torch import Tensor, nn

from st_weince.functional.false_negatives import (
    FalseNegativeFilter,
    false_negative_mask,
    filter_row_counts,
    shares_from_row_counts,
)
from st_weince.functional.layouts import (
    CandidateGroup,
    Direction,
    MNRLLayout,
    PartitionMode,
    check_directions,
    mnrl_cross_entropy,
    mnrl_layout,
    normalize_rows,
)
from st_weince.functional.weince import (
    DEFAULTS,
    TailFit,
    WeinceMode,
    WeinceOptions,
    WeinceStatistics,
    blended_cross_entropy,
    check_scale,
    statistics_from_fit,
    weince_cross_entropy,
    weince_logits,
    weince_statistics,
    weince_tail_fit,
)
from st_weince.losses._columns import check_embedding_columns
from st_weince.losses._labels import warn_unused_labels
from st_weince.utils.hotpath import DeferredChecks

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

# The loss class's one departure from the released implementation's defaults (WeinceOptions): see its docstring.
LOSS_BETA_DEFAULT = "auto"
LOGGED_STATISTICS = (
    "weince_lambda_mean",
    "weince_lambda_gt_half",
    "weince_rho0",
    "weince_delta_aic_mean",
    "weince_beta_mean",
)
# Logged too when the false-negative guard is on (of the query-anchored rows, like the statistics above).
GUARD_LOGGED_STATISTICS = ("weince_fn_masked_share", "weince_fn_anchors_share")


def check_mnrl_only_arguments(
    similarity_fct: Callable[[Tensor, Tensor], Tensor], hardness_mode: str | None, hardness_strength: float
) -> None:
    """MultipleNegativesRankingLoss arguments that WEINCE cannot honour are refused with the reason."""
    if similarity_fct is not cos_sim:
        name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
        raise ValueError(
            f"WEINCE needs cosine scores (similarity_fct=cos_sim), got {name}: its shortfall logit "
            "-beta log(1 - s) and its tail fit assume scores capped at the endpoint 1, which other similarities "
            "(dot product, Euclidean, Manhattan) do not have."
        )
    if hardness_mode is not None or hardness_strength != 0.0:
        raise ValueError(
            "hardness_mode / hardness_strength (MNRL's hardness weighting) are not supported: they add "
            "alpha * s to the negative logits, so the softmax would no longer be the choice model whose tail WEINCE "
            "fits; WEINCE's own lambda already up-weights anchors with hard negatives. Leave them at None / 0.0."
        )


class WEINCELoss(nn.Module):
    def __init__(
        self,
        model: nn.Module | None,
        scale: float = 20.0,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: PartitionMode = "joint",
        *,
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
            q: quantile of the hardest-negative shortfalls that defines the batch pivot ``rho0``.
            kappa_rho: slope of the hardness gate.
            kappa_aic: slope of the geometry (AIC) gate.
            aic_margin: AIC difference at which the geometry gate is one half.
            tail_frac: share of an anchor's negatives used for the tail fit.
            min_tail_points: minimum tail size.
            eps: floor of the shortfall ``1 - s``.
            false_negative_filter: the in-batch false-negative guard (off by default): ``("absolute", m)`` removes
                the candidates with score > s_pos - m, ``("relative", r)`` those with score > r * s_pos, from the
                candidate set of the row, before the tail statistics and the softmax (neither fitted nor pushed
                away); the positive is never removed. Rows without a positive of their own (``doc_to_doc`` without
                ``doc_to_query``) use the score of their query_to_doc pair. Logged as ``weince_fn_masked_share``
                and ``weince_fn_anchors_share``. See ``docs/false-negatives.md``.
            check_inputs: check the embeddings for NaN/Inf in every forward pass, with one host-device sync
                (all checks read at once). False makes the hot path free of host syncs, so
                ``torch.compile(loss.compute_loss_from_embeddings, fullgraph=True)`` and CUDA graphs work;
                a NaN embedding then gives a NaN loss instead of an error.
            similarity_fct: only ``cos_sim`` (accepted for MNRL compatibility): WEINCE needs scores with endpoint 1.
            hardness_mode: only None (MNRL's hardness weighting does not combine with WEINCE; refused otherwise).
            hardness_strength: only 0.0.

        The nine WEINCE options are validated at construction (types, ranges, finiteness), by
        :class:`st_weince.functional.WeinceOptions`, which holds their defaults.

        References:
            - Erol et al., When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE, ICML 2026,
              arXiv 2606.00262.
            - ``shared/docs/ALGORITHMS.md`` section 1 of this project for the exact statistics.

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

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_weince.losses import WEINCELoss
                from st_weince.training import prepare_trainer

                model = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                loss = WEINCELoss(model)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                prepare_trainer(trainer)
                trainer.train()
        """
        super().__init__()
        self.model = model
        self.scale = check_scale(scale)
        if not isinstance(gather_across_devices, bool):
            raise TypeError(f"gather_across_devices must be a bool, got {gather_across_devices!r}")
        if not isinstance(check_inputs, bool):
            raise TypeError(f"check_inputs must be a bool, got {check_inputs!r}")
        check_directions(directions, partition_mode)
        check_mnrl_only_arguments(similarity_fct, hardness_mode, hardness_strength)
        self.directions = tuple(directions)
        self.partition_mode = partition_mode
        self.gather_across_devices = gather_across_devices
        self.check_inputs = check_inputs
        self.options = WeinceOptions(
            q=q,
            kappa_rho=kappa_rho,
            kappa_aic=kappa_aic,
            aic_margin=aic_margin,
            tail_frac=tail_frac,
            min_tail_points=min_tail_points,
            eps=eps,
            mode=mode,
            beta=beta,
        )
        self.false_negative_filter = FalseNegativeFilter.parse(false_negative_filter)
        self._logged_names = LOGGED_STATISTICS + (GUARD_LOGGED_STATISTICS if self.false_negative_filter else ())
        self.last_statistics: WeinceStatistics | None = None
        # Sums of LOGGED_STATISTICS since the last pop, kept on the device: read only when the trainer logs.
        self._logged_sums: Tensor | None = None
        self._logged_steps: Tensor | None = None

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def beta(self) -> float | str:
        return self.options.beta

    @property
    def mode(self) -> str:
        return self.options.mode

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels)

    # -- statistics --------------------------------------------------------------------------------------------

    def _gather(self, local: Tensor) -> Tensor:
        """A per-anchor tensor of this process -> the global batch's (no gradient); identity without gathering."""
        return all_gather(local) if self.gather_across_devices else local

    def statistics(
        self, scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None = None
    ) -> WeinceStatistics:
        """Statistics of rows held by this process; the pivot rho0 is taken over all processes' rows."""
        return weince_statistics(
            scores, positive_index, valid_mask, self.options, gather=self._gather, checks=self.check_inputs
        )

    def _guarded(self, layout: MNRLLayout) -> tuple[MNRLLayout, tuple[Tensor, Tensor] | None]:
        """The layout with the false-negative guard's candidates removed from every group's ``valid_mask``, and the
        per-row counts (masked, negatives before) of the query-anchored group; the layout itself when it is off."""
        spec = self.false_negative_filter
        if spec is None:
            return layout, None
        query_group = layout.groups[0]
        # The row's own positive pair score: query i against document i (query_to_doc, the first block of group 0).
        pair_scores = query_group.scores.gather(1, query_group.positive_index[:, None]).squeeze(1)
        groups, counts = [], None
        for group in layout.groups:
            masked = false_negative_mask(
                group.scores,
                group.positive_index,
                group.valid_mask,
                spec,
                positive_scores=None if group.has_positive else pair_scores,
            )
            if counts is None:
                counts = filter_row_counts(masked, group.positive_index, group.valid_mask)
            valid_mask = ~masked if group.valid_mask is None else group.valid_mask & ~masked
            groups.append(
                CandidateGroup(
                    directions=group.directions,
                    scores=group.scores,
                    widths=group.widths,
                    positive_index=group.positive_index,
                    valid_mask=valid_mask,
                    has_positive=group.has_positive,
                )
            )
        return MNRLLayout(groups=tuple(groups), partition_mode=layout.partition_mode, num_rows=layout.num_rows), counts

    def _group_fits(self, layout: MNRLLayout) -> list[TailFit]:
        # The scores come from normalised finite embeddings (checked by the caller): no value checks here.
        return [
            weince_tail_fit(group.scores, group.positive_index, group.valid_mask, self.options, checks=False)
            for group in layout.groups
        ]

    def _rows_loss(self, layout: MNRLLayout, statistics: list[WeinceStatistics]) -> Tensor:
        """Per-row loss of one block of rows of the MNRL layout, given each group's statistics of those rows."""
        if len(layout.groups) == 1 or layout.partition_mode == "per_direction":
            # every group is its own softmax: the fused cross-entropy (mean over directions for per_direction)
            rows = [
                blended_cross_entropy(
                    group.scores,
                    stats.lam,
                    stats.beta,
                    group.positive_index,
                    group.valid_mask,
                    temperature=self.temperature,
                    eps=self.options.eps,
                )
                for group, stats in zip(layout.groups, statistics)
            ]
            return rows[0] if len(rows) == 1 else torch.stack(rows, dim=1).mean(dim=1)
        logits = [
            weince_logits(
                group.scores,
                stats.lam,
                stats.beta,
                group.valid_mask,
                temperature=self.temperature,
                eps=self.options.eps,
            )
            for group, stats in zip(layout.groups, statistics)
        ]
        return mnrl_cross_entropy(layout, logits)

    def _normalized_columns(
        self, embeddings: list[Tensor], checks: DeferredChecks | bool
    ) -> tuple[Tensor, list[Tensor], int]:
        """Checked, (gathered,) unit-normalised columns and the global row of this process's first anchor."""
        # Shapes here; the values (NaN, Inf, overflowing norms) by the norm check of normalize_rows.
        check_embedding_columns(embeddings, type(self).__name__, checks=False)
        queries, docs = embeddings[0], list(embeddings[1:])
        offset = 0
        if self.gather_across_devices:
            offset = get_rank() * queries.shape[0]
            queries = all_gather_with_grad(queries)
            docs = [all_gather_with_grad(doc) for doc in docs]
        deferred = checks if isinstance(checks, DeferredChecks) else None
        name = type(self).__name__
        return (
            normalize_rows(queries, deferred, f"{name}: column 0"),
            [normalize_rows(doc, deferred, f"{name}: column {index}") for index, doc in enumerate(docs, start=1)],
            offset,
        )

    # -- losses ------------------------------------------------------------------------------------------------

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Cross-entropy over one score matrix, e.g. the SimCLR 2N x 2N layout of
        :func:`st_weince.functional.nt_xent_layout`. Used by the vision adapter."""
        checks = DeferredChecks() if self.check_inputs else False
        counts = None
        if self.false_negative_filter is not None:
            masked = false_negative_mask(scores, positive_index, valid_mask, self.false_negative_filter)
            counts = filter_row_counts(masked, positive_index, valid_mask)
            valid_mask = ~masked if valid_mask is None else valid_mask & ~masked
        stats = weince_statistics(scores, positive_index, valid_mask, self.options, gather=self._gather, checks=checks)
        loss = weince_cross_entropy(
            scores,
            positive_index,
            valid_mask,
            self.options,
            temperature=self.temperature,
            statistics=stats,
            checks=checks,
        )
        if checks:
            checks.raise_if_failed()
        self._record(stats, counts)
        return loss

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        warn_unused_labels(self, labels)  # no sync: a host-side check
        checks = DeferredChecks() if self.check_inputs else False
        queries, docs, offset = self._normalized_columns(embeddings, checks)
        batch_size = embeddings[0].shape[0]
        layout = mnrl_layout(
            queries, docs, self.directions, self.partition_mode, row_start=offset, row_end=offset + batch_size
        )
        layout, counts = self._guarded(layout)
        statistics = [statistics_from_fit(fit, self.options, gather=self._gather) for fit in self._group_fits(layout)]
        loss = self._rows_loss(layout, statistics).mean()
        if checks:
            checks.raise_if_failed()  # the one host sync of the step
        self._record(statistics[0], counts)
        return loss

    # -- logging -----------------------------------------------------------------------------------------------

    def _record(self, stats: WeinceStatistics, guard_counts: tuple[Tensor, Tensor] | None = None) -> None:
        """Keep the statistics of the query rows: the latest ones, and their sums for the trainer's logs (on the
        device, so no step reads them on the host). ``guard_counts``: the guard's per-row (masked, negatives)."""
        if not torch.compiler.is_compiling():
            self.last_statistics = stats
        fitted = stats.fitted.to(stats.lam.dtype)
        values = torch.stack(
            [
                stats.lam.mean(),
                (stats.lam > 0.5).to(stats.lam.dtype).mean(),
                stats.rho0,
                (stats.delta_aic * fitted).sum() / fitted.sum().clamp_min(1.0),
                stats.beta.mean(),
                *(
                    [value.to(stats.lam.dtype) for value in shares_from_row_counts(*guard_counts)]
                    if guard_counts is not None
                    else []
                ),
            ]
        ).detach()
        if self._logged_sums is None or self._logged_sums.device != values.device:
            self._logged_sums = torch.zeros(len(self._logged_names), dtype=torch.float32, device=values.device)
            self._logged_steps = torch.zeros((), dtype=torch.float32, device=values.device)
        self._logged_sums.add_(values.to(self._logged_sums.dtype))
        self._logged_steps.add_(1.0)

    def pop_logged_statistics(self) -> dict[str, float]:
        """Means of the statistics since the last call (used by :func:`st_weince.training.log_loss_statistics`);
        the one place they are read on the host."""
        if self._logged_sums is None or not float(self._logged_steps):
            return {}
        means = (self._logged_sums / self._logged_steps).tolist()
        self._logged_sums.zero_()
        self._logged_steps.zero_()
        return dict(zip(self._logged_names, means))

    def get_config_dict(self) -> dict[str, Any]:
        """The constructor arguments: ``type(loss)(model, **loss.get_config_dict())`` rebuilds the same loss."""
        return {
            "scale": self.scale,
            "gather_across_devices": self.gather_across_devices,
            "directions": list(self.directions),
            "partition_mode": self.partition_mode,
            **self.options.as_dict(),
            "false_negative_filter": self.false_negative_filter.to_config() if self.false_negative_filter else None,
            "check_inputs": self.check_inputs,
        }

    @property
    def citation(self) -> str:
        return WEINCE_CITATION
