"""Pure tensor functions on score matrices: the math every loss adapter (text and vision) calls."""

from st_weince.functional.layouts import nt_xent_layout
from st_weince.functional.sigmoid import (
    chunked_sigmoid_contrastive_loss,
    constellation_margin,
    constellation_margin_from_extremes,
    locked_adapter_scores,
    score_extremes,
    sigmoid_contrastive_loss,
    sigmoid_logits,
    targets_from_positive_index,
)
from st_weince.functional.weince import (
    DEFAULT_OPTIONS,
    TailFit,
    WeinceStatistics,
    batch_pivot,
    blend_weights,
    tail_index,
    tail_sizes,
    weince_cross_entropy,
    weince_logits,
    weince_statistics,
    weince_tail_fit,
)

__all__ = [
    "chunked_sigmoid_contrastive_loss",
    "constellation_margin",
    "constellation_margin_from_extremes",
    "locked_adapter_scores",
    "score_extremes",
    "sigmoid_contrastive_loss",
    "sigmoid_logits",
    "targets_from_positive_index",
    "DEFAULT_OPTIONS",
    "TailFit",
    "WeinceStatistics",
    "batch_pivot",
    "blend_weights",
    "nt_xent_layout",
    "tail_index",
    "tail_sizes",
    "weince_cross_entropy",
    "weince_logits",
    "weince_statistics",
    "weince_tail_fit",
]
