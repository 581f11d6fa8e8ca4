#!/usr/bin/env bash
# Start llama.cpp's llama-server on 127.0.0.1 as a benchmark peer, serving the very GGUF
# tinyserve serves by default (SmolLM2-135M-Instruct Q4_1; llama.cpp runs it quantised):
#   scripts/run_llamacpp_peer.sh [PORT] [BIN] [GGUF]
#
# PORT  default 8090
# BIN   default $TINYSERVE_LLAMACPP_BIN, else the one scripts/build_llamacpp_peer.sh builds
#       (~/.cache/tinyserve/llama-src/llama.cpp/build/bin/llama-server, or under
#       $TINYSERVE_LLAMACPP_SRC). Without BIN, a native build beside it (build-native/, from
#       `NATIVE=1 scripts/build_llamacpp_peer.sh SRC .../build-native`) is tried first: it is
#       started and sent one completion; if it dies (its AMX code segfaults on the AMX Xeons
#       seen so far, at model load or at the first request), the default build serves.
#       Which one serves is written to $PEER_INFO (default
#       ~/.cache/tinyserve/llamacpp_peer_PORT.json), where benchmarks/run_peers.py reads it.
# GGUF  default: tinyserve's default model (fetched on first use)
# Environment: SLOTS (default 32), CTX_PER_SLOT (default 2048), THREADS (default 2),
# CACHE_RAM in MiB (default 1024); any further arguments go to llama-server as they are.
#
# Flags, and why:
#   -np 32          32 slots = the highest concurrency the benchmarks use; a request beyond
#                   the slots waits in llama-server's queue, as in any server
#   -c SLOTS*CTX    the KV context is split evenly across slots (no --kv-unified: llama.cpp's
#                   high-throughput split-KV mode), so per slot it is CTX_PER_SLOT=2048 tokens:
#                   the longest benchmark request (long_prompt, 1293 prompt + 32 output tokens
#                   with the chat template) fits with room to spare. f16 KV, ~1.5 GB at 65536
#   -t 2 -tb 2      threads for decode and for prompt processing: the cores of this machine
#   --jinja         the GGUF's own chat template (the one tinyserve applies); on by default in
#                   recent builds, passed anyway for older ones
#   --cache-ram N   cap llama-server's host-RAM prompt cache (default 8 GiB) at 1 GiB, like
#                   tinyserve's --kv-cache-memory 1GiB in run_all.sh; bench_serving salts its
#                   prompts per run so this cache cannot carry hits from one run into the next
#   --alias         the model id the other servers report
#   --metrics       Prometheus counters on /metrics (prompt tokens processed, ...)
set -euo pipefail
PORT=${1:-8090}
SRC=${TINYSERVE_LLAMACPP_SRC:-$HOME/.cache/tinyserve/llama-src}
NATIVE_BIN=""
if [ -z "${2:-}" ] && [ -z "${TINYSERVE_LLAMACPP_BIN:-}" ] && [ -x "$SRC/llama.cpp/build-native/bin/llama-server" ]; then
  NATIVE_BIN=$SRC/llama.cpp/build-native/bin/llama-server
fi
BIN=${2:-${TINYSERVE_LLAMACPP_BIN:-$SRC/llama.cpp/build/bin/llama-server}}
GGUF=${3:-}
shift $(( $# < 3 ? $# : 3 ))
PEER_INFO=${PEER_INFO:-$HOME/.cache/tinyserve/llamacpp_peer_$PORT.json}
mkdir -p "$(dirname "$PEER_INFO")"
if [ ! -x "$BIN" ] && [ -z "$NATIVE_BIN" ]; then
  echo "no llama-server at $BIN: build it with scripts/build_llamacpp_peer.sh (or pass BIN)" >&2
  exit 1
fi
if [ -z "$GGUF" ]; then
  GGUF=$(${PYTHON:-python} -c "from tinyserve.models.default_model import ensure_default_model; print(ensure_default_model(progress=False))")
fi
SLOTS=${SLOTS:-32}
CTX=$(( SLOTS * ${CTX_PER_SLOT:-2048} ))
THREADS=${THREADS:-2}
ARGS=(-m "$GGUF" --host 127.0.0.1 --port "$PORT" --alias SmolLM2-135M-Instruct
  -np "$SLOTS" -c "$CTX" -t "$THREADS" -tb "$THREADS" --jinja
  --cache-ram "${CACHE_RAM:-1024}" --metrics "$@")

# The native build, if there is one: kept only if it loads and answers a completion.
if [ -n "$NATIVE_BIN" ]; then
  "$NATIVE_BIN" "${ARGS[@]}" &
  pid=$!
  for _ in $(seq 1 120); do
    kill -0 "$pid" 2>/dev/null || break
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null && curl -sf -m 120 "http://127.0.0.1:$PORT/v1/completions" \
       -H 'Content-Type: application/json' -d '{"prompt": "Hello", "max_tokens": 4}' >/dev/null \
     && kill -0 "$pid" 2>/dev/null; then
    printf '{"binary": "%s", "build": "native"}\n' "$NATIVE_BIN" > "$PEER_INFO"
    echo "llama.cpp: the native build serves ($NATIVE_BIN)" >&2
    trap 'kill "$pid" 2>/dev/null' TERM INT
    wait "$pid"
    exit $?
  fi
  wait "$pid" 2>/dev/null && rc=0 || rc=$?
  why="exit status $rc"
  [ "$rc" -gt 128 ] && why="signal $((rc - 128))"
  echo "llama.cpp: the native build died ($why); the default build serves instead" >&2
  printf '{"binary": "%s", "build": "default", "native_failed": "%s", "native_binary": "%s"}\n' \
    "$BIN" "$why" "$NATIVE_BIN" > "$PEER_INFO"
  [ -x "$BIN" ] || { echo "no llama-server at $BIN to fall back to" >&2; exit 1; }
else
  printf '{"binary": "%s", "build": "default"}\n' "$BIN" > "$PEER_INFO"
fi
exec "$BIN" "${ARGS[@]}"
