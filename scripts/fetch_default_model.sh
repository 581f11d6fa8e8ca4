#!/usr/bin/env bash
# Pre-fetch the default model (SmolLM2-135M-Instruct GGUF) into the tinyserve cache folder.
set -euo pipefail
exec python -m tinyserve.models.default_model "$@"
