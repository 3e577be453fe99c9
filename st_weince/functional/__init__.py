"""Pure tensor functions on score matrices: the math every loss adapter (text and vision) calls, and the options
objects they take. The names below are the public API (docs/algorithms.md, "The functional API"); everything else
stays importable from its module (``st_weince.functional.weince.weince_tail_fit``) and may change."""

from st_weince.functional.checks import check_scores
from st_weince.functional.false_negatives import FalseNegativeFilter, apply_false_negative_filter, input_keys
from st_weince.functional.layouts import mnrl_layout, normalize_rows, nt_xent_layout
from st_weince.functional.options import Gate, RBSigmoidOptions, TopM, WEINCEOptions
from st_weince.functional.sigmoid import constellation_margin, sigmoid_contrastive_loss
from st_weince.functional.weince import weince_cross_entropy, weince_logits, weince_statistics

__all__ = [
    "FalseNegativeFilter",
    "Gate",
    "RBSigmoidOptions",
    "TopM",
    "WEINCEOptions",
    "apply_false_negative_filter",
    "check_scores",
    "constellation_margin",
    "input_keys",
    "mnrl_layout",
    "normalize_rows",
    "nt_xent_layout",
    "sigmoid_contrastive_loss",
    "weince_cross_entropy",
    "weince_logits",
    "weince_statistics",
]
