"""Offline evaluation of sentence embedding models: command lines, run as ``python eval/NAME.py``.

- :mod:`eval.sts`: the SimCSE 7-task STS table (STS12-16 with SentEval's "all" aggregation, STS-B and SICK-R test),
  cosine Spearman x100, from local files; the readers and the scores are in ``eval/sts_tasks.py`` (``evaluate_sts``).
- :mod:`eval.mteb_eval`: an MTEB subset on one or several models, offline where the task data is local, without
  MTEB's result cache (so two models can never share cached scores).
- :mod:`eval.compare`: several score files side by side, mean +- std over seeds.
"""
