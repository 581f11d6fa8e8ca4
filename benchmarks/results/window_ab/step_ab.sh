#!/usr/bin/env bash
# bench_step A/B for issue 41: 8c47555 (before sliding windows) vs HEAD, interleaved, 3 repetitions.
cd /work/main
. .venv/bin/activate
export TINYSERVE_NO_PROGRESS=1
for rep in ${REPS:-0 1 2}; do
  if [ $((rep % 2)) -eq 0 ]; then order="before after"; else order="after before"; fi
  for tree in $order; do
    if [ $tree = before ]; then pp=/tmp/ts_before_win; else pp=/work/main; fi
    PYTHONPATH=$pp python benchmarks/bench_step.py --batch-sizes 1,32 --steps 30 --paths kernels \
      --out benchmarks/results/window_ab/step_ab_${tree}_${rep}.json 2>&1 | grep "kernels  " | sed "s/^/$tree $rep /"
  done
done
