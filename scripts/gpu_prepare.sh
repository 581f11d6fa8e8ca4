#!/usr/bin/env bash
# Prepare, on this (networked, CPU) machine, what scripts/gpu_check.sh needs on a bare GPU
# machine that has CUDA PyTorch and transformers but no network and none of tinyserve's
# serving packages:
#   scripts/gpu_prepare.sh [DEST]      (default .gpu_carry, git-ignored)
# DEST/wheels     tinyserve's pure-serving dependencies as wheels for CPython 3.12 on
#                 manylinux x86_64 (no torch, no transformers: the GPU image has its own)
# DEST/tokenizer  SmolLM2's tokenizer and chat template (the 98 MB GGUF is over the device
#                 tool's transfer limit; gpu_check.sh builds a random model of its shape there)
# Then, with the device tool:  run(command="bash scripts/gpu_check.sh", carry=[".gpu_carry"])
set -euo pipefail
DEST=${1:-.gpu_carry}
PY=${PYTHON:-python}
mkdir -p "$DEST/wheels" "$DEST/tokenizer"
# Exact names: these are what the GPU image lacks (the device tool's KINDS.md lists what it
# holds: anyio, h11, httpx, jinja2, prometheus-client, numpy, safetensors, tokenizers ...).
# The versions this venv runs (tested together), as CPython 3.12 wheels.
pins=$("$PY" -c "from importlib.metadata import version as v; print(' '.join(f'{n}=={v(n)}' for n in ['fastapi', 'starlette', 'uvicorn', 'sse-starlette', 'pydantic', 'pydantic-core', 'annotated-types', 'typing-inspection', 'gguf', 'llguidance', 'pytest-timeout']))")
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --dest "$DEST/wheels" $pins 2>&1 \
  | grep -v "^WARNING: Location" || true
ls "$DEST/wheels"
tok=$("$PY" - <<'EOF'
from tinyserve.models.default_model import ensure_default_model, tokenizer_dir_for
print(tokenizer_dir_for(ensure_default_model(progress=False)))
EOF
)
cp "$tok"/* "$DEST/tokenizer/"
du -sh "$DEST"
