"""What WEINCELoss and RBSigmoidLoss share: the entry points (``forward``, ``compute_loss_from_embeddings``, the
input checks of ``loss_from_scores``), the false-negative guard's input keys, the checked unit-length columns, the
logged statistics, the configuration, and the handling of MultipleNegativesRankingLoss's arguments.

The embeddings' shapes are checked for free (no device value is read); their values (NaN, Inf, overflowing norms)
by :func:`st_weince.functional.normalize_rows`, in the loss's one host sync."""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.util import cos_sim
from torch import Tensor, nn

from st_weince.functional.checks import check_score_shapes, compute_dtype, full_precision, require_valid_scores
from st_weince.functional.false_negatives import KEY_RULES, FilterCounts, check_labels, feature_keys, label_keys
from st_weince.functional.layouts import normalize_rows
from st_weince.functional.options import Options
from st_weince.training.processes import check_process_group
from st_weince.training.protocol import LossState
from st_weince.utils.hotpath import DeferredChecks
from st_weince.utils.logged_statistics import RunningMeans

# The losses take no labels but the guard's: the advice of the warning that they are ignored.
_GRADED_PAIRS_ADVICE = (
    "every (anchor, positive) row is trained as a positive pair, also one labelled 0. For pairs with a similarity "
    "score use CoSENTLoss or AnglELoss (sentence-transformers); for 0/1-labelled pairs keep only the positive ones, "
    "or use ContrastiveLoss / OnlineContrastiveLoss"
)

# MultipleNegativesRankingLoss's arguments that a loss may have no use for: the value at which each is a no-op.
_MNRL_NO_OPS: dict[str, Callable[[Any], bool]] = {
    "similarity_fct": lambda value: value is cos_sim,
    "hardness_mode": lambda value: value is None,
    "hardness_strength": lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0,
    "partition_mode": lambda value: value is None,
}


def guard_share_values(prefix: str, counts: FilterCounts | None) -> dict[str, Tensor]:
    """The false-negative guard's logged shares: of the candidates removed and of the anchors that lost any."""
    if counts is None:
        return {}
    return {f"{prefix}_fn_masked_share": counts.masked_share, f"{prefix}_fn_anchors_share": counts.anchors_share}


class ColumnsLoss(nn.Module, LossState):
    """A loss on the columns of a sentence-transformers batch (``[anchor, positive, *negatives]``) with one frozen
    options object (``options_class``; the cached variants add ``cache_options_class``) and statistics logged by
    name. A subclass writes out its constructor (every option a parameter whose default reads the options class's,
    and MultipleNegativesRankingLoss's arguments it accepts at their no-op values), computes
    ``_loss_from_embeddings(embeddings, row_keys)`` and gives its ``citation``.

    A loss with state of its own that training changes (:meth:`state_tensors`) refuses its first training step
    (``forward`` in training mode with gradients on) until :meth:`mark_state_managed` says who handles that state: the
    sentence-transformers trainer neither checkpoints, syncs across processes nor trains it at its own learning
    rate, so without the setup it would be lost silently."""

    options_class: ClassVar[type[Options]]
    cache_options_class: ClassVar[type[Options] | None] = None
    #: MultipleNegativesRankingLoss's arguments the loss has no use for: name -> why values other than the no-op one
    #: are refused
    mnrl_refusals: ClassVar[dict[str, str]] = {}

    def reads_labels(self) -> bool:
        guard = getattr(self.options, "false_negative_filter", None)
        return guard is not None and guard.uses_labels

    def __init__(self, model: nn.Module | None, options: Options) -> None:
        super().__init__()
        self.model = model
        self.options = options
        self.logged_statistics = RunningMeans()
        self._first_training_step_done = False

    def _refuse_mnrl_arguments(self, **arguments: Any) -> None:
        """Accept MultipleNegativesRankingLoss's ``arguments`` at their no-op values; refuse other values with the
        loss's reason (:attr:`mnrl_refusals`)."""
        for name, value in arguments.items():
            if not _MNRL_NO_OPS[name](value):
                shown = getattr(value, "__name__", None) if callable(value) else None
                reason = self.mnrl_refusals[name]
                raise ValueError(f"{type(self).__name__} does not support {name}={shown or repr(value)}: {reason}")

    # -- MultipleNegativesRankingLoss's attributes, read from the options ---------------------------------------

    @property
    def temperature(self) -> float | Tensor:
        """``1 / scale``, as MNRL's ``temperature``."""
        return 1.0 / self.scale

    @property
    def gather_across_devices(self) -> bool:
        return self.options.gather_across_devices

    @property
    def similarity_fct(self) -> Callable[[Tensor, Tensor], Tensor]:
        """Always ``cos_sim``: both losses are defined on cosine scores."""
        return cos_sim

    @property
    def hardness_mode(self) -> None:
        """Always None: neither loss has MNRL's hardness weighting."""
        return None

    @property
    def hardness_strength(self) -> float:
        """Always 0 (no hardness weighting)."""
        return 0.0

    # -- the training protocol (st_weince.training.protocol) ----------------------------------------------------

    #: names of buffers that training changes (state like a parameter's, e.g. a moving average)
    evolving_buffers: ClassVar[tuple[str, ...]] = ()

    def state_tensors(self) -> dict[str, Tensor]:
        """The loss's own trainable parameters and evolving buffers (not the model's)."""
        tensors = {name: p for name, p in self.named_parameters() if p.requires_grad and not name.startswith("model.")}
        tensors.update({name: getattr(self, name) for name in self.evolving_buffers if getattr(self, name) is not None})
        return tensors

    def pop_logged_statistics(self) -> dict[str, float]:
        return self.logged_statistics.pop(current=self.logged_state())

    def end_statistics_step(self) -> bool:
        return self.logged_statistics.end_step()

    def logged_state(self) -> dict[str, Tensor]:
        """The loss's state shown in every log record, as 0-d device tensors of its current values (read at the
        log, with the statistics): none by default."""
        return {}

    def _at_first_training_step(self) -> None:
        """Once, at the first forward in training mode with gradients on: an error when the loss gathers across the
        processes of a group that the trainer trains each alone, and an error when the loss has state that nobody
        was declared to handle (Python checks of construction-time facts; no tensor is read)."""
        if self._first_training_step_done or not (self.training and torch.is_grad_enabled()):
            return
        # A process group that accelerate (the trainer) trains NOT_PARALLEL, with gathering: docs/distributed.md
        check_process_group(bool(getattr(self.options, "gather_across_devices", False)), type(self).__name__)
        self._first_training_step_done = True
        names = list(self.state_tensors())
        if names and self.state_managed_by is None:
            self._first_training_step_done = False
            raise RuntimeError(
                f"{type(self).__name__} has state of its own that training changes ({', '.join(names)}), and "
                "nothing handles it: SentenceTransformerTrainer would train it at the model's learning rate with "
                "weight decay, put it in no checkpoint (a resume restarts it), let it drift apart across processes, "
                "and the saved model would not carry it. Add the one line "
                "st_weince.training.prepare_trainer(trainer) after building the trainer, before trainer.train() "
                "(model.fit builds a trainer of its own, which cannot be set up: use SentenceTransformerTrainer). In "
                "a training loop of your own that handles it, call loss.mark_state_managed() once instead."
            )

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        if not self._first_training_step_done:
            self._at_first_training_step()
        sentence_features = list(sentence_features)
        guard = self.options.false_negative_filter
        row_keys = self._row_keys(sentence_features) if guard is not None and guard.rule == "identical" else None
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels, row_keys=row_keys)

    def compute_loss_from_embeddings(
        self, embeddings: list[Tensor], labels: Tensor | None = None, *, row_keys: list[Tensor] | None = None
    ) -> Tensor:
        """The loss on already computed column embeddings, in float32 for half-precision embeddings (also under
        autocast) and in float64 for float64 ones. ``labels``: a class or group id per row, read by the guard's
        ``"same_label"`` rule only (else ignored, with a warning). ``row_keys``: each column's
        :func:`~st_weince.functional.input_keys`, read by the ``"identical"`` rule only (``forward`` computes them
        from the token ids)."""
        if labels is None and self.options.false_negative_filter is None:
            row_keys = None  # nothing to check, nothing to compare
        else:
            row_keys = self._checked_row_keys(row_keys, labels, embeddings)
        with full_precision(*embeddings):
            return self._loss_from_embeddings(embeddings, row_keys)

    def _loss_from_embeddings(self, embeddings: list[Tensor], row_keys: list[Tensor] | None) -> Tensor:
        raise NotImplementedError

    # -- input checks ------------------------------------------------------------------------------------------

    def _require_valid_state(self, checks: DeferredChecks) -> None:
        """Add checks of the loss's own state (its parameters) to the step's ``checks``; none by default."""

    def _check_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None, **rules: Any) -> None:
        """The checks of ``loss_from_scores``: shapes (free), then the values, in the step's one host sync."""
        if self._guard_rule() in KEY_RULES:  # a score matrix carries no rows' inputs or labels to compare
            raise ValueError(
                f"{type(self).__name__}: false_negative_filter={self._guard_rule()!r} compares the rows' inputs or "
                "labels, which a score matrix does not carry: use compute_loss_from_embeddings (or forward)"
            )
        check_score_shapes(scores, positive_index, valid_mask)
        if self.options.check_inputs:
            checks = DeferredChecks()
            require_valid_scores(checks, scores, positive_index, valid_mask, **rules)
            self._require_valid_state(checks)
            checks.raise_if_failed()

    def _checked_columns(
        self, embeddings: list[Tensor], gather: Callable[[Tensor], Tensor] | None = None
    ) -> list[Tensor]:
        """The columns (gathered across processes with ``gather``) with unit-length rows in the computation dtype
        (float64 stays float64, half precision becomes float32), after the step's one host sync: with
        ``check_inputs``, rows with NaN/Inf or an overflowing norm (they would normalise to zero vectors) and an
        invalid loss state are refused there, all read at once."""
        name = type(self).__name__  # the shapes (free: no device value is read)
        if len(embeddings) < 2:
            raise ValueError(
                f"{name} needs at least 2 input columns (anchor, positive[, negative_1, ...]), got {len(embeddings)}. "
                "Check the columns of your dataset: a single text column is not enough."
            )
        for index, embedding in enumerate(embeddings):
            if not isinstance(embedding, Tensor) or embedding.dim() != 2:
                shape = tuple(embedding.shape) if isinstance(embedding, Tensor) else type(embedding).__name__
                raise ValueError(
                    f"{name}: column {index} must be a 2-D [batch, dimension] embedding matrix, got shape {shape}"
                )
            if not embedding.is_floating_point():
                raise ValueError(f"{name}: column {index} must hold floating-point embeddings, got {embedding.dtype}")
        sizes, dims = [e.shape[0] for e in embeddings], [e.shape[1] for e in embeddings]
        if len(set(sizes)) > 1:
            raise ValueError(f"{name}: all columns must have the same batch size, got {sizes}")
        if sizes[0] < 1:
            raise ValueError(f"{name}: the batch is empty")
        if len(set(dims)) > 1:
            raise ValueError(f"{name}: all columns must have the same embedding dimension, got {dims}")
        if dims[0] < 1:
            raise ValueError(f"{name}: the embeddings have no features: a cosine score needs at least one dimension")
        columns = embeddings if gather is None else [gather(column) for column in embeddings]
        dtype = compute_dtype(*columns)
        checks = DeferredChecks() if self.options.check_inputs else None
        columns = [normalize_rows(column, checks, f"{name}: column {i}", dtype) for i, column in enumerate(columns)]
        if checks is not None:
            self._require_valid_state(checks)
            checks.raise_if_failed()  # the one host sync of the step, where the loss receives its inputs
        return columns

    # -- the false-negative guard's input keys ----------------------------------------------------------------

    def _guard_rule(self) -> str | None:
        return getattr(self.options.false_negative_filter, "rule", None)

    def _row_keys(self, sentence_features: list[dict[str, Tensor]]) -> list[Tensor]:
        """The input keys of every column's rows, which the guard's ``"identical"`` rule compares."""
        return [feature_keys(features, type(self).__name__) for features in sentence_features]

    def _has_hard_negative_columns(self) -> bool:
        """Whether the columns after the second are mined hard negatives (MNRL's layout), which the ``"same_label"``
        rule never masks."""
        return True

    def _checked_row_keys(
        self, row_keys: list[Tensor] | None, labels: Tensor | None, embeddings: list[Tensor]
    ) -> list[Tensor] | None:
        """The keys the guard compares: ``row_keys`` for ``"identical"`` (refused when missing), the labels' for
        ``"same_label"`` (refused when there are none), else None; labels given to any other setting are ignored,
        with one warning."""
        rule = self._guard_rule()
        if rule == "same_label":
            if labels is None:
                raise ValueError(
                    f"{type(self).__name__}: false_negative_filter='same_label' needs the dataset's 'label' column (a "
                    "class or group id per row, which sentence-transformers passes to the loss as labels), and this "
                    "batch has none: add a 'label' column, or choose another false_negative_filter"
                )
            check_labels(labels, embeddings[0].shape[0], type(self).__name__)
            labels = labels.to(embeddings[0].device)  # a no-op in training (the trainer moved them)
            return label_keys(labels, len(embeddings), hard_negative_columns=self._has_hard_negative_columns())
        if labels is not None:
            self._warn_unused_labels(labels)
        if rule != "identical":
            return None
        num_columns = len(embeddings)
        if row_keys is None or len(row_keys) != num_columns:
            raise ValueError(
                f"{type(self).__name__}: false_negative_filter='identical' compares the inputs' token ids: call the "
                "loss on tokenized features (forward), or pass row_keys=[st_weince.functional.input_keys(input_ids, "
                f"attention_mask) of each of the {num_columns} columns] to compute_loss_from_embeddings"
            )
        return row_keys

    _warned_unused_labels = False

    def _warn_unused_labels(self, labels: Tensor) -> None:
        """Warn once per loss object that it ignores ``labels`` (the columns sentence-transformers' data collator
        passes as labels, ``valid_label_columns``). Costs the step nothing: whether labels were given is known on the
        host."""
        if self._warned_unused_labels or torch.compiler.is_compiling():
            return
        message = (
            f"{type(self).__name__} does not use labels and ignores the 'label' or 'score' column of the dataset: "
            f"{_GRADED_PAIRS_ADVICE}."
        )
        warnings.warn(message, stacklevel=3)
        self._warned_unused_labels = True

    # -- configuration ------------------------------------------------------------------------------------------

    def get_config_dict(self) -> dict[str, Any]:
        """The options as configured (JSON-able): ``type(loss)(model, **loss.get_config_dict())`` rebuilds the loss
        as it was built."""
        config = self.options.to_config()
        if self.cache_options_class is not None:
            config.update(self.cache_options.to_config())
        return config

    def resume_config(self, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint records and a resume compares: ``config`` (a configuration of this loss class that a
        checkpoint recorded, perhaps under an older version; None: this loss's own) as this version reads it. An
        option it lacks takes its default (an option added later keeps the old behaviour at its default, so an older
        run resumes); an option this version no longer has stays as written, so that the resume names it. The
        options that change only how the loss is computed (``operational`` fields) are left out."""
        classes = [cls for cls in (self.options_class, self.cache_options_class) if cls is not None]
        if config is None:
            config = self.get_config_dict()
        else:
            config = dict(config)
            for options_class in classes:
                names = {field.name for field in dataclasses.fields(options_class)}
                try:
                    config.update(options_class(**{k: v for k, v in config.items() if k in names}).to_config())
                except (TypeError, ValueError):
                    pass  # a value this version refuses: compared as written, so that the resume names it
        operational = frozenset().union(*(cls.operational_fields() for cls in classes))
        return {name: value for name, value in config.items() if name not in operational}
