// gemm.c's bf16-activation path (a header of gemm.c's, over gemm_common.h): Q4_1 / Q8_0 weights
// times activations rounded to bf16, on AVX512-BF16's vdpbf16ps (two products per lane per
// instruction: twice the multiply rate of the float tiles, where many rows make the matmul
// compute-bound). Asked for by gemm's kind | BF16_ACT; built only under __AVX512BF16__.
//
// The codes (Q4_1 0..15, Q8_0 -127..127) are exact in bf16, so the weights are still the
// checkpoint's: only x is rounded (to nearest even). A lane holds a pair of a block's weights
// p and p + 16 (Q4_1's low and high nibble of byte p), the activations the same pair.
// Contract, per output, whatever M, the tiling and the thread count:
//   T = 0; per block b in order: S = 0; for p = 0..15: S = dpbf16(S, (q_p, q_p+16),
//   (xr_p, xr_p+16)); T = fma(d_b, S, T); Q4_1: T = fma(m_b, sxr_b, T)
// with xr = bf16(x) and sxr_b = block_sum of block b's xr. A bf16 weight (kind 3: a dense
// checkpoint's weights as bf16 pairs, no scale) is its own codes, and T = T + S (what
// fma(1, S, T) gives).
#ifndef TINYSERVE_GEMM_BF16_H
#define TINYSERVE_GEMM_BF16_H
#include "gemm_common.h"  // weight_t, act_t, q8_codes, block_sum, prefetch_block, PANEL
#include <string.h>

#define BF16_ACT 16  // the flag in gemm's kind argument
// Up to this many rows each row tile converts the codes itself (since the table lookup, as
// cheap as reading them back from a buffer); more: converted once per panel. Zen 4, against
// buffering from 9 rows: 9 rows 1.33x, 12 1.56x, 16 1.38x, 20 1.18x, 24 1.04x, 48 0.90x.
#define BF16_FEW_ROWS 24

#ifdef TINYSERVE_AMX_EMULATE
// As vcvtneps2bf16, in scalar code: nearest even; a denormal becomes a zero of its sign
// (checked on the AMX Xeon: 1e-39 -> 0x0000); a NaN stays a (quiet) NaN.
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (!(u & 0x7F800000)) return (u >> 16) & 0x8000;
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (u >> 16) | 0x40;
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
}
#endif

#ifdef __AVX512BF16__
int gemm_bf16(void) { return 1; }

// Two float vectors whose lanes are exact in bf16 -> one vector of (lo, hi) bf16 pairs.
// One vpermt2w: word 2c from lo's word 2c + 1 (lane c's high half), word 2c + 1 from hi's.
INLINE __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i pick = _mm512_set_epi32(
        0x3F001F, 0x3D001D, 0x3B001B, 0x390019, 0x370017, 0x350015, 0x330013, 0x310011,
        0x2F000F, 0x2D000D, 0x2B000B, 0x290009, 0x270007, 0x250005, 0x230003, 0x210001);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(lo), pick, _mm512_castps_si512(hi));
}

// bf16(i & 15) for word i = 0..31: vpermw reads an index's low 5 bits only.
static const uint16_t BF16_NIBBLE[32] __attribute__((aligned(64))) = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// Pair p (0..15) of block b of group g: weights p and p + 16 of each of the GW outputs.
// Q4_1 by table: dword c = byte c | byte c << 12 puts the low nibble in the low word's
// bits 0-3 (bit 4, the high nibble's, picks the table's identical second half) and the high
// nibble in the high word's; one vpermw turns both into bf16 — 4 instructions a pair
// vector where converting through floats takes 8 (1.03-1.18x at 1-8 rows on Zen 4, where
// the codes' conversion, not memory, bounds the tile). The same bf16 values, so the same
// results.
INLINE __m512i code_pairs(const weight_t *w, int64_t g, int64_t b, int p) {
    if (w->kind == 3) return _mm512_load_si512((const uint32_t *)w->qs + ((g * w->nb + b) * 16 + p) * GW);
    if (w->kind == 0) {
        const uint8_t *q = (const uint8_t *)w->qs + ((g * w->nb + b) * 16 + p) * GW;
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        return _mm512_permutexvar_epi16(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)),
                                        _mm512_load_si512(BF16_NIBBLE));
    }
    return bf16_pairs(q8_codes(w, g, b, p), q8_codes(w, g, b, p + 16));
}

INLINE vf DPBF16(vf acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

// One block of 32 activations rounded to bf16 (nearest even): xr the rounded values,
// pairs [16] the pairs (xr_p, xr_p+16).
INLINE void bf16_block(const float *xp, uint32_t *pairs, float *xr) {
    __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xp)));
    __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xp + 16)));
    _mm512_storeu_si512(pairs, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    _mm512_store_ps(xr, _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)));
    _mm512_store_ps(xr + 16, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
}

// MT rows (from row r0 of the activations) x NT groups (from g0): the pairs converted from
// the codes (buf NULL: few rows) or read from buf [NT, K/2, GW] (converted once per panel).
// The sums T stay in registers: 6 x 2 or 12 x 1 x (S, T) + the weight vectors + a broadcast
// fit in 32.
INLINE void tile_bf16(const weight_t *w, int64_t g0, const int NT, int prefetch,
                      const uint32_t *buf, const act_t *a, int r0, const int MT, float *y,
                      int64_t ldy) {
    const int64_t nb = w->nb, half = w->K / 2;
    vf T[12][2], S[12][2];  // MT x NT <= 12: up to 6 x 2, or 7-12 x 1
    for (int r = 0; r < MT; r++)
        for (int i = 0; i < NT; i++) T[r][i] = VZERO();
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) prefetch_block(w, g0 + PF_TILES(MT) * NT, NT, b, MT <= 6);
        for (int r = 0; r < MT; r++)
            for (int i = 0; i < NT; i++) S[r][i] = VZERO();
        for (int p = 0; p < 16; p++) {
            __m512i wv[2];
            for (int i = 0; i < NT; i++)
                wv[i] = buf ? _mm512_load_si512(buf + ((int64_t)i * half + b * 16 + p) * GW)
                            : code_pairs(w, g0 + i, b, p);
            for (int r = 0; r < MT; r++) {
                const __m512i xv = _mm512_set1_epi32((int)a->xb[(int64_t)(r0 + r) * a->ldxb + b * 16 + p]);
                for (int i = 0; i < NT; i++) S[r][i] = DPBF16(S[r][i], wv[i], xv);
            }
        }
        for (int r = 0; r < MT; r++)
            for (int i = 0; i < NT; i++) {
                const int64_t o = ((g0 + i) * nb + b) * GW;
                if (w->kind == 3) {
                    T[r][i] = _mm512_add_ps(T[r][i], S[r][i]);
                    continue;
                }
                T[r][i] = VFMA(VLOAD(w->d + o), S[r][i], T[r][i]);
                if (w->kind == 0) T[r][i] = VFMA(VLOAD(w->m + o), VSET1(a->sx[(r0 + r) * nb + b]), T[r][i]);
            }
    }
    for (int r = 0; r < MT; r++)
        for (int i = 0; i < NT; i++) VSTORE(y + (int64_t)(r0 + r) * ldy + i * GW, T[r][i]);
}

// One (rows, groups) tile with both counts fixed at compile time: up to 6 rows x NT groups,
// or 7-12 rows x 1 group.
INLINE void tile_bf16_any(const weight_t *w, int64_t g, int NT, int prefetch, const uint32_t *buf,
                          const act_t *a, int r0, int MT, float *y, int64_t ldy) {
#define BF16_CASE(M_)                                                                        \
    case M_:                                                                                 \
        if (M_ <= 6 && NT == 2) tile_bf16(w, g, 2, prefetch, buf, a, r0, M_, y, ldy);       \
        else tile_bf16(w, g, 1, prefetch, buf, a, r0, M_, y, ldy);                          \
        break;
    switch (MT) {  // M_ > 6: 1 group only (no 7-12 x 2 tile is compiled)
        BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6)
        BF16_CASE(7) BF16_CASE(8) BF16_CASE(9) BF16_CASE(10) BF16_CASE(11) BF16_CASE(12)
        default: break;
    }
#undef BF16_CASE
}

// Groups [g0, g1)'s codes as bf16 pairs into dst [g1 - g0, K/2, GW]: a group's block b, pair
// p at (b * 16 + p) * GW.
static void bf16_pack(const weight_t *w, int64_t g0, int64_t g1, uint32_t *dst) {
    for (int64_t g = g0; g < g1; g++)
        for (int64_t b = 0; b < w->nb; b++)
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(dst + (((g - g0) * w->nb + b) * 16 + p) * GW, code_pairs(w, g, b, p));
}

// Rows [0, M) x groups [g0, g1) into y (group g0's first output); buf: this thread's
// scratch, >= K x GW pairs. Up to BF16_FEW_ROWS rows: each row tile converts the codes in
// registers; more: converted once per panel into buf. 7-12 rows (a verification run of 6-11
// drafts, a small decode batch) are one tile of 1 group rather than two of 2: each converted
// pair vector serves every row, and the step from 6 to 7 rows costs a row, not a second pass
// (Zen 4, min ms: 7 rows 1.20x, 8-10 1.10-1.11x, 12 1.02x; 13-24 as 12 x 1 tiles 0.96-1.10x:
// not taken). packed (NULL: none): the groups' pairs converted already, [g1 - g0, K/2, GW]
// (bf16_pack; gemm_score.h converts a slice once for all its panels), read as buf would be.
static void bf16_rows_packed(const weight_t *w, const act_t *a, uint32_t *buf,
                             const uint32_t *packed, float *y, int64_t ldy, int64_t g0, int64_t g1) {
    const int M = a->M;
    const int64_t half = w->K / 2;
    const int few = M <= BF16_FEW_ROWS && !packed;
    for (int p0 = 0; p0 < M; p0 += PANEL) {
        const int pm = M - p0 < PANEL ? M - p0 : PANEL;
        const int wide = few && pm > 6 && pm <= 12;  // one tile of pm rows x 1 group
        const int tiles = wide ? 1 : (pm + 5) / 6, mt = (pm + tiles - 1) / tiles;  // balanced
        for (int64_t g = g0; g < g1;) {
            const int NG = !wide && g + 2 <= g1 ? 2 : 1;
            // bf16 weights are pairs already, in the buffer's layout: read in place
            const uint32_t *pairs = w->kind == 3 ? (const uint32_t *)w->qs + g * half * GW
                                    : packed      ? packed + (g - g0) * half * GW
                                                  : buf;
            if (!few && w->kind != 3 && !packed) bf16_pack(w, g, g + NG, buf);
            const int prefetch = few && (NG == 2 || wide) && g + (PF_TILES(mt) + 1) * NG <= g1;
            for (int r = p0; r < p0 + pm; r += mt) {
                const int rows = p0 + pm - r < mt ? p0 + pm - r : mt;
                tile_bf16_any(w, g, NG, prefetch && r == p0, few ? NULL : pairs, a, r, rows,
                              y + (g - g0) * GW, ldy);
            }
            g += NG;
        }
    }
}
#define bf16_rows(w, a, buf, y, ldy, g0, g1) bf16_rows_packed(w, a, buf, NULL, y, ldy, g0, g1)
#elif defined(TINYSERVE_AMX_EMULATE)  // gemm_amx.h's emulated tiles serve bf16 calls
int gemm_bf16(void) { return 1; }
INLINE void bf16_block(const float *xp, uint32_t *pairs, float *xr) {  // in scalar code
    for (int p = 0; p < 32; p++) {
        const uint32_t h = bf16_bits(xp[p]) << 16;
        memcpy(&xr[p], &h, 4);
    }
    for (int p = 0; p < 16; p++) pairs[p] = bf16_bits(xr[p]) | bf16_bits(xr[p + 16]) << 16;
}
#else  // gemm() answers -2 to a bf16 call here, so these are never reached
int gemm_bf16(void) { return 0; }
#define bf16_rows(...) ((void)0)
#define bf16_rows_packed(...) ((void)0)
#define bf16_pack(...) ((void)0)
#define bf16_activations(...) ((void)0)
#endif

#if defined(__AVX512BF16__) || defined(TINYSERVE_AMX_EMULATE)
// x rows rounded to bf16: xb [M, K/2] pairs (block b's pair p at b * 16 + p) and, for Q4_1,
// sx [M, nb] the block sums of the rounded values (block_sum's order).
static void bf16_activations(const float *x, int64_t ldx, int M, int64_t K, int kind,
                             uint32_t *xb, float *sx) {
    const int64_t nb = K / 32;
    float xr[32] __attribute__((aligned(64)));
    for (int r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            bf16_block(x + (int64_t)r * ldx + b * 32, xb + (int64_t)r * (K / 2) + b * 16, xr);
            if (kind == 0) sx[r * nb + b] = block_sum(xr);
        }
}
#endif

#endif
