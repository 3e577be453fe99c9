"""Offline evaluation of sentence embedding models: thin command lines over the package.

- :mod:`eval.sts`: the SimCSE 7-task STS table (STS12-16 with SentEval's "all" aggregation, STS-B and SICK-R test),
  cosine Spearman x100, from local files. From Python: :func:`st_weince.evaluation.evaluate_sts`.
- :mod:`eval.mteb_eval`: an MTEB subset on one or several models, offline where the task data is local, without
  MTEB's result cache (so two models can never share cached scores).
- :mod:`eval.compare`: several score files side by side, mean +- std over seeds.
"""
