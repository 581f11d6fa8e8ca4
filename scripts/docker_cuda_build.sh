#!/usr/bin/env bash
# Build docker/Dockerfile.cuda offline and check it as far as this machine goes (issue 42).
#
#   scripts/docker_cuda_build.sh [--dev] [--gpu-check] [--no-build]
#
#   --dev        WITH_DEV=1 (the test dependencies: the image scripts/gpu_check.sh runs in),
#                tagged tinyserve:cuda-dev; default WITH_DEV=0, tinyserve:cuda
#   --gpu-check  (with --dev) also run scripts/gpu_check.sh in the image, with --gpus all
#                where this host has a GPU; without one, up to its device tests and the
#                server's start on cuda (never its benchmarks), and print its summary
#   --no-build   check the image already there
#
# Steps: start the Docker engine if none answers (scripts/docker_smoke.sh's flags); the base
# image tinyserve-base:<this host's release> (debootstrapped by scripts/docker_smoke.sh: run
# it first, or set BASE_IMAGE, e.g. the Dockerfile's default nvidia/cuda image where Docker
# Hub is reachable); build with this host's pip settings (scripts/docker_pip_args.py) less
# its find-links folders (they hold a +cpu torch, which `torch==X` would prefer to the CUDA
# build) and TORCH_INDEX_URL empty (torch==X from those settings; PyPI's is a CUDA build).
# Checks, GPU or not: torch is a CUDA build, Triton imports, gcc compiles Triton's launcher
# source against Python's and Triton's headers; without a GPU also: torch.cuda.is_available()
# is False, `tinyserve serve --device cuda` fails with a message, `--device cpu` serves
# /health and a chat completion (--network host on $CHECK_PORT). With a GPU: the server on
# cuda answers instead. Image size and build time are printed.
#
# Exit 0: passed. 1: a check failed. 77: skipped (no Docker engine or base image here).
# Environment: BASE_IMAGE, TORCH_INDEX_URL (default empty), TORCH_VERSION, CONTEXT (the
# build context, default the repository root), CHECK_PORT (default 8798), LOG (default
# /tmp/tinyserve-docker-cuda), DOCKER (a client that can use BuildKit), IMAGE (the tag).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0 GPU_CHECK=0 BUILD=1
for a in "$@"; do
    case "$a" in
        --dev) DEV=1 ;; --gpu-check) GPU_CHECK=1 ;; --no-build) BUILD=0 ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "docker_cuda_build.sh: unknown option $a" >&2; exit 2 ;;
    esac
done
TAG=cuda; [ "$DEV" = 0 ] || TAG=cuda-dev
IMAGE=${IMAGE:-tinyserve:$TAG}
PORT=${CHECK_PORT:-8798} LOG=${LOG:-/tmp/tinyserve-docker-cuda} NAME=tinyserve-cuda-check
CONTEXT=${CONTEXT:-.}
mkdir -p "$LOG"
say() { echo "docker_cuda: $*"; }
skip() { say "SKIPPED: $*"; exit 77; }
fail() { say "FAILED: $*"; exit 1; }

engine_up() { docker info >/dev/null 2>&1; }
if ! engine_up; then
    [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null || skip "no Docker engine (dockerd needs root)"
    nohup dockerd --storage-driver=overlay2 --iptables=false --ip6tables=false --bridge=none \
        >"$LOG/dockerd.log" 2>&1 &
    for _ in $(seq 60); do engine_up && break; sleep 0.5; done
    engine_up || skip "dockerd did not come up: $(tail -2 "$LOG/dockerd.log" | tr '\n' ' ')"
fi
if [ -z "${DOCKER:-}" ]; then  # without buildx, Debian's docker.io client (BuildKit built in)
    DOCKER=docker; docker buildx version >/dev/null 2>&1 || [ ! -x /usr/bin/docker ] || DOCKER=/usr/bin/docker
fi
GPUS=() HAVE_GPU=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then GPUS=(--gpus all); HAVE_GPU=1; fi
cleanup() { [ -z "${PIP_PID:-}" ] || kill "$PIP_PID" 2>/dev/null || true
            docker rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

if [ "$BUILD" = 1 ]; then
    if [ -z "${BASE_IMAGE:-}" ]; then
        BASE_IMAGE=tinyserve-base:$( . /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-none}")
        docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
            || skip "no $BASE_IMAGE: run scripts/docker_smoke.sh once (it makes it) or set BASE_IMAGE"
    fi
    PIP_ARGS=$(mktemp)   # fresh each run (its loopback port is stable: docker_pip_args.py)
    python3 scripts/docker_pip_args.py "$PIP_ARGS" 2>"$LOG/pip_args.log" & PIP_PID=$!
    for _ in $(seq 50); do [ -s "$PIP_ARGS" ] && break; sleep 0.1; done
    mapfile -t ARGS < <(grep -v '^--build-arg=PIP_FIND_LINKS=' "$PIP_ARGS" || true)
    rm -f "$PIP_ARGS"
    ARGS+=("--build-arg=TORCH_INDEX_URL=${TORCH_INDEX_URL:-}")
    [ -z "${TORCH_VERSION:-}" ] || ARGS+=("--build-arg=TORCH_VERSION=$TORCH_VERSION")
    say "building $IMAGE (WITH_DEV=$DEV) from $BASE_IMAGE, context $CONTEXT (log: $LOG/build-$DEV.log)"
    t=$SECONDS
    DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain --network host \
        -f "$CONTEXT/docker/Dockerfile.cuda" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --build-arg "WITH_DEV=$DEV" "${ARGS[@]}" -t "$IMAGE" "$CONTEXT" >"$LOG/build-$DEV.log" 2>&1 \
        || { tail -30 "$LOG/build-$DEV.log"; fail "docker build"; }
    say "build: $(( SECONDS - t )) s"
fi
say "image $IMAGE: $(( $(docker image inspect -f '{{.Size}}' "$IMAGE") / 1000000 )) MB"
if docker history --no-trunc --format '{{.CreatedBy}}' "$IMAGE" | grep -E '127\.0\.0\.1|PIP_INDEX_URL=.|pip_cert,src'; then
    fail "build settings recorded in the image's history"
fi
run() { docker run --rm "${GPUS[@]}" --entrypoint "$1" "$IMAGE" "${@:2}"; }

# torch is a CUDA build; Triton imports; CUDA present only with a GPU.
run python3 -c '
import sys, torch, triton
print("docker_cuda: torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__,
      "cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
assert torch.version.cuda, "CPU-only torch"
sys.exit(torch.cuda.is_available() != bool(int(sys.argv[1])) and "cuda availability differs from the host")
' "$HAVE_GPU" || fail "torch / triton"
# Triton's launcher build: gcc compiles its driver source against Python.h and Triton's
# cuda.h (linking needs the driver's libcuda, mounted only with a GPU).
run bash -c 'set -e; T=$(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")
    P=$(python3 -c "import sysconfig; print(sysconfig.get_paths()[\"include\"])")
    gcc -c -fPIC -O0 -I"$T/backends/nvidia/include" -I"$P" "$T/backends/nvidia/driver.c" -o /tmp/d.o
    echo "docker_cuda: gcc $(gcc -dumpversion) compiles Triton launcher source (driver.c) with Python.h"' \
    || fail "gcc / Python.h / Triton headers"
run tinyserve --help >/dev/null || fail "tinyserve --help"
say "tinyserve imports, its CLI answers"

serve() {  # serve DEVICE: start, wait for /health (or the server's end), one chat completion
    docker rm -f "$NAME" >/dev/null 2>&1 || true
    docker run -d --name "$NAME" --network host "${GPUS[@]}" "$IMAGE" --port "$PORT" --device "$1" >/dev/null
    local ok=""
    for _ in $(seq 900); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { ok=1; break; }
        [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || break
        sleep 0.2
    done
    docker logs "$NAME" >"$LOG/serve-$1.log" 2>&1
    [ -n "$ok" ] || return 1
    curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}' >"$LOG/chat-$1.json" || return 2
    say "--device $1: /health 200, chat: $(python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"]))' "$LOG/chat-$1.json")"
    docker stop -t 30 "$NAME" >/dev/null; docker rm "$NAME" >/dev/null
}
if [ "$HAVE_GPU" = 1 ]; then
    serve cuda || { tail -20 "$LOG/serve-cuda.log"; fail "serving on cuda"; }
    grep -i triton "$LOG/serve-cuda.log" | head -3 || true
else
    if serve cuda; then fail "--device cuda served without a GPU"; fi
    say "--device cuda without a GPU: $(docker inspect -f '{{.State.Status}}, exit {{.State.ExitCode}}' "$NAME"), it says:"
    tail -5 "$LOG/serve-cuda.log" | sed 's/^/    /'
    docker rm -f "$NAME" >/dev/null
    serve cpu || { tail -20 "$LOG/serve-cpu.log"; fail "serving on cpu in the CUDA image"; }
fi

if [ "$GPU_CHECK" = 1 ]; then
    [ "$DEV" = 1 ] || fail "--gpu-check needs --dev (pytest and the benchmarks' clients)"
    rm -rf "$LOG/gpu_check"; mkdir -p "$LOG/gpu_check"
    # Without a GPU: stop once the device tests are recorded (they skip, saying why) and the
    # server on cuda has had a few seconds to fail, before the benchmark steps.
    stop_at='^device_tests'; [ "$HAVE_GPU" = 0 ] || stop_at='^$'
    # (bash: scripts/gpu_check.sh is not executable in the repository)
    docker run --rm --name "$NAME" "${GPUS[@]}" --entrypoint bash -e OUT=/out -e STOP_AT="$stop_at" \
        -v "$LOG/gpu_check:/out" "$IMAGE" -c 'export GPU_CHECK_TOKENIZER=$(ls -d /models/models/*/*.tokenizer)
        bash scripts/gpu_check.sh & p=$!
        while kill -0 $p 2>/dev/null; do grep -q "$STOP_AT" /out/summary.txt 2>/dev/null && { sleep 8; break; }; sleep 0.5; done
        kill $p 2>/dev/null; wait $p; echo "docker_cuda: gpu_check.sh exit $?"' || true
    [ -s "$LOG/gpu_check/summary.txt" ] || fail "gpu_check.sh wrote no summary"
    say "gpu_check summary:"; sed 's/^/    /' "$LOG/gpu_check/summary.txt"
    sed 's/^/    env: /' "$LOG/gpu_check/env.txt"
    tail -1 "$LOG/gpu_check/device_tests.txt" | sed 's/^/    device_tests: /'
    tail -1 "$LOG/gpu_check/server.log" | sed 's/^/    server.log: /'
fi
say "PASSED"
