"""Data collection for the diagnostics: negative pools, choice layouts, text encoding with and without dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from st_weince.diagnostics.collect import (
    choice_data,
    encode_texts,
    hardest_negatives,
    negative_pool,
    read_pairs,
)
from st_weince.diagnostics.inputs import sample_distinct_lines


def test_negative_pool_holds_every_distinct_pair_once() -> None:
    emb = torch.randn(37, 8, generator=torch.Generator().manual_seed(0))
    pool = negative_pool(emb, chunk=10)  # several chunks
    unit = F.normalize(emb, dim=-1)
    full = unit @ unit.T
    i, j = torch.triu_indices(37, 37, offset=1)
    assert pool.shape == (37 * 36 // 2,)
    assert sorted(pool.tolist()) == pytest.approx(sorted(full[i, j].double().tolist()), abs=1e-6)
    sub = negative_pool(emb, max_values=100, seed=1)
    assert sub.shape == (100,)
    # every sampled value is one of the pool's (to float precision: the two passes may round differently)
    assert float(abs(torch.as_tensor(sub)[:, None] - torch.as_tensor(pool)[None, :]).min(dim=1).values.max()) < 1e-6
    with pytest.raises(ValueError, match="N >= 2"):
        negative_pool(emb[:1])


def test_choice_data_pairs_layout() -> None:
    a, b = torch.randn(70, 5), torch.randn(70, 5)
    scores, winners, mask = choice_data(a, b, batch_size=32)  # 2 full batches, 6 inputs dropped
    assert scores.shape == (64, 32) and mask.all()
    assert torch.equal(winners, torch.arange(32).repeat(2))
    expected = F.normalize(a[32:64], dim=-1) @ F.normalize(b[32:64], dim=-1).T
    assert torch.allclose(scores[32:], expected, atol=1e-6)
    hardest = hardest_negatives(scores, winners, mask)
    off = expected.masked_fill(torch.eye(32, dtype=torch.bool), float("-inf"))
    assert torch.allclose(hardest[32:], off.max(1).values)


def test_choice_data_nt_xent_layout() -> None:
    a, b = torch.randn(16, 5), torch.randn(16, 5)
    scores, winners, mask = choice_data(a, b, batch_size=8, layout="nt_xent")
    assert scores.shape == (32, 16)
    assert not mask[torch.arange(16), torch.arange(16)].any()  # self-pairs of the first batch excluded
    assert torch.equal(winners[:16], torch.cat([torch.arange(8, 16), torch.arange(8)]))
    assert torch.allclose(scores[0, 8], F.cosine_similarity(a[0], b[0], dim=0), atol=1e-6)
    with pytest.raises(ValueError, match="layout"):
        choice_data(a, b, batch_size=8, layout="other")
    with pytest.raises(ValueError, match="do not fill one batch"):
        choice_data(a, b, batch_size=32)


def test_sample_distinct_lines_dedupes_and_samples(tmp_path) -> None:
    read_sentences = sample_distinct_lines  # the diagnostics' reader (the recipes read the first N lines instead)
    path = tmp_path / "s.txt"
    path.write_text("a b\n\nc d\na b\ne f\ng h\n", encoding="utf-8")
    assert read_sentences(path) == ["a b", "c d", "e f", "g h"]
    sample = read_sentences(path, limit=2, seed=3)
    assert len(sample) == 2 and sample == read_sentences(path, limit=2, seed=3)
    with pytest.raises(ValueError, match="not found"):
        read_sentences(tmp_path / "missing.txt")


def test_read_pairs_with_score_filter(shared_data) -> None:
    pairs = read_pairs(shared_data / "stsb" / "stsb-en-dev.csv", min_score=4.0)
    assert 100 < len(pairs) <= 264  # 264 dev pairs score >= 4 (fewer after deduplicating first sentences)
    assert len(set(pairs.anchors)) == len(pairs) == len(pairs.positives) and pairs.labels is None
    assert all(a != b for a, b in zip(pairs.anchors, pairs.positives))


def test_read_pairs_from_a_saved_dataset_dict(tmp_path) -> None:
    from datasets import Dataset, DatasetDict

    columns = {"q": ["a  b", "c", "c", "e", "g"], "p": ["x", "y", "z", "e", "h"], "score": [5, 4, 5, 5, 1]}
    table = Dataset.from_dict({**columns, "y": [0, 1, 1, 2, 3]})
    DatasetDict(dev=table).save_to_disk(str(tmp_path / "dd"))
    pairs = read_pairs(tmp_path / "dd", 4.0, columns=["q", "p"], label_column="y", split="dev")
    # whitespace normalised; "c" kept once (its first pair); "e" paired with itself and "g" below the score dropped
    assert (pairs.anchors, pairs.positives, pairs.labels) == (["a b", "c"], ["x", "y"], [0, 1])
    assert pairs.texts() == ["a b", "c", "x", "y"]
    with pytest.raises(ValueError, match="holds the splits dev, not 'train'; name one"):
        read_pairs(tmp_path / "dd", columns=["q", "p"])
    with pytest.raises(ValueError, match=r"no column 'rating' \(--score-column\); its columns: q, p, score, y"):
        read_pairs(tmp_path / "dd", 4.0, columns=["q", "p"], score_column="rating", split="dev")


def test_encode_texts_dropout_views_differ_and_mode_is_restored(tiny_model) -> None:
    sentences = ["the cat sat on the mat", "a dog runs in the park", "rain falls on the city"]
    tiny_model.eval()
    frozen = encode_texts(tiny_model, sentences, batch_size=2)
    reference = F.normalize(torch.as_tensor(tiny_model.encode(sentences)), dim=-1)
    assert torch.allclose(frozen, reference, atol=1e-5)
    torch.manual_seed(0)
    view_a = encode_texts(tiny_model, sentences, train_mode=True)
    view_b = encode_texts(tiny_model, sentences, train_mode=True)
    assert not torch.allclose(view_a, view_b)
    assert torch.allclose(view_a.norm(dim=1), torch.ones(3))
    assert not tiny_model.training
