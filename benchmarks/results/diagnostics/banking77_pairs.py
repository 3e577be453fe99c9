"""Same-intent sentence pairs of BANKING77's train split for the diagnostics' timing and verdict runs: within each
intent, texts 0-1, 2-3, ... in file order form a pair (4,978 pairs). Usage: python banking77_pairs.py OUT.csv"""

import collections
import csv
import sys

SOURCE = "../shared/data/banking77/train.csv"

if __name__ == "__main__":
    with open(SOURCE, encoding="utf-8", newline="") as handle:
        by_intent: dict[str, list[str]] = collections.defaultdict(list)
        for row in csv.DictReader(handle):
            by_intent[row["category"]].append(row["text"])
    pairs = [
        (texts[k], texts[k + 1], intent) for intent, texts in by_intent.items() for k in range(0, len(texts) - 1, 2)
    ]
    with open(sys.argv[1], "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["anchor", "positive", "intent"])
        writer.writerows(pairs)
    print(f"{len(pairs)} pairs -> {sys.argv[1]}")
