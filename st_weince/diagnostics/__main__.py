"""Tail diagnostics of an encoder: is the hard-negative tail Weibull, how much endpoint do the winners want, and
which loss does that point to?

Text (a SentenceTransformer directory) on a file of sentence pairs, its columns named (CSV with a header row,
JSON lines, Parquet, or a ``save_to_disk`` folder); the negative pool is the pairs' distinct texts:

    python -m st_weince.diagnostics --model PATH --pairs pairs.csv --columns anchor positive --scale 20 --output-dir DIR

or on a file of sentences, one a line, for the negative pool (``--sentences``), with or without pairs. The last line
printed begins ``Verdict:`` (the rule: docs/diagnostics.md, "The verdict").

Images (an encoder saved by recipes/simclr.py) on an ImageFolder directory or zip, with the same options, from a clone
of the repository (the CIFAR encoders and augmentations are the recipe's, ``recipes/simclr_tools``):

    python recipes/simclr_diagnostics.py --encoder runs/simclr/... --images cifar10-jpg.zip --image-split test \
        --output-dir DIR

The steps (negative pool and its POT fits, choice data and link fits, verdict) and the outputs (``summary.json``
and PNG plots in ``--output-dir``): docs/diagnostics.md, "What is measured".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from st_weince.diagnostics.collect import (
    choice_data,
    encode_texts,
    hardest_negatives,
    negative_pool,
    read_pairs,
)
from st_weince.diagnostics.evt import pot_fit, pot_fit_rows, summarize_shapes, threshold_stability
from st_weince.diagnostics.inputs import sample_distinct, sample_distinct_lines
from st_weince.diagnostics.link import LinkFit, fit_link
from st_weince.diagnostics.plots import (
    plot_exceedance_density,
    plot_link_profile,
    plot_qq,
    plot_row_shapes,
    plot_shape_stability,
)
from st_weince.diagnostics.verdict import decide, same_label_share, weince_gate
from st_weince.utils.cli import check_model_path, quiet_known_warnings, user_errors_exit
from st_weince.utils.provenance import provenance

DEFAULT_STABILITY = (0.99, 0.995, 0.998, 0.999, 0.9995, 0.9998, 0.9999)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="st-weince-diagnostics",
        description="POT/GPD tail fits of negative scores and likelihood link selection (WEINCE diagnostics); the "
        "last line printed, 'Verdict: ...', says which loss they point to.",
    )
    src = p.add_argument_group("text encoder")
    src.add_argument("--model", help="SentenceTransformer directory (local; the hub is not used)")
    src.add_argument(
        "--pairs",
        help="sentence pairs, the positives of the link fit and of the verdict: a CSV file (with --columns: a header "
        "row; without: sentence1,sentence2[,score], no header), a JSON-lines or Parquet file, or a save_to_disk folder",
    )
    src.add_argument(
        "--columns", nargs=2, metavar=("ANCHOR", "POSITIVE"), help="the pair columns (default: the first two)"
    )
    src.add_argument("--label-column", help="a column of labels (e.g. the intent): the verdict's guard uses it")
    src.add_argument("--pairs-split", help="split of a DatasetDict folder (default: train)")
    src.add_argument("--min-pair-score", type=float, default=None, help="keep pairs with score >= this")
    src.add_argument("--score-column", default="score", help="the scores' column, for --min-pair-score")
    src.add_argument(
        "--sentences", help="text file, one sentence a line: the negative pool (default: the distinct texts of --pairs)"
    )
    dropout = src.add_mutually_exclusive_group()
    dropout.add_argument(
        "--dropout-views",
        action="store_true",
        help="also fit the link on dropout views (each sentence encoded twice in train mode); the default without "
        "--pairs, skipped with --pairs (the verdict reads the pairs; two more encodings of every sentence)",
    )
    dropout.add_argument("--skip-dropout", action="store_true", help=argparse.SUPPRESS)  # the default with --pairs
    src.add_argument("--max-seq-length", type=int, default=32, help="token limit (SimCSE trains with 32)")
    img = p.add_argument_group("image encoder")
    img.add_argument("--encoder", help="directory written by recipes/simclr.py (recipes/simclr_diagnostics.py)")
    img.add_argument("--images", help="ImageFolder directory or zip (<split>/<class>/<image>)")
    img.add_argument("--image-split", default="test")
    img.add_argument(
        "--features", choices=("projection", "backbone"), default="projection", help="what the loss saw: projection"
    )
    p.add_argument("--output-dir", required=True)
    p.add_argument("--name", default=None, help="label in plots and summary (default: the model directory name)")
    p.add_argument("--num-inputs", type=int, default=4000, help="sentences / images used (seeded subset)")
    p.add_argument("--batch-size", type=int, default=128, help="rows and candidates of a choice batch: your batch")
    p.add_argument(
        "--layout", choices=("pairs", "nt_xent"), default=None, help="default: pairs (text), nt_xent (images)"
    )
    p.add_argument("--threshold-quantile", type=float, default=0.999)
    p.add_argument("--stability-quantiles", type=float, nargs="+", default=list(DEFAULT_STABILITY))
    p.add_argument("--anchor-sample", type=int, default=300, help="anchors for the per-anchor POT fits (0: none)")
    p.add_argument("--anchor-threshold-quantile", type=float, default=0.95)
    scale = p.add_mutually_exclusive_group()
    scale.add_argument(
        "--scale", type=float, default=None, help="your training scale, 1 / temperature (default 20 text, 2 images)"
    )
    scale.add_argument("--temperature", type=float, default=None, help="your training temperature: --scale 1/T")
    p.add_argument("--profile-points", type=int, default=21)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encode-batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p


Views = dict[str, tuple[torch.Tensor, torch.Tensor, dict]]


@dataclass(frozen=True)
class Encoded:
    """What the fits need: the frozen embeddings of the negative pool, the two views of each source of positives,
    a description of the data for the summary, and the pairs' labels (None without ``--label-column``)."""

    frozen: torch.Tensor
    views: Views
    data: dict
    labels: list | None = None


def _text_views(args: argparse.Namespace) -> Encoded:
    from sentence_transformers import SentenceTransformer

    if not (args.sentences or args.pairs):
        raise ValueError("--model needs --pairs (a file of sentence pairs) or --sentences (one sentence a line)")
    if args.skip_dropout and not args.pairs:
        raise ValueError("--skip-dropout needs --pairs (the link fit needs one source of positives)")
    dropout_views = args.dropout_views or not args.pairs  # with pairs the verdict reads the pairs' choice data
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a local directory (the Hugging Face hub is not used)")
    check_model_path(args.model)  # a recipe's run folder: its model is in final/
    pairs = None
    if args.pairs:  # read (and checked) before the model loads: a wrong column name costs no encoding
        pairs = read_pairs(
            args.pairs, args.min_pair_score, args.num_inputs, args.seed, columns=args.columns,
            score_column=args.score_column, label_column=args.label_column, split=args.pairs_split,
        )  # fmt: skip
    if args.sentences:
        sentences = sample_distinct_lines(args.sentences, args.num_inputs, args.seed)  # a duplicate is no negative
    else:
        sentences = sample_distinct(pairs.texts(), args.num_inputs, args.seed, source=args.pairs)
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_seq_length
    bs = args.encode_batch_size
    # every distinct text once, in eval mode: the negative pool's sentences and both sides of the pairs
    needed = sentences + ([] if pairs is None else pairs.anchors + pairs.positives)
    distinct = list(dict.fromkeys(needed))
    print(f"encoding {len(distinct)} distinct texts (eval mode): the negative pool and the pairs", flush=True)
    embeddings = encode_texts(model, distinct, batch_size=bs, show_progress_bar=True)
    row_of = {text: row for row, text in enumerate(distinct)}

    def embedded(texts: list[str]) -> torch.Tensor:
        return embeddings[torch.tensor([row_of[text] for text in texts], dtype=torch.long)]

    frozen = embedded(sentences)
    views: Views = {}
    if dropout_views:
        torch.manual_seed(args.seed)
        print(f"encoding the {len(sentences)} sentences twice in train mode (dropout views)", flush=True)
        views["dropout"] = (
            encode_texts(model, sentences, batch_size=bs, train_mode=True, show_progress_bar=True),
            encode_texts(model, sentences, batch_size=bs, train_mode=True, show_progress_bar=True),
            {"kind": "the same sentence encoded twice in train mode (dropout), as unsupervised SimCSE"},
        )
    if pairs is not None:
        views["pairs"] = (
            embedded(pairs.anchors),
            embedded(pairs.positives),
            {
                "kind": "sentence pairs",
                "file": args.pairs,
                "columns": args.columns,
                "split": args.pairs_split,
                "label_column": args.label_column,
                "min_score": args.min_pair_score,
                "count": len(pairs),
            },
        )
    data = {
        "inputs": len(sentences),
        "input_file": args.sentences or args.pairs,
        "negative_pool": "sentence file" if args.sentences else "distinct texts of the pairs",
        "max_seq_length": args.max_seq_length,
    }
    return Encoded(frozen, views, data, None if pairs is None else pairs.labels)


def _command_line() -> str:
    program = Path(sys.argv[0]).name
    program = "python -m st_weince.diagnostics" if program == "__main__.py" else program
    return " ".join([program, *sys.argv[1:]])


BETA1_MEANING = "lambda of the link fitted with beta = 1, tau free"
TAU_FIXED_MEANING = "lambda at your temperature tau = 1/scale = {tau:g}, beta free"


def _link_summary(fit: LinkFit, meaning: str) -> dict:
    out = {"meaning": meaning, **fit.to_dict()}
    out["loglik_gain_per_anchor"] = (fit.loglik - fit.loglik_softmax) / fit.num_anchors
    return out


def _per_anchor_fits(
    frozen: torch.Tensor, args: argparse.Namespace, out_dir: Path, name: str, pooled_xi: float
) -> dict | None:
    """POT fits of sampled anchors' own tails (each against all other inputs); None when ``--anchor-sample 0``."""
    if args.anchor_sample <= 0:
        return None
    print(f"per-anchor POT fits ({args.anchor_sample} anchors against all other inputs)", flush=True)
    generator = torch.Generator().manual_seed(args.seed)
    anchors = torch.randperm(frozen.shape[0], generator=generator)[: args.anchor_sample]
    rows = (frozen[anchors] @ frozen.T).clamp(-1.0, 1.0)
    rows[torch.arange(len(anchors)), anchors] = float("nan")  # the anchor itself is no negative
    row_values = [r[~torch.isnan(r)].double().numpy() for r in rows]
    row_fits = pot_fit_rows(row_values, args.anchor_threshold_quantile)
    shapes = [f.xi for f in row_fits if f is not None]
    if not shapes:  # too few inputs for 30 exceedances per anchor: say so instead of failing after the other fits
        return {"skipped": "no anchor has 30 exceedances; use more inputs or a lower quantile"}
    plot_row_shapes(shapes, out_dir / "pot_per_anchor.png", title=name, pooled_xi=pooled_xi)
    return {"threshold_quantile": args.anchor_threshold_quantile, **summarize_shapes(row_fits)}


def _link_fits(
    views: Views, args: argparse.Namespace, layout: str, temperature: float, out_dir: Path, name: str
) -> tuple[dict, dict, dict[str, LinkFit]]:
    """The two link fits of each source of positives (summary entries), each source's choice data, and each source's
    fit with beta = 1 (the verdict's evidence)."""
    links, choices, beta1_fits = {}, {}, {}
    beta1_meaning, tau_meaning = BETA1_MEANING, TAU_FIXED_MEANING.format(tau=temperature)
    for source, (view_a, view_b, info) in views.items():
        print(f"link fits ({source} positives)", flush=True)
        scores, winners, mask = choices[source] = choice_data(view_a, view_b, batch_size=args.batch_size, layout=layout)
        common = {"temperature": temperature, "profile_points": args.profile_points}
        fit_beta1 = fit_link(scores, winners, mask, free=("lambda", "tau"), **common)  # beta: WEINCE's default
        fit_tau = fit_link(scores, winners, mask, free=("lambda", "beta"), **common)
        beta1_fits[source] = fit_beta1
        plot_link_profile(
            {"beta = 1, tau fitted": fit_beta1, f"tau = {temperature:g}, beta fitted": fit_tau},
            out_dir / f"link_profile_{source}.png",
            title=f"{name} ({source} positives)",
        )
        negatives = mask.clone()
        negatives[torch.arange(scores.shape[0]), winners] = False
        links[source] = {
            "positives": info,
            "rows": int(scores.shape[0]),
            "positive_score_mean": float(scores[torch.arange(scores.shape[0]), winners].mean()),
            "hardest_negative_score_mean": float(hardest_negatives(scores, winners, mask).mean()),
            "negative_score_mean": float(scores[negatives].mean()),
            "beta1_tau_fitted": _link_summary(fit_beta1, beta1_meaning),
            "tau_fixed_beta_fitted": _link_summary(fit_tau, tau_meaning),
        }
        print(
            f"  {source}: top-1 accuracy {fit_beta1.top1_accuracy:.3f}, separated {fit_beta1.separated}\n"
            f"    {beta1_meaning}: {fit_beta1.lam:.3f} [{fit_beta1.lam_ci[0]:.3f}, {fit_beta1.lam_ci[1]:.3f}] "
            f"(tau = {fit_beta1.tau:.4g}; LR vs softmax {fit_beta1.lr_statistic:.1f})\n"
            f"    {tau_meaning}: {fit_tau.lam:.3f} (beta = {fit_tau.beta:.3g}; LR vs softmax at that tau "
            f"{fit_tau.lr_statistic:.1f})",
            flush=True,
        )
    return links, choices, beta1_fits


def run(args: argparse.Namespace, image_views: Callable[[argparse.Namespace], Encoded] | None = None) -> dict:
    """Encode the inputs and ``analyse`` them: text with the model; images with ``image_views``, the SimCLR recipe's
    encoder reader (recipes/simclr_diagnostics.py passes it; the CIFAR encoders are the recipe's, not the wheel's)."""
    if bool(args.model) == bool(args.encoder):
        raise ValueError("pass exactly one of --model (text) and --encoder (images)")
    if args.encoder and image_views is None:
        raise ValueError(
            "--encoder: image encoders are the SimCLR recipe's; run python recipes/simclr_diagnostics.py with the "
            "same options (from a clone of the repository)"
        )
    for option in ("scale", "temperature"):
        if getattr(args, option) is not None and not getattr(args, option) > 0:
            raise ValueError(f"--{option} must be > 0, got {getattr(args, option)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    torch.manual_seed(args.seed)
    encoded = _text_views(args) if args.model else image_views(args)
    return analyse(encoded, args, started=started)


def analyse(encoded: Encoded, args: argparse.Namespace, *, started: float | None = None) -> dict:
    """The fits, plots, summary and verdict of embeddings already computed (``run`` encodes them from the model and
    inputs; a script may pass its own, e.g. synthetic embeddings): ``args`` are the command line's."""
    started = time.time() if started is None else started
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    is_text = bool(args.model)
    layout = args.layout or ("pairs" if is_text else "nt_xent")
    scale = args.scale or (1.0 / args.temperature if args.temperature else 20.0 if is_text else 2.0)
    temperature = args.temperature or 1.0 / scale
    name = args.name or Path(args.model or args.encoder).resolve().name
    frozen = encoded.frozen

    print(f"POT fits ({time.time() - started:.0f} s)", flush=True)
    pool = negative_pool(frozen)
    pot = pot_fit(pool, args.threshold_quantile)
    stability = threshold_stability(pool, args.stability_quantiles)
    plot_exceedance_density(pool, pot, out_dir / "pot_density.png", title=name)
    plot_qq(pool, pot, out_dir / "pot_qq.png", title=name)
    plot_shape_stability(stability, out_dir / "pot_stability.png", title=name)
    per_anchor = _per_anchor_fits(frozen, args, out_dir, name, pot.xi)
    links, choices, beta1_fits = _link_fits(encoded.views, args, layout, temperature, out_dir, name)

    source = "pairs" if "pairs" in choices else next(iter(choices))  # given pairs are the user's positives
    scores, winners, mask = choices[source]
    # choice_data's batches are square (B x B pairs, 2B x 2B nt_xent): one batch per scores.shape[1] rows
    gate = weince_gate(scores, winners, mask, rows_per_batch=scores.shape[1], scale=scale)
    labels = encoded.labels if source == "pairs" and layout == "pairs" else None
    verdict = decide(
        pot, gate, beta1_fits[source], links[source]["positive_score_mean"],
        links[source]["hardest_negative_score_mean"],
        label_column=args.label_column if labels else None,
        hardest_negative_same_label_share=same_label_share(scores, winners, mask, labels) if labels else None,
    )  # fmt: skip

    summary = {
        **provenance(),  # machine, versions, git commit; the command below is the diagnostics' own
        "name": name,
        "command": args.command or _command_line(),
        "model": args.model or args.encoder,
        "data": encoded.data,
        "seed": args.seed,
        "scale": {
            "inputs": int(frozen.shape[0]),
            "negative_pairs": int(pool.size),
            "batch_size": args.batch_size,
            "layout": layout,
            "temperature": temperature,
            "training_scale": scale,
        },
        "pot": pot.to_dict(),
        "pot_stability": [f.to_dict() for f in stability],
        "pot_per_anchor": per_anchor,
        "negative_pool_quantiles": {str(q): float(np.quantile(pool, q)) for q in (0.5, 0.9, 0.99, 0.999, 1.0)},
        "link": links,
        "weince_gate": {"positives": source, **asdict(gate)},
        "verdict": {"positives": source, **verdict.to_dict()},
        "paper": {"xi": -0.39, "lambda_range": [0.33, 0.50]},
        "seconds": round(time.time() - started, 1),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    print(
        f"xi = {pot.xi:.3f} [{pot.xi_ci[0]:.3f}, {pot.xi_ci[1]:.3f}] at u = {pot.threshold:.4f} "
        f"({pot.num_exceedances} exceedances); summary: {out_dir / 'summary.json'}\n"
        f"{gate.meaning}, {source} positives, scale {scale:g}: mean {gate.lam_mean:.3f}, share > 0.5 "
        f"{gate.lam_share_above_half:.3f}, effective scale of the blend {gate.effective_scale_mean:.1f}, hardest "
        f"negative's gradient WEINCE / InfoNCE: median {gate.gradient_ratio_median:.2f}",
        flush=True,
    )
    print(verdict.line(), flush=True)  # the last line
    return summary


def main(argv: Sequence[str] | None = None, image_views: Callable[[argparse.Namespace], Encoded] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = None if argv is None else " ".join(["st-weince-diagnostics", *argv])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet_known_warnings()
    with user_errors_exit(parser.prog):  # a missing file or model, a bad value: one line, exit status 2
        run(args, image_views)
    return 0


if __name__ == "__main__":
    sys.exit(main())
