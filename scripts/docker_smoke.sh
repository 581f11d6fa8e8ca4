#!/usr/bin/env bash
# Build the CPU image and check that it serves, as a user would (issue 42). CI runs it.
#
#   scripts/docker_smoke.sh [--replicas] [--keep]
#
#   --replicas  also bring up docker/compose.replicas.yaml (two replicas behind HAProxy),
#               stop one replica under load and check that no request is lost
#   --keep      leave the image's container running (name tinyserve-smoke) for a look
#
# Steps: start the Docker engine if none answers (installing docker.io first, as root, with
# the flags this kind of machine needs: overlay2, no iptables, no default bridge); make the
# base image offline if missing (debootstrap of this host's Debian/Ubuntu release from the
# apt mirror it already uses, `docker import` -> tinyserve-base:<release>, cached); build
# docker/Dockerfile with this host's pip settings (scripts/docker_pip_args.py); run the container
# with --network host on $SMOKE_PORT (not 8321: the health check must follow the port); wait
# for /health and for Docker's "healthy"; one streamed chat completion; one structured-output
# request (response_format json_schema); the start-up log must say the C kernels are on;
# SIGTERM (docker stop) must end it with exit code 0.
#
# Exit 0: all passed. 1: a check failed. 77: skipped, no usable Docker engine or base image
# here (the reason is printed); .ci/run reports that and goes on.
#
# Environment: BASE_IMAGE (skip debootstrap, e.g. debian:bookworm-slim where Docker Hub is
# reachable), IMAGE (default tinyserve:cpu), SMOKE_PORT (default 8799), SMOKE_LOG (folder for
# the logs, default /tmp/tinyserve-docker-smoke), DOCKER (a client, default: one that can
# use BuildKit), TORCH_VERSION / TORCH_INDEX_URL (default: torch 2.13.0+cpu from this host's
# pip settings if they reach it, else from PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."

REPLICAS=0 KEEP=0
for a in "$@"; do
    case "$a" in
        --replicas) REPLICAS=1 ;;
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "docker_smoke.sh: unknown option $a" >&2; exit 2 ;;
    esac
done
IMAGE=${IMAGE:-tinyserve:cpu}
PORT=${SMOKE_PORT:-8799}
LOG=${SMOKE_LOG:-/tmp/tinyserve-docker-smoke}
NAME=tinyserve-smoke
mkdir -p "$LOG"
T0=$SECONDS
say() { echo "docker_smoke: $*"; }
skip() { say "SKIPPED: $*"; exit 77; }
fail() { say "FAILED: $*"; exit 1; }
lap() { say "$1: $(( SECONDS - $2 )) s"; }

# --- the engine -----------------------------------------------------------------------------
# A client that can build with BuildKit: docker with buildx, else a client older than 23
# (BuildKit built in; Debian's docker.io installs /usr/bin/docker), else plain docker.
pick_client() {
    if [ -n "${DOCKER:-}" ]; then echo "$DOCKER"; return; fi
    if docker buildx version >/dev/null 2>&1; then echo docker; return; fi
    local c v
    for c in /usr/bin/docker docker; do
        v=$("$c" version --format '{{.Client.Version}}' 2>/dev/null || true)
        case "$v" in 1[0-9].*|20.*|21.*|22.*) echo "$c"; return ;; esac
    done
    echo docker
}

engine_up() { docker info >/dev/null 2>&1; }
if ! engine_up; then
    if ! command -v dockerd >/dev/null; then
        [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
            || skip "no Docker engine, and cannot install one here (needs root and apt-get)"
        say "installing docker.io (apt)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
              docker.io >"$LOG/apt.log" 2>&1; } || skip "apt-get install docker.io failed (see $LOG/apt.log)"
    fi
    [ "$(id -u)" = 0 ] || skip "the Docker engine is not running and starting dockerd needs root"
    say "starting dockerd (log: $LOG/dockerd.log)"
    nohup dockerd --storage-driver=overlay2 --iptables=false --ip6tables=false --bridge=none \
        >"$LOG/dockerd.log" 2>&1 &
    for _ in $(seq 60); do engine_up && break; sleep 0.5; done
    engine_up || skip "dockerd did not come up in 30 s: $(tail -3 "$LOG/dockerd.log" | tr '\n' ' ')"
fi
if [ "$REPLICAS" = 1 ] && ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
        || skip "--replicas needs docker-compose or the compose plugin"
    say "installing docker-compose (apt)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
          docker-compose >>"$LOG/apt.log" 2>&1; } || skip "apt-get install docker-compose failed"
fi
DOCKER=$(pick_client)
say "engine $(docker version --format '{{.Server.Version}}' 2>/dev/null), build client $DOCKER"

# --- the base image, made offline -----------------------------------------------------------
if [ -z "${BASE_IMAGE:-}" ]; then
    RELEASE=$( . /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}" || true)
    [ -n "$RELEASE" ] || skip "BASE_IMAGE unset and this host is not a Debian/Ubuntu release to debootstrap"
    BASE_IMAGE=tinyserve-base:$RELEASE
    if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        t=$SECONDS
        # The archive this host's apt uses (its first source), read, not written down here.
        MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                 | awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' || true)
        [ -n "$MIRROR" ] || MIRROR=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
                 | awk '$1 == "URIs:" {print $2; exit}' || true)
        [ -n "$MIRROR" ] || skip "no apt mirror found in /etc/apt to debootstrap $RELEASE from"
        if ! command -v debootstrap >/dev/null; then
            [ "$(id -u)" = 0 ] || skip "debootstrap missing (needs root to install)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >>"$LOG/apt.log" 2>&1 \
                || skip "apt-get install debootstrap failed"
        fi
        ROOTFS=$(mktemp -d /tmp/tinyserve-rootfs.XXXX)
        say "making $BASE_IMAGE: debootstrap --variant=minbase $RELEASE (log: $LOG/debootstrap.log)"
        debootstrap --variant=minbase "$RELEASE" "$ROOTFS" "$MIRROR" >"$LOG/debootstrap.log" 2>&1 \
            || { rm -rf "$ROOTFS"; skip "debootstrap $RELEASE failed (see $LOG/debootstrap.log)"; }
        # The same suites this host's apt reaches (updates, security), not only the release.
        cp /etc/apt/sources.list "$ROOTFS/etc/apt/sources.list" 2>/dev/null || true
        cp /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
            "$ROOTFS/etc/apt/sources.list.d/" 2>/dev/null || true
        rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/lib/apt/lists/*
        tar -C "$ROOTFS" -c . | docker import - "$BASE_IMAGE" >/dev/null
        rm -rf "$ROOTFS"
        lap "base image $BASE_IMAGE" "$t"
    fi
fi

# --- the image ------------------------------------------------------------------------------
PIP_ARGS_FILE=$(mktemp)
python3 scripts/docker_pip_args.py "$PIP_ARGS_FILE" 2>"$LOG/pip_args.log" &
PIP_ARGS_PID=$!
cleanup() {
    kill "$PIP_ARGS_PID" 2>/dev/null || true
    rm -f "$PIP_ARGS_FILE"
    if [ "$KEEP" = 0 ]; then docker rm -f "$NAME" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
for _ in $(seq 50); do [ -s "$PIP_ARGS_FILE" ] && break; sleep 0.1; done
mapfile -t BUILD_ARGS < "$PIP_ARGS_FILE"
cat "$LOG/pip_args.log"
# torch: from the same pip settings when they reach the CPU build (resolved here, nothing
# downloaded), else from the Dockerfile's default, PyTorch's own CPU index. TORCH_INDEX_URL set
# (even empty) decides instead.
if [ -n "${TORCH_INDEX_URL+x}" ]; then
    BUILD_ARGS+=("--build-arg=TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif timeout 120 python3 -m pip install --dry-run --no-deps --ignore-installed -q \
        "torch==${TORCH_VERSION:-2.13.0}+cpu" >/dev/null 2>&1; then
    say "torch ${TORCH_VERSION:-2.13.0}+cpu: from this host's pip settings"
    BUILD_ARGS+=("--build-arg=TORCH_INDEX_URL=")
fi
[ -z "${TORCH_VERSION:-}" ] || BUILD_ARGS+=("--build-arg=TORCH_VERSION=$TORCH_VERSION")
t=$SECONDS
say "building $IMAGE from $BASE_IMAGE (log: $LOG/build.log)"
DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain --network host -f docker/Dockerfile \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" "${BUILD_ARGS[@]}" \
    -t "$IMAGE" . >"$LOG/build.log" 2>&1 || { tail -30 "$LOG/build.log"; fail "docker build"; }
kill "$PIP_ARGS_PID" 2>/dev/null || true
lap "image build" "$t"
SIZE=$(docker image inspect -f '{{.Size}}' "$IMAGE")
say "image size $(( SIZE / 1000000 )) MB"
docker run --rm --entrypoint sh "$IMAGE" -c \
    'for d in /opt/venv/lib/python3*/site-packages/torch /opt/venv /models /opt/tinyserve/kernels /usr; do du -sm $d; done' \
    | sed 's/^/docker_smoke:   MB /'
# Every kernel at every ISA level is in the image and loads (dlopen) with no compiler there.
docker run --rm --entrypoint python3 "$IMAGE" -c '
import ctypes, shutil
from tinyserve.kernels import build
assert shutil.which("gcc") is None and shutil.which("cc") is None, "a compiler in the image"
libs = [ctypes.CDLL(str(build.built(n, lv))) for lv in build.ISA_LEVELS for n in build.kernel_names()]
print(f"docker_smoke: {len(libs)} prebuilt kernels load ({len(build.ISA_LEVELS)} ISA levels), no compiler in the image")
' || fail "prebuilt kernels"
if docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$IMAGE" | grep -E '^(PIP_|TORCH_INDEX)'; then
    fail "build settings leaked into the image's ENV"
fi
if docker history --no-trunc --format '{{.CreatedBy}}' "$IMAGE" | grep -E 'PIP_|127\.0\.0\.1|pip_cert'; then
    fail "build settings recorded in the image's history"
fi

# --- run it ---------------------------------------------------------------------------------
docker rm -f "$NAME" >/dev/null 2>&1 || true
if curl -s -o /dev/null "http://127.0.0.1:$PORT/"; then
    fail "port $PORT already answers (another server?): set SMOKE_PORT to a free one"
fi
t=$SECONDS
START_NS=$(date +%s%N)
docker run -d --name "$NAME" --network host "$IMAGE" --port "$PORT" >/dev/null
ready=""
for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
        ready=$(( ($(date +%s%N) - START_NS) / 1000000 )); break
    fi
    [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || break
    sleep 0.1
done
docker logs "$NAME" >"$LOG/server.log" 2>&1
[ -n "$ready" ] || { tail -20 "$LOG/server.log"; fail "no /health 200 on port $PORT"; }
say "start -> /health 200: $ready ms"
healthy=""
for _ in $(seq 300); do
    if [ "$(docker inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ]; then
        healthy=$(( ($(date +%s%N) - START_NS) / 1000000 )); break
    fi
    sleep 0.1
done
[ -n "$healthy" ] || fail "Docker never reported the container healthy (health check on port $PORT)"
say "start -> Docker 'healthy': $healthy ms (health check every 5 s)"

BASE=http://127.0.0.1:$PORT/v1
MODEL=$(curl -sf "$BASE/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])') \
    || fail "GET /v1/models"
curl -sfN "$BASE/chat/completions" -H 'Content-Type: application/json' -d '{
    "model": "'"$MODEL"'", "stream": true, "max_tokens": 24,
    "messages": [{"role": "user", "content": "Say hello in five words."}]}' >"$LOG/stream.txt" \
    || fail "streamed chat completion"
chunks=$(grep -c '^data: {' "$LOG/stream.txt" || true)
grep -q '^data: \[DONE\]' "$LOG/stream.txt" && [ "$chunks" -ge 2 ] \
    || fail "streamed chat completion: $chunks chunks, no [DONE] (see $LOG/stream.txt)"
say "streamed chat completion: $chunks chunks, [DONE]"

curl -sf "$BASE/chat/completions" -H 'Content-Type: application/json' -d '{
    "model": "'"$MODEL"'", "max_tokens": 64, "temperature": 0,
    "messages": [{"role": "user", "content": "Give the name and age of a person as JSON."}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true,
        "schema": {"type": "object", "additionalProperties": false, "required": ["name", "age"],
                   "properties": {"name": {"type": "string", "maxLength": 20},
                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}}}}}}' \
    >"$LOG/structured.json" || fail "structured-output request"
python3 - "$LOG/structured.json" <<'EOF' || fail "structured output is not the schema's JSON (see $LOG/structured.json)"
import json, sys
content = json.load(open(sys.argv[1]))["choices"][0]["message"]["content"]
obj = json.loads(content)
assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int), obj
print("docker_smoke: structured output:", content)
EOF

docker logs "$NAME" >"$LOG/server.log" 2>&1
grep -E "CPU kernels built for" "$LOG/server.log" | head -1 | sed 's/^/docker_smoke: log: /'
if grep -E "CPU kernel .* off|CPU kernels off" "$LOG/server.log"; then
    fail "the C kernels are off in the container (see $LOG/server.log)"
fi
grep -q "CPU kernels built for" "$LOG/server.log" || fail "the start-up log does not say the C kernels are on"

if [ "$KEEP" = 1 ]; then
    say "left $NAME running on port $PORT"
else
    t=$SECONDS
    docker stop -t 40 "$NAME" >/dev/null   # SIGTERM, then SIGKILL after 40 s
    code=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
    docker logs "$NAME" >"$LOG/server.log" 2>&1
    [ "$code" = 0 ] || { tail -5 "$LOG/server.log"; fail "exit code $code after SIGTERM (want 0)"; }
    lap "SIGTERM -> exit 0" "$t"
    docker rm "$NAME" >/dev/null
fi

if [ "$REPLICAS" = 1 ]; then
    t=$SECONDS
    BASE_IMAGE=$BASE_IMAGE IMAGE=$IMAGE DOCKER=$DOCKER python3 docker/replicas_check.py "$LOG" \
        || fail "replicas behind the load balancer (see $LOG/replicas.log)"
    lap "replicas check" "$t"
fi
say "PASSED in $(( SECONDS - T0 )) s"
