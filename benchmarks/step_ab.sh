#!/usr/bin/env bash
# bench_step A/B of two trees, interleaved (the order alternates per repetition):
#   benchmarks/step_ab.sh BEFORE_TREE OUT_DIR [bench_step args...]
# BEFORE_TREE: a checkout of the old revision (git archive REV | tar -x -C DIR); "after" is
# this tree. Writes OUT_DIR/step_ab_{before,after}_REP.json; REPS (default "0 1 2") names
# the repetitions. Default bench_step args: --batch-sizes 1,32 --steps 30 --paths kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1 OUT=$2
shift 2
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--batch-sizes 1,32 --steps 30 --paths kernels)
export TINYSERVE_NO_PROGRESS=1
mkdir -p "$OUT"
for rep in ${REPS:-0 1 2}; do
  if [ $((rep % 2)) -eq 0 ]; then order="before after"; else order="after before"; fi
  for tree in $order; do
    if [ $tree = before ]; then pp=$BEFORE; else pp=$PWD; fi
    PYTHONPATH=$pp python benchmarks/bench_step.py "${ARGS[@]}" \
      --out "$OUT/step_ab_${tree}_${rep}.json" 2>&1 | grep "kernels  " | sed "s/^/$tree $rep /"
  done
done
