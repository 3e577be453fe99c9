#!/usr/bin/env bash
# the warm-start arm at 14c3df0 (7cc7eaf + the arm), AVX2 kernels, one thread; output beside the 7cc7eaf runs
cd /work/wt-warm
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=/work/wt-warm
for run in "$@"; do
  echo "$(date -u +%FT%TZ) start $run"
  nice -n 10 python3 benchmarks/simclr_link_or_temperature.py --runs "$run" --output-dir /work/link/out --state-dir /work/link/state --data-dir /work/shared/data/cifar10/cifar10-jpg.zip
  echo "$(date -u +%FT%TZ) end $run rc=$?"
done
