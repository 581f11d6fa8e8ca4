#!/usr/bin/env bash
# Issue 41's family benchmark: for each ~1B-shaped Q4_1 GGUF from benchmarks/family_ggufs.py,
# tinyserve's decode step at 1 and 32 rows (bench_step.py, the default kernels path), then
# served `mixed` at 1 and 8 streams against llama.cpp's llama-server on the same file
# (run_peers.py: interleaved, 3 repetitions, medians), one server pair at a time.
#   benchmarks/run_families.sh [FAMILY ...]      (default: qwen3 granite smollm3)
# Writes benchmarks/results/families/<family>_step.json and <family>_peers.json.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${FAMILY_DIR:-$HOME/.cache/tinyserve/families}
OUT=benchmarks/results/families
mkdir -p "$OUT"
FAMILIES=("$@")
[ ${#FAMILIES[@]} -eq 0 ] && FAMILIES=(qwen3 granite smollm3)
TS_PORT=8331 LL_PORT=8094
wait_health() { for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
for fam in "${FAMILIES[@]}"; do
  gguf="$DIR/$fam-1b-random.Q4_1.gguf"
  [ -f "$gguf" ] || python benchmarks/family_ggufs.py --out-dir "$DIR" --families "$fam"
  # STEP=0 skips the decode-step benchmark (it holds ~18-21 GB at these shapes: its float
  # floors dequantise the model; with other work on the machine it was OOM-killed once).
  [ "${STEP:-1}" = 0 ] || python benchmarks/bench_step.py --model "$gguf" --batch-sizes 1,32 \
    --steps 20 --paths kernels --out "$OUT/${fam}_step.json"
  tinyserve serve --model "$gguf" --port $TS_PORT --kv-cache-memory 1GiB --max-num-seqs 64 \
    --served-model-name SmolLM2-135M-Instruct --log-level warning > "/tmp/ts-$fam.log" 2>&1 &
  ts=$!
  wait_health $TS_PORT
  SLOTS=8 scripts/run_llamacpp_peer.sh $LL_PORT "" "$gguf" > "/tmp/ll-$fam.log" 2>&1 &
  ll=$!
  wait_health $LL_PORT
  python benchmarks/run_peers.py --server tinyserve=http://127.0.0.1:$TS_PORT \
    --server llama.cpp=http://127.0.0.1:$LL_PORT --plan mixed:1,8 --repeats 3 \
    --out "$OUT/${fam}_peers.json" || true
  kill $ts $ll 2>/dev/null; pkill -f "llama-server.*$LL_PORT" 2>/dev/null || true
  wait $ts $ll 2>/dev/null || true
done
