"""A tiny trainer run for the checkpoint tests (tests/training/test_checkpoints.py), also run as a subprocess that the
test SIGKILLs at a chosen moment of a checkpoint save. The loss (``--loss``): RB-Sigmoid (its trained t and b_rel) or
the released WEINCE composite (its batch tail index, a moving average carried across steps).

    python tests/checkpoint_worker.py MODEL_DIR OUTPUT_DIR [--loss NAME] [--block WHERE --block-step N --ready FILE]

``--block`` makes the run signal (create ``--ready``) and then sleep at one moment of the save of
``checkpoint-N``, so that the parent kills it exactly there:

- ``model``: the model files are written, nothing else (inside ``Trainer.save_model``);
- ``state``: model, optimizer and RNG states are written, ``trainer_state.json`` is not yet (inside the trainer's
  collection of ``ExportableState`` callback states, which comes right before that file);
- ``on_save``: the checkpoint is complete, the ``on_save`` callbacks run (where the loss state used to be written).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: import this checkout

from st_weince.functional.options import RELEASED_COMPOSITE  # noqa: E402
from st_weince.losses import RBSigmoidLoss, WEINCELoss  # noqa: E402
from st_weince.training import prepare_trainer  # noqa: E402
from tests.conftest import SHORT_RUN  # noqa: E402
from tests.conftest import build_trainer as tiny_trainer  # noqa: E402

MAX_STEPS = 6
SAVE_STEPS = 2
# (loss, batch size). The composite: every batch fit trusted (R^2 >= 0), so that the moving average moves at this tiny
# batch; 6 pairs give 5 negatives per anchor, enough for the blend's tail fits too.
LOSSES = {
    "rb-sigmoid": (RBSigmoidLoss, 4),
    "weince-composite": (
        lambda model: WEINCELoss.released(model, top_m=RELEASED_COMPOSITE.top_m.replace(beta_min_r_squared=0.0)),
        6,
    ),
}


def build_trainer(model_dir, output_dir, callbacks=(), loss="rb-sigmoid", **overrides) -> SentenceTransformerTrainer:
    model = SentenceTransformer(str(model_dir), device="cpu")
    loss_class, batch_size = LOSSES[loss]
    settings = {**SHORT_RUN, "per_device_train_batch_size": batch_size, "max_steps": MAX_STEPS}
    settings.update(save_strategy="steps", save_steps=SAVE_STEPS)
    return tiny_trainer(model, loss_class(model), output_dir, callbacks=callbacks, **{**settings, **overrides})


def block_forever(ready: str) -> None:
    Path(ready).touch()
    while True:
        time.sleep(60)


class BlockInState(TrainerCallback, ExportableState):
    """Its ``state()`` is called by the trainer while it saves, after the optimizer, before trainer_state.json."""

    def __init__(self, step: int = -1, ready: str = "") -> None:
        self.step, self.ready, self.global_step = step, ready, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.global_step = state.global_step

    def state(self) -> dict:
        if self.global_step == self.step:
            block_forever(self.ready)
        return {"args": {}, "attributes": {}}


class BlockOnSave(TrainerCallback):
    def __init__(self, step: int, ready: str) -> None:
        self.step, self.ready = step, ready

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            block_forever(self.ready)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="rb-sigmoid")
    parser.add_argument("--block", choices=["none", "model", "state", "on_save"], default="none")
    parser.add_argument("--block-step", type=int, default=-1)
    parser.add_argument("--ready", default="")
    options = parser.parse_args()
    callbacks = []
    if options.block == "state":
        callbacks.append(BlockInState(options.block_step, options.ready))
    if options.block == "on_save":
        callbacks.append(BlockOnSave(options.block_step, options.ready))
    trainer = prepare_trainer(
        build_trainer(options.model_dir, options.output_dir, callbacks=callbacks, loss=options.loss)
    )
    if options.block == "model":
        save_model = trainer.save_model

        def save_model_then_block(output_dir=None, _internal_call=False):
            save_model(output_dir, _internal_call=_internal_call)
            if trainer.state.global_step == options.block_step:
                block_forever(options.ready)

        trainer.save_model = save_model_then_block
    Path(options.output_dir, "started").touch()
    trainer.train()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
