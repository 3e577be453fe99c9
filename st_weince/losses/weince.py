from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.util import all_gather_with_grad, cos_sim, get_rank
from torch import Tensor, nn

from st_weince.functional.weince import (
    WeinceMode,
    WeinceStatistics,
    check_temperature,
    weince_logits,
    weince_statistics,
)
from st_weince.losses._columns import check_embedding_columns
from st_weince.training.statistics import RunningMeans
from st_weince.utils.distributed import gather_rows_no_grad

Direction = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
_QUERY_ANCHORED = ("query_to_doc", "query_to_query")
_DOC_ANCHORED = ("doc_to_query", "doc_to_doc")

WEINCE_CITATION = """
@inproceedings{erol2026weince,
    title={When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE},
    author={Erol and others},
    booktitle={Proceedings of the 43rd International Conference on Machine Learning (ICML)},
    year={2026},
    eprint={2606.00262},
    archivePrefix={arXiv},
}
"""


class WEINCELoss(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        gather_across_devices: bool = False,
        directions: tuple[Direction, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        *,
        beta: float | str = "auto",
        mode: WeinceMode = "both",
        q: float = 0.2,
        kappa_rho: float = 10.0,
        kappa_aic: float = 1.0,
        aic_margin: float = 2.0,
        tail_frac: float = 0.10,
        min_tail_points: int = 32,
        eps: float = 1e-6,
    ) -> None:
        """
        WEINCE (Weibull-enhanced InfoNCE): a drop-in replacement for
        :class:`~sentence_transformers.sentence_transformer.losses.MultipleNegativesRankingLoss`.

        InfoNCE's softmax is a top-1 choice model with Gumbel noise, whose tail is unbounded, while cosine scores
        stop at 1. For every anchor, WEINCE fits the tail of its hardest negatives and blends the usual logit
        ``s / tau`` with a shortfall logit ``-beta log(1 - s)`` (a Weibull-domain tail with endpoint 1), weighted by
        ``lambda(a)``, which is large for anchors whose hardest negative lies closer to the cap than the batch pivot
        ``rho0`` and whose tail fits the Weibull line better than the Gumbel one. The statistics are computed without
        gradient; the loss has no trainable parameters. With ``lambda = 0`` it is exactly MNRL.

        Args:
            model: SentenceTransformer model.
            scale: inverse temperature, ``scale = 1 / temperature`` (as in MNRL; 20 = temperature 0.05).
            gather_across_devices: gather embeddings across processes (local anchors x global candidates); the pivot
                ``rho0`` is then taken over the anchors of the global batch, so results do not depend on the split.
            directions: as in MNRL: "query_to_doc" (required), "query_to_query", "doc_to_query", "doc_to_doc".
                Rows anchored at queries (query_to_doc, query_to_query) share one set of statistics per query;
                rows anchored at documents (doc_to_query, doc_to_doc) get their own.
            partition_mode: "joint" (one softmax over all directions) or "per_direction" (one per direction,
                averaged), as in MNRL.
            beta: tail index in the shortfall logit. "auto" (the text default) uses each anchor's estimate,
                clamped to [0.5, 16]; the reference implementation's 1.0 was tuned at temperature 0.5 and is
                10-20x too soft at SimCSE's 0.05 (see the README's measurements).
            mode: "both" (hardness x geometry gate, default), "rho" (hardness only) or "aic" (geometry only).
            q: quantile of the hardest-negative shortfalls that defines the batch pivot ``rho0``.
            kappa_rho: slope of the hardness gate.
            kappa_aic: slope of the geometry (AIC) gate.
            aic_margin: AIC difference at which the geometry gate is one half.
            tail_frac: share of an anchor's negatives used for the tail fit.
            min_tail_points: minimum tail size.
            eps: floor of the shortfall ``1 - s``.

        References:
            - Erol et al., When Softmax Fails at the Top: Extreme-Value Corrections for InfoNCE, ICML 2026,
              arXiv 2606.00262.
            - ``shared/docs/ALGORITHMS.md`` section 1 of this project for the exact statistics.

        Requirements:
            1. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples.
            2. Batches with many in-batch negatives: anchors with fewer than 4 negatives fall back to InfoNCE.

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

        Recommendations:
            - Use ``BatchSamplers.NO_DUPLICATES`` so no in-batch negative duplicates an anchor's positive.
            - Call :func:`st_weince.training.log_loss_statistics` on the trainer to log the mean lambda, the share
              of anchors with lambda > 0.5, rho0 and the mean dAIC.

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                from st_weince.losses import WEINCELoss
                from st_weince.training import log_loss_statistics

                model = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["It's nice weather outside today.", "He drove to work."],
                    "positive": ["It's so sunny.", "He took the car to the office."],
                })
                loss = WEINCELoss(model)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                log_loss_statistics(trainer)
                trainer.train()
        """
        super().__init__()
        self.model = model
        if not scale > 0:
            raise ValueError(f"scale must be > 0 (scale = 1 / temperature), got {scale}")
        self.scale = float(scale)
        check_temperature(1.0 / self.scale)
        valid_directions = set(_QUERY_ANCHORED + _DOC_ANCHORED)
        if not directions:
            raise ValueError("At least one direction must be specified.")
        if not set(directions) <= valid_directions:
            raise ValueError(f"Invalid directions: {set(directions) - valid_directions}. Valid: {valid_directions}")
        if "query_to_doc" not in directions:
            raise ValueError("'query_to_doc' direction is required (contains the positive pair).")
        if partition_mode not in ("joint", "per_direction"):
            raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
        if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
            raise ValueError(
                "partition_mode='per_direction' requires every direction to contain the positive pair; "
                "'query_to_query' and 'doc_to_doc' do not. Use partition_mode='joint'."
            )
        self.directions = tuple(directions)
        self.partition_mode = partition_mode
        self.gather_across_devices = gather_across_devices
        self.beta = beta
        if beta != "auto" and (isinstance(beta, str) or not float(beta) > 0):
            raise ValueError(f"beta must be a positive number or 'auto', got {beta!r}")
        self.mode = mode
        self.options = {
            "q": q,
            "kappa_rho": kappa_rho,
            "kappa_aic": kappa_aic,
            "aic_margin": aic_margin,
            "tail_frac": tail_frac,
            "min_tail_points": min_tail_points,
            "eps": eps,
        }
        if mode not in ("both", "rho", "aic"):
            raise ValueError(f"mode must be 'both', 'rho' or 'aic', got {mode!r}")
        self.logged_statistics = RunningMeans()
        self.last_statistics: WeinceStatistics | None = None

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        embeddings = embed_columns(self.model, sentence_features)
        return self.compute_loss_from_embeddings(embeddings, labels)

    def statistics(
        self, scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None = None
    ) -> WeinceStatistics:
        """Statistics of rows held by this process; the pivot rho0 is taken over all processes' rows."""
        return weince_statistics(
            scores,
            positive_index,
            valid_mask,
            mode=self.mode,
            beta=self.beta,
            gather=gather_rows_no_grad if self.gather_across_devices else None,
            **self.options,
        )

    def logits_from_scores(
        self, scores: Tensor, positive_index: Tensor | None, valid_mask: Tensor | None = None
    ) -> tuple[Tensor, WeinceStatistics]:
        """Blended logits of one group of rows (one anchor set with its candidates) and their statistics."""
        stats = self.statistics(scores, positive_index, valid_mask)
        logits = weince_logits(
            scores, stats.lam, stats.beta, valid_mask, temperature=self.temperature, eps=self.options["eps"]
        )
        return logits, stats

    def loss_from_scores(self, scores: Tensor, positive_index: Tensor, valid_mask: Tensor | None = None) -> Tensor:
        """Cross-entropy over one score matrix, e.g. the SimCLR 2N x 2N layout of
        :func:`st_weince.functional.nt_xent_layout`. Used by the vision adapter."""
        logits, stats = self.logits_from_scores(scores, positive_index, valid_mask)
        self._record(stats)
        return nn.functional.cross_entropy(logits, positive_index)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        check_embedding_columns(embeddings, type(self).__name__)
        queries, docs = embeddings[0], list(embeddings[1:])
        batch_size = queries.size(0)
        offset = 0
        if self.gather_across_devices:
            queries = all_gather_with_grad(queries)
            docs = [all_gather_with_grad(doc) for doc in docs]
            offset = get_rank() * batch_size
        world_batch_size = queries.size(0)
        device = queries.device
        docs_all = torch.cat(docs, dim=0)
        local_indices = torch.arange(offset, offset + batch_size, device=device)
        row_indices = torch.arange(batch_size, device=device)
        local_queries = queries[local_indices]
        local_docs = docs[0][local_indices]

        # One score block per direction, its invalid entries marked in a mask (not -inf in the scores, so the
        # tail statistics see only real candidates).
        blocks: dict[str, tuple[Tensor, Tensor | None]] = {"query_to_doc": (cos_sim(local_queries, docs_all), None)}
        if "query_to_query" in self.directions:
            mask = torch.ones(batch_size, world_batch_size, dtype=torch.bool, device=device)
            mask[row_indices, local_indices] = False
            blocks["query_to_query"] = (cos_sim(local_queries, queries), mask)
        if "doc_to_query" in self.directions:
            blocks["doc_to_query"] = (cos_sim(local_docs, queries), None)
        if "doc_to_doc" in self.directions:
            same_query = torch.eye(world_batch_size, dtype=torch.bool, device=device)[local_indices]
            blocks["doc_to_doc"] = (cos_sim(local_docs, docs_all), ~same_query.repeat(1, len(docs)))

        if self.partition_mode == "joint":
            groups = [[d for d in _QUERY_ANCHORED if d in blocks], [d for d in _DOC_ANCHORED if d in blocks]]
        else:
            groups = [[d] for d in blocks]
        logits: dict[str, Tensor] = {}
        for group in filter(None, groups):
            # A group is one anchor set: its blocks side by side form each anchor's full candidate row.
            scores = torch.cat([blocks[d][0] for d in group], dim=1) if len(group) > 1 else blocks[group[0]][0]
            valid_mask = None  # all valid: no mask tensor, no masked copies
            if any(blocks[d][1] is not None for d in group):
                valid_mask = torch.cat(
                    [
                        blocks[d][1] if blocks[d][1] is not None else torch.ones_like(blocks[d][0], dtype=torch.bool)
                        for d in group
                    ],
                    dim=1,
                )
            has_positive = group[0] in ("query_to_doc", "doc_to_query")
            positive_index = local_indices if has_positive else torch.full_like(local_indices, -1)
            group_logits, stats = self.logits_from_scores(scores, positive_index, valid_mask)
            if group[0] == "query_to_doc":
                self._record(stats)
            widths = [blocks[d][0].shape[1] for d in group]
            logits.update(zip(group, group_logits.split(widths, dim=1)))

        if self.partition_mode == "joint":
            positive_logits = logits["query_to_doc"][row_indices, local_indices]
            joint = torch.cat([logits[d] for d in blocks], dim=1) if len(blocks) > 1 else logits["query_to_doc"]
            log_z = torch.logsumexp(joint, dim=1)
            return -(positive_logits - log_z).mean()
        per_direction = [
            -(logits[d][row_indices, local_indices] - torch.logsumexp(logits[d], dim=1)).mean() for d in blocks
        ]
        return torch.stack(per_direction).mean()

    def _record(self, stats: WeinceStatistics) -> None:
        self.last_statistics = stats
        self.logged_statistics.add(
            {
                "weince_lambda_mean": stats.lam.mean(),
                "weince_lambda_gt_half": (stats.lam > 0.5).float().mean(),
                "weince_rho0": stats.rho0,
                "weince_delta_aic_mean": stats.delta_aic[stats.fitted].mean() if stats.fitted.any() else 0.0,
                "weince_beta_mean": stats.beta.mean(),
            }
        )

    def pop_logged_statistics(self) -> dict[str, float]:
        """Means of the statistics since the last call (used by :func:`st_weince.training.log_loss_statistics`)."""
        return self.logged_statistics.pop()

    def get_config_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "gather_across_devices": self.gather_across_devices,
            "directions": list(self.directions),
            "partition_mode": self.partition_mode,
            "beta": self.beta,
            "mode": self.mode,
            **self.options,
        }

    @property
    def citation(self) -> str:
        return WEINCE_CITATION
