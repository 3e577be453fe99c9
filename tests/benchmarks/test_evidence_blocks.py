"""The generated tables of docs/evidence.md are the committed outputs: each ``<!-- NAME summary: start/end -->``
block equals ``benchmarks/results/NAME/summary.md`` (what ``benchmarks/NAME.py --summarize --docs
docs/evidence.md`` writes), so a page never shows a figure its committed run files do not give."""

from __future__ import annotations

import pytest

from benchmarks.lab.summaries import docs_blocks
from tests.conftest import REPO_ROOT

EVIDENCE = REPO_ROOT / "docs" / "evidence.md"


def test_evidence_has_the_studies_blocks():
    assert {"simclr_study", "simclr_grid", "simclr_negatives", "simclr_ablation"} <= set(docs_blocks(EVIDENCE))


@pytest.mark.parametrize("name", sorted(docs_blocks(EVIDENCE)))
def test_generated_block_equals_the_committed_summary(name):
    summary = REPO_ROOT / "benchmarks" / "results" / name / "summary.md"
    assert summary.is_file(), f"docs/evidence.md has a {name} block but {summary} is not committed"
    assert docs_blocks(EVIDENCE)[name] == summary.read_text(encoding="utf-8").rstrip("\n"), (
        f"the {name} block of docs/evidence.md is stale: run benchmarks/{name}.py --summarize --docs docs/evidence.md"
        " (a retired study's script: at commit 82267c0, docs/evidence.md)"
    )
