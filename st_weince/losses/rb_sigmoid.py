from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_weince.functional.checks import compute_dtype, full_precision
from st_weince.functional.exchange import ring_block_losses
from st_weince.functional.false_negatives import FalseNegativeFilter, FilterCounts, apply_false_negative_filter
from st_weince.functional.options import ColumnMode, Exchange, Parametrization, RBSigmoidOptions, defaults_of
from st_weince.functional.sigmoid import (
    CandidateGuard,
    SigmoidBlockLoss,
    SigmoidLogits,
    chunked_sigmoid_contrastive_loss,
    constellation_margin_from_extremes,
    locked_adapter_scores,
    score_extremes,
    sigmoid_contrastive_loss,
    targets_from_positive_index,
)
from st_weince.losses._gradcache import backward_from_leaves
from st_weince.losses._sigmoid_blocks import (
    all_gathers,
    candidate_columns,
    directional_blocks,
    joined,
    symmetric_from_directions,
)
from st_weince.losses.columns_loss import ColumnsLoss, guard_share_values
from st_weince.utils.hotpath import DeferredChecks
from st_weince.utils.options import log_scale_cap

_DEFAULTS = defaults_of(RBSigmoidOptions)  # the signature's defaults: read from the options class, their one home

_SOFTMAX_ONLY = "hardness weighting re-weights the softmax denominator of InfoNCE, and the sigmoid loss has none"

RB_SIGMOID_CITATION = """
@inproceedings{bangachev2025global,
    title={Global Minimizers of Sigmoid Contrastive Loss},
    author={Bangachev, Kiril and Bresler, Guy and Noman, Iliyas and Polyanskiy, Yury},
    booktitle={Advances in Neural Information Processing Systems (NeurIPS)},
    year={2025},
}
@inproceedings{zhai2023sigmoid,
    title={Sigmoid Loss for Language Image Pre-Training},
    author={Zhai, Xiaohua and Mustafa, Basil and Kolesnikov, Alexander and Beyer, Lucas},
    booktitle={Proceedings of the IEEE/CVF International Conference on Computer Vision (ICCV)},
    year={2023},
}
"""


class RBSigmoidLoss(ColumnsLoss):
    """
    RB-Sigmoid: the sigmoid (SigLIP-style) contrastive loss with a trainable scale ``t`` and a trainable *relative*
    bias ``b_rel``. Every (anchor, candidate) pair is its own binary decision "matching or not" with logit
    ``z = t (s - b_rel)`` on the cosine score ``s``; the loss is the mean over anchors of the sum over candidates of
    ``-log sigmoid(+-z)``. Training ``b_rel`` instead of SigLIP's ``b = t b_rel`` reaches larger margins
    (docs/rb-sigmoid.md); the absolute parametrization is the plain SigLIP baseline.

    Args:
        model: SentenceTransformer model (None to use only ``compute_loss_from_embeddings`` / ``loss_from_scores``).
        scale: initial ``t = 1 / temperature`` (trained as ``log_t``), as MNRL's ``scale``; SigLIP's start. Read
            back, ``loss.scale`` is the current (trained) ``t``; it cannot be assigned (see :attr:`scale`).
        max_scale: cap on ``t`` (>= ``scale``, finite in float32): the forward uses ``t = exp(min(log_t, log
            max_scale))``, and after every optimizer step ``log_t`` itself is clamped to the cap, where its gradient
            stays live. Logged as ``rb_sigmoid_t_capped`` (share of steps at the cap). CLIP's and open_clip's cap.
        parametrization: "relative" (``z = t (s - b_rel)``) or "absolute" (SigLIP's ``z = t s - b``).
        relative_bias: initial ``b_rel`` (None: 0.7, which reached the largest margins in
            ``benchmarks/sigmoid_synthetic.py``). In the absolute parametrization it gives the start ``b = scale *
            relative_bias`` instead of ``bias``.
        bias: initial absolute bias ``b`` (absolute parametrization only; None: ``scale * relative_bias``).
        trainable_scale: train ``t``; if False it stays fixed.
        trainable_bias: train the bias (``b_rel`` or ``b``); if False it is a fixed hyperparameter (a fixed ``b_rel``
            trades margin against bias).
        gather_across_devices: score the local anchors against the candidates of all processes.
        exchange: how the other processes' candidates arrive with ``gather_across_devices``: "all_gather" (one
            global candidate matrix) or "neighbour" (SigLIP's scheme: the candidate blocks pass around the ring of
            processes in both directions and the anchors are scored against one block at a time, so no process
            holds the global matrix; same loss and gradients; equal local batch sizes required).
        symmetric: also score the positives (column 2) as anchors against all anchors and average both directions;
            without hard-negative columns this changes nothing, with them it doubles the anchor-positive block's
            weight relative to the hard negatives.
        columns: "negatives" (as MNRL: anchor, positive, negative_1, ...; the candidates are all positives and
            negatives of the batch) or "modalities" (each column one modality of the same items; the loss is the sum
            over all column pairs of the two-modality loss, sharing ``t`` and the bias).
        locked_adapter: for a locked (frozen) encoder on one side: replace ``s`` by ``delta^2 s - (1 - delta^2)``
            with one trainable ``delta = sigmoid(x)``, the implicit adapter ``(delta U, sqrt(1 - delta^2))``,
            ``(delta V, -sqrt(1 - delta^2))``.
        adapter_logit: initial ``x`` of the adapter (0 gives ``delta = 0.5``, as in the released experiments).
        chunk_size: compute the loss in blocks of this many candidates (each recomputed during backward), so memory
            grows with batch x chunk instead of batch x candidates. None: one block.
        check_inputs: check the embeddings and the loss parameters (finite) in every forward, with one host-device
            sync. False: no check and no sync (``torch.compile(fullgraph=True)`` then traces the loss whole).
        false_negative_filter: the in-batch false-negative guard (off by default), as WEINCE's: the removed
            candidates count neither in the loss nor in the logged margin. Logged as ``rb_sigmoid_fn_masked_share``
            and ``rb_sigmoid_fn_anchors_share``.
        directions: MNRL's argument: None (the default), ``("query_to_doc",)`` or ``("query_to_doc",
            "doc_to_query")`` (= ``symmetric=True``); the other directions are refused.
        similarity_fct: MNRL's; only ``cos_sim`` (the default) is accepted, other values are refused with the reason.
        hardness_mode: MNRL's; only None (the default) is accepted.
        hardness_strength: MNRL's; only 0 (the default) is accepted.
        partition_mode: MNRL's; only None (the default) is accepted.

    Every option is checked when the loss is built, with an error naming it, and kept in one frozen
    :class:`~st_weince.functional.RBSigmoidOptions` (``loss.options``), which is the one home of the defaults above;
    the trained values of ``t`` and the bias live in the loss's parameters.

    References:
        - Bangachev, Bresler, Noman, Polyanskiy: Global Minimizers of Sigmoid Contrastive Loss, NeurIPS 2025.
        - Zhai et al.: Sigmoid Loss for Language Image Pre-Training (SigLIP), ICCV 2023.
        - ``docs/algorithms.md`` section 2 of this project; ``docs/rb-sigmoid.md``.

    Requirements:
        1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples; or, with
           ``columns="modalities"``, two or more columns that all describe the same item.

    Inputs:
        +-------------------------------------------------+--------+
        | Texts                                           | Labels |
        +=================================================+========+
        | (anchor, positive) pairs                        | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative_1, ..., negative_n) | none   |
        +-------------------------------------------------+--------+
        | (modality_1, ..., modality_k), columns=         | none   |
        | "modalities"                                    |        |
        +-------------------------------------------------+--------+

    Recommendations:
        - Call :func:`st_weince.training.prepare_trainer` on the trainer: it logs and checkpoints the loss
          parameters and gives them their own learning rate (at fine-tuning rates such as 2e-5 they would hardly
          move), also under a wrapper such as ``MatryoshkaLoss``.
        - Use ``BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.
        - For batches beyond what fits in memory use :class:`~st_weince.losses.CachedRBSigmoidLoss` (the same
          loss with gradient caching, with the same options and parameter names).

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            from st_weince.losses import RBSigmoidLoss
            from st_weince.training import prepare_trainer

            model = SentenceTransformer("all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
            })
            loss = RBSigmoidLoss(model)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            prepare_trainer(trainer)
            trainer.train()
            print(loss.trained_values())  # t, b_rel, b after training
    """

    options_class = RBSigmoidOptions
    mnrl_refusals = {
        "similarity_fct": (
            "RB-Sigmoid's relative bias and margin are defined on cosine scores in [-1, 1] (the embeddings are "
            "normalized), so only sentence_transformers.util.cos_sim applies"
        ),
        "hardness_mode": _SOFTMAX_ONLY + ": every pair is its own binary decision",
        "hardness_strength": _SOFTMAX_ONLY,
        "partition_mode": (
            "the sigmoid loss has no softmax partition function to share or split across directions; with "
            "symmetric=True the two directions are averaged"
        ),
    }

    def __init__(
        self,
        model: nn.Module | None = None,
        scale: float = _DEFAULTS.scale,
        *,
        max_scale: float = _DEFAULTS.max_scale,
        parametrization: Parametrization = _DEFAULTS.parametrization,
        relative_bias: float | None = _DEFAULTS.relative_bias,
        bias: float | None = _DEFAULTS.bias,
        trainable_scale: bool = _DEFAULTS.trainable_scale,
        trainable_bias: bool = _DEFAULTS.trainable_bias,
        gather_across_devices: bool = _DEFAULTS.gather_across_devices,
        exchange: Exchange = _DEFAULTS.exchange,
        symmetric: bool = _DEFAULTS.symmetric,
        columns: ColumnMode = _DEFAULTS.columns,
        locked_adapter: bool = _DEFAULTS.locked_adapter,
        adapter_logit: float = _DEFAULTS.adapter_logit,
        chunk_size: int | None = _DEFAULTS.chunk_size,
        check_inputs: bool = _DEFAULTS.check_inputs,
        false_negative_filter: FalseNegativeFilter | tuple[str, float] | str | None = _DEFAULTS.false_negative_filter,
        directions: tuple[str, ...] | None = None,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        partition_mode: str | None = None,
    ) -> None:
        self._refuse_mnrl_arguments(
            similarity_fct=similarity_fct,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
            partition_mode=partition_mode,
        )
        options = RBSigmoidOptions(
            scale=scale,
            max_scale=max_scale,
            parametrization=parametrization,
            relative_bias=relative_bias,
            bias=bias,
            trainable_scale=trainable_scale,
            trainable_bias=trainable_bias,
            gather_across_devices=gather_across_devices,
            exchange=exchange,
            symmetric=symmetric_from_directions(directions, symmetric, type(self).__name__),
            columns=columns,
            locked_adapter=locked_adapter,
            adapter_logit=adapter_logit,
            chunk_size=chunk_size,
            check_inputs=check_inputs,
            false_negative_filter=false_negative_filter,
        )
        super().__init__(model, options)
        self.log_scale_cap = log_scale_cap(options.max_scale)
        self._register_scalar("log_t", math.log(options.scale), options.trainable_scale)
        if options.parametrization == "relative":
            self._register_scalar("b_rel", options.relative_bias, options.trainable_bias)
        else:
            self._register_scalar("bias", options.bias, options.trainable_bias)
        if options.locked_adapter:
            self._register_scalar("adapter_logit", options.adapter_logit, True)

    def _register_scalar(self, name: str, value: float, trainable: bool) -> None:
        tensor = torch.tensor(value, dtype=torch.float32)
        if trainable:
            setattr(self, name, nn.Parameter(tensor))
        else:
            self.register_buffer(name, tensor)

    # ----- the loss parameters -----
    @property
    def scale(self) -> Tensor:
        """The current ``t = exp(min(log_t, log max_scale))`` (in the autograd graph): MNRL's ``scale``, trained. Not
        assignable: the optimizer and the checkpoints hold ``t``, so an assignment would reset a trained value behind
        the optimizer's back or leave the recorded start (``options.scale``) describing another run."""
        return self._capped_log_t(self.log_t).exp()

    @scale.setter
    def scale(self, value: float) -> None:
        raise AttributeError(
            f"{type(self).__name__}.scale is the trained t (exp(log_t), capped at max_scale) and cannot be assigned: "
            f"build the loss with {type(self).__name__}(model, scale={value!r}) for that start value (add "
            "trainable_scale=False to keep t fixed at it)"
        )

    @property
    def directions(self) -> tuple[str, ...]:
        """MNRL's ``directions`` of this loss: ``("query_to_doc", "doc_to_query")`` when ``symmetric``."""
        return ("query_to_doc", "doc_to_query") if self.options.symmetric else ("query_to_doc",)

    @property
    def partition_mode(self) -> None:
        """Always None: the sigmoid loss has no softmax partition function."""
        return None

    def _capped_log_t(self, log_t: Tensor) -> Tensor:
        """``log_t`` clamped at the cap, with its gradient passing at the cap itself (``torch.clamp``'s is zero
        there), so that a ``log_t`` held at the cap by :meth:`clamp_parameters_` moves down when its gradient turns;
        above the cap the gradient is zero."""
        return torch.where(log_t > self.log_scale_cap, self.log_scale_cap, log_t)

    @torch.no_grad()
    def clamp_parameters_(self) -> None:
        """Clamp ``log_t`` in place to the cap of ``max_scale``, as open_clip clamps its logit scale after each
        optimizer step; call it after every optimizer step in custom training loops (``prepare_trainer`` does it)."""
        self.log_t.clamp_(max=self.log_scale_cap)

    @property
    def relative_bias(self) -> Tensor:
        """``b_rel`` (relative) or ``b / t`` (absolute)."""
        return self.b_rel if self.options.parametrization == "relative" else self.bias / self.scale

    @property
    def absolute_bias(self) -> Tensor:
        """``b = t b_rel`` (relative) or ``b`` (absolute)."""
        return self.bias if self.options.parametrization == "absolute" else self.scale * self.b_rel

    @property
    def delta(self) -> Tensor | None:
        """The locked-encoder adapter's ``delta = sigmoid(x)``, or None without the adapter."""
        return torch.sigmoid(self.adapter_logit) if self.options.locked_adapter else None

    def _has_hard_negative_columns(self) -> bool:
        return self.options.columns == "negatives"

    # ----- the training protocol (st_weince.training.protocol) -----
    def no_weight_decay(self) -> set[str]:
        """Every parameter of the loss's own: a scale and a bias are no weights to shrink."""
        return {name for name, _ in self.named_parameters() if not name.startswith("model.")}

    def after_optimizer_step(self) -> None:
        self.clamp_parameters_()

    def carried_values(self) -> dict[str, Any]:
        """The trained ``t``, ``b_rel``, ``b`` (and ``delta``), which the model carries for its match probability."""
        return {**self.trained_values(), "loss": type(self).__name__}

    def loss_parameters(self) -> dict[str, Tensor]:
        """The loss's own scalars by name (parameters or, when fixed, buffers): ``log_t``, ``b_rel`` or ``bias``,
        and ``adapter_logit`` with the adapter. Every computation reads them from such a dict, so that the cached
        variant can substitute stand-ins."""
        names = ["log_t", "b_rel" if self.options.parametrization == "relative" else "bias"]
        if self.options.locked_adapter:
            names.append("adapter_logit")
        return {name: getattr(self, name) for name in names}

    def _scalars(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Detached ``t`` (capped), ``b_rel``, ``b`` (and ``delta`` with the adapter), in ``dtype`` if given."""
        params = self.loss_parameters()
        convert = (lambda value: value.detach()) if dtype is None else (lambda value: value.detach().to(dtype))
        t = self._capped_log_t(convert(params["log_t"])).exp()
        if self.options.parametrization == "relative":
            b_rel = convert(params["b_rel"])
            b = t * b_rel
        else:
            b = convert(params["bias"])
            b_rel = b / t
        values = {"t": t, "b_rel": b_rel, "b": b}
        if self.options.locked_adapter:
            values["delta"] = torch.sigmoid(convert(params["adapter_logit"]))
        return values

    def _sigmoid_logits(self, params: dict[str, Tensor], dtype: torch.dtype) -> SigmoidLogits:
        """The logits' scale, bias and score transform (the locked adapter) for these parameter values, in the
        computation dtype (the scale is exponentiated in it, so float64 inputs get a float64 ``t``)."""
        log_t = self._capped_log_t(params["log_t"])
        scale = (log_t if log_t.dtype == dtype else log_t.to(dtype)).exp()
        if self.options.parametrization == "relative":
            logits = SigmoidLogits(scale, relative_bias=params["b_rel"])
        else:
            logits = SigmoidLogits(scale, bias=params["bias"])
        if not self.options.locked_adapter:
            return logits
        delta = torch.sigmoid(params["adapter_logit"].to(dtype))
        return dataclasses.replace(logits, score_transform=lambda scores: locked_adapter_scores(scores, delta))

    def _require_valid_state(self, checks: DeferredChecks) -> None:
        for name, value in self.loss_parameters().items():
            checks.require(
                torch.isfinite(value),  # a bool result: no autograd graph
                f"loss parameter {name} is not finite: training diverged (lower its learning rate)",
            )

    # ----- entry points -----
    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Sigmoid loss of one score matrix: ``scores`` [A, C] cosine, ``positive_index`` [A] the positive column of
        each row (-1: none), ``valid_mask`` [A, C] bool (False = excluded, e.g. the self-pairs of the SimCLR layout
        of :func:`st_weince.functional.nt_xent_layout`). Targets are 1 at the positive, 0 at the other valid entries.
        Used by the vision adapter; with the locked adapter enabled it is applied to ``scores`` first."""
        self._check_scores(scores, positive_index, valid_mask)
        params = self.loss_parameters()
        with full_precision(scores):
            dtype = compute_dtype(scores)
            targets = targets_from_positive_index(positive_index, scores.shape[1], dtype=dtype)
            logits = self._sigmoid_logits(params, dtype)
            # on the cosine scores, before the adapter's transform, as in compute_loss_from_embeddings
            valid_mask, guard_counts = apply_false_negative_filter(
                scores, positive_index, valid_mask, self.options.false_negative_filter
            )
            scores = scores.to(dtype) if logits.score_transform is None else logits.score_transform(scores)
            bias = {"relative_bias": logits.relative_bias, "bias": logits.bias}
            loss = sigmoid_contrastive_loss(
                scores, targets, scale=logits.scale, **bias, valid_mask=valid_mask, check_inputs=False
            )
            if self.log_statistics:
                self._record(score_extremes(scores, targets, valid_mask), guard_counts)
            return loss

    def _loss_from_embeddings(self, embeddings: list[Tensor], row_keys: list[Tensor] | None) -> Tensor:
        params = self.loss_parameters()
        loss, extremes, guard_counts = self._block_losses(self._checked_columns(embeddings), params, row_keys)
        if self.log_statistics:
            self._record(extremes, guard_counts)
        return loss

    # ----- the pieces, shared with CachedRBSigmoidLoss -----
    def _block_losses(
        self,
        normalized: list[Tensor],
        params: dict[str, Tensor],
        row_keys: list[Tensor] | None,
        *,
        chunk_rows: int | None = None,
        backward: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], FilterCounts | None]:
        """The loss of the checked, unit-length columns: the weighted sum of every anchors-against-candidates block's
        loss (:func:`~st_weince.losses._sigmoid_blocks.directional_blocks`), over row chunks of ``chunk_rows`` anchors
        (None: one chunk); with the first block's extremes and guard counts per anchor (None without the guard).

        With ``backward`` (a cached loss's loss stage) each chunk is back-propagated at once and the loss returned
        detached: each chunk's backward stops at the normalized (and gathered) columns, made leaves here, and one
        backward per column then carries the accumulated gradients through the gather and normalization."""
        options = self.options
        columns = [column.detach().requires_grad_() for column in normalized] if backward else normalized
        gathered, candidate_keys, positive_index = candidate_columns(columns, row_keys, options)
        # Without gathering the candidates are the columns themselves; gathered ones become leaves of their own.
        leaves = all_gathers(options) and backward
        candidates = [column.detach().requires_grad_() for column in gathered] if leaves else gathered
        batch_size = columns[0].shape[0]
        step = batch_size if chunk_rows is None else chunk_rows

        total = extremes = None
        guard_counts: list[FilterCounts] = []
        for block_index, (anchor_column, sources, weight) in enumerate(directional_blocks(len(columns), options)):
            anchors, block = columns[anchor_column], joined(candidates, sources)
            keys = None if candidate_keys is None else joined(candidate_keys, sources)
            if options.gather_across_devices and options.exchange == "neighbour":
                # Each process block arrives once; the row chunks go through it before the next one is received.
                ring = {"weight": weight, "anchor_chunk": chunk_rows, "backward": backward, "candidate_keys": keys}
                chunk_results = [
                    ring_block_losses(anchors, block, positive_index, self._rows_loss, params=params, **ring)
                ]
            else:
                chunk_results = []
                for begin in range(0, batch_size, step):
                    end = min(begin + step, batch_size)
                    anchor_rows, positive_rows = anchors, positive_index  # one chunk: no slice in the graph
                    if chunk_rows is not None:
                        anchor_rows, positive_rows = anchors[begin:end], positive_index[begin:end]
                    value, low, high, counts = self._rows_loss(
                        params, anchor_rows, block, positive_rows, block_keys=keys
                    )
                    # The block loss is the mean over the chunk's anchors; the loss is the mean over all anchors.
                    value = value * (weight * (end - begin) / batch_size)
                    if backward:
                        value.backward()
                        value = value.detach()
                    chunk_results.append((value, low, high, counts))
            for value, low, high, counts in chunk_results:
                total = value if total is None else total + value
                if block_index == 0:  # the logged margin is the first block's
                    if extremes is not None:
                        low, high = torch.minimum(extremes[0], low), torch.maximum(extremes[1], high)
                    extremes = (low, high)
                    if counts is not None:
                        guard_counts.append(counts)
        if leaves:
            backward_from_leaves(gathered, candidates)
        if backward:
            backward_from_leaves(normalized, columns)
        # per-anchor counts of the row chunks, in row order
        return total, extremes, FilterCounts.cat(guard_counts) if guard_counts else None

    def _rows_loss(
        self,
        params: dict[str, Tensor],
        rows: Tensor,
        block: Tensor,
        index: Tensor,
        positive_scores: Tensor | None = None,
        block_keys: Tensor | None = None,
        reference_keys: Tensor | None = None,
    ) -> SigmoidBlockLoss:
        """Mean over the anchor ``rows`` of their loss against one ``block`` of candidates, with its extremes and guard
        counts; the block loss of :func:`~st_weince.functional.exchange.ring_block_losses`, which passes the guard's
        threshold ``positive_scores`` and the positives' ``reference_keys`` when the block may not hold them."""
        guard = CandidateGuard(self.options.false_negative_filter, positive_scores, block_keys, reference_keys)
        logits = self._sigmoid_logits(params, rows.dtype)
        # the inputs are checked by the loss, with its own switch
        return chunked_sigmoid_contrastive_loss(
            rows, block, index, logits, guard=guard, chunk_size=self.options.chunk_size, check_inputs=False
        )

    @torch.no_grad()
    def _record(self, extremes: tuple[Tensor, Tensor], guard_counts: FilterCounts | None) -> None:
        """Keep the margin of the first anchors-against-candidates block of the (local) batch, from its ``extremes``
        (infinite without matching or non-matching pairs, then not counted), and the guard's shares, as device
        tensors: no sync in the hot path. ``t`` and ``b_rel`` are state, read at the log (:meth:`logged_state`)."""
        margin, _ = constellation_margin_from_extremes(*extremes)
        self.logged_statistics.add({"rb_sigmoid_margin": margin, **guard_share_values("rb_sigmoid", guard_counts)})

    @torch.no_grad()
    def logged_state(self) -> dict[str, Tensor]:
        """``t``, ``b_rel``, ``b`` (and ``delta``) as they are now, and ``t_capped``: 1 when ``t`` is at its cap
        ``max_scale`` (device tensors, read at the log)."""
        values = {f"rb_sigmoid_{name}": value for name, value in self._scalars().items()}
        capped = self.log_t.detach() >= self.log_scale_cap
        values["rb_sigmoid_t_capped"] = capped.to(values["rb_sigmoid_t"].dtype)
        return values

    @torch.no_grad()
    def trained_values(self) -> dict[str, float]:
        """The current ``t`` (capped), ``b_rel``, ``b = t b_rel`` (and ``delta``) as Python floats (one host read; not
        for the hot path). :meth:`get_config_dict` gives the configured starts instead; the model carries these after
        training (:class:`st_weince.MatchProbability`)."""
        return {name: float(value) for name, value in self._scalars(torch.float64).items()}

    @property
    def citation(self) -> str:
        return RB_SIGMOID_CITATION
