from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.util import all_gather, all_gather_with_grad, cos_sim, get_rank
from torch import Tensor, nn

from st_weince.functional.checks import check_score_shapes, compute_dtype, full_precision, require_valid_scores
from st_weince.functional.composite import (
    TOP_M_DEFAULTS,
    BatchTail,
    BatchTailFit,
    TopMOptions,
    batch_negative_tail,
    batch_tail_fit,
    composite_loss,
    initial_beta_ema,
    top_m_cross_entropies,
    update_beta_ema,
)
from st_weince.functional.false_negatives import (
    FalseNegativeFilter,
    FilterCounts,
    apply_false_negative_filter,
    feature_keys,
)
from st_weince.functional.layouts import (
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
from st_weince.utils.logged_statistics import RunningMeans
from st_weince.utils.options import flag_option, options_config, options_from_arguments

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


@dataclass(frozen=True)
class WEINCELossOptions:
    """The options of :class:`WEINCELoss` (and :class:`~st_weince.losses.CachedWEINCELoss`): the one place of their
    defaults and their validation; the loss signatures read their defaults from here, ``get_config_dict`` writes
    them out. The nine options of the math default to the released implementation's
    (:class:`~st_weince.functional.WeinceOptions`), except ``beta``: "auto" here, because the released 1.0 was tuned
    at temperature 0.5 and is 10-20x too soft at SimCSE's 0.05 (``docs/weince.md``). The scale is MNRL's
    (temperature 0.05)."""

    scale: float = 20.0
    gather_across_devices: bool = False
    directions: tuple[Direction, ...] = ("query_to_doc",)
    partition_mode: PartitionMode = "joint"
    beta: float | str = "auto"
    mode: WeinceMode = DEFAULTS.mode
    q: float = DEFAULTS.q
    kappa_rho: float = DEFAULTS.kappa_rho
    kappa_aic: float = DEFAULTS.kappa_aic
    aic_margin: float = DEFAULTS.aic_margin
    tail_frac: float = DEFAULTS.tail_frac
    min_tail_points: int = DEFAULTS.min_tail_points
    eps: float = DEFAULTS.eps
    false_negative_filter: FalseNegativeFilter | None = None
    check_inputs: bool = True
    # The released vision composite's two top-M terms and the batch tail index of the shortfall term: off by default
    # (weights 0); the other defaults are the released implementation's (TopMOptions).
    top_m: int = TOP_M_DEFAULTS.top_m
    top_m_shortfall_weight: float = TOP_M_DEFAULTS.top_m_shortfall_weight
    top_m_infonce_weight: float = TOP_M_DEFAULTS.top_m_infonce_weight
    beta_ema_start: float = TOP_M_DEFAULTS.beta_ema_start
    beta_ema_momentum: float = TOP_M_DEFAULTS.beta_ema_momentum
    beta_min_r_squared: float = TOP_M_DEFAULTS.beta_min_r_squared
    beta_min: float = TOP_M_DEFAULTS.beta_min
    beta_max: float = TOP_M_DEFAULTS.beta_max
    beta_tail_min_points: int = TOP_M_DEFAULTS.beta_tail_min_points
    beta_tail_frac: float = TOP_M_DEFAULTS.beta_tail_frac
    # The options of the statistics (:mod:`st_weince.functional.weince`), derived from the fields above.
    math: WeinceOptions = field(init=False, repr=False, compare=False)
    # The options of the top-M terms (:mod:`st_weince.functional.composite`), derived from the fields above.
    top_m_options: TopMOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("scale", check_scale(self.scale))
        for name in ("gather_across_devices", "check_inputs"):
            put(name, flag_option(name, getattr(self, name)))
        check_directions(self.directions, self.partition_mode)
        put("directions", tuple(self.directions))
        put("math", WeinceOptions(**{f.name: getattr(self, f.name) for f in fields(WeinceOptions)}))
        for name in self.math.as_dict():  # validated and normalised there (NumPy numbers -> Python numbers)
            put(name, getattr(self.math, name))
        put("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))
        # validated and normalised there; eps is the blend's (one floor of the shortfall for every term)
        put("top_m_options", TopMOptions(**{f.name: getattr(self, f.name) for f in fields(TopMOptions)}))
        for name in self.top_m_options.as_dict():
            put(name, getattr(self.top_m_options, name))

    @property
    def has_top_m_terms(self) -> bool:
        """Whether either top-M term is on (a weight > 0)."""
        return self.top_m_shortfall_weight > 0 or self.top_m_infonce_weight > 0


#: The released vision composite (docs/algorithms.md, "the released recipe"): temperature 0.5 (scale 2), beta 1 in the
#: blend (the released implementation's, WeinceOptions), both top-M terms at weight 0.5 with M = 50 (the default).
RELEASED_COMPOSITE: dict[str, Any] = {
    "scale": 2.0,
    "beta": DEFAULTS.beta,
    "top_m_shortfall_weight": 0.5,
    "top_m_infonce_weight": 0.5,
}


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
        scale: float = WEINCELossOptions.scale,
        gather_across_devices: bool = WEINCELossOptions.gather_across_devices,
        directions: tuple[Direction, ...] = WEINCELossOptions.directions,
        partition_mode: PartitionMode = WEINCELossOptions.partition_mode,
        *,
        beta: float | str = WEINCELossOptions.beta,
        mode: WeinceMode = WEINCELossOptions.mode,
        q: float = WEINCELossOptions.q,
        kappa_rho: float = WEINCELossOptions.kappa_rho,
        kappa_aic: float = WEINCELossOptions.kappa_aic,
        aic_margin: float = WEINCELossOptions.aic_margin,
        tail_frac: float = WEINCELossOptions.tail_frac,
        min_tail_points: int = WEINCELossOptions.min_tail_points,
        eps: float = WEINCELossOptions.eps,
        false_negative_filter: FalseNegativeFilter | tuple | list | None = WEINCELossOptions.false_negative_filter,
        check_inputs: bool = WEINCELossOptions.check_inputs,
        top_m: int = WEINCELossOptions.top_m,
        top_m_shortfall_weight: float = WEINCELossOptions.top_m_shortfall_weight,
        top_m_infonce_weight: float = WEINCELossOptions.top_m_infonce_weight,
        beta_ema_start: float = WEINCELossOptions.beta_ema_start,
        beta_ema_momentum: float = WEINCELossOptions.beta_ema_momentum,
        beta_min_r_squared: float = WEINCELossOptions.beta_min_r_squared,
        beta_min: float = WEINCELossOptions.beta_min,
        beta_max: float = WEINCELossOptions.beta_max,
        beta_tail_min_points: int = WEINCELossOptions.beta_tail_min_points,
        beta_tail_frac: float = WEINCELossOptions.beta_tail_frac,
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
                the candidates with score > s_pos - m, ``("relative", r)`` those with score > s_pos - (1 - r) |s_pos|,
                from the candidate set of the row, before the tail statistics and the softmax (neither fitted nor
                pushed away); ``"identical"`` removes the candidates whose input (token ids) is identical to the row's
                positive's (for rows anchored at documents: to the row's query), also across processes and
                mini-batches; the positive is never removed. Rows without a positive of their own (``doc_to_doc``
                without ``doc_to_query``) use the score of their query_to_doc pair. Logged as ``weince_fn_masked_share``
                and ``weince_fn_anchors_share``. See ``docs/false-negatives.md``.
            check_inputs: check the embeddings for NaN/Inf in every forward pass, with one host-device sync
                (all checks read at once). False makes the hot path free of host syncs, so
                ``torch.compile(loss.compute_loss_from_embeddings, fullgraph=True)`` and CUDA graphs work;
                a NaN embedding then gives a NaN loss instead of an error.
            top_m: M, the number of hardest negatives per anchor of the two top-M terms (a row with K negatives uses
                ``min(M, K - 1)``).
            top_m_shortfall_weight: weight of the top-M shortfall term (0 = off, the default; released: 0.5): a
                pure shortfall softmax, logits ``-beta_t log(1 - s)``, over the positive and the M hardest negatives
                of each anchor, with ``beta_t`` the batch tail index below.
            top_m_infonce_weight: weight of the top-M InfoNCE term (0 = off, the default; released: 0.5): InfoNCE
                (logits ``scale * s``) over the positive and the M hardest negatives only.
            beta_ema_start, beta_ema_momentum, beta_min_r_squared, beta_min, beta_max, beta_tail_min_points,
                beta_tail_frac: the batch tail index ``beta_t`` of the top-M shortfall term (not the blend's
                ``beta``): a Weibull line is fitted to the ``k = min(K_all, max(beta_tail_min_points, floor(
                beta_tail_frac * K_all)))`` smallest shortfalls of ALL the batch's K_all negative scores (the global
                batch under ``gather_across_devices``); when its R^2 reaches ``beta_min_r_squared`` and its slope is
                positive, ``beta_ema = beta_ema_momentum * beta_ema + (1 - beta_ema_momentum) * clamp(slope,
                beta_min, beta_max)``; ``beta_t = beta_ema``, which starts at ``beta_ema_start``. The moving average
                is the loss's buffer ``batch_beta_ema`` (present when the shortfall term is on): it is in the loss's
                ``state_dict``, :func:`st_weince.training.prepare_trainer` saves it in every checkpoint and restores
                it on resume. It advances on training steps (grad enabled, loss in training mode); under
                ``torch.no_grad()`` or after ``loss.eval()`` it is read, not changed. Defaults: the released
                implementation's.
            similarity_fct: only ``cos_sim`` (accepted for MNRL compatibility): WEINCE needs scores with endpoint 1.
            hardness_mode: only None (MNRL's hardness weighting does not combine with WEINCE; refused otherwise).
            hardness_strength: only 0.0.

        The released vision composite (docs/algorithms.md) is
        ``WEINCELoss(model, scale=2.0, beta=1.0, top_m_shortfall_weight=0.5, top_m_infonce_weight=0.5)`` on the
        SimCLR layout (:meth:`loss_from_scores` with :func:`st_weince.functional.nt_xent_layout`), also
        :meth:`WEINCELoss.released`: ``L = L_blend + 0.5 L_shortfall_topM + 0.5 L_infonce_topM``, M = 50. With both
        weights 0 (the default) the loss is the blend alone, computed exactly as without these options. The logs
        then add ``weince_batch_beta`` (the batch tail index used), ``weince_batch_beta_r2`` (its fit's R^2) and
        each term's share of the loss (``weince_share_blend``, ``weince_share_top_m_shortfall``,
        ``weince_share_top_m_infonce``).

        Every option is validated at construction (types, ranges, finiteness) by
        :class:`~st_weince.losses.weince.WEINCELossOptions`, which holds their defaults; the loss reads them as
        ``loss.options.<name>``.

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
        check_mnrl_only_arguments(similarity_fct, hardness_mode, hardness_strength)
        self.model = model
        self.options = options_from_arguments(WEINCELossOptions, locals())
        self.logged_statistics = RunningMeans()
        self.last_statistics: WeinceStatistics | None = None
        self.batch_beta_ema: Tensor | None
        if self.options.top_m_shortfall_weight > 0:
            # State carried across steps: in the state_dict, hence in every checkpoint (training/loss_state.py).
            self.register_buffer("batch_beta_ema", initial_beta_ema(self.options.top_m_options))
        else:
            self.batch_beta_ema = None

    @classmethod
    def released(cls, model: nn.Module | None, **overrides: Any) -> WEINCELoss:
        """The released vision composite: ``cls(model, scale=2.0, beta=1.0, top_m_shortfall_weight=0.5,
        top_m_infonce_weight=0.5)`` (M = 50 and the batch tail index at their defaults), with ``overrides`` applied
        (any option of the class, e.g. ``gather_across_devices=True``). Use it on the SimCLR layout
        (:meth:`loss_from_scores`); on the text layout it is the same loss on MNRL's candidates."""
        return cls(model, **{**RELEASED_COMPOSITE, **overrides})

    @property
    def scale(self) -> float:
        """``1 / temperature``, as MNRL's ``scale`` (read from the options)."""
        return self.options.scale

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        row_keys = self._row_keys(sentence_features)
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels, row_keys=row_keys)

    # -- the false-negative guard's input keys ------------------------------------------------------------------

    def _compares_inputs(self) -> bool:
        spec = self.options.false_negative_filter
        return spec is not None and spec.needs_keys

    def _row_keys(self, sentence_features: list[dict[str, Tensor]]) -> list[Tensor] | None:
        """The input keys of every column's rows when the guard compares inputs (``"identical"``), else None."""
        if not self._compares_inputs():
            return None
        return [feature_keys(features, type(self).__name__) for features in sentence_features]

    def _gathered_keys(self, row_keys: list[Tensor] | None, num_columns: int) -> list[Tensor] | None:
        """The columns' input keys of the global batch (gathered like the embeddings), checked; None when the guard
        does not compare inputs."""
        if not self._compares_inputs():
            return None
        if row_keys is None or len(row_keys) != num_columns:
            raise ValueError(
                f"{type(self).__name__}: false_negative_filter='identical' compares the inputs' token ids: call the "
                "loss on tokenized features (forward), or pass row_keys=[st_weince.functional.input_keys(input_ids, "
                f"attention_mask) of each of the {num_columns} columns] to compute_loss_from_embeddings"
            )
        return [self._gather(keys) for keys in row_keys]

    # -- statistics --------------------------------------------------------------------------------------------

    def _gather(self, local: Tensor) -> Tensor:
        """A per-anchor tensor of this process -> the global batch's (no gradient); identity without gathering."""
        return all_gather(local) if self.options.gather_across_devices else local

    def statistics(
        self, scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None = None
    ) -> WeinceStatistics:
        """Statistics of rows held by this process; the pivot rho0 is taken over all processes' rows."""
        return weince_statistics(
            scores, positive_index, valid_mask, self.options.math, gather=self._gather
        )

    def _guarded(
        self, layout: MNRLLayout, keys: list[Tensor] | None = None, row_start: int = 0
    ) -> tuple[MNRLLayout, FilterCounts | None]:
        """The layout with the false-negative guard's candidates removed from every group's ``valid_mask``, and the
        per-row counts (masked, negatives before) of the query-anchored group; the layout itself when it is off.
        ``keys``: the (gathered) columns' input keys for the ``"identical"`` rule, with the layout's first row
        ``row_start``."""
        spec = self.options.false_negative_filter
        if spec is None:
            return layout, None
        query_group = layout.groups[0]
        # The row's own positive pair score: query i against document i (query_to_doc, the first block of group 0).
        pair_scores = query_group.scores.gather(1, query_group.positive_index[:, None]).squeeze(1)
        groups, counts = [], None
        for group in layout.groups:
            key_arguments = {}
            if spec.needs_keys:
                key_arguments = _identical_rule_keys(group, keys, row_start, layout.num_rows)
            valid_mask, group_counts = apply_false_negative_filter(
                group.scores,
                group.positive_index,
                group.valid_mask,
                spec,
                positive_scores=None if group.has_positive else pair_scores,
                **key_arguments,
            )
            counts = group_counts if counts is None else counts
            groups.append(dataclasses.replace(group, valid_mask=valid_mask))
        return MNRLLayout(groups=tuple(groups), partition_mode=layout.partition_mode, num_rows=layout.num_rows), counts

    def _group_fits(self, layout: MNRLLayout) -> list[TailFit]:
        return [
            weince_tail_fit(group.scores, group.positive_index, group.valid_mask, self.options.math)
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
                    scale=self.options.scale,
                    eps=self.options.math.eps,
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
                scale=self.options.scale,
                eps=self.options.math.eps,
            )
            for group, stats in zip(layout.groups, statistics)
        ]
        return mnrl_cross_entropy(layout, logits)

    def _normalized_columns(
        self, embeddings: list[Tensor], checks: DeferredChecks | bool
    ) -> tuple[Tensor, list[Tensor], int]:
        """Checked, (gathered,) unit-normalised columns and the global row of this process's first anchor."""
        # Shapes here; the values (NaN, Inf, overflowing norms) by the norm check of normalize_rows.
        check_embedding_columns(embeddings, type(self).__name__)
        dtype = compute_dtype(*embeddings)  # float32 for half precision (and a mix of dtypes), float64 stays
        queries, docs = embeddings[0], list(embeddings[1:])
        offset = 0
        if self.options.gather_across_devices:
            offset = get_rank() * queries.shape[0]
            queries = all_gather_with_grad(queries)
            docs = [all_gather_with_grad(doc) for doc in docs]
        deferred = checks if isinstance(checks, DeferredChecks) else None
        name = type(self).__name__
        return (
            normalize_rows(queries, deferred, f"{name}: column 0", dtype),
            [
                normalize_rows(doc, deferred, f"{name}: column {index}", dtype)
                for index, doc in enumerate(docs, start=1)
            ],
            offset,
        )

    # -- losses ------------------------------------------------------------------------------------------------

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Cross-entropy over one score matrix, e.g. the SimCLR 2N x 2N layout of
        :func:`st_weince.functional.nt_xent_layout`. Used by the vision adapter."""
        self._gathered_keys(None, 0)  # a score matrix carries no inputs to compare ("identical" is refused)
        check_score_shapes(scores, positive_index, valid_mask)
        if self.options.check_inputs:  # the one host sync of the step
            checks = DeferredChecks()
            require_valid_scores(checks, scores, positive_index, valid_mask, every_row_has_positive=True)
            checks.raise_if_failed()
        positive_index = positive_index.long()
        with full_precision(scores):
            valid_mask, counts = apply_false_negative_filter(
                scores, positive_index, valid_mask, self.options.false_negative_filter
            )
            stats = weince_statistics(scores, positive_index, valid_mask, self.options.math, gather=self._gather)
            loss = weince_cross_entropy(
                scores,
                positive_index,
                valid_mask,
                self.options.math,
                scale=self.options.scale,
                statistics=stats,
                check_inputs=False,  # checked above, with the loss's own switch
            )
            if not self.options.has_top_m_terms:
                self._record(stats, counts)
                return loss
            units = [(scores, positive_index, valid_mask)]
            beta_t, fit = self._advance_batch_beta(self._batch_tail(units, scores.shape[0]))
            shortfall, infonce = self._top_m_rows(units, beta_t)
            composite = composite_loss(loss, shortfall.mean(), infonce.mean(), self.options.top_m_options)
        self._record(stats, counts, self._composite_values(composite.shares(), beta_t, fit))
        return composite.total

    def compute_loss_from_embeddings(
        self, embeddings: list[Tensor], labels: Tensor | None = None, *, row_keys: list[Tensor] | None = None
    ) -> Tensor:
        """The loss on already computed column embeddings (``[anchor, positive, *negatives]``), in float32 for
        half-precision embeddings (also under autocast) and in float64 for float64 ones. ``row_keys``: each column's
        :func:`~st_weince.functional.input_keys`, needed by the guard's ``"identical"`` rule only (``forward``
        computes them from the token ids)."""
        keys = self._gathered_keys(row_keys, len(embeddings))
        warn_unused_labels(self, labels)  # no sync: a host-side check
        with full_precision(*embeddings):
            return self._loss_from_embeddings(embeddings, keys)

    def _loss_from_embeddings(self, embeddings: list[Tensor], keys: list[Tensor] | None) -> Tensor:
        checks = DeferredChecks() if self.options.check_inputs else False
        queries, docs, offset = self._normalized_columns(embeddings, checks)
        if checks:
            checks.raise_if_failed()  # the one host sync of the step, where the loss receives its inputs
        batch_size = embeddings[0].shape[0]
        layout = mnrl_layout(
            queries,
            docs,
            self.options.directions,
            self.options.partition_mode,
            row_start=offset,
            row_end=offset + batch_size,
        )
        layout, counts = self._guarded(layout, keys, offset)
        statistics = [
            statistics_from_fit(fit, self.options.math, gather=self._gather) for fit in self._group_fits(layout)
        ]
        loss = self._rows_loss(layout, statistics).mean()
        if not self.options.has_top_m_terms:
            self._record(statistics[0], counts)
            return loss
        units = self._top_m_units(layout)
        beta_t, fit = self._advance_batch_beta(self._batch_tail(units, layout.num_rows))
        shortfall, infonce = self._top_m_rows(units, beta_t)
        composite = composite_loss(loss, shortfall.mean(), infonce.mean(), self.options.top_m_options)
        self._record(statistics[0], counts, self._composite_values(composite.shares(), beta_t, fit))
        return composite.total

    # -- the top-M terms and the batch tail index ----------------------------------------------------------------

    @staticmethod
    def _top_m_units(layout: MNRLLayout) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """The (scores, positive_index, valid_mask) of each softmax of the layout's rows, over which the top-M terms
        pick a row's hardest negatives: under ``"joint"`` one, every group's candidates of the row side by side
        (the query_to_doc positive the target, as in the blend's softmax); under ``"per_direction"`` one per group."""
        groups = layout.groups
        if layout.partition_mode == "per_direction" or len(groups) == 1:
            return [(g.scores, g.positive_index, g.valid_mask) for g in groups]
        masks = [g.valid_mask for g in groups]
        valid_mask = None
        if any(m is not None for m in masks):
            valid_mask = torch.cat(
                [m if m is not None else torch.ones_like(g.scores, dtype=torch.bool) for m, g in zip(masks, groups)],
                dim=1,
            )
        return [(torch.cat([g.scores for g in groups], dim=1), groups[0].positive_index, valid_mask)]

    def _batch_tail(self, units: list[tuple[Tensor, Tensor, Tensor | None]], step_rows: int) -> BatchTail | None:
        """The smallest negative shortfalls of these rows (no gradient), as many as the global batch's tail can
        need: ``step_rows`` is the number of rows of this process's whole step (a cached loss passes one row chunk
        at a time), so that every chunk and process keeps at least the global tail's size. None when the shortfall
        term is off (its tail index is its only use)."""
        if self.batch_beta_ema is None:
            return None
        world = dist.get_world_size() if self.options.gather_across_devices and dist.is_initialized() else 1
        global_entries = step_rows * world * sum(scores.shape[1] for scores, _, _ in units)
        return BatchTail.cat(
            [
                batch_negative_tail(scores, index, mask, self.options.top_m_options, global_entries=global_entries)
                for scores, index, mask in units
            ]
        )

    def _advance_batch_beta(self, tail: BatchTail | None) -> tuple[Tensor | None, BatchTailFit | None]:
        """This step's ``beta_t`` and fit from the batch tail (gathered over processes): the moving average updated
        with the fit, stored in the buffer on training steps. (None, None) when the shortfall term is off."""
        if tail is None or self.batch_beta_ema is None:
            return None, None
        if self.options.gather_across_devices:
            tail = BatchTail(
                shortfalls=all_gather(tail.shortfalls), num_negatives=all_gather(tail.num_negatives[None]).sum()
            )
        fit = batch_tail_fit(tail, self.options.top_m_options)
        beta_t = update_beta_ema(self.batch_beta_ema, fit, self.options.top_m_options)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.batch_beta_ema.copy_(beta_t)
        return beta_t, fit

    def _top_m_rows(
        self, units: list[tuple[Tensor, Tensor, Tensor | None]], beta_t: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Per-row [R] top-M shortfall and top-M InfoNCE terms (the mean over the units of a row)."""
        beta = beta_t if beta_t is not None else 1.0  # only the shortfall term reads it, and it is off then
        terms = [
            top_m_cross_entropies(scores, index, mask, self.options.top_m_options, beta=beta, scale=self.options.scale)
            for scores, index, mask in units
        ]
        if len(terms) == 1:
            return terms[0]
        return torch.stack([t[0] for t in terms], 1).mean(1), torch.stack([t[1] for t in terms], 1).mean(1)

    @staticmethod
    def _composite_values(
        shares: dict[str, Tensor], beta_t: Tensor | None, fit: BatchTailFit | None
    ) -> dict[str, Tensor]:
        """The logged values of the composite: each term's share, the batch tail index and its fit's R^2."""
        values = {f"weince_share_{name}": share for name, share in shares.items()}
        if beta_t is not None and fit is not None:
            values["weince_batch_beta"] = beta_t.detach()
            values["weince_batch_beta_r2"] = fit.r_squared
        return values

    # -- logging -----------------------------------------------------------------------------------------------

    def _record(
        self,
        stats: WeinceStatistics,
        guard_counts: FilterCounts | None = None,
        composite_values: dict[str, Tensor] | None = None,
    ) -> None:
        """Keep the statistics of the query rows: the latest ones, and their running means for the trainer's logs
        (on the device, so no step reads them on the host)."""
        if not torch.compiler.is_compiling():
            self.last_statistics = stats
        fitted = stats.fitted.to(stats.lam.dtype)
        values = {
            "weince_lambda_mean": stats.lam.mean(),
            "weince_lambda_gt_half": (stats.lam > 0.5).to(stats.lam.dtype).mean(),
            "weince_rho0": stats.rho0,
            "weince_delta_aic_mean": (stats.delta_aic * fitted).sum() / fitted.sum().clamp_min(1.0),
            "weince_beta_mean": stats.beta.mean(),
        }
        if guard_counts is not None:  # of the query-anchored rows, like the statistics above
            values["weince_fn_masked_share"] = guard_counts.masked_share
            values["weince_fn_anchors_share"] = guard_counts.anchors_share
        values.update(composite_values or {})
        self.logged_statistics.add(values)

    def pop_logged_statistics(self) -> dict[str, float]:
        """Means of the statistics since the last call (used by :func:`st_weince.training.log_loss_statistics`);
        the one place they are read on the host."""
        return self.logged_statistics.pop()

    def get_config_dict(self) -> dict[str, Any]:
        """The constructor arguments: ``type(loss)(model, **loss.get_config_dict())`` rebuilds the same loss."""
        return options_config(self.options)

    @property
    def citation(self) -> str:
        return WEINCE_CITATION


def _identical_rule_keys(group: Any, keys: list[Tensor] | None, row_start: int, num_rows: int) -> dict[str, Tensor]:
    """The candidates' input keys of one MNRL group (its directions' candidate sets side by side) and each row's
    reference keys: the positive document's for rows anchored at queries, the row's query for rows anchored at
    documents (its pair partner)."""
    if keys is None:
        raise ValueError("false_negative_filter='identical' needs the inputs' keys")
    query_keys, doc_keys = keys[0], keys[1:]
    all_doc_keys = torch.cat(doc_keys) if len(doc_keys) > 1 else doc_keys[0]
    per_direction = {
        "query_to_doc": all_doc_keys,
        "query_to_query": query_keys,
        "doc_to_query": query_keys,
        "doc_to_doc": all_doc_keys,
    }
    candidate_keys = torch.cat([per_direction[direction] for direction in group.directions])
    rows = slice(row_start, row_start + num_rows)
    anchored_at_queries = group.directions[0] in ("query_to_doc", "query_to_query")
    reference_keys = doc_keys[0][rows] if anchored_at_queries else query_keys[rows]
    return {"candidate_keys": candidate_keys, "reference_keys": reference_keys}
