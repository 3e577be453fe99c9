"""Print the Markdown tables of docs/diagnostics.md from the committed summaries (summary.json of every model).

Usage: python benchmarks/results/diagnostics/table.py   (from the repository root)
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _ci(pair: list[float]) -> str:
    return f"[{pair[0]:.3f}, {pair[1]:.3f}]"


def main() -> None:
    summaries = [json.loads(p.read_text()) for p in sorted(ROOT.glob("*/summary.json"))]
    print("POT / GPD fits of the pooled negative scores (all pairs of the inputs), paper: xi about -0.39\n")
    print("| model | inputs | pairs | threshold u (quantile) | exceedances | xi [95% CI] | p(xi = 0) | endpoint |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summaries:
        pot = s["pot"]
        endpoint = f"{pot['endpoint']:.3f}" if pot["endpoint"] is not None else "none (xi >= 0)"
        print(
            f"| {s['name']} | {s['scale']['inputs']} | {s['scale']['negative_pairs']} | "
            f"{pot['threshold']:.4f} ({pot['threshold_quantile']}) | {pot['num_exceedances']} | "
            f"{pot['xi']:.3f} {_ci(pot['xi_ci'])} | {pot['p_value_xi0']:.2g} | {endpoint} |"
        )
    print("\nShape vs threshold quantile (xi [95% CI], pooled negatives)\n")
    quantiles = sorted({f["threshold_quantile"] for s in summaries for f in s["pot_stability"]})
    print("| model | " + " | ".join(str(q) for q in quantiles) + " |")
    print("| --- |" + " --- |" * len(quantiles))
    for s in summaries:
        by_q = {f["threshold_quantile"]: f for f in s["pot_stability"]}
        cells = [f"{by_q[q]['xi']:.3f} {_ci(by_q[q]['xi_ci'])}" if q in by_q else "-" for q in quantiles]
        print(f"| {s['name']} | " + " | ".join(cells) + " |")
    print("\nPer-anchor tails (each sampled anchor against all other inputs, one GPD fit per anchor)\n")
    print("| model | anchors | exceedances/anchor | xi median [IQR] | share xi < 0 | CI below 0 | CI above 0 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in summaries:
        a = s.get("pot_per_anchor")
        if not a or "rows_fitted" not in a:
            continue
        q = a["xi_quantiles"]
        print(
            f"| {s['name']} | {a['rows_fitted']} | {a['exceedances_per_row_median']:.0f} | "
            f"{q['0.5']:.3f} [{q['0.25']:.3f}, {q['0.75']:.3f}] | {a['share_xi_negative']:.2f} | "
            f"{a['share_ci_below_zero']:.2f} | {a['share_ci_above_zero']:.2f} |"
        )
    print("\nLink selection (winner = the positive; paper: lambda about 0.33-0.50)\n")
    print(
        "| model | positives | rows x candidates | top-1 acc | beta = 1: lambda [95% CI] | tau | LR vs softmax (p) "
        "| tau fixed: lambda, beta | LR (p) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summaries:
        for source, link in s["link"].items():
            b1, tf = link["beta1_tau_fitted"], link["tau_fixed_beta_fitted"]
            flag = " (separated)" if b1["separated"] else ""
            print(
                f"| {s['name']} | {source} | {b1['num_anchors']} x {b1['mean_candidates']:.0f} | "
                f"{b1['top1_accuracy']:.4f}{flag} | {b1['lam']:.3f} {_ci(b1['lam_ci'])} | {b1['tau']:.4g} | "
                f"{b1['lr_statistic']:.2f} ({b1['p_value']:.2g}) | {tf['lam']:.3f}, {tf['beta']:.3g} | "
                f"{tf['lr_statistic']:.2f} ({tf['p_value']:.2g}) |"
            )

    groups: dict[str, list[dict]] = {}
    for s in summaries:
        groups.setdefault(re.sub(r"-seed\d+$", "", s["name"]), []).append(s)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if groups:
        print("\nOver seeds (mean +- sd over the seeds' point estimates)\n")
        print("| models | seeds | pooled xi (q = 0.999) | per-anchor median xi | beta = 1: lambda | LR vs softmax |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, members in groups.items():
            pooled = [m["pot"]["xi"] for m in members]
            anchor = [m["pot_per_anchor"]["xi_quantiles"]["0.5"] for m in members]
            source = next(iter(members[0]["link"]))
            lam = [m["link"][source]["beta1_tau_fitted"]["lam"] for m in members]
            lr = [m["link"][source]["beta1_tau_fitted"]["lr_statistic"] for m in members]
            seeds = ", ".join(m["name"].rsplit("seed", 1)[1] for m in members)
            print(
                f"| {name}-* | {seeds} | {_mean_sd(pooled)} | {_mean_sd(anchor)} | {_mean_sd(lam)} | "
                f"{_mean_sd(lr, 0)} |"
            )


def _mean_sd(values: list[float], digits: int = 3) -> str:
    return f"{statistics.mean(values):.{digits}f} +- {statistics.stdev(values):.{digits}f}"


if __name__ == "__main__":
    main()
