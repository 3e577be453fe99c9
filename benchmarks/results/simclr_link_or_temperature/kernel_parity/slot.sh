#!/usr/bin/env bash
# usage: slot.sh OUTDIR STATEDIR [--stop-after-epoch N] RUN [RUN ...]: each run in turn at 7cc7eaf, AVX2 kernels
out=$1; state=$2; shift 2
extra=()
if [ "$1" = "--stop-after-epoch" ]; then extra=(--stop-after-epoch "$2"); shift 2; fi
cd /work/wt-link
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=/work/wt-link
for run in "$@"; do
  echo "$(date -u +%FT%TZ) start $run"
  nice -n 10 python3 benchmarks/simclr_link_or_temperature.py --runs "$run" --output-dir "$out" --state-dir "$state" --data-dir /work/shared/data/cifar10/cifar10-jpg.zip "${extra[@]}"
  echo "$(date -u +%FT%TZ) end $run rc=$?"
done
