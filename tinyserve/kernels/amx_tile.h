// The thin tile layer under gemm_amx.h: AMX's tile registers and TDPBF16PS, or (built with
// -DTINYSERVE_AMX_EMULATE, on any CPU) a scalar emulation with the same semantics, so that
// the AMX kernels' tiling, packing and K order are tested on machines without a matrix
// engine, and on AMX machines the hardware is tested against the emulation.
//
// TDPBF16PS, as this CPU computes it (checked bitwise on a Sapphire-Rapids-class Xeon over
// 256k random outputs, 2026-12-05; the SDM's newer pseudo-code says the same): per output
// (m, n), two float32 accumulators, te over the pairs' first (even) elements and to over
// their second (odd), each an FMA chain over the pairs k in order from 0, then
//   C[m][n] = C[m][n] + (te + to)
// every step rounded to nearest even, bf16 inputs' denormals read as zero, float32
// denormal results flushed to zero. (Not the older pseudo-code's single chain even, odd,
// even, ...: that differs in ~26% of outputs.) Rows are independent: row m of C depends on
// row m of A only, so a row's result does not depend on the other rows of the tile.
#ifndef TINYSERVE_AMX_TILE_H
#define TINYSERVE_AMX_TILE_H
#include <stdint.h>
#include <string.h>

#define TILE_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config_t;

// Tiles 0-1 (C: rows x GW float32, colsb bytes), 2-3 (A: rows x 16 pairs of bf16, one
// block of 32) and 4-7 (B-shaped: 16 pairs x GW outputs, colsb bytes; gemm_amx.h uses 4-5). rows < 16 for a tile of
// few rows: the multiply's cost follows its rows.
static inline void tile_config_fill(tile_config_t *c, int colsb, int rows) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 8; t++) {
        c->rows[t] = t < 4 ? rows : TILE_ROWS;
        c->colsb[t] = (t == 2 || t == 3) ? 64 : colsb;
    }
}

// Any shapes (attention_amx.h's): tile t with rows[t] rows of colsb[t] bytes.
static inline void tile_config_fill_shapes(tile_config_t *c, const uint8_t rows[8],
                                           const uint16_t colsb[8]) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 8; t++) c->rows[t] = rows[t], c->colsb[t] = colsb[t];
}

#ifndef TINYSERVE_AMX_EMULATE
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
// Linux gives a process the AMX tile state only when asked (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Per process, threads
// included. 0: granted.
int amx_request(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }
int amx_emulated(void) { return 0; }
static inline void tile_config(int colsb, int rows) {
    tile_config_t c;
    tile_config_fill(&c, colsb, rows);
    _tile_loadconfig(&c);
}
static inline void tile_config_shapes(const uint8_t rows[8], const uint16_t colsb[8]) {
    tile_config_t c;
    tile_config_fill_shapes(&c, rows, colsb);
    _tile_loadconfig(&c);
}
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_DPBF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()
#else
#include <math.h>
int amx_request(void) { return 0; }
int amx_emulated(void) { return 1; }
// The emulated register file: 8 tiles of 16 rows x 64 bytes, and their shapes.
static __thread uint8_t tmm[8][TILE_ROWS][64] __attribute__((aligned(64)));
static __thread tile_config_t tcfg;
static inline void tile_config(int colsb, int rows) { tile_config_fill(&tcfg, colsb, rows); }
static inline void tile_config_shapes(const uint8_t rows[8], const uint16_t colsb[8]) {
    tile_config_fill_shapes(&tcfg, rows, colsb);
}
static inline float bf16_daz(uint16_t h) {
    uint32_t u = (h & 0x7F80) ? (uint32_t)h << 16 : (uint32_t)(h & 0x8000) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float ftz(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f; }
static inline void tile_zero(int t) { memset(tmm[t], 0, sizeof tmm[t]); }
static inline void tile_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < tcfg.rows[t]; r++) memcpy(tmm[t][r], (const uint8_t *)p + r * stride, tcfg.colsb[t]);
}
static inline void tile_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < tcfg.rows[t]; r++) memcpy((uint8_t *)p + r * stride, tmm[t][r], tcfg.colsb[t]);
}
static void tile_dpbf16(int c, int a, int b) {
    for (int m = 0; m < tcfg.rows[c]; m++)
        for (int n = 0; n < tcfg.colsb[c] / 4; n++) {
            float te = 0.0f, to = 0.0f, acc;
            for (int k = 0; k < tcfg.colsb[a] / 4; k++) {
                uint16_t ae, ao, be, bo;
                memcpy(&ae, &tmm[a][m][4 * k], 2);
                memcpy(&ao, &tmm[a][m][4 * k + 2], 2);
                memcpy(&be, &tmm[b][k][4 * n], 2);
                memcpy(&bo, &tmm[b][k][4 * n + 2], 2);
                te = ftz(fmaf(bf16_daz(ae), bf16_daz(be), te));
                to = ftz(fmaf(bf16_daz(ao), bf16_daz(bo), to));
            }
            memcpy(&acc, &tmm[c][m][4 * n], 4);
            acc = ftz(acc + ftz(te + to));
            memcpy(&tmm[c][m][4 * n], &acc, 4);
        }
}
#define TILE_ZERO(t) tile_zero(t)
#define TILE_LOAD(t, p, stride) tile_load(t, p, stride)
#define TILE_STORE(t, p, stride) tile_store(t, p, stride)
#define TILE_DPBF16(c, a, b) tile_dpbf16(c, a, b)
#define TILE_RELEASE() ((void)0)
#endif
#endif
