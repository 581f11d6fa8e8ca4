#!/usr/bin/env python
"""This CPU's bf16 matrix-multiply peak: AMX TDPBF16PS and AVX512-BF16 vdpbf16ps, per core
and on every usable core, so that the kernels' and a prefill's GFLOP/s can be put against
what the hardware does (benchmarks/bench_prefill.py reports its share of these).

tiles, registers  4 independent 16x16x32 TDPBF16PS into 4 accumulator tiles from 4 loaded
                  A/B tiles: the tile unit's own rate, no memory traffic
tiles, L1 loads   per multiply one A and one B tile loaded from L1 (16 KiB rotating) and
                  an accumulator kept: the rate a kernel that streams its operands can reach
tiles, + store    as "L1 loads", the accumulator zeroed and stored each multiply (what a
                  per-block scale, as gemm_amx.h's Q4_1 / Q8_0 blocks need, costs the tiles)
vdpbf16ps         12 independent zmm accumulators (2 bf16 products per lane per instruction)

A C program over the kernels' tile layer (kernels/amx_tile.h), compiled here with gcc -O3
-march=native, run once per thread count; each thread asks Linux for the tile state itself.
GFLOP/s count 2 per multiply-add.

python benchmarks/bench_amx_peak.py [--seconds 1.0] [--out benchmarks/results/amx_peak.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from tinyserve.utils.cpu import amx_permitted, cpu_flags, usable_cpus  # noqa: E402

SOURCE = r"""
#include "amx_tile.h"  /* the kernels' tile layer: tile_config, amx_request */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void config(void) { tile_config(64, 16); }  /* every tile 16 rows x 64 bytes */
#define TILE_FLOP (16.0 * 16 * 32 * 2)
static double tiles_regs(long n) {
    config(); _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    double t = now();
    for (long i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    t = now() - t; _tile_release(); return 4.0 * n * TILE_FLOP / t;
}
static double tiles_loads(long n, int store) {
    static __thread uint8_t buf[32768] __attribute__((aligned(64)));
    static __thread float out[4][256] __attribute__((aligned(64)));
    config(); _tile_zero(0); _tile_zero(1);
    double t = now();
    for (long i = 0; i < n; i++) {
        const int o = (i & 7) * 2048;
        _tile_loadd(2, buf + o, 64); _tile_loadd(4, buf + o + 1024, 64);
        if (store) _tile_zero(0);
        _tile_dpbf16ps(0, 2, 4);
        if (store) _tile_stored(0, out[i & 3], 64);
        _tile_loadd(3, buf + 16384 + o, 64); _tile_loadd(5, buf + 16384 + o + 1024, 64);
        if (store) _tile_zero(1);
        _tile_dpbf16ps(1, 3, 5);
        if (store) _tile_stored(1, out[(i + 2) & 3], 64);
    }
    t = now() - t; _tile_release(); return 2.0 * n * TILE_FLOP / t;
}
static double avx512(long n) {
    __m512 a[12]; for (int j = 0; j < 12; j++) a[j] = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3F803F80), y = (__m512bh)_mm512_set1_epi32(0x3F803F80);
    double t = now();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm512_dpbf16_ps(a[j], x, y);
    }
    t = now() - t;
    float s = 0; for (int j = 0; j < 12; j++) s += _mm512_reduce_add_ps(a[j]);
    if (s == 1.0f) printf("#");
    return 12.0 * n * 64 / t;
}
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]); const double secs = atof(argv[2]);
    double r[4] = {0, 0, 0, 0};
    const long n[4] = {(long)(secs * 2e7), (long)(secs * 1.5e7), (long)(secs * 1e7), (long)(secs * 2e7)};
    for (int k = 0; k < 4; k++) {
#pragma omp parallel num_threads(threads) reduction(+ : r[k])
        {
            if (k < 3 && amx_request() != 0) { printf("no AMX grant\n"); exit(3); }
            r[k] += k == 0 ? tiles_regs(n[0]) : k == 3 ? avx512(n[3]) : tiles_loads(n[k], k == 2);
        }
    }
    printf("%.1f %.1f %.1f %.1f\n", r[0] / 1e9, r[1] / 1e9, r[2] / 1e9, r[3] / 1e9);
    return 0;
}
"""

KERNELS = Path(__file__).resolve().parent.parent / "tinyserve" / "kernels"
KEYS = ("tiles_registers", "tiles_l1_loads", "tiles_l1_loads_store", "vdpbf16ps")


def run(seconds: float) -> dict:
    if not ({"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags() and amx_permitted()):
        raise SystemExit("bench_amx_peak: this CPU (or Linux) offers no AMX-BF16")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", f"-I{KERNELS}", "-o", str(exe),
                        str(src)], check=True)  # fmt: skip
        out = {}
        for threads in sorted({1, usable_cpus()}):
            line = subprocess.run([str(exe), str(threads), str(seconds)], check=True,
                                  capture_output=True, text=True).stdout.split()  # fmt: skip
            out[f"{threads}_threads"] = dict(zip(KEYS, map(float, line[-4:]), strict=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="roughly, per measurement")
    ap.add_argument("--out", default="benchmarks/results/amx_peak.json")
    args = ap.parse_args()
    result = {"machine": machine_info(), "gflops": run(args.seconds)}
    for threads, row in result["gflops"].items():
        print(threads, "  ".join(f"{k} {v:.0f}" for k, v in row.items()), "GFLOP/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
