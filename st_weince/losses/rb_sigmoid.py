from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import combinations
from typing import Any, Literal

import torch
import torch.nn.functional as F
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.util import all_gather_with_grad, get_rank
from torch import Tensor, nn

from st_weince.functional.sigmoid import (
    chunked_sigmoid_contrastive_loss,
    constellation_margin_from_extremes,
    locked_adapter_scores,
    score_extremes,
    sigmoid_contrastive_loss,
    targets_from_positive_index,
)
from st_weince.losses._columns import check_embedding_columns
from st_weince.training.statistics import RunningMeans

Parametrization = Literal["relative", "absolute"]
ColumnMode = Literal["negatives", "modalities"]

# Defaults chosen by measurement (benchmarks/sigmoid_synthetic.py, parts "init" and "bias"): docs/rb-sigmoid.md.
DEFAULT_INVERSE_TEMPERATURE = 10.0
DEFAULT_RELATIVE_BIAS = 0.7
DEFAULT_ADAPTER_LOGIT = 0.0

RB_SIGMOID_CITATION = """
@inproceedings{bangachev2025global,
    title={Global Minimizers of Sigmoid Contrastive Loss},
    author={Bangachev, Kiril and Bresler, Guy and Noman, Iliyas and Polyanskiy, Yury},
    booktitle={Advances in Neural Information Processing Systems (NeurIPS)},
    year={2025},
}
@inproceedings{zhai2023sigmoid,
    title={Sigmoid Loss for Language Image Pre-Training},
    author={Zhai, Xiaohua and Mustafa, Basil and Kolesnikov, Alexander and Beyer, Lucas},
    booktitle={Proceedings of the IEEE/CVF International Conference on Computer Vision (ICCV)},
    year={2023},
}
"""


class RBSigmoidLoss(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        parametrization: Parametrization = "relative",
        inverse_temperature: float = DEFAULT_INVERSE_TEMPERATURE,
        relative_bias: float = DEFAULT_RELATIVE_BIAS,
        bias: float | None = None,
        trainable_temperature: bool = True,
        trainable_bias: bool = True,
        gather_across_devices: bool = False,
        symmetric: bool = False,
        columns: ColumnMode = "negatives",
        locked_adapter: bool = False,
        adapter_logit: float = DEFAULT_ADAPTER_LOGIT,
        chunk_size: int | None = None,
    ) -> None:
        """
        RB-Sigmoid: the sigmoid (SigLIP-style) contrastive loss with a trainable inverse temperature ``t`` and a
        trainable *relative* bias ``b_rel``. Every (anchor, candidate) pair is an independent binary decision
        "matching or not" with logit ``z = t (s - b_rel)`` on the cosine score ``s``; there is no softmax over the
        batch. The loss is the mean over anchors of the sum over candidates of ``-log sigmoid(+-z)``.

        Zero loss is reachable exactly on ``(m, b_rel)``-constellations: every matching pair scores at least
        ``b_rel + m`` and every non-matching pair at most ``b_rel - m``. Training ``b_rel`` directly (instead of
        SigLIP's absolute bias ``b = t b_rel``, which drifts ``b / t`` towards 0) reaches larger margins. The
        absolute parametrization is available as the plain SigLIP baseline.

        Args:
            model: SentenceTransformer model.
            parametrization: "relative" (``z = t (s - b_rel)``, default) or "absolute" (SigLIP's ``z = t s - b``).
            inverse_temperature: initial ``t`` (trained as ``log t``). Default 10 (SigLIP's start).
            relative_bias: initial ``b_rel`` (relative parametrization; in the absolute one the default start is
                ``b = t * relative_bias``). Default 0.7, measured: see ``docs/rb-sigmoid.md``.
            bias: initial absolute bias ``b`` (absolute parametrization only; overrides ``t * relative_bias``).
            trainable_temperature: train ``t``; if False it stays fixed.
            trainable_bias: train the bias (``b_rel`` or ``b``); if False it is a fixed hyperparameter (a fixed
                ``b_rel`` trades margin against bias).
            gather_across_devices: gather embeddings across processes: local anchors against global candidates. The
                loss parameters' gradients must then be averaged across processes:
                :func:`st_weince.training.prepare_trainer` does that (and the rest of the trainer integration).
            symmetric: also score the positives (column 2) as anchors against all anchors and average both
                directions. For the sigmoid loss the reverse block holds the same pairs as the anchor-positive
                block, so without hard-negative columns this changes nothing; with them it doubles the weight of
                the anchor-positive block relative to the hard negatives.
            columns: "negatives" (default, like MultipleNegativesRankingLoss: anchor, positive, negative_1, ...;
                candidates are all positives and negatives of the batch) or "modalities" (each column is one modality
                of the same items; the loss is the sum over all column pairs of the two-modality loss, sharing
                ``t`` and the bias).
            locked_adapter: for a locked (frozen) encoder on one side: replace ``s`` by
                ``delta^2 s - (1 - delta^2)`` with one trainable scalar ``delta = sigmoid(x)``, the implicit adapter
                ``(delta U, sqrt(1 - delta^2))``, ``(delta V, -sqrt(1 - delta^2))``.
            adapter_logit: initial ``x`` of the adapter (0 gives ``delta = 0.5``, as in the released experiments).
            chunk_size: compute the loss in blocks of this many candidates (each block recomputed during backward),
                so memory grows with batch x chunk instead of batch x candidates. None: one block.

        References:
            - Bangachev, Bresler, Noman, Polyanskiy: Global Minimizers of Sigmoid Contrastive Loss, NeurIPS 2025.
            - Zhai et al.: Sigmoid Loss for Language Image Pre-Training (SigLIP), ICCV 2023.
            - ``shared/docs/ALGORITHMS.md`` section 2 of this project; ``docs/rb-sigmoid.md``.

        Requirements:
            1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples; or, with
               ``columns="modalities"``, two or more columns that all describe the same item.

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+
            | (modality_1, ..., modality_k), columns=         | none   |
            | "modalities"                                    |        |
            +-------------------------------------------------+--------+

        Recommendations:
            - Call :func:`st_weince.training.prepare_trainer` on the trainer: it logs ``t``, ``b_rel``, ``b`` and
              the margin, saves and restores the loss parameters with every checkpoint, keeps weight decay off them
              and averages their gradients across processes.
            - The loss parameters train with the trainer's learning rate; at fine-tuning rates (e.g. 2e-5) ``t`` and
              ``b_rel`` hardly move, so give them their own, e.g.
              ``SentenceTransformerTrainingArguments(learning_rate_mapping={r"^(log_t|b_rel)$": 1e-2})``.
            - Use ``BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_weince.losses import RBSigmoidLoss
                from st_weince.training import prepare_trainer

                model = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                loss = RBSigmoidLoss(model)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                prepare_trainer(trainer)
                trainer.train()
        """
        super().__init__()
        self.model = model
        if parametrization not in ("relative", "absolute"):
            raise ValueError(f"parametrization must be 'relative' or 'absolute', got {parametrization!r}")
        if columns not in ("negatives", "modalities"):
            raise ValueError(f"columns must be 'negatives' or 'modalities', got {columns!r}")
        if not (math.isfinite(inverse_temperature) and inverse_temperature > 0):
            raise ValueError(f"inverse_temperature must be a finite number > 0, got {inverse_temperature!r}")
        if not math.isfinite(relative_bias):
            raise ValueError(f"relative_bias must be finite, got {relative_bias!r}")
        if bias is not None and parametrization != "absolute":
            raise ValueError("bias is the start of the absolute parametrization; use relative_bias with 'relative'")
        if bias is not None and not math.isfinite(bias):
            raise ValueError(f"bias must be finite, got {bias!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
        if not math.isfinite(adapter_logit):
            raise ValueError(f"adapter_logit must be finite, got {adapter_logit!r}")
        self.parametrization = parametrization
        self.gather_across_devices = gather_across_devices
        self.symmetric = symmetric
        self.columns = columns
        self.chunk_size = chunk_size
        self.locked_adapter = locked_adapter
        self.trainable_temperature = trainable_temperature
        self.trainable_bias = trainable_bias
        self.initial_values = {"inverse_temperature": float(inverse_temperature), "relative_bias": float(relative_bias)}

        log_t = torch.tensor(math.log(inverse_temperature), dtype=torch.float32)
        if trainable_temperature:
            self.log_t = nn.Parameter(log_t)
        else:
            self.register_buffer("log_t", log_t)
        if parametrization == "relative":
            self._register_scalar("b_rel", float(relative_bias), trainable_bias)
        else:
            start = float(bias) if bias is not None else float(inverse_temperature * relative_bias)
            self.initial_values["bias"] = start
            self._register_scalar("bias", start, trainable_bias)
        if locked_adapter:
            self.adapter_logit = nn.Parameter(torch.tensor(float(adapter_logit), dtype=torch.float32))
            self.initial_values["adapter_logit"] = float(adapter_logit)
        self.logged_statistics = RunningMeans()

    def _register_scalar(self, name: str, value: float, trainable: bool) -> None:
        tensor = torch.tensor(value, dtype=torch.float32)
        if trainable:
            setattr(self, name, nn.Parameter(tensor))
        else:
            self.register_buffer(name, tensor)

    # ----- the loss parameters -----
    @property
    def inverse_temperature(self) -> Tensor:
        """``t = exp(log_t)`` (a tensor in the autograd graph)."""
        return self.log_t.exp()

    @property
    def relative_bias(self) -> Tensor:
        """``b_rel`` (relative) or ``b / t`` (absolute)."""
        if self.parametrization == "relative":
            return self.b_rel
        return self.bias / self.inverse_temperature

    @property
    def absolute_bias(self) -> Tensor:
        """``b = t b_rel`` (relative) or ``b`` (absolute)."""
        if self.parametrization == "absolute":
            return self.bias
        return self.inverse_temperature * self.b_rel

    @property
    def delta(self) -> Tensor | None:
        """The locked-encoder adapter's ``delta = sigmoid(x)``, or None without the adapter."""
        return torch.sigmoid(self.adapter_logit) if self.locked_adapter else None

    def no_weight_decay_parameter_names(self) -> list[str]:
        """Names of this loss's own parameters (relative to the loss), none of which should get weight decay."""
        return [name for name, _ in self.named_parameters() if not name.startswith("model.")]

    def _bias_kwargs(self) -> dict[str, Tensor]:
        if self.parametrization == "relative":
            return {"relative_bias": self.b_rel}
        return {"bias": self.bias}

    def _transform(self, scores: Tensor) -> Tensor:
        return locked_adapter_scores(scores, torch.sigmoid(self.adapter_logit)) if self.locked_adapter else scores

    # ----- entry points -----
    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Sigmoid loss of one score matrix: ``scores`` [A, C] cosine, ``positive_index`` [A] the positive column of
        each row (-1: none), ``valid_mask`` [A, C] bool (False = excluded, e.g. the self-pairs of the SimCLR layout
        of :func:`st_weince.functional.nt_xent_layout`). Targets are 1 at the positive, 0 at the other valid entries.
        Used by the vision adapter; with the locked adapter enabled it is applied to ``scores`` first."""
        if scores.dim() != 2:
            raise ValueError(f"scores must be a 2-D [anchors, candidates] matrix, got shape {tuple(scores.shape)}")
        targets = targets_from_positive_index(positive_index, scores.shape[1])
        scores = self._transform(scores)
        loss = sigmoid_contrastive_loss(
            scores, targets, inverse_temperature=self.inverse_temperature, valid_mask=valid_mask, **self._bias_kwargs()
        )
        margin = None
        valid = torch.ones_like(targets, dtype=torch.bool) if valid_mask is None else valid_mask
        if (valid & (targets == 1)).any() and (valid & (targets == 0)).any():
            margin = constellation_margin_from_extremes(*score_extremes(scores, targets, valid_mask))[0]
        self._record(margin)
        return loss

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """The loss on already computed column embeddings (``[anchor, positive, *negatives]`` or modalities)."""
        check_embedding_columns(embeddings, type(self).__name__)
        columns = [F.normalize(embedding.float(), dim=-1) for embedding in embeddings]
        batch_size = columns[0].shape[0]
        offset = 0
        gathered = columns
        if self.gather_across_devices:
            gathered = [all_gather_with_grad(column) for column in columns]
            offset = get_rank() * batch_size
        positive_index = torch.arange(offset, offset + batch_size, device=columns[0].device)

        # The logged margin is that of the first block: anchors (column 0) against their candidates.
        if self.columns == "negatives":
            loss, margin = self._directional_loss(columns[0], torch.cat(gathered[1:], dim=0), positive_index)
            if self.symmetric:
                loss = (loss + self._directional_loss(columns[1], gathered[0], positive_index)[0]) / 2
        else:
            losses, margin = [], None
            for i, j in combinations(range(len(columns)), 2):
                pair_loss, pair_margin = self._directional_loss(columns[i], gathered[j], positive_index)
                margin = pair_margin if margin is None else margin
                if self.symmetric:
                    pair_loss = (pair_loss + self._directional_loss(columns[j], gathered[i], positive_index)[0]) / 2
                losses.append(pair_loss)
            loss = torch.stack(losses).sum()
        self._record(margin)
        return loss

    def _directional_loss(
        self, anchors: Tensor, candidates: Tensor, positive_index: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """Loss of one anchor set against its candidates, and the block's margin (None without negatives)."""
        loss, min_positive, max_negative = chunked_sigmoid_contrastive_loss(
            anchors,
            candidates,
            positive_index,
            inverse_temperature=self.inverse_temperature,
            score_transform=self._transform if self.locked_adapter else None,
            chunk_size=self.chunk_size,
            return_extremes=True,
            **self._bias_kwargs(),
        )
        if not (torch.isfinite(min_positive) and torch.isfinite(max_negative)):
            return loss, None
        return loss, constellation_margin_from_extremes(min_positive, max_negative)[0]

    # ----- statistics -----
    @torch.no_grad()
    def _record(self, margin: Tensor | None) -> None:
        values: dict[str, Any] = {
            "rb_sigmoid_t": self.inverse_temperature,
            "rb_sigmoid_b_rel": self.relative_bias,
            "rb_sigmoid_b": self.absolute_bias,
        }
        if margin is not None:
            values["rb_sigmoid_margin"] = margin
        if self.locked_adapter:
            values["rb_sigmoid_delta"] = self.delta
        self.logged_statistics.add(values)

    def pop_logged_statistics(self) -> dict[str, float]:
        """Means since the last call of ``t``, ``b_rel``, ``b`` and the batch margin (and ``delta`` with the
        adapter); used by :func:`st_weince.training.log_loss_statistics`. The margin is that of the (local) batch:
        ``(min matching score - max non-matching score) / 2`` of the anchor-vs-candidates block."""
        return self.logged_statistics.pop()

    def get_config_dict(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "parametrization": self.parametrization,
            "inverse_temperature": float(self.inverse_temperature.detach()),
            "relative_bias": float(self.relative_bias.detach()),
            "bias": float(self.absolute_bias.detach()),
            "trainable_temperature": self.trainable_temperature,
            "trainable_bias": self.trainable_bias,
            "gather_across_devices": self.gather_across_devices,
            "symmetric": self.symmetric,
            "columns": self.columns,
            "locked_adapter": self.locked_adapter,
            "chunk_size": self.chunk_size,
        }
        if self.locked_adapter:
            config["delta"] = float(self.delta.detach())
        return config

    @property
    def citation(self) -> str:
        return RB_SIGMOID_CITATION
