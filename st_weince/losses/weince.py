from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_weince.functional.batch_tail import initial_beta_ema
from st_weince.functional.checks import full_precision
from st_weince.functional.exchange import all_gather, all_gather_with_grad, process_count
from st_weince.functional.false_negatives import FalseNegativeFilter, apply_false_negative_filter
from st_weince.functional.layouts import CandidateGroup, Direction, MNRLColumns, MNRLLayout, PartitionMode
from st_weince.functional.options import RELEASED_COMPOSITE, Gate, TopM, WEINCEMode, WEINCEOptions, defaults_of
from st_weince.functional.weince import WEINCEStatistics, negatives_needed, weince_statistics
from st_weince.functional.weince_step import WEINCEStep, weince_step
from st_weince.losses.columns_loss import ColumnsLoss, guard_share_values

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


_DEFAULTS = defaults_of(WEINCEOptions)  # the signature's defaults: read from the options class, their one home

# Why MultipleNegativesRankingLoss's arguments other than their no-op values do not apply to WEINCE.
_HARDNESS = (
    "MNRL's hardness weighting adds alpha * s to the negative logits, so the softmax would no longer be the choice "
    "model whose tail WEINCE fits; WEINCE's own lambda already up-weights anchors with hard negatives"
)


class WEINCELoss(ColumnsLoss):
    """
    WEINCE (Weibull-enhanced InfoNCE): a drop-in replacement for
    :class:`~sentence_transformers.sentence_transformer.losses.MultipleNegativesRankingLoss`.

    InfoNCE's softmax is a top-1 choice model with Gumbel noise, whose tail is unbounded, while cosine scores stop at 1.
    For every anchor, WEINCE fits the tail of its hardest negatives and blends the usual logit ``s / tau`` with a
    shortfall logit ``-beta log(1 - s)`` (a Weibull-domain tail with endpoint 1), weighted by ``lambda(a)``, which is
    large for anchors whose hardest negative lies closer to the cap than the batch pivot ``rho0`` and whose tail fits
    the Weibull line better than the Gumbel one. The statistics are computed without gradient; the loss has no
    trainable parameters. With ``lambda = 0`` it is exactly MNRL.

    The released vision composite (:meth:`released`) adds two terms over each anchor's M hardest negatives,
    ``L = L_blend + 0.5 L_shortfall_topM + 0.5 L_infonce_topM`` (docs/algorithms.md 1.2b), with a batch tail index
    ``beta_t`` carried across steps in the buffer ``batch_beta_ema`` (in every checkpoint; it advances on training
    steps only).

    Args:
        model: SentenceTransformer model (None for :meth:`compute_loss_from_embeddings` / :meth:`loss_from_scores`
            only).
        scale: inverse temperature, ``scale = 1 / temperature`` (as in MNRL; 20 = temperature 0.05). Settable
            afterwards as ``loss.scale``, as MNRL's.
        gather_across_devices: gather embeddings across processes (local anchors x global candidates); the pivot
            ``rho0`` is then taken over the anchors of the global batch, so results do not depend on the split.
        directions: as in MNRL: "query_to_doc" (required), "query_to_query", "doc_to_query", "doc_to_doc". Rows
            anchored at queries (query_to_doc, query_to_query) share one set of statistics per query; rows anchored
            at documents (doc_to_query, doc_to_doc) get their own.
        partition_mode: "joint" (one softmax over all directions) or "per_direction" (one per direction,
            averaged), as in MNRL.
        beta: tail index in the shortfall logit, a finite number > 0, or "auto": each anchor's estimate, clamped to
            [0.5, 16]. The released implementation uses 1.0 (at temperature 0.5, 10-20x too soft at SimCSE's 0.05;
            docs/weince.md).
        mode: "both" (hardness x geometry gate), "rho" (hardness only), "aic" (geometry only) or "none" (lambda = 0:
            exactly MultipleNegativesRankingLoss through the same code path, the control arm of a comparison).
        gate: the gate lambda's four settings as one :class:`~st_weince.functional.Gate` (or its dict).
        tail_frac: share of an anchor's negatives used for the tail fit, in (0, 1].
        min_tail_points: minimum tail size, an integer >= 1.
        eps: floor of the shortfall ``1 - s`` for every term, in (0, 0.5).
        false_negative_filter: the in-batch false-negative guard (off by default), applied to each row's candidates
            before the tail statistics and the softmax (removed candidates are neither fitted nor pushed away; the
            positive never is): ``("absolute", m)``, ``("relative", r)``, ``"identical"`` or ``"same_label"``
            (docs/false-negatives.md). Logged as ``weince_fn_masked_share`` and ``weince_fn_anchors_share``.
        check_inputs: check the embeddings for NaN/Inf in every forward pass, with one host-device sync. False makes
            the hot path free of host syncs, so ``torch.compile(..., fullgraph=True)`` and CUDA graphs work; a NaN
            embedding then gives a NaN loss instead of an error.
        top_m: the released composite's two top-M terms and the batch tail index of its shortfall term, as one
            :class:`~st_weince.functional.TopM` (or its dict); None (the default, and a TopM with both weights 0):
            off, the loss is the blend alone.
        similarity_fct: MNRL's; only ``cos_sim`` (the default) is accepted, other values are refused with the reason.
        hardness_mode: MNRL's; only None (the default) is accepted.
        hardness_strength: MNRL's; only 0 (the default) is accepted.

    Every option is checked when the loss is built, with an error naming it, and kept in one frozen
    :class:`~st_weince.functional.WEINCEOptions` (``loss.options``), which is the one home of the defaults above.

    References:
        - Erol et al., When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE, ICML 2026, arXiv
          2606.00262.
        - ``docs/algorithms.md`` section 1 of this project for the exact statistics.

    Requirements:
        1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
        2. Batches with many in-batch negatives: anchors with fewer than 4 negatives fall back to InfoNCE (the loss
           warns once). For batches in the thousands use :class:`~st_weince.losses.CachedWEINCELoss`.

    Inputs:
        +-------------------------------------------------+-----------------------------------------------+
        | Texts                                           | Labels                                        |
        +=================================================+===============================================+
        | (anchor, positive) pairs                        | none, or a class id per row for               |
        |                                                 | ``false_negative_filter="same_label"``        |
        +-------------------------------------------------+-----------------------------------------------+
        | (anchor, positive, negative_1, ..., negative_n) | as above                                      |
        +-------------------------------------------------+-----------------------------------------------+

    Recommendations:
        - Use ``BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.
        - Call :func:`st_weince.training.prepare_trainer` on the trainer to log the mean lambda, the share of
          anchors with lambda > 0.5, rho0 and the mean dAIC (and, for the composite, to checkpoint its tail index).

    Example:
        ::

            from datasets import load_dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_weince.losses import WEINCELoss
            from st_weince.training import prepare_trainer

            model = SentenceTransformer("all-MiniLM-L6-v2")
            train_dataset = load_dataset("sentence-transformers/all-nli", "triplet", split="train")
            loss = WEINCELoss(model)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            prepare_trainer(trainer)
            trainer.train()
    """

    options_class = WEINCEOptions
    mnrl_refusals = {
        "similarity_fct": (
            "WEINCE needs cosine scores (only cos_sim): its shortfall logit -beta log(1 - s) and its tail fit assume "
            "scores capped at the endpoint 1, which other similarities (dot product, Euclidean, Manhattan) lack"
        ),
        "hardness_mode": _HARDNESS,
        "hardness_strength": _HARDNESS,
    }
    evolving_buffers = ("batch_beta_ema",)  # the released composite's batch tail index (its moving average)

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
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        self._refuse_mnrl_arguments(
            similarity_fct=similarity_fct, hardness_mode=hardness_mode, hardness_strength=hardness_strength
        )
        options = WEINCEOptions(
            scale=scale,
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
        )
        super().__init__(model, options)
        self.last_step: WEINCEStep | None = None  # the latest step's loss, statistics and terms (not when compiled)
        self._batch_checked = False
        top_m_options = self.options.top_m
        self.batch_beta_ema: Tensor | None
        if top_m_options is not None and top_m_options.shortfall_weight > 0:
            self.register_buffer("batch_beta_ema", initial_beta_ema(top_m_options))
        else:
            self.batch_beta_ema = None

    @classmethod
    def released(cls, model: nn.Module | None = None, **overrides: Any) -> WEINCELoss:
        """The released vision composite (:data:`~st_weince.functional.options.RELEASED_COMPOSITE`) with ``overrides``
        applied (e.g. ``gather_across_devices=True``). Use it on the SimCLR layout (:meth:`loss_from_scores`); on the
        text layout it is the same loss on MNRL's candidates."""
        released = {field.name: getattr(RELEASED_COMPOSITE, field.name) for field in dataclasses.fields(WEINCEOptions)}
        return cls(model, **{**released, **overrides})

    # -- MultipleNegativesRankingLoss's attributes --------------------------------------------------------------

    @property
    def scale(self) -> float:
        """``1 / temperature``, as MNRL's ``scale``. Settable, as MNRL's: ``loss.scale = 10.0`` replaces the options
        by a copy with that scale, checked as at construction (the configuration, and a checkpoint's record, then
        show the new value)."""
        return self.options.scale

    @scale.setter
    def scale(self, value: float) -> None:
        self.options = self.options.replace(scale=value)

    @property
    def directions(self) -> tuple[str, ...]:
        return self.options.directions

    @property
    def partition_mode(self) -> str:
        return self.options.partition_mode

    def statistics(
        self, scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None = None
    ) -> WEINCEStatistics:
        """Statistics of rows held by this process (the pivot rho0 taken over all processes' rows), without a step:
        no state advances and nothing is logged."""
        gather = all_gather if self.options.gather_across_devices else None
        return weince_statistics(scores, positive_index, valid_mask, self.options, gather=gather)

    @property
    def last_statistics(self) -> WEINCEStatistics | None:
        """The statistics of the latest step's query rows."""
        return None if self.last_step is None else self.last_step.statistics

    # -- entry points ---------------------------------------------------------------------------------------------

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """The loss of one score matrix, e.g. the SimCLR 2N x 2N layout of
        :func:`st_weince.functional.nt_xent_layout`: each row one softmax over its valid columns, its positive the
        target. Used by the vision adapter."""
        self._check_scores(scores, positive_index, valid_mask, every_row_has_positive=True)
        positive_index = positive_index.long()
        with full_precision(scores):
            mask, counts = apply_false_negative_filter(
                scores, positive_index, valid_mask, self.options.false_negative_filter
            )
            group = CandidateGroup(("query_to_doc",), scores, (scores.shape[1],), positive_index, mask, True)
            layout = MNRLLayout((group,), "joint", scores.shape[0], guard_counts=counts)
            gather = all_gather if self.options.gather_across_devices else None
            return self._end_step(
                weince_step(
                    layout, self.options, self.batch_beta_ema, gather=gather, effective_scales=self.log_statistics
                )
            )

    def _loss_from_embeddings(self, embeddings: list[Tensor], row_keys: list[Tensor] | None) -> Tensor:
        batch = self._mnrl_columns(embeddings, row_keys)[0]
        gather = all_gather if self.options.gather_across_devices else None
        return self._end_step(
            weince_step(batch, self.options, self.batch_beta_ema, gather=gather, effective_scales=self.log_statistics)
        )

    # -- the pieces shared with CachedWEINCELoss ------------------------------------------------------------------

    def _mnrl_columns(
        self, embeddings: list[Tensor], row_keys: list[Tensor] | None, *, leaves: bool = False
    ) -> tuple[MNRLColumns, list[Tensor]]:
        """This process's rows of the batch in MNRL's layout, from the checked, unit-length (and gathered) columns
        (and keys); and those columns. With ``leaves`` the layout's columns are detached stand-ins for them, at which
        a chunk's backward stops (a cached loss back-propagates the normalisation and the gather once, not once per
        chunk)."""
        options = self.options
        gather = options.gather_across_devices
        keys = row_keys if row_keys is None or not gather else [all_gather(keys) for keys in row_keys]
        columns = self._checked_columns(embeddings, all_gather_with_grad if gather else None)
        queries, *docs = [column.detach().requires_grad_() for column in columns] if leaves else columns
        if not self._batch_checked and self.training and torch.is_grad_enabled():
            self._warn_if_no_tail_fits(queries.shape[0], len(docs))
        batch = MNRLColumns(
            queries,
            docs,
            options.directions,
            options.partition_mode,
            num_rows=embeddings[0].shape[0],
            offset=process_count()[0] * embeddings[0].shape[0] if gather else 0,
            guard=options.false_negative_filter,
            keys=keys,
        )
        return batch, columns

    def _end_step(self, step: WEINCEStep) -> Tensor:
        """The end of a :func:`~st_weince.functional.weince_step.weince_step`: on training steps (grad enabled, loss
        in training mode) its ``beta_t`` is stored in the buffer; the step is kept (the latest one and, with
        :attr:`log_statistics`, the running means of its query rows' statistics for the trainer's logs, on the
        device, so no step reads them on the host): the gate and tail statistics, the guard's shares, each term's
        effective scale and, with the top-M terms, each term's share of the loss, the batch tail index and its fit's
        R^2."""
        if step.beta_t is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.batch_beta_ema.copy_(step.beta_t)
        if not torch.compiler.is_compiling():
            self.last_step = step
        if not self.log_statistics:
            return step.loss
        stats = step.statistics
        fitted = stats.fitted.to(stats.lam.dtype)
        values = {
            "weince_lambda_mean": stats.lam.mean(),
            "weince_lambda_gt_half": (stats.lam > 0.5).to(stats.lam.dtype).mean(),
            "weince_rho0": stats.rho0,
            "weince_delta_aic_mean": (stats.delta_aic * fitted).sum() / fitted.sum().clamp_min(1.0),
            "weince_beta_mean": stats.beta.mean(),
        }
        if step.guard_counts is not None:  # of the query-anchored rows, like the statistics above
            values.update(guard_share_values("weince", step.guard_counts))
        values.update(
            {f"weince_effective_scale_{name}": scale.detach() for name, scale in step.effective_scales.items()}
        )
        if step.terms is not None:
            values.update({f"weince_share_{name}": share for name, share in step.terms.shares().items()})
        if step.beta_t is not None and step.fit is not None:
            values["weince_batch_beta"] = step.beta_t.detach()
            values["weince_batch_beta_r2"] = step.fit.r_squared
        self.logged_statistics.add(values)
        return step.loss

    def _warn_if_no_tail_fits(self, batch_size: int, num_documents: int) -> None:
        """At the first training step: a warning when no anchor of this (global) batch has the negatives a tail fit
        needs, so that lambda is 0 everywhere and the loss is InfoNCE. Shapes decide; nothing is read from a
        device."""
        self._batch_checked = True
        # a query-anchored row's negatives: every document but its positive, with query_to_query every other query
        others = int("query_to_query" in self.options.directions)
        negatives = batch_size * (num_documents + others) - 1 - others
        needed = negatives_needed(self.options)
        if self.options.mode == "none" or negatives >= needed:
            return
        batch = -(-(needed + 1 + others) // (num_documents + others))  # the smallest batch with as many
        warnings.warn(
            f"{type(self).__name__} at a batch of {batch_size} ({negatives} negative{'s' if negatives != 1 else ''} "
            f"per anchor) fits no anchor's tail: its tail fit needs at least {needed} negatives per anchor, so lambda "
            "is 0 for every anchor and the loss is InfoNCE (MultipleNegativesRankingLoss). Use a batch of at least "
            f"{batch} (per_device_train_batch_size, and a dataset at least that long; with gather_across_devices=True "
            "the batch of all processes together); the default tail uses up to the hardest "
            f"{self.options.min_tail_points} negatives, which a batch of 64 or more gives.",
            stacklevel=5,
        )

    @property
    def citation(self) -> str:
        return WEINCE_CITATION
