// What gemm.c's three paths share: the float tiles (gemm.c), the bf16 tiles (gemm_bf16.h)
// and the AMX tiles (gemm_amx.h) read the same weights (gemm.c: the layout) and the same
// activations, through these types and helpers. It defines code, not only declarations:
// for gemm.c's library only (directly and through gemm_bf16.h and gemm_amx.h), as every
// kernel source is compiled into its own library (build.py).
#ifndef TINYSERVE_GEMM_COMMON_H
#define TINYSERVE_GEMM_COMMON_H
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE, vf / GW
#include <string.h>

// One weight in the kernel layout (gemm.c): kind 0 Q4_1, 1 Q8_0, 2 float32, 3 bf16 pairs (the
// bf16-activation paths only; no scales); nb = K / 32.
typedef struct {
    int kind;
    const void *qs;
    const float *d, *m;
    int64_t K, N, nb;
} weight_t;

// One call's activations: x rows at ldx, their Q4_1 block sums sx, computed once; bf16 mode
// (gemm_bf16.h, gemm_amx.h): xb [XB_ROWS(M), ldxb] the rows as bf16 pairs, sx their sums.
typedef struct {
    const float *x, *sx;
    int64_t ldx;
    int M;
    const uint32_t *xb;  // [XB_ROWS(M), ldxb]
    int64_t ldxb;
} act_t;

#define PANEL 128  // many rows: row panels whose x stays in L2

INLINE float block_sum(const float *x) {
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
    return hsum8(s);
}

// Step p (0..15) of block b of group g, Q4_1: the codes of weights p (lo) and p + 16 (hi).
INLINE void q4_codes(const weight_t *w, int64_t g, int64_t b, int p, vf *lo, vf *hi) {
    const uint8_t *q = (const uint8_t *)w->qs + ((g * w->nb + b) * 16 + p) * GW;
#ifdef __AVX512F__
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#else
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#endif
}

// Weight j (0..31) of block b of group g, Q8_0.
INLINE vf q8_codes(const weight_t *w, int64_t g, int64_t b, int j) {
    const int8_t *q = (const int8_t *)w->qs + ((g * w->nb + b) * 32 + j) * GW;
#ifdef __AVX512F__
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#endif
}

// Prefetch block b of the NT groups at ga (codes, scales, minima) while an earlier tile
// computes. L2: prefetcht1, for the memory-bound tiles (1-2 rows; bf16 up to 6), and 1-2 rows
// prefetch 1 tile ahead, not 2: a 1-row step's matmuls 1.26-1.40x, then 1.01-1.06x (Zen 4,
// benchmarks/README.md; likely as an L1 prefetch holds one of the few L1 miss buffers).
INLINE void prefetch_block(const weight_t *w, int64_t ga, int NT, int64_t b, const int L2) {
    const int64_t cb = (w->kind == 0 ? 16 : w->kind == 3 ? 64 : 32) * GW;  // a group's block
    for (int i = 0; i < NT; i++) {
        const char *q = (const char *)w->qs + ((ga + i) * w->nb + b) * cb;
        for (int64_t off = 0; off < cb; off += 64) prefetch_line(q + off, L2);
        if (w->kind != 3 && (b * GW * 4) % 64 == 0) {  // a line of scales (and minima) per 64 B
            prefetch_line(w->d + ((ga + i) * w->nb + b) * GW, L2);
            if (w->kind == 0) prefetch_line(w->m + ((ga + i) * w->nb + b) * GW, L2);
        }
    }
}

#define PF_TILES(MT) ((MT) <= 2 ? 1 : 2)  // how many tiles ahead the few-row tiles prefetch

#endif
