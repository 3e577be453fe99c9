"""RB-Sigmoid's trained values in the trainer: the cap on ``t`` after every optimizer step, and ``t``, ``b_rel`` carried
by the model (in its configuration, :mod:`st_weince.calibration`) and shown in its model card.

The model card sentence-transformers writes shows the loss configuration it read when the trainer was built:
``get_config_dict()``, the loss as configured (``cls(model, **config)`` rebuilds it so). The trained values are added
next to it, as a second block, each time they are written to the model: before every checkpoint and at the end of
training (after the best checkpoint's loss state is restored with ``load_best_model_at_end``).
"""

from __future__ import annotations

import json
import logging
from textwrap import indent
from typing import Any

from torch import nn
from transformers import TrainerCallback

from st_weince.calibration import CONFIG_KEY, MatchProbability, carry_match_probability
from st_weince.training.statistics import statistics_sources

logger = logging.getLogger(__name__)

_CONFIGURED_CODE = "st_weince_configured_config_code"  # the card's loss block as sentence-transformers wrote it


def rb_sigmoid_losses(loss: nn.Module | dict[str, nn.Module]) -> list[nn.Module]:
    """The RB-Sigmoid losses (uncached or cached) in a loss tree, inside wrappers too, each once."""
    from st_weince.losses.rb_sigmoid import RBSigmoidLoss

    return [module for module in statistics_sources(loss) if isinstance(module, RBSigmoidLoss)]


def carried_values(loss: nn.Module, global_step: int) -> MatchProbability:
    return MatchProbability(**loss.trained_values(), loss=type(loss).__name__, global_step=int(global_step))


def carry_trained_values(model: nn.Module, loss: nn.Module | dict[str, nn.Module], global_step: int) -> bool:
    """Store the current values of the model's one RB-Sigmoid loss in the model's configuration; False (with a
    warning) when there is nothing to carry them in or several RB-Sigmoid losses whose values would disagree."""
    losses = rb_sigmoid_losses(loss)
    if len(losses) != 1:
        if losses:
            logger.warning(
                "%d RB-Sigmoid losses train separate t and b_rel; the model carries none of them", len(losses)
            )
        return False
    if not carry_match_probability(model, carried_values(losses[0], global_step)):
        logger.warning(
            "%s has no Hugging Face configuration to carry the trained t and b_rel in; they stay in the checkpoints' "
            "loss state only",
            type(model).__name__,
        )
        return False
    return True


def _dataset_losses(loss: nn.Module | dict[str, nn.Module], count: int) -> list[nn.Module]:
    if isinstance(loss, dict):
        return list(loss.values())[:count]
    return [loss] * count


def annotate_model_card(model: nn.Module, loss: nn.Module | dict[str, nn.Module], global_step: int) -> None:
    """Add the trained values of each dataset's RB-Sigmoid loss to its loss block in the model card data, after the
    configuration sentence-transformers wrote there (replacing the values written before)."""
    card = getattr(model, "model_card_data", None)
    if card is None:
        return
    for datasets in (card.train_datasets or [], card.eval_datasets or []):
        for info, dataset_loss in zip(datasets, _dataset_losses(loss, len(datasets))):
            block = info.get("loss") if isinstance(info, dict) else None
            losses = rb_sigmoid_losses(dataset_loss)
            if not isinstance(block, dict) or "config_code" not in block or len(losses) != 1:
                continue
            configured = block.setdefault(_CONFIGURED_CODE, block["config_code"])
            values = {key: value for key, value in losses[0].trained_values().items()}
            trained = json.dumps({**values, "global_step": int(global_step)}, indent=4)
            block["config_code"] = (
                f"{configured}\n  Trained values (the model carries them in its config.json, "
                f"{CONFIG_KEY!r}; st_weince.match_probability gives sigmoid(t * (cos - b_rel))):\n"
                + indent(f"```json\n{trained}\n```", "  ")
            )


class TrainedValuesCallback(TrainerCallback):
    """Clamps RB-Sigmoid's ``log_t`` at its ``max_scale`` cap after every optimizer step, and writes the trained
    ``t`` and ``b_rel`` into the model's configuration (:mod:`st_weince.calibration`) and its model card before every
    checkpoint and at the end of training. Added by :func:`st_weince.training.prepare_trainer`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        # after the step of the averaged gradients: the same clamp on every process, so they stay equal
        for loss in rb_sigmoid_losses(self.trainer.loss):
            loss.clamp_parameters_()

    def write(self, global_step: int) -> None:
        carry_trained_values(self.trainer.model, self.trainer.loss, global_step)
        annotate_model_card(self.trainer.model, self.trainer.loss, global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:  # the trainer saves the model next
            self.write(state.global_step)

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:
            self.write(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.write(state.global_step)
