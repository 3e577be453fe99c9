"""Vision adapter: SimCLR-style training of image encoders with the same loss classes as the text side.

Data (:mod:`.data`), batched tensor augmentations (:mod:`.augment`), CIFAR-stem ResNets and the projection head
(:mod:`.models`), the NT-Xent objectives over the shared loss classes (:mod:`.objectives`), the released and
batchnorm-head setups and the ablation arms (:mod:`.presets`), the training step and epoch (:mod:`.training`) and
frozen-feature evaluation (:mod:`.evaluation`). The recipe is ``recipes/simclr.py``; see docs/vision.md.
"""

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
    "resolve_protocol",
    "resolve_setup",
    "setup_name",
    "data_order",
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


def __getattr__(name: str):
    """The old name ``PREVIOUS_PROTOCOL`` (now ``STANDARDIZED_PROTOCOL``), with a ``DeprecationWarning``."""
    from st_weince.vision import evaluation

    if name in evaluation._RENAMED_CONSTANTS:
        return getattr(evaluation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
