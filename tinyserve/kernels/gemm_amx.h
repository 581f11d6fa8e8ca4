// gemm.c's bf16-activation path on AMX (a header of gemm.c's, over gemm_bf16.h; built at the
// ISA level "amx", or with -DTINYSERVE_AMX_EMULATE on any CPU through amx_tile.h's scalar
// tiles): Q4_1 / Q8_0 blocks times activations rounded to bf16, one block of 32 per
// TDPBF16PS — a 16-row x GW-output tile, 8x the multiply rate of vdpbf16ps per core.
//
// The same weights and activations as gemm_bf16.h (a pair holds a block's weights p and
// p + 16, the activations the same pair; x rounded to nearest even), but the tile sums a
// block in its own order, so on an AMX machine every row count takes this path (one
// numeric path: batch invariance) and its contract is, per output, whatever M, the tiling
// and the thread count:
//   T = 0; per block b in order: te = to = 0; for p = 0..15: te = fma(q_p, xr_p, te),
//   to = fma(q_p+16, xr_p+16, to); S = 0 + (te + to); T = fma(d_b, S, T);
//   Q4_1: T = fma(m_b, sxr_b, T)
// (amx_tile.h: te / to are TDPBF16PS's two chains; the tile is zeroed per block because the
// scale d_b multiplies one block's sum.) A row's result depends on its own A row only, so
// a tile with 1..16 valid rows gives each the bits a full one does.
#ifndef TINYSERVE_GEMM_AMX_H
#define TINYSERVE_GEMM_AMX_H
#include "gemm_bf16.h"  // code_pairs, bf16_bits, bf16_activations (+ gemm_common.h)
#include <string.h>

#if defined(__AMX_BF16__) || defined(TINYSERVE_AMX_EMULATE)
#include "amx_tile.h"

int gemm_amx(void) { return 1; }

// Up to this many rows one row tile converts each block's codes as it goes (no panel
// buffer): a decode step or a verification run.
#define AMX_FEW_ROWS 16
// Few rows pack the codes this many blocks ahead of the tile loads, and prefetch (into L2)
// the group this many groups ahead: 1-row decode matmuls 0.87x -> 1.00x the vdpbf16ps
// tiles with packing 1 ahead; 2-3 ahead, or prefetching 1, 4, 8 ahead: within +-3%.
#ifndef AMX_AHEAD
#define AMX_AHEAD 1
#endif
#ifndef AMX_PF
#define AMX_PF 2
#endif

#ifdef TINYSERVE_AMX_EMULATE
// Block b of group g as a B tile: row p = the pairs (q_p, q_p+16) of the GW outputs.
static void amx_pack_block(const weight_t *w, int64_t g, int64_t b, uint32_t *dst) {
    for (int p = 0; p < 16; p++)
        for (int c = 0; c < GW; c++) {
            if (w->kind == 3) {  // bf16 pairs already
                dst[p * GW + c] = ((const uint32_t *)w->qs)[((g * w->nb + b) * 16 + p) * GW + c];
                continue;
            }
            int lo, hi;
            if (w->kind == 0) {
                const uint8_t q = ((const uint8_t *)w->qs)[((g * w->nb + b) * 16 + p) * GW + c];
                lo = q & 15, hi = q >> 4;
            } else {
                const int8_t *q = (const int8_t *)w->qs + (g * w->nb + b) * 32 * GW + c;
                lo = q[p * GW], hi = q[(p + 16) * GW];
            }
            dst[p * GW + c] = bf16_bits((float)lo) | bf16_bits((float)hi) << 16;  // exact
        }
}
#else
INLINE void amx_pack_block(const weight_t *w, int64_t g, int64_t b, uint32_t *dst) {
    for (int p = 0; p < 16; p++) _mm512_store_si512(dst + p * GW, code_pairs(w, g, b, p));
}
#endif

// Groups [g0, g1)'s blocks as B tiles into dst [g1 - g0, K/2, GW]: a group's block b at
// b * 16 * GW.
static void amx_pack(const weight_t *w, int64_t g0, int64_t g1, uint32_t *dst) {
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < w->nb; b++) amx_pack_block(w, g, b, dst + ((g - g0) * w->nb + b) * 16 * GW);
}

// Below 16 rows the tiles are configured with M rows; above, the A tiles read whole tiles of
// 16 rows: xb's rows past M are zeros (not for fewer: 17-46 KB a decode matmul to clear).
#define XB_ROWS(M) ((M) < TILE_ROWS ? (M) : ((M) + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS)
static void amx_activations(const float *x, int64_t ldx, int M, int64_t K, int kind,
                            uint32_t *xb, float *sx) {
    bf16_activations(x, ldx, M, K, kind, xb, sx);
    memset(xb + (size_t)M * K / 2, 0, (size_t)(XB_ROWS(M) - M) * K / 2 * sizeof(uint32_t));
}

// Linux's grant of the tile state to this process (amx_tile.h), asked once.
static int amx_ready(void) {
    static int granted = -1;
    if (granted < 0) granted = amx_request() == 0;
    return granted;
}

// One block on tiles (C, A, B): S [16, GW] = 0 + this block's pair sums of rows r0.., then
// each valid row's T takes the scale (and the Q4_1 minimum).
#define AMX_BLOCK(CT, AT, BT, b, bt, Sb)                                                   \
    do {                                                                                   \
        TILE_LOAD(AT, a->xb + (int64_t)r0 * a->ldxb + (b) * 16, a->ldxb * 4);              \
        TILE_LOAD(BT, bt, GW * 4);                                                         \
        TILE_ZERO(CT);                                                                     \
        TILE_DPBF16(CT, AT, BT);                                                           \
        TILE_STORE(CT, Sb, GW * 4);                                                        \
        const int64_t o = (g * nb + (b)) * GW;                                             \
        if (w->kind == 3) {  /* bf16 weights: no scale, T + S */                          \
            for (int r = 0; r < MT; r++) T[r] = VADD(T[r], VLOADA(Sb + r * GW));           \
        } else {                                                                           \
            const vf dv = VLOAD(w->d + o);                                                 \
            for (int r = 0; r < MT; r++) T[r] = VFMA(dv, VLOADA(Sb + r * GW), T[r]);       \
        }                                                                                  \
        if (w->kind == 0) {                                                                \
            const vf mv = VLOAD(w->m + o);                                                 \
            for (int r = 0; r < MT; r++) T[r] = VFMA(mv, VSET1(a->sx[(r0 + r) * nb + (b)]), T[r]); \
        }                                                                                  \
    } while (0)

// MT rows from r0 x group g over every block: the B tiles from panel [nb, 16, GW] (packed
// once per row panel) or, panel NULL, packed here block by block (few rows). T in registers.
INLINE void amx_tile(const weight_t *w, int64_t g, const uint32_t *panel, const act_t *a,
                     int r0, const int MT, float *y, int64_t ldy, int prefetch) {
    const int64_t nb = w->nb;
    float S[2][TILE_ROWS * GW] __attribute__((aligned(64)));
    uint32_t bb[AMX_AHEAD + 1][16 * GW] __attribute__((aligned(64)));
    vf T[TILE_ROWS];
    for (int r = 0; r < MT; r++) T[r] = VZERO();
    // Even blocks on tiles 0/2/4, odd on 1/3/5. Few rows pack block b + AMX_AHEAD's codes
    // before block b's tile loads, so that the loads do not wait for just-issued stores.
    for (int64_t b = 0; !panel && b < AMX_AHEAD && b < nb; b++) amx_pack_block(w, g, b, bb[b]);
#define AMX_NEXT(b) \
    if (!panel && (b) + AMX_AHEAD < nb) amx_pack_block(w, g, (b) + AMX_AHEAD, bb[((b) + AMX_AHEAD) % (AMX_AHEAD + 1)])
#define AMX_B(b) (panel ? panel + (b) * 16 * GW : bb[(b) % (AMX_AHEAD + 1)])
    for (int64_t b = 0; b < nb; b += 2) {
        if (prefetch) {
            prefetch_block(w, g + AMX_PF, 1, b, 1);
            if (b + 1 < nb) prefetch_block(w, g + AMX_PF, 1, b + 1, 1);
        }
        AMX_NEXT(b);
        AMX_BLOCK(0, 2, 4, b, AMX_B(b), S[0]);
        if (b + 1 < nb) {
            AMX_NEXT(b + 1);
            AMX_BLOCK(1, 3, 5, b + 1, AMX_B(b + 1), S[1]);
        }
    }
#undef AMX_NEXT
#undef AMX_B
    for (int r = 0; r < MT; r++) VSTORE(y + (int64_t)(r0 + r) * ldy, T[r]);
}

INLINE void amx_tile_any(const weight_t *w, int64_t g, const uint32_t *panel, const act_t *a,
                         int r0, int MT, float *y, int64_t ldy, int prefetch) {
#define AMX_CASE(M_) \
    case M_:                                                                              \
        amx_tile(w, g, panel, a, r0, M_, y, ldy, prefetch);                                 \
        break;
    switch (MT) {
        AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7)
        AMX_CASE(8) AMX_CASE(9) AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13)
        AMX_CASE(14) AMX_CASE(15) AMX_CASE(16)
        default: break;
    }
#undef AMX_CASE
}

// Rows [0, M) x groups [g0, g1) into y (group g0's first output); buf: this thread's scratch,
// >= K/2 x GW words (one group's packed blocks). Below 16 rows the tiles are configured with
// M rows; from 16 the activations' rows are padded to a multiple of 16 (zeros): every A tile
// load stays inside them. packed (NULL: none): the groups' blocks packed already, [g1 - g0,
// K/2, GW] (amx_pack; gemm_score.h packs a slice once for all its panels).
static void amx_rows_packed(const weight_t *w, const act_t *a, uint32_t *buf,
                            const uint32_t *packed, float *y, int64_t ldy, int64_t g0, int64_t g1) {
    const int M = a->M;
    tile_config(GW * 4, M < TILE_ROWS ? M : TILE_ROWS);
    if (M <= AMX_FEW_ROWS && !packed) {
        for (int64_t g = g0; g < g1; g++)
            amx_tile_any(w, g, NULL, a, 0, M, y + (g - g0) * GW, ldy, g + AMX_PF < g1);
    } else {
        for (int p0 = 0; p0 < M; p0 += PANEL) {
            const int pm = M - p0 < PANEL ? M - p0 : PANEL;
            for (int64_t g = g0; g < g1; g++) {
                // bf16 weights are B tiles already ([nb, 16, GW] pairs): read in place
                const uint32_t *panel = w->kind == 3 ? (const uint32_t *)w->qs + g * w->nb * 16 * GW
                                        : packed      ? packed + (g - g0) * w->nb * 16 * GW
                                                      : buf;
                if (w->kind != 3 && !packed) amx_pack(w, g, g + 1, buf);
                for (int r = p0; r < p0 + pm; r += TILE_ROWS) {
                    const int rows = p0 + pm - r < TILE_ROWS ? p0 + pm - r : TILE_ROWS;
                    amx_tile_any(w, g, panel, a, r, rows, y + (g - g0) * GW, ldy, 0);
                }
            }
        }
    }
    TILE_RELEASE();
}
#define amx_rows(w, a, buf, y, ldy, g0, g1) amx_rows_packed(w, a, buf, NULL, y, ldy, g0, g1)
#define bf16_path_rows amx_rows
#define bf16_path_activations amx_activations
#define bf16_path_pack amx_pack
#define bf16_path_rows_packed amx_rows_packed
#define BF16_PATH_FEW AMX_FEW_ROWS
#else
int gemm_amx(void) { return 0; }
int amx_request(void) { return -1; }
int amx_emulated(void) { return 0; }
#define XB_ROWS(M) (M)
#define amx_ready() 1
#define bf16_path_rows bf16_rows
#define bf16_path_activations bf16_activations
#define bf16_path_pack bf16_pack
#define bf16_path_rows_packed bf16_rows_packed
#define BF16_PATH_FEW BF16_FEW_ROWS
#endif

#endif
