"""What a loss gives the training integration: the one protocol between the losses and :mod:`st_weince.training`.
A loss module that inherits :class:`LossState` declares the state that training changes and sentence-transformers'
trainer does not handle; :mod:`st_weince.training` reads nothing else of a loss, so that it names no loss class and a
third loss with parameters needs no change there.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


class LossState:
    """The training protocol of a loss module (every method has a no-state default)."""

    def state_tensors(self) -> dict[str, Tensor]:
        """The tensors training changes, by their names in the module's ``state_dict``: trainable parameters and
        buffers that evolve (a moving average). They go into every checkpoint and are restored on resume; the
        parameters' gradients are averaged across processes."""
        return {}

    def no_weight_decay(self) -> set[str]:
        """The names (of :meth:`state_tensors`) of the parameters that must train without weight decay."""
        return set()

    def after_optimizer_step(self) -> None:
        """Called after every optimizer step (e.g. clamping a parameter to its range), on every process alike."""

    def pop_logged_statistics(self) -> dict[str, float]:
        """The means of the loss's logged statistics of the latest step :meth:`end_statistics_step` ended (without
        steps: since the last call), and the current values of the state it shows in every log record (RB-Sigmoid's
        ``t`` and ``b_rel``: state, not batch statistics); the one place they are read on the host."""
        return {}

    def end_statistics_step(self) -> bool:
        """End a training step: the statistics computed since the last call become the ones
        :meth:`pop_logged_statistics` returns, replacing an earlier step's. Returns whether the step computed any (a
        Python fact, no host read), i.e. whether the loss ran with :attr:`log_statistics` in that step."""
        return False

    #: Whether a forward computes and keeps the statistics it logs. True unless the trainer integration says
    #: otherwise: it sets it for the steps whose statistics a log record will hold (the steps the trainer logs and,
    #: with a dict of losses, each loss's first step after a record), so that the other steps skip that cost.
    log_statistics: bool = True

    def get_config_dict(self) -> dict[str, Any]:
        """The loss's configuration as built (JSON data)."""
        return {}

    def resume_config(self, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint records and a resume compares (JSON data): ``config``, a configuration of this loss class
        as a checkpoint recorded it (perhaps by an older version), as this version reads it; None: this loss's own.
        A loss with options fills in the default of an option the checkpoint lacks (added later: its default keeps
        the old behaviour) and leaves out the options that change only how the loss is computed."""
        return self.get_config_dict() if config is None else dict(config)

    def reads_labels(self) -> bool:
        """Whether the loss reads the batch's labels (the guard's ``"same_label"`` rule): ``prepare_trainer`` then
        refuses, before step 1, a dataset without a column of integer class ids for it."""
        return False

    def carried_values(self) -> dict[str, Any] | None:
        """Values the trained model should carry in its configuration (:mod:`st_weince.calibration`), or None."""
        return None

    def mark_state_managed(self, by: str = "the caller's training loop") -> Any:
        """Declare that ``by`` handles :meth:`state_tensors` (the optimizer's parameter groups, checkpoints, the
        average across processes). Returns the loss."""
        self.state_managed_by = by
        return self

    state_managed_by: str | None = None
