// y[r, n] = sum_k W[n, k] * x[r, k] with the activations quantised to 8 bits per block of 32
// (as llama.cpp multiplies its GGUF blocks), for any number of rows r. Weights as in gemm.c:
//   kind 0  Q4_1 blocks: qs [N, K/32, 16] (low nibbles = weights 0..15), d, m [N, K/32]
//   kind 1  Q8_0 blocks (or int8 per channel): qs int8 [N, K], d [N, K/32]
// Activations, per row r and block b: dx = max|x| / 127, qx = round(x / dx) in int8 (round
// half to even), sx = dx * sum(qx). Then per block
//   Q4_1: d*dx * sum(q * qx) + m * sx        Q8_0: d*dx * sum(q * qx)
// The integer sums are exact (maddubs: |u4 * i8| pairs <= 3810, |i8 * i8| pairs <= 32512,
// no saturation); only dx's rounding of x moves the result: |error| <= sum_b dx_b / 2 *
// sum_k |w_k| over the block. AVX2 + FMA (+ AVX512-VNNI where built for it), K % 32 == 0.
//
// Batch invariance, as in gemm.c: every y[r, n] is the same sequence of float operations
// whatever M, the tiling and the thread count: one 8-lane accumulator per (n, r) takes
// acc = fma(d*dx, float(int sums), acc) over the blocks in order; y = hsum8(acc) plus,
// for Q4_1, the minima sum_b m * sx in a fixed order (dotf). A row is quantised alone.
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include <math.h>

#define PF_TILES 2  // prefetch the tile this many tiles ahead (1-2 best here; 4, 8 worse)

typedef struct {
    int kind;
    const uint8_t *qs;
    const float *d, *m;
    int64_t K, N;
    const int8_t *qx;  // [M, K] quantised activations
    const float *dx, *sx;  // [M, K/32]
} qgemm_t;

// Row r of x [.., K] into qx [K], dx and sx [K/32].
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + j * 8);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h), d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4];
        for (int j = 0; j < 4; j++)  // cvtps rounds half to even (the default MXCSR mode)
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
        // Sum of the codes, then pack 32 int32 -> 32 int8 in order.
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        // packs works within 128-bit lanes: restore the element order 0..31.
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qx + b * 32), p);
        dx[b] = d;
        sx[b] = d * (float)_mm_cvtsi128_si32(s4);
    }
}

// The 32 codes of block b of output n as bytes (Q4_1: unsigned 0..15; Q8_0: signed).
INLINE __m256i codes(const qgemm_t *w, const int kind, int64_t n, int64_t b) {
    const int64_t nb = w->K / 32;
    if (kind == 0) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(w->qs + (n * nb + b) * 16));
        const __m128i low = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    return _mm256_loadu_si256((const __m256i *)(w->qs + n * w->K + b * 32));
}

// 8 int32 partial sums of codes . qx as floats, lane j = the products of bytes 4j..4j+3.
// With AVX512-VNNI one vpdpbusd; else maddubs (pairs, no saturation: see above) and madd
// (pairs of pairs). Both are exact, so the two give the same integers, and the same floats.
INLINE __m256 dot32(int kind, __m256i wq, __m256i wabs, __m256i xq) {
    const __m256i xs = kind == 0 ? xq : _mm256_sign_epi8(xq, wq), wu = kind == 0 ? wq : wabs;
#ifdef __AVX512VNNI__
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, xs));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), ones));
#endif
}

// sum_b a[b] * b[b] in a fixed order (8 lanes, then the lanes, then the tail).
INLINE float dotf(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

// One tile: NT outputs x MT rows.
INLINE void tile(const qgemm_t *w, const int kind, int64_t n0, const int NT, int64_t r0,
                 const int MT, float *y, int64_t ldy) {
    __m256 acc[4][4];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm256_setzero_ps();
    const int64_t nb = w->K / 32;
    const int64_t cb = kind == 0 ? 16 : 32, ahead = n0 + PF_TILES * NT;
    const int prefetch = ahead + NT <= w->N;
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) prefetch_tile(w->qs, w->d, kind == 0 ? w->m : NULL, ahead, NT, nb, cb, b);
        __m256i wq[4], wabs[4];
        float dw[4];
        for (int i = 0; i < NT; i++) {
            wq[i] = codes(w, kind, n0 + i, b);
            wabs[i] = kind == 0 ? wq[i] : _mm256_sign_epi8(wq[i], wq[i]);
            dw[i] = w->d[(n0 + i) * nb + b];
        }
        for (int r = 0; r < MT; r++) {
            const int64_t row = (r0 + r) * nb + b;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(w->qx + row * 32));
            const float dx = w->dx[row];
            for (int i = 0; i < NT; i++)
                acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[i] * dx),
                                            dot32(kind, wq[i], wabs[i], xq), acc[i][r]);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) {
            float v = hsum8(acc[i][r]);
            if (kind == 0) v += dotf(w->m + (n0 + i) * nb, w->sx + (r0 + r) * nb, nb);
            y[(r0 + r) * ldy + n0 + i] = v;
        }
}

// Decode (up to FEW rows): 4 outputs per tile, one row at a time; more rows: 2 outputs x 4 rows, rows in panels whose
// codes (PANEL x K bytes) stay in L2 while every output pair passes over them.
#define NT1 4
#define FEW 2
#define NT_MANY 2
#define MT_MANY 4
#define PANEL 128

INLINE void rows_kind(const qgemm_t *w, const int kind, int M, float *y, int64_t ldy,
                      int64_t n0, int64_t n1) {
    if (M <= FEW) {  // each 4-output tile once per row while its codes are in L1
        int64_t n = n0;
        for (; n + NT1 <= n1; n += NT1)
            for (int r = 0; r < M; r++) tile(w, kind, n, NT1, r, 1, y, ldy);
        for (; n < n1; n++)
            for (int r = 0; r < M; r++) tile(w, kind, n, 1, r, 1, y, ldy);
        return;
    }
    for (int p0 = 0; p0 < M; p0 += PANEL) {
        const int p1 = M - p0 < PANEL ? M : p0 + PANEL;
        int64_t n = n0;
        for (; n + NT_MANY <= n1; n += NT_MANY) {
            int r = p0;
            for (; r + MT_MANY <= p1; r += MT_MANY) tile(w, kind, n, NT_MANY, r, MT_MANY, y, ldy);
            for (; r < p1; r++) tile(w, kind, n, NT_MANY, r, 1, y, ldy);
        }
        for (; n < n1; n++)
            for (int r = p0; r < p1; r++) tile(w, kind, n, 1, r, 1, y, ldy);
    }
}

// One copy per weight kind: the kind is a constant in each, so its branches fold away.
static void rows_q4_1(const qgemm_t *w, int M, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    rows_kind(w, 0, M, y, ldy, n0, n1);
}
static void rows_q8_0(const qgemm_t *w, int M, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    rows_kind(w, 1, M, y, ldy, n0, n1);
}

// Entry point (ctypes). Returns 0, or -1 when the activation buffers cannot be allocated.
int qgemm(int kind, const void *qs, const float *d, const float *m, const float *x,
          int64_t ldx, float *y, int64_t ldy, int64_t N, int64_t K, int M, int nthreads) {
    const int64_t nb = K / 32;
    int8_t *qx = (int8_t *)malloc((size_t)M * K);
    float *dx = (float *)malloc((size_t)M * nb * 2 * sizeof(float));
    if (qx == NULL || dx == NULL) {
        free(qx);
        free(dx);
        return -1;
    }
    float *sx = dx + (size_t)M * nb;
    qgemm_t w = {kind, (const uint8_t *)qs, d, m, K, N, qx, dx, sx};
    void (*fn)(const qgemm_t *, int, float *, int64_t, int64_t, int64_t) =
        kind == 0 ? rows_q4_1 : rows_q8_0;
    if (nthreads <= 1 || N < 8) {
        for (int r = 0; r < M; r++) quantize_row(x + r * ldx, K, qx + r * K, dx + r * nb, sx + r * nb);
        fn(&w, M, y, ldy, 0, N);
    } else {
#pragma omp parallel num_threads(nthreads)
        {
            THREAD_INDEX(t, T);
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++)
                quantize_row(x + r * ldx, K, qx + r * K, dx + r * nb, sx + r * nb);
            // (the implicit barrier of omp for: every row is quantised before any tile)
            int64_t units = (N + 3) / 4, per = (units + T - 1) / T;
            int64_t n0 = t * per * 4, n1 = (t + 1) * per * 4;
            if (n1 > N) n1 = N;
            if (n0 < n1) fn(&w, M, y, ldy, n0, n1);
        }
    }
    free(qx);
    free(dx);
    return 0;
}
