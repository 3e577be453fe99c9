"""Scores of sentence encoders, computed by sentence-transformers; only SentEval's aggregation is this project's.

- :mod:`st_weince.evaluation.sts`: STS tasks (SimCSE's 7-task table) through sentence-transformers'
  ``EmbeddingSimilarityEvaluator`` (cosine, Spearman), each distinct sentence encoded once, STS12-16 aggregated as
  SentEval does (``all`` / ``mean`` / ``wmean``). Used by ``eval/sts.py``, ``recipes/simcse.py`` and the benchmarks,
  so that a recipe's printed score is the one ``eval/sts.py`` gives on the saved model.

The data files are read by :mod:`st_weince.data`.
"""

from st_weince.evaluation.sts import (
    AGGREGATIONS,
    STSEvaluator,
    aggregate_spearman,
    evaluate_sts,
    evaluate_subsets,
    format_table,
    scores_from_details,
    sts_details,
)

__all__ = [
    "AGGREGATIONS",
    "STSEvaluator",
    "aggregate_spearman",
    "evaluate_sts",
    "evaluate_subsets",
    "format_table",
    "scores_from_details",
    "sts_details",
]
