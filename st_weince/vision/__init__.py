"""Vision adapter: SimCLR-style training of image encoders with the same loss classes as the text side.

Data (:mod:`.data`), batched tensor augmentations (:mod:`.augment`), CIFAR-stem ResNets and the projection head
(:mod:`.models`), the NT-Xent objectives over the shared loss classes (:mod:`.objectives`), the released and
batchnorm-head setups and the ablation arms (:mod:`.presets`), the training step and epoch (:mod:`.training`) and
frozen-feature evaluation (:mod:`.evaluation`). The recipe is ``recipes/simclr.py``; see docs/vision.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from st_weince.vision.augment import RELEASED_AUGMENT, SimCLRAugment, SimCLRAugmentConfig, eval_transform
    from st_weince.vision.data import ImageTensorDataset, balanced_subset, load_dataset, load_image_folder
    from st_weince.vision.evaluation import (
        KNN_KS,
        KNN_TEMPERATURE,
        PROBE_PROTOCOLS,
        RELEASED_PROTOCOL,
        STANDARDIZED_PROTOCOL,
        ProbeProtocol,
        evaluate_frozen_features,
        extract_features,
        knn_evaluate,
        knn_evaluate_splits,
        linear_probe,
        resolve_protocol,
        stratified_split,
    )
    from st_weince.vision.models import CifarResNet, ProjectionHead, SimCLRModel, load_encoder, save_encoder
    from st_weince.vision.objectives import LOSSES, SIMCLR_BETA, SIMCLR_SCALE, SimCLRObjective
    from st_weince.vision.presets import (
        ARMS,
        RELEASED_TOP_M_OPTIONS,
        SETUPS,
        Setup,
        arm_objective,
        build_objective,
        resolve_setup,
        setup_name,
    )
    from st_weince.vision.training import (
        SimCLRTraining,
        build_model,
        build_optimizer,
        build_run,
        data_order,
        to_memory_format,
    )

# Imported on first use (PEP 562), so that a process using one part (the models, the augmentations) does not pay for
# the others (the objectives import sentence-transformers, about 5 s): ``from st_weince.vision import X`` and
# ``st_weince.vision.<submodule>`` work as before.
_EXPORTS = {
    "ARMS": "presets",
    "CifarResNet": "models",
    "ImageTensorDataset": "data",
    "KNN_KS": "evaluation",
    "KNN_TEMPERATURE": "evaluation",
    "LOSSES": "objectives",
    "PROBE_PROTOCOLS": "evaluation",
    "ProbeProtocol": "evaluation",
    "ProjectionHead": "models",
    "RELEASED_AUGMENT": "augment",
    "RELEASED_PROTOCOL": "evaluation",
    "RELEASED_TOP_M_OPTIONS": "presets",
    "SETUPS": "presets",
    "STANDARDIZED_PROTOCOL": "evaluation",
    "SIMCLR_BETA": "objectives",
    "SIMCLR_SCALE": "objectives",
    "Setup": "presets",
    "SimCLRAugment": "augment",
    "SimCLRAugmentConfig": "augment",
    "SimCLRModel": "models",
    "SimCLRObjective": "objectives",
    "SimCLRTraining": "training",
    "arm_objective": "presets",
    "balanced_subset": "data",
    "build_model": "training",
    "build_objective": "presets",
    "build_optimizer": "training",
    "build_run": "training",
    "data_order": "training",
    "eval_transform": "augment",
    "evaluate_frozen_features": "evaluation",
    "extract_features": "evaluation",
    "knn_evaluate": "evaluation",
    "knn_evaluate_splits": "evaluation",
    "linear_probe": "evaluation",
    "resolve_protocol": "evaluation",
    "resolve_setup": "presets",
    "setup_name": "presets",
    "load_dataset": "data",
    "load_encoder": "models",
    "load_image_folder": "data",
    "save_encoder": "models",
    "stratified_split": "evaluation",
    "to_memory_format": "training",
}
_SUBMODULES = frozenset(_EXPORTS.values()) | {"presets", "training"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"st_weince.vision.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"st_weince.vision.{name}")
    evaluation = importlib.import_module("st_weince.vision.evaluation")
    if name in evaluation.RENAMED_CONSTANTS:  # an old name: not cached, so that every use warns
        return getattr(evaluation, name)
    raise AttributeError(f"module 'st_weince.vision' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "ARMS",
    "RELEASED_TOP_M_OPTIONS",
    "SETUPS",
    "Setup",
    "SimCLRTraining",
    "arm_objective",
    "build_model",
    "build_objective",
    "build_optimizer",
    "build_run",
    "data_order",
    "resolve_protocol",
    "resolve_setup",
    "setup_name",
    "to_memory_format",
    "KNN_KS",
    "KNN_TEMPERATURE",
    "LOSSES",
    "PROBE_PROTOCOLS",
    "RELEASED_AUGMENT",
    "RELEASED_PROTOCOL",
    "STANDARDIZED_PROTOCOL",
    "ProbeProtocol",
    "evaluate_frozen_features",
    "knn_evaluate_splits",
    "stratified_split",
    "SIMCLR_BETA",
    "SIMCLR_SCALE",
    "CifarResNet",
    "ImageTensorDataset",
    "ProjectionHead",
    "SimCLRAugment",
    "SimCLRAugmentConfig",
    "SimCLRModel",
    "SimCLRObjective",
    "balanced_subset",
    "eval_transform",
    "extract_features",
    "knn_evaluate",
    "linear_probe",
    "load_dataset",
    "load_encoder",
    "load_image_folder",
    "save_encoder",
]
