from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import combinations
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.util import all_gather, all_gather_with_grad, cos_sim, get_rank
from torch import Tensor, nn

from st_weince.functional.checks import check_score_shapes, compute_dtype, full_precision, require_valid_scores
from st_weince.functional.exchange import ring_block_losses
from st_weince.functional.false_negatives import (
    FalseNegativeFilter,
    FilterCounts,
    apply_false_negative_filter,
    feature_keys,
)
from st_weince.functional.layouts import normalize_rows
from st_weince.functional.sigmoid import (
    chunked_sigmoid_contrastive_loss,
    constellation_margin_from_extremes,
    locked_adapter_scores,
    score_extremes,
    sigmoid_contrastive_loss,
    targets_from_positive_index,
)
from st_weince.losses._columns import check_embedding_columns
from st_weince.losses._labels import warn_unused_labels
from st_weince.utils.hotpath import DeferredChecks
from st_weince.utils.logged_statistics import RunningMeans
from st_weince.utils.options import (
    check_representable,
    choice_option,
    flag_option,
    options_config,
    options_from_arguments,
    positive_int_option,
    real_option,
)

Parametrization = Literal["relative", "absolute"]
ColumnMode = Literal["negatives", "modalities"]
Exchange = Literal["all_gather", "neighbour"]

# MultipleNegativesRankingLoss's arguments that RB-Sigmoid has no use for: accepted at the value that makes them a
# no-op, refused otherwise, with the reason. ``directions`` is accepted (it maps onto ``symmetric``).
_MNRL_NO_OP_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "similarity_fct": (
        lambda value: value is cos_sim,
        "RB-Sigmoid's relative bias and margin are defined on cosine scores in [-1, 1] (the embeddings are "
        "normalized), so only sentence_transformers.util.cos_sim applies",
    ),
    "hardness_mode": (
        lambda value: value is None,
        "hardness weighting re-weights the softmax denominator of InfoNCE, and the sigmoid loss has none: every pair "
        "is its own binary decision",
    ),
    "hardness_strength": (
        lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0,
        "hardness weighting re-weights the softmax denominator of InfoNCE, and the sigmoid loss has none",
    ),
    "partition_mode": (
        lambda value: value is None,
        "the sigmoid loss has no softmax partition function to share or split across directions; with "
        "symmetric=True the two directions are averaged",
    ),
}
_ONE_DIRECTION = frozenset({"query_to_doc"})
_BOTH_DIRECTIONS = frozenset({"query_to_doc", "doc_to_query"})

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


@dataclass(frozen=True)
class RBSigmoidOptions:
    """The options of :class:`RBSigmoidLoss` (and :class:`~st_weince.losses.CachedRBSigmoidLoss`): the one place of
    their defaults and their validation; the loss signatures read their defaults from here. Construction validates
    and resolves them: in the relative parametrization ``relative_bias`` is set (default
    ``RELATIVE_BIAS_START``) and ``bias`` is None; in the absolute one ``bias`` is set (default
    ``scale * relative_bias``) and ``relative_bias`` is None.

    The start values were chosen by measurement (``benchmarks/sigmoid_synthetic.py``, parts "init" and "bias"; see
    ``docs/rb-sigmoid.md``): ``t = 10`` is SigLIP's start, ``b_rel = 0.7`` reached the largest margins. The cap
    ``max_scale = 100`` is CLIP's and open_clip's cap on their logit scale (10x the start; see ``docs/rb-sigmoid.md``).
    """

    RELATIVE_BIAS_START: ClassVar[float] = 0.7

    scale: float = 10.0
    max_scale: float = 100.0
    parametrization: Parametrization = "relative"
    relative_bias: float | None = None
    bias: float | None = None
    trainable_scale: bool = True
    trainable_bias: bool = True
    gather_across_devices: bool = False
    exchange: Exchange = "all_gather"
    symmetric: bool = False
    columns: ColumnMode = "negatives"
    locked_adapter: bool = False
    adapter_logit: float = 0.0
    chunk_size: int | None = None
    check_inputs: bool = True
    false_negative_filter: FalseNegativeFilter | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("parametrization", choice_option("parametrization", self.parametrization, ("relative", "absolute")))
        put("columns", choice_option("columns", self.columns, ("negatives", "modalities")))
        put("exchange", choice_option("exchange", self.exchange, ("all_gather", "neighbour")))
        put("scale", stored_scale_option("scale", self.scale))
        put("max_scale", real_option("max_scale", self.max_scale, positive=True))
        if not self.max_scale < _FLOAT32_MAX:
            raise ValueError(f"max_scale must be finite in float32 (below {_FLOAT32_MAX:.4g}), got {self.max_scale!r}")
        if self.max_scale < self.scale:
            raise ValueError(
                f"max_scale must be >= scale (t starts at scale and never exceeds max_scale), got max_scale="
                f"{self.max_scale!r} < scale={self.scale!r}"
            )
        relative_bias = real_option("relative_bias", self.relative_bias, optional=True, dtype=torch.float32)
        bias = real_option("bias", self.bias, optional=True, dtype=torch.float32)
        start = self.RELATIVE_BIAS_START if relative_bias is None else relative_bias
        if self.parametrization == "relative":
            if bias is not None:
                raise ValueError(
                    "bias is the start of the absolute parametrization (z = t s - b); with parametrization="
                    "'relative' give relative_bias (z = t (s - b_rel))"
                )
            put("relative_bias", start)
        else:
            if bias is not None and relative_bias is not None:
                raise ValueError(
                    "give the absolute start either as bias or as relative_bias (then b = scale * relative_bias), "
                    "not both"
                )
            put("bias", self.scale * start if bias is None else bias)
            check_representable("bias", self.bias, torch.float32)  # scale * relative_bias may overflow
            put("relative_bias", None)
        for name in ("trainable_scale", "trainable_bias", "gather_across_devices", "symmetric", "locked_adapter"):
            put(name, flag_option(name, getattr(self, name)))
        put("check_inputs", flag_option("check_inputs", self.check_inputs))
        if self.exchange == "neighbour" and not self.gather_across_devices:
            raise ValueError(
                "exchange='neighbour' passes candidate blocks between processes, so it needs "
                "gather_across_devices=True (without it every process scores only its own candidates)"
            )
        put("adapter_logit", real_option("adapter_logit", self.adapter_logit, dtype=torch.float32))
        put("chunk_size", positive_int_option("chunk_size", self.chunk_size, optional=True))
        put("false_negative_filter", FalseNegativeFilter.parse(self.false_negative_filter))


def stored_scale_option(name: str, value: Any) -> float:
    """A scale ``t > 0`` validated as it is stored, a float32 ``log_t`` whose ``exp`` is ``t``: refused, naming it,
    when that ``t`` overflows or underflows float32 (1e39 has a finite float32 log, whose exp is Inf; 1e-46 gives
    t = 0)."""
    number = real_option(name, value, positive=True)
    # t from the float32 log_t, in float64 on the host (no tensor), with a margin of 1e-6 relative for the rounding of
    # float32 exp implementations at the range's ends
    log_t = float(np.float32(math.log(number)))
    t = math.exp(log_t) if log_t < 710.0 else math.inf
    info = torch.finfo(torch.float32)
    if not t <= info.max * (1.0 - 1e-6):
        raise ValueError(
            f"{name} = {number!r} overflows float32 as stored (t = exp(log_t) with a float32 log_t is {t:.4g}; "
            f"largest finite value {info.max:.4g})"
        )
    if t < info.tiny * (1.0 + 1e-6):
        raise ValueError(
            f"{name} = {number!r} underflows float32 as stored (t = exp(log_t) with a float32 log_t is {t:.4g}, "
            f"below the smallest normal value {info.tiny:.4g})"
        )
    return number
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def log_scale_cap(max_scale: float) -> float:
    """The largest float32 ``c`` whose ``exp`` stays within ``max_scale`` on any CPU or GPU: ``log_t`` is clamped to
    ``c`` so that ``t = exp(log_t) <= max_scale``. ``exp`` in float32 is faithfully rounded (within one ulp), so ``c``
    is taken 2 ulp of ``max_scale`` below it in float64 and rounded down to float32."""
    target = math.log(max_scale * (1.0 - 2.0**-22))
    cap = np.float32(target)  # NumPy, not a torch tensor: building a loss reads no device value
    if float(cap) > target:
        cap = np.nextafter(cap, np.float32(-np.inf))
    return float(cap)


def symmetric_from_directions(directions: tuple[str, ...] | None, symmetric: bool, owner: str) -> bool:
    """MultipleNegativesRankingLoss's ``directions`` in RB-Sigmoid's terms: ``("query_to_doc",)`` or
    ``("query_to_doc", "doc_to_query")`` (= ``symmetric=True``); None keeps ``symmetric``."""
    if directions is None:
        return symmetric
    if isinstance(directions, str) or not isinstance(directions, (tuple, list)):
        raise TypeError(f"directions must be a tuple of direction names, got {directions!r}")
    chosen = frozenset(directions)
    if chosen not in (_ONE_DIRECTION, _BOTH_DIRECTIONS) or len(chosen) != len(directions):
        raise ValueError(
            f"{owner} supports directions ('query_to_doc',) and ('query_to_doc', 'doc_to_query') "
            f"(= symmetric=True), got {tuple(directions)!r}: query_to_query and doc_to_doc would score "
            "anchors against anchors and documents against documents, which hold no positive pair here "
            "(for every column pair use columns='modalities')"
        )
    if symmetric is True and chosen != _BOTH_DIRECTIONS:
        raise ValueError(f"symmetric=True contradicts directions={tuple(directions)!r}")
    return chosen == _BOTH_DIRECTIONS


def refuse_mnrl_arguments(owner: str, **arguments: Any) -> None:
    for name, value in arguments.items():
        is_no_op, reason = _MNRL_NO_OP_VALUES[name]
        if not is_no_op(value):
            raise ValueError(f"{owner} does not support {name}={value!r}: {reason}")


class RBSigmoidLoss(nn.Module):
    def __init__(
        self,
        model: nn.Module | None,
        scale: float = RBSigmoidOptions.scale,
        *,
        max_scale: float = RBSigmoidOptions.max_scale,
        parametrization: Parametrization = RBSigmoidOptions.parametrization,
        relative_bias: float | None = RBSigmoidOptions.relative_bias,
        bias: float | None = RBSigmoidOptions.bias,
        trainable_scale: bool = RBSigmoidOptions.trainable_scale,
        trainable_bias: bool = RBSigmoidOptions.trainable_bias,
        gather_across_devices: bool = RBSigmoidOptions.gather_across_devices,
        exchange: Exchange = RBSigmoidOptions.exchange,
        symmetric: bool = RBSigmoidOptions.symmetric,
        columns: ColumnMode = RBSigmoidOptions.columns,
        locked_adapter: bool = RBSigmoidOptions.locked_adapter,
        adapter_logit: float = RBSigmoidOptions.adapter_logit,
        chunk_size: int | None = RBSigmoidOptions.chunk_size,
        check_inputs: bool = RBSigmoidOptions.check_inputs,
        false_negative_filter: FalseNegativeFilter | tuple | list | None = RBSigmoidOptions.false_negative_filter,
        directions: tuple[str, ...] | None = None,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
        partition_mode: str | None = None,
    ) -> None:
        """
        RB-Sigmoid: the sigmoid (SigLIP-style) contrastive loss with a trainable scale (inverse temperature) ``t``
        and a trainable *relative* bias ``b_rel``. Every (anchor, candidate) pair is an independent binary decision
        "matching or not" with logit ``z = t (s - b_rel)`` on the cosine score ``s``; there is no softmax over the
        batch. The loss is the mean over anchors of the sum over candidates of ``-log sigmoid(+-z)``.

        Zero loss is reachable exactly on ``(m, b_rel)``-constellations: every matching pair scores at least
        ``b_rel + m`` and every non-matching pair at most ``b_rel - m``. Training ``b_rel`` directly (instead of
        SigLIP's absolute bias ``b = t b_rel``, which drifts ``b / t`` towards 0) reaches larger margins. The
        absolute parametrization is available as the plain SigLIP baseline.

        Args:
            model: SentenceTransformer model (None to use only ``compute_loss_from_embeddings`` /
                ``loss_from_scores``).
            scale: initial ``t = 1 / temperature`` (trained as ``log_t``), as MNRL's ``scale``. Default 10
                (SigLIP's start).
            max_scale: cap on ``t`` (default 100, CLIP's and open_clip's cap; >= ``scale``, finite in float32). The
                forward uses ``t = exp(min(log_t, log max_scale))``, so ``t`` never exceeds it, and
                :meth:`clamp_parameters_` (called after every optimizer step by
                :func:`st_weince.training.prepare_trainer`) keeps ``log_t`` itself at or below the cap, where its
                gradient stays live. Logged as ``rb_sigmoid_t_capped`` (share of steps at the cap).
            parametrization: "relative" (``z = t (s - b_rel)``, default) or "absolute" (SigLIP's ``z = t s - b``).
            relative_bias: initial ``b_rel`` (default 0.7, measured: see ``docs/rb-sigmoid.md``). In the absolute
                parametrization it gives the start ``b = scale * relative_bias`` instead of ``bias``.
            bias: initial absolute bias ``b`` (absolute parametrization only).
            trainable_scale: train ``t``; if False it stays fixed.
            trainable_bias: train the bias (``b_rel`` or ``b``); if False it is a fixed hyperparameter (a fixed
                ``b_rel`` trades margin against bias).
            gather_across_devices: gather embeddings across processes: local anchors against global candidates. The
                loss parameters' gradients must then be averaged across processes:
                :func:`st_weince.training.prepare_trainer` does that (and the rest of the trainer integration).
            exchange: how the candidates of the other processes reach each process with ``gather_across_devices``:
                "all_gather" (default) gathers every candidate embedding into one global candidate matrix and scores
                the local anchors against it at once; "neighbour" passes the candidate blocks (with their
                hard-negative rows) around the ring of processes in both directions and scores the local anchors
                against one block at a time, with the gradients sent back the same way (SigLIP's scheme): the largest
                score tensor is one process's block instead of all of them, and no process holds the global
                candidate matrix. Same loss and gradients (see ``docs/rb-sigmoid.md``). Every process must have the
                same local batch size.
            symmetric: also score the positives (column 2) as anchors against all anchors and average both
                directions. For the sigmoid loss the reverse block holds the same pairs as the anchor-positive
                block, so without hard-negative columns this changes nothing; with them it doubles the weight of
                the anchor-positive block relative to the hard negatives.
            columns: "negatives" (default, like MultipleNegativesRankingLoss: anchor, positive, negative_1, ...;
                candidates are all positives and negatives of the batch) or "modalities" (each column is one modality
                of the same items; the loss is the sum over all column pairs of the two-modality loss, sharing
                ``t`` and the bias).
            locked_adapter: for a locked (frozen) encoder on one side: replace ``s`` by
                ``delta^2 s - (1 - delta^2)`` with one trainable scalar ``delta = sigmoid(x)``, the implicit adapter
                ``(delta U, sqrt(1 - delta^2))``, ``(delta V, -sqrt(1 - delta^2))``.
            adapter_logit: initial ``x`` of the adapter (0 gives ``delta = 0.5``, as in the released experiments).
            chunk_size: compute the loss in blocks of this many candidates (each block recomputed during backward),
                so memory grows with batch x chunk instead of batch x candidates. None: one block.
            check_inputs: check the embeddings (finite) and the loss parameters (finite) in every forward, with one
                host-device sync in all. False: no check and no sync (then ``torch.compile(fullgraph=True)`` traces
                ``compute_loss_from_embeddings`` whole); NaN input then gives a NaN loss instead of an error.
            directions: MultipleNegativesRankingLoss's argument: ``("query_to_doc",)`` or
                ``("query_to_doc", "doc_to_query")`` (= ``symmetric=True``); the other directions are refused.
            false_negative_filter: the in-batch false-negative guard (off by default): ``("absolute", m)`` leaves
                out the non-matching candidates with cosine score > s_pos - m, ``("relative", r)`` those with score
                > s_pos - (1 - r) |s_pos|, where s_pos is the score of the row's matching pair, ``"identical"``
                those whose input (token ids) is identical to the row's matching candidate's, also across processes
                and mini-batches; they contribute nothing to the loss
                (neither fitted nor pushed away) and nothing to the logged margin. Logged as
                ``rb_sigmoid_fn_masked_share`` and ``rb_sigmoid_fn_anchors_share`` (of the first block, like the
                margin). See ``docs/false-negatives.md``.

        MultipleNegativesRankingLoss's other arguments are accepted at their no-op value and refused otherwise, with
        the reason: ``similarity_fct`` (only ``cos_sim``), ``hardness_mode`` (None), ``hardness_strength`` (0),
        ``partition_mode`` (refused: there is no softmax partition).

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
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+
            | (modality_1, ..., modality_k), columns=         | none   |
            | "modalities"                                    |        |
            +-------------------------------------------------+--------+

        Recommendations:
            - Call :func:`st_weince.training.prepare_trainer` on the trainer: it logs ``t``, ``b_rel``, ``b`` and
              the margin, saves and restores the loss parameters with every checkpoint, keeps weight decay off them
              and averages their gradients across processes.
            - At fine-tuning rates (e.g. 2e-5) ``t`` and ``b_rel`` hardly move; ``prepare_trainer`` gives them their own
              learning rate (``loss_learning_rate``, default 3e-2), also under a wrapper such as ``MatryoshkaLoss``.
            - Use ``BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.
            - For batches beyond what fits in memory use :class:`~st_weince.losses.CachedRBSigmoidLoss`.

        Relations:
            - :class:`~st_weince.losses.CachedRBSigmoidLoss` is the same loss with gradient caching (GradCache),
              with the same options and parameter names.

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
        """
        super().__init__()
        owner = type(self).__name__
        refuse_mnrl_arguments(
            owner,
            similarity_fct=similarity_fct,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
            partition_mode=partition_mode,
        )
        symmetric = symmetric_from_directions(directions, symmetric, owner)
        options = options_from_arguments(RBSigmoidOptions, locals())
        self.model = model
        # The options as constructed; the trained values of t and the bias live in the parameters below.
        self.options = options
        self.log_scale_cap = log_scale_cap(options.max_scale)
        self._register_scalar("log_t", math.log(options.scale), options.trainable_scale)
        if options.parametrization == "relative":
            self._register_scalar("b_rel", options.relative_bias, options.trainable_bias)
        else:
            self._register_scalar("bias", options.bias, options.trainable_bias)
        if options.locked_adapter:
            self._register_scalar("adapter_logit", options.adapter_logit, True)
        self.logged_statistics = RunningMeans()

    def _register_scalar(self, name: str, value: float, trainable: bool) -> None:
        tensor = torch.tensor(value, dtype=torch.float32)
        if trainable:
            setattr(self, name, nn.Parameter(tensor))
        else:
            self.register_buffer(name, tensor)

    # ----- the loss parameters -----
    @property
    def scale(self) -> Tensor:
        """The current ``t = exp(min(log_t, log max_scale))`` (a tensor in the autograd graph)."""
        return self._capped_log_t(self.log_t).exp()

    def _capped_log_t(self, log_t: Tensor) -> Tensor:
        """``log_t`` clamped at the cap, with its gradient passing at the cap itself (``torch.clamp``'s is zero
        there), so that a ``log_t`` held at the cap by :meth:`clamp_parameters_` moves down when its gradient turns;
        above the cap the gradient is zero."""
        return torch.where(log_t > self.log_scale_cap, self.log_scale_cap, log_t)

    @torch.no_grad()
    def clamp_parameters_(self) -> None:
        """Clamp ``log_t`` in place to the cap of ``max_scale`` (as open_clip clamps its logit scale after each
        optimizer step). Call it after every optimizer step in custom training loops; ``prepare_trainer`` does it
        for the trainer. The same clamp on every process (after the averaged gradients' step) and on resume (the
        checkpoint holds the clamped value), so 2 processes and a resumed run stay equal to one process."""
        self.log_t.clamp_(max=self.log_scale_cap)

    @property
    def relative_bias(self) -> Tensor:
        """``b_rel`` (relative) or ``b / t`` (absolute)."""
        if self.options.parametrization == "relative":
            return self.b_rel
        return self.bias / self.scale

    @property
    def absolute_bias(self) -> Tensor:
        """``b = t b_rel`` (relative) or ``b`` (absolute)."""
        if self.options.parametrization == "absolute":
            return self.bias
        return self.scale * self.b_rel

    @property
    def delta(self) -> Tensor | None:
        """The locked-encoder adapter's ``delta = sigmoid(x)``, or None without the adapter."""
        return torch.sigmoid(self.adapter_logit) if self.options.locked_adapter else None

    def no_weight_decay_parameter_names(self) -> list[str]:
        """Names of this loss's own parameters (relative to the loss), none of which should get weight decay."""
        return [name for name, _ in self.named_parameters() if not name.startswith("model.")]

    def loss_parameters(self) -> dict[str, Tensor]:
        """The loss's own scalars by name (parameters or, when fixed, buffers): ``log_t``, ``b_rel`` or ``bias``,
        and ``adapter_logit`` with the adapter. Every computation reads them from such a dict, so that the cached
        variant can substitute stand-ins."""
        names = ["log_t", "b_rel" if self.options.parametrization == "relative" else "bias"]
        if self.options.locked_adapter:
            names.append("adapter_logit")
        return {name: getattr(self, name) for name in names}

    def _logit_arguments(self, params: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """Keyword arguments of the functional losses for these parameter values, in the computation dtype (the
        scale is exponentiated in that dtype, so float64 inputs get a float64 ``t``)."""
        arguments: dict[str, Any] = {"scale": self._capped_log_t(params["log_t"]).to(dtype).exp()}
        if self.options.parametrization == "relative":
            arguments["relative_bias"] = params["b_rel"]
        else:
            arguments["bias"] = params["bias"]
        return arguments

    def _score_transform(self, params: dict[str, Tensor], dtype: torch.dtype) -> Callable[[Tensor], Tensor] | None:
        if not self.options.locked_adapter:
            return None
        delta = torch.sigmoid(params["adapter_logit"].to(dtype))
        return lambda scores: locked_adapter_scores(scores, delta)

    def _new_checks(self) -> DeferredChecks | None:
        return DeferredChecks() if self.options.check_inputs else None

    @staticmethod
    def _require_finite_parameters(params: dict[str, Tensor], checks: DeferredChecks | None) -> None:
        if checks is None:
            return
        for name, value in params.items():
            checks.require(
                torch.isfinite(value.detach()),
                f"loss parameter {name} is not finite: training diverged (lower its learning rate)",
            )

    # ----- entry points -----
    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        row_keys = self._row_keys(sentence_features)
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels, row_keys=row_keys)

    def _row_keys(self, sentence_features: list[dict[str, Tensor]]) -> list[Tensor] | None:
        """The input keys of every column's rows when the guard compares inputs (``"identical"``), else None."""
        spec = self.options.false_negative_filter
        if spec is None or not spec.needs_keys:
            return None
        return [feature_keys(features, type(self).__name__) for features in sentence_features]

    def _require_row_keys(self, row_keys: list[Tensor] | None, num_columns: int) -> None:
        spec = self.options.false_negative_filter
        if spec is None or not spec.needs_keys:
            return
        if row_keys is None or len(row_keys) != num_columns:
            raise ValueError(
                f"{type(self).__name__}: false_negative_filter='identical' compares the inputs' token ids: call the "
                "loss on tokenized features (forward), or pass row_keys=[st_weince.functional.input_keys(input_ids, "
                f"attention_mask) of each of the {num_columns} columns] to compute_loss_from_embeddings"
            )

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Sigmoid loss of one score matrix: ``scores`` [A, C] cosine, ``positive_index`` [A] the positive column of
        each row (-1: none), ``valid_mask`` [A, C] bool (False = excluded, e.g. the self-pairs of the SimCLR layout
        of :func:`st_weince.functional.nt_xent_layout`). Targets are 1 at the positive, 0 at the other valid entries.
        Used by the vision adapter; with the locked adapter enabled it is applied to ``scores`` first."""
        self._require_row_keys(None, 0)  # a score matrix carries no inputs to compare
        check_score_shapes(scores, positive_index, valid_mask)
        params = self.loss_parameters()
        if self.options.check_inputs:  # the one host sync of the step
            checks = DeferredChecks()
            require_valid_scores(checks, scores, positive_index, valid_mask)
            self._require_finite_parameters(params, checks)
            checks.raise_if_failed()
        with full_precision(scores):
            return self._loss_from_checked_scores(scores, positive_index, valid_mask, params)

    def _loss_from_checked_scores(
        self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None, params: dict[str, Tensor]
    ) -> Tensor:
        dtype = compute_dtype(scores)
        targets = targets_from_positive_index(positive_index, scores.shape[1], dtype=dtype)
        transform = self._score_transform(params, dtype)
        # on the cosine scores, before the adapter's transform, as in compute_loss_from_embeddings
        valid_mask, guard_counts = apply_false_negative_filter(
            scores, positive_index, valid_mask, self.options.false_negative_filter
        )
        scores = scores.to(dtype) if transform is None else transform(scores)
        loss = sigmoid_contrastive_loss(scores, targets, valid_mask=valid_mask, **self._logit_arguments(params, dtype))
        self._record(params, *score_extremes(scores, targets, valid_mask), guard_counts)
        return loss

    def compute_loss_from_embeddings(
        self, embeddings: list[Tensor], labels: Tensor | None = None, *, row_keys: list[Tensor] | None = None
    ) -> Tensor:
        """The loss on already computed column embeddings (``[anchor, positive, *negatives]`` or modalities), in
        float32 for half-precision embeddings (also under autocast) and in float64 for float64 ones.
        ``row_keys``: each column's :func:`~st_weince.functional.input_keys`, needed by the guard's ``"identical"``
        rule only (``forward`` computes them from the token ids)."""
        self._require_row_keys(row_keys, len(embeddings))
        warn_unused_labels(self, labels)  # no sync: a host-side check
        with full_precision(*embeddings):
            return self._loss_from_embeddings(embeddings, row_keys)

    def _loss_from_embeddings(self, embeddings: list[Tensor], row_keys: list[Tensor] | None) -> Tensor:
        checks = self._new_checks()
        columns, gathered, positive_index = self._prepare_columns(embeddings, checks)
        key_blocks = self._key_blocks(columns, row_keys)
        params = self.loss_parameters()
        self._require_finite_parameters(params, checks)
        if checks is not None:
            checks.raise_if_failed()  # the one host sync of the step, where the loss receives its inputs
        loss = columns[0].new_zeros(())
        extremes = guard_counts = None
        blocks = self._directional_blocks(columns, gathered)
        for (anchor_column, candidates, weight), keys in zip(blocks, key_blocks):
            value, low, high, counts = self._block_loss(
                columns[anchor_column], candidates, positive_index, params, keys
            )
            loss = loss + weight * value
            if extremes is None:  # the first block's, logged
                extremes, guard_counts = (low, high), counts
        self._record(params, *extremes, guard_counts)
        return loss

    # ----- the pieces, shared with CachedRBSigmoidLoss -----
    def _prepare_columns(
        self, embeddings: list[Tensor], checks: DeferredChecks | None
    ) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Normalized columns in the computation dtype, the candidate columns (gathered across processes with
        ``gather_across_devices``) and each local anchor's positive row among the candidates."""
        # Shapes here; the values (NaN, Inf, overflowing norms) by the norm check of normalize_rows.
        check_embedding_columns(embeddings, type(self).__name__)
        columns = self._normalized(embeddings, checks)
        gathered, positive_index = self._candidates(columns)
        return columns, gathered, positive_index

    def _candidates(self, columns: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """The candidate columns (the local ones, or with ``gather_across_devices`` and all-gather those of all
        processes, with gradient) and the row of each local anchor's positive among them. With the neighbour exchange
        they stay local: each block loss passes them around the ring."""
        batch_size = columns[0].shape[0]
        offset = 0
        gathered = columns
        if self._all_gathers:
            gathered = [all_gather_with_grad(column) for column in columns]
            offset = get_rank() * batch_size
        return gathered, torch.arange(offset, offset + batch_size, device=columns[0].device)

    def _key_blocks(self, columns: list[Tensor], row_keys: list[Tensor] | None) -> list[Tensor | None]:
        """The candidates' input keys of every directional block (gathered like the candidates), or Nones."""
        spec = self.options.false_negative_filter
        if row_keys is None or spec is None or not spec.needs_keys:
            return [None] * len(self._directional_blocks(columns, columns))
        if self._all_gathers:  # with the neighbour exchange they travel with their candidate blocks instead
            row_keys = [all_gather(keys) for keys in row_keys]  # integers: no gradient
        return [keys for _, keys, _ in self._directional_blocks(columns, row_keys)]

    @property
    def _all_gathers(self) -> bool:
        """Whether the candidates are all-gathered into one global matrix."""
        return self.options.gather_across_devices and self.options.exchange == "all_gather"

    @property
    def _exchanges_with_neighbours(self) -> bool:
        """Whether the candidates stay local and every block loss passes them around the ring of processes."""
        return self.options.gather_across_devices and self.options.exchange == "neighbour"

    def _normalized(self, embeddings: list[Tensor], checks: DeferredChecks | None) -> list[Tensor]:
        """Unit-length rows in the computation dtype (float64 stays float64, half precision becomes float32); with
        ``checks``, rows with NaN/Inf or an overflowing norm are refused (they would normalise to zero vectors)."""
        dtype = compute_dtype(*embeddings)
        name = type(self).__name__
        return [
            normalize_rows(embedding, checks, f"{name}: column {index}", dtype)
            for index, embedding in enumerate(embeddings)
        ]

    def _directional_blocks(self, columns: list[Tensor], candidates: list[Tensor]) -> list[tuple[int, Tensor, float]]:
        """``(anchor column, candidate matrix, weight)`` of every anchors-against-candidates block whose weighted sum
        is the loss. The first block's margin is the one logged."""
        if self.options.columns == "negatives":
            documents = candidates[1] if len(candidates) == 2 else torch.cat(candidates[1:], dim=0)
            pairs, reverse = [(0, documents)], [(1, candidates[0])]
        else:
            index_pairs = list(combinations(range(len(columns)), 2))
            pairs = [(i, candidates[j]) for i, j in index_pairs]
            reverse = [(j, candidates[i]) for i, j in index_pairs]
        if not self.options.symmetric:
            return [(column, block, 1.0) for column, block in pairs]
        # Each direction of a pair gets half the weight: the symmetric loss is the mean of both directions.
        return [(column, block, 0.5) for column, block in pairs + reverse]

    def _block_loss(
        self,
        anchors: Tensor,
        candidates: Tensor,
        positive_index: Tensor,
        params: dict[str, Tensor],
        candidate_keys: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, FilterCounts | None]:
        """Mean over ``anchors`` of their loss against ``candidates``, with the block's smallest matching and largest
        non-matching score (no gradient), and what the false-negative guard removed per anchor (None without it).
        With ``exchange="neighbour"`` ``candidates`` are the local ones, and the loss is taken against every
        process's block of them."""
        if self._exchanges_with_neighbours:
            return self._exchanged_block_loss(
                anchors, candidates, positive_index, params, candidate_keys=candidate_keys
            )
        return self._candidate_block_loss(
            anchors, candidates, positive_index, params, candidate_keys=candidate_keys
        )

    def _exchanged_block_loss(
        self,
        anchors: Tensor,
        candidates: Tensor,
        positive_index: Tensor,
        params: dict[str, Tensor],
        *,
        weight: float = 1.0,
        anchor_chunk: int | None = None,
        backward: bool = False,
        candidate_keys: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, FilterCounts | None]:
        """:meth:`_block_loss` against the local ``candidates`` and those of every other process, passed around the
        ring (:func:`st_weince.functional.exchange.ring_block_losses`; ``weight``, ``anchor_chunk`` and ``backward``
        as there; ``candidate_keys``, the local candidates' input keys, travel with their block)."""

        def block_loss(
            rows: Tensor,
            block: Tensor,
            index: Tensor,
            positive_scores: Tensor,
            block_keys: Tensor | None = None,
            reference_keys: Tensor | None = None,
        ):
            return self._candidate_block_loss(
                rows, block, index, params, positive_scores, candidate_keys=block_keys, reference_keys=reference_keys
            )

        return ring_block_losses(
            anchors,
            candidates,
            positive_index,
            block_loss,
            weight=weight,
            anchor_chunk=anchor_chunk,
            backward=backward,
            candidate_keys=candidate_keys,
        )

    def _candidate_block_loss(
        self,
        anchors: Tensor,
        candidates: Tensor,
        positive_index: Tensor,
        params: dict[str, Tensor],
        positive_scores: Tensor | None = None,
        *,
        candidate_keys: Tensor | None = None,
        reference_keys: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, FilterCounts | None]:
        """:meth:`_block_loss` against exactly ``candidates`` (``positive_scores``, ``reference_keys``: the guard's
        threshold scores and the positives' input keys when the block may not hold the rows' positives)."""
        dtype = anchors.dtype
        outputs = chunked_sigmoid_contrastive_loss(
            anchors,
            candidates,
            positive_index,
            score_transform=self._score_transform(params, dtype),
            chunk_size=self.options.chunk_size,
            return_extremes=True,
            false_negative_filter=self.options.false_negative_filter,
            return_guard_counts=True,
            positive_scores=positive_scores,
            candidate_keys=candidate_keys,
            reference_keys=reference_keys,
            **self._logit_arguments(params, dtype),
        )
        return outputs

    # ----- statistics -----
    @torch.no_grad()
    def _record(
        self,
        params: dict[str, Tensor],
        min_positive: Tensor,
        max_negative: Tensor,
        guard_counts: FilterCounts | None = None,
    ) -> None:
        """Keep ``t``, ``b_rel``, ``b``, the margin (and ``delta``, and the false-negative guard's shares) as device
        tensors: no sync in the hot path."""
        log_t = params["log_t"].detach()
        t = self._capped_log_t(log_t).exp()
        if self.options.parametrization == "relative":
            b_rel = params["b_rel"].detach()
            b = t * b_rel
        else:
            b = params["bias"].detach()
            b_rel = b / t
        values = {"rb_sigmoid_t": t, "rb_sigmoid_b_rel": b_rel, "rb_sigmoid_b": b}
        # 1 when t is at its cap max_scale (the mean over the logging interval: the share of steps at the cap)
        values["rb_sigmoid_t_capped"] = (log_t >= self.log_scale_cap).to(t.dtype)
        # A block without matching or without non-matching pairs has an infinite "margin": not counted.
        values["rb_sigmoid_margin"] = constellation_margin_from_extremes(min_positive, max_negative)[0]
        if self.options.locked_adapter:
            values["rb_sigmoid_delta"] = torch.sigmoid(params["adapter_logit"].detach())
        if guard_counts is not None:
            values["rb_sigmoid_fn_masked_share"] = guard_counts.masked_share
            values["rb_sigmoid_fn_anchors_share"] = guard_counts.anchors_share
        self.logged_statistics.add(values)

    def pop_logged_statistics(self) -> dict[str, float]:
        """Means since the last call of ``t``, ``b_rel``, ``b`` and the batch margin (and ``delta`` with the
        adapter); used by :func:`st_weince.training.log_loss_statistics`. The margin is that of the (local) batch:
        ``(min matching score - max non-matching score) / 2`` of the anchor-vs-candidates block. Reading them is the
        one host-device sync, at logging time only."""
        return self.logged_statistics.pop()

    def get_config_dict(self) -> dict[str, Any]:
        """The options as configured (JSON-able): ``type(loss)(model, **loss.get_config_dict())`` rebuilds this loss
        as it was built, with ``t`` and the bias at their configured starts. The trained values are
        :meth:`trained_values`; the model carries them after training (:class:`st_weince.MatchProbability`) and its
        model card shows them next to this configuration (``docs/rb-sigmoid.md``)."""
        return options_config(self.options)

    @torch.no_grad()
    def trained_values(self) -> dict[str, float]:
        """The current values of the loss's own scalars, as Python floats (one host read): ``t`` (capped at
        ``max_scale``), ``b_rel`` (``b / t`` in the absolute parametrization), ``b = t b_rel``, and ``delta`` with the
        locked adapter. Not for the hot path."""
        params = self.loss_parameters()
        t = self._capped_log_t(params["log_t"].detach()).double().exp()
        if self.options.parametrization == "relative":
            b_rel = params["b_rel"].detach().double()
            b = t * b_rel
        else:
            b = params["bias"].detach().double()
            b_rel = b / t
        values = {"t": float(t), "b_rel": float(b_rel), "b": float(b)}
        if self.options.locked_adapter:
            values["delta"] = float(torch.sigmoid(params["adapter_logit"].detach().double()))
        return values

    @property
    def citation(self) -> str:
        return RB_SIGMOID_CITATION
