#!/usr/bin/env bash
# Install tinyserve: the one recipe behind the README, .ci/run and the Dockerfiles.
#
#   scripts/install.sh [--venv DIR] [--dev] [--editable] [--fetch-model]
#
#   --venv DIR     create (if needed) and use a virtual environment at DIR
#   --dev          with the test dependencies (the [dev] extra)
#   --editable     pip install -e (a working copy) instead of a regular install
#   --fetch-model  download the default model (SmolLM2-135M GGUF) into the cache folder
#                  ($TINYSERVE_CACHE_DIR, default ~/.cache/tinyserve)
#
# Environment: TORCH_VERSION (default 2.13.0); TORCH_INDEX_URL, a PyTorch wheel index
# (e.g. https://download.pytorch.org/whl/cpu or .../cu128); unset, pip's configured index.
# torch goes in first and pinned, so that resolving the rest never swaps in another build.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="" extras="" editable="" fetch=0
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="$2"; shift 2 ;;
        --dev) extras="[dev]"; shift ;;
        --editable) editable="-e"; shift ;;
        --fetch-model) fetch=1; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    . "$venv/bin/activate"
fi

torch_spec="torch==${TORCH_VERSION:-2.13.0}"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pip install -q "$torch_spec" --index-url "$TORCH_INDEX_URL"
else
    pip install -q "$torch_spec"
fi
pip install -q $editable ".${extras}"

if [ "$fetch" = 1 ]; then
    scripts/fetch_default_model.sh
fi
python -c "import tinyserve, torch; print('tinyserve installed; torch', torch.__version__)"
