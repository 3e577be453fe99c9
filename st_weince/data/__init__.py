"""Readers for the text files the recipes, the evaluation and the diagnostics share.

- :mod:`st_weince.data.sentences`: one sentence a line (training files, diagnostics inputs).
- :mod:`st_weince.data.tables`: tables of texts (e.g. sentence pairs) in the formats ``datasets`` reads, by its
  loaders: CSV, JSON lines, Parquet, ``save_to_disk`` folders.
- :mod:`st_weince.data.sts`: STS data as SentEval and the SimCSE authors ship it (STS12-16, STS-B, SICK-R): the
  folder layout, one reader per file format, and the download of SentEval's archive.

Scores are computed elsewhere (:mod:`st_weince.evaluation`); nothing here encodes text.
"""
