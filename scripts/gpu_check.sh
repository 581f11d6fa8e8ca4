#!/usr/bin/env bash
# Issue 16's whole GPU verification in one call on a bare GPU machine (CUDA PyTorch and
# transformers there, no network): prepare here with scripts/gpu_prepare.sh, then with the
# device tool
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_carry"], timeout_s=540)
# Everything lands in $OUT (the device tool's folder; /tmp/gpu_check when unset):
#   summary.txt         one line per step: ok / FAILED (rc) and its seconds
#   env.txt             GPU, driver, Python, torch and CUDA versions
#   device_tests.*      pytest -m device on the GPU (TINYSERVE_TEST_DEVICE=cuda): parity with
#                       transformers (tiny Llama and Qwen2 fp32, SmolLM2-shaped bf16), batched =
#                       alone, preemption with and without prefix caching, the sampler, the
#                       Triton decode-attention kernel vs the reference, a captured CUDA graph's
#                       replay vs the eager forward
#   stream.txt          one streamed chat completion from a served SmolLM2-shaped random model
#   serving_c*.json     bench_serving.py `mixed` at concurrency 1, 32, 128, 256
#   device_step.json    step anatomy: step ms, launches, syncs, copies, graph replays per step
#                       at batch 1/8/64, for CUDA graphs, eager, and eager with masked SDPA
#   server.log
# GPU_CHECK_DEVICE=cpu (and GPU_CHECK_DTYPE=float32) runs the same steps on a CPU, a dry run
# of the plumbing (tests/test_gpu_check.py). Steps are bounded by timeouts so that one hung
# step cannot eat the call: the budget is ~8 minutes in all.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
DEV=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
PY=${PYTHON:-python3}
CARRY=${GPU_CARRY:-.gpu_carry}
MODEL=${GPU_CHECK_MODEL:-/tmp/smollm2_like}
CONCURRENCY=${GPU_CHECK_CONCURRENCY:-1 32 128 256}
PORT=${GPU_CHECK_PORT:-8321}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
SITE=$(mktemp -d)

step() {  # step NAME TIMEOUT CMD...: run, log its status and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout "$limit" "$@"
  rc=$?
  if [ $rc -eq 0 ]; then echo "$name: ok ($((SECONDS - t0)) s)" >> "$OUT/summary.txt"
  else echo "$name: FAILED (rc $rc, $((SECONDS - t0)) s)" >> "$OUT/summary.txt"; fi
  return $rc
}

# 0. What machine this is.
{
  date -u
  nvidia-smi 2>&1 || echo "no nvidia-smi"
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
} > "$OUT/env.txt" 2>&1

# 1. The serving packages the image lacks, from carried wheels, into a private folder on
# PYTHONPATH: the image's torch and transformers are never replaced.
if ls "$CARRY"/wheels/*.whl > /dev/null 2>&1; then
  step wheels 120 "$PY" -m pip install -q --no-deps --no-index --target "$SITE" \
    "$CARRY"/wheels/*.whl > "$OUT/pip.txt" 2>&1
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TINYSERVE_NO_PROGRESS=1 TINYSERVE_CACHE_DIR=${TINYSERVE_CACHE_DIR:-/tmp/tinyserve-cache}

# 2. A random SmolLM2-shaped model with SmolLM2's tokenizer and chat template.
if [ ! -f "$MODEL/config.json" ]; then
  TOK=${GPU_CHECK_TOKENIZER:-$CARRY/tokenizer}
  step model 120 "$PY" -c "import sys; from tinyserve.testing.checkpoints import smollm2_like; smollm2_like(sys.argv[1], sys.argv[2], num_hidden_layers=int(sys.argv[3]))" \
    "$MODEL" "$TOK" "${GPU_CHECK_LAYERS:-30}" > "$OUT/model.txt" 2>&1
fi

# 3. The device-selected tests (the GGUF-backed SmolLM2 ones need the 98 MB file: not here).
export TINYSERVE_TEST_DEVICE=$DEV
# shellcheck disable=SC2086  # GPU_CHECK_TESTS: paths, word-split on purpose
step device_tests 200 "$PY" -m pytest ${GPU_CHECK_TESTS:-tests} -m device -q -p no:cacheprovider \
  -k "${GPU_CHECK_K:-not shared_system_prompt}" --junitxml "$OUT/device_tests.xml" \
  > "$OUT/device_tests.txt" 2>&1
# pytest exits 0 when every test skips (no CUDA device): say so instead of a bare "ok".
grep -Eq '[0-9]+ passed' "$OUT/device_tests.txt" \
  || echo "device_tests: NOTHING RAN ($(tail -1 "$OUT/device_tests.txt"))" >> "$OUT/summary.txt"

# 4. Served: one streamed request, then the load test at each concurrency.
"$PY" -m tinyserve.entrypoints.cli serve --model "$MODEL" --device "$DEV" --dtype "$DTYPE" \
  --port "$PORT" --max-num-seqs 256 > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2> /dev/null' EXIT
step health 150 "$PY" -c "
import sys, time, httpx
while True:
    try:
        if httpx.get(sys.argv[1], timeout=2).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(1)" "http://127.0.0.1:$PORT/health"
step stream 60 "$PY" -c "
import sys, httpx
body = {'stream': True, 'max_tokens': 32, 'messages': [{'role': 'user', 'content': 'Say hello.'}]}
with httpx.stream('POST', sys.argv[1], json=body, timeout=60) as r, open(sys.argv[2], 'w') as f:
    r.raise_for_status()
    for line in r.iter_lines(): f.write(line + '\\n')
" "http://127.0.0.1:$PORT/v1/chat/completions" "$OUT/stream.txt"
for c in $CONCURRENCY; do
  n=$((c < 32 ? 2 * c : c)); n=$((n < 6 ? 6 : n))
  step "serving_c$c" 90 "$PY" benchmarks/bench_serving.py --base-url "http://127.0.0.1:$PORT" \
    --workload mixed --concurrency "$c" --num-requests "$n" --no-progress \
    --out "$OUT/serving_c$c.json" > "$OUT/serving_c$c.txt" 2>&1
done
kill $SERVER 2> /dev/null
wait $SERVER 2> /dev/null

# 5. Step anatomy (launches, syncs, copies per step) from the profiler.
step device_step 150 "$PY" benchmarks/bench_device_step.py --model "$MODEL" --device "$DEV" \
  --dtype "$DTYPE" --batch-sizes "${GPU_CHECK_BATCHES:-1,8,64}" --steps 20 --kv-cache-memory 4GiB \
  --out "$OUT/device_step.json" > "$OUT/device_step.txt" 2>&1
cat "$OUT/summary.txt"
! grep -q FAILED "$OUT/summary.txt"
