// y[r, n] = sum_k W[n, k] * x[r, k] for any number of rows r, from weights stored as
//   kind 0  Q4_1 blocks (GGUF): qs[N, K/32, 16] low nibbles = weights 0..15 of the block,
//           high = 16..31; d, m float32 [N, K/32]: w = d * q + m
//   kind 1  Q8_0 blocks (GGUF) or int8 per channel: qs int8 [N, K], d float32 [N, K/32]:
//           w = d * q
//   kind 2  float32 [N, K] (the dense weight, for the batch-invariant path)
// AVX2 + FMA, K % 32 == 0.
//
// Batch invariance is the contract: every output y[r, n] is computed by the same sequence
// of float operations whatever M is, however rows and outputs are tiled, and however many
// threads run. Each weight block is dequantised to 4 x 8 floats (the same ops every time),
// one 8-lane accumulator per (n, r) takes acc = fma(w, x, acc) over the blocks in order,
// and the 8 lanes are summed last in a fixed tree. Tiling only decides which (n, r) pairs
// share a dequantised block; it never changes what is added to what.
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE

typedef struct {
    int kind;
    const void *qs;
    const float *d, *m;
    int64_t K, N;
} weight_t;

#define PF_TILES 2  // decode tiles prefetch the tile this many tiles ahead

// The 8 weights j*8 .. j*8+7 of block b of output row n, as floats.
INLINE __m256 weights8(const weight_t *w, int64_t n, int64_t b, int j) {
    const int64_t nb = w->K / 32;
    if (w->kind == 0) {
        const uint8_t *q = (const uint8_t *)w->qs + (n * nb + b) * 16 + (j & 1) * 8;
        __m128i raw = _mm_loadl_epi64((const __m128i *)q);
        if (j >= 2) raw = _mm_srli_epi16(raw, 4);
        raw = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
        return _mm256_fmadd_ps(_mm256_set1_ps(w->d[n * nb + b]), qf,
                               _mm256_set1_ps(w->m[n * nb + b]));
    }
    if (w->kind == 1) {
        const int8_t *q = (const int8_t *)w->qs + n * w->K + b * 32 + j * 8;
        __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
        return _mm256_mul_ps(_mm256_set1_ps(w->d[n * nb + b]), qf);
    }
    return _mm256_loadu_ps((const float *)w->qs + n * w->K + b * 32 + j * 8);
}

// One tile: NT output rows x MT activation rows, accumulators in registers.
INLINE void tile(const weight_t *w, int64_t n0, const int NT, const float *x, int64_t ldx,
                 const int MT, float *y, int64_t ldy) {
    __m256 acc[8][6];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm256_setzero_ps();
    const int64_t nb = w->K / 32;
    const int64_t ahead = n0 + PF_TILES * NT;
    const int prefetch = w->kind != 2 && MT <= 2 && ahead + NT <= w->N;  // decode tiles
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch)
            prefetch_tile(w->qs, w->d, w->kind == 0 ? w->m : NULL, ahead, NT, nb,
                          w->kind == 0 ? 16 : 32, b);
        for (int j = 0; j < 4; j++) {
            __m256 wv[8];
            for (int i = 0; i < NT; i++) wv[i] = weights8(w, n0 + i, b, j);
            for (int r = 0; r < MT; r++) {
                __m256 xv = _mm256_loadu_ps(x + r * ldx + b * 32 + j * 8);
                for (int i = 0; i < NT; i++) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) y[r * ldy + n0 + i] = hsum8(acc[i][r]);
}

// The same tile over float32 rows (the dequantised buffer, or a dense weight).
INLINE void tile_f32(const weight_t *w, int64_t n0, const int NT, const float *x, int64_t ldx,
                     const int MT, float *y, int64_t ldy) {
    weight_t c = *w;
    c.kind = 2;
    tile(&c, n0, NT, x, ldx, MT, y, ldy);
}

// Q4_1, one row: the same floats and FMAs as tile() (so the same results), with each
// block's 16 code bytes loaded once and its scale/minimum broadcast once. It spells out
// block32's dequantisation interleaved with the FMAs on purpose: calling block32 keeps four
// dequantised vectors live per output next to the 6 accumulators and 4 activations, and
// the decode step's matmuls got 4-7% slower (bench_kernels --baseline-rev, 1 row, 3 runs).
INLINE void tile_q4_1_m1(const weight_t *w, int64_t n0, const int NT, const float *x, float *y) {
    __m256 acc[8];
    for (int i = 0; i < NT; i++) acc[i] = _mm256_setzero_ps();
    const int64_t nb = w->K / 32;
    const __m128i low = _mm_set1_epi8(0x0F);
    const int64_t ahead = n0 + PF_TILES * NT;
    const int prefetch = ahead + NT <= w->N;
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) prefetch_tile(w->qs, w->d, w->m, ahead, NT, nb, 16, b);
        const __m256 x0 = _mm256_loadu_ps(x + b * 32), x1 = _mm256_loadu_ps(x + b * 32 + 8);
        const __m256 x2 = _mm256_loadu_ps(x + b * 32 + 16), x3 = _mm256_loadu_ps(x + b * 32 + 24);
        for (int i = 0; i < NT; i++) {
            const int64_t blk = (n0 + i) * nb + b;
            __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)w->qs + blk * 16));
            __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
            __m256 d = _mm256_set1_ps(w->d[blk]), m = _mm256_set1_ps(w->m[blk]);
            __m256 w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
            acc[i] = _mm256_fmadd_ps(w0, x0, acc[i]);
            __m256 w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
            acc[i] = _mm256_fmadd_ps(w1, x1, acc[i]);
            __m256 w2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
            acc[i] = _mm256_fmadd_ps(w2, x2, acc[i]);
            __m256 w3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
            acc[i] = _mm256_fmadd_ps(w3, x3, acc[i]);
        }
    }
    for (int i = 0; i < NT; i++) y[n0 + i] = hsum8(acc[i]);
}

// All 32 weights of block b of output row n as 4 x 8 floats: exactly weights8(w, n, b, j)
// for j = 0..3, with the block's code bytes loaded and its scale/minimum broadcast once.
INLINE void block32(const weight_t *w, int64_t n, int64_t b, __m256 out[4]) {
    const int64_t blk = n * (w->K / 32) + b;
    if (w->kind == 0) {
        const __m128i low = _mm_set1_epi8(0x0F);
        __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)w->qs + blk * 16));
        __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        __m256 d = _mm256_set1_ps(w->d[blk]), m = _mm256_set1_ps(w->m[blk]);
        out[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
        out[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
        out[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
        out[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
        return;
    }
    for (int j = 0; j < 4; j++) out[j] = weights8(w, n, b, j);
}

// A few rows (2..8: a verification run, a small batch): each block of an output row is
// dequantised once into registers and used by all MT rows (the many-row path writes it to a
// buffer and reads it back; at few rows that traffic costs more than the FMAs).
INLINE void tile_rows(const weight_t *w, int64_t n0, const int NT, const float *x, int64_t ldx,
                      const int MT, float *y, int64_t ldy) {
    __m256 acc[2][8];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm256_setzero_ps();
    const int64_t nb = w->K / 32;
    const int64_t ahead = n0 + PF_TILES * NT;
    const int prefetch = w->kind != 2 && ahead + NT <= w->N;
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch)
            prefetch_tile(w->qs, w->d, w->kind == 0 ? w->m : NULL, ahead, NT, nb,
                          w->kind == 0 ? 16 : 32, b);
        for (int i = 0; i < NT; i++) {
            __m256 wv[4];
            block32(w, n0 + i, b, wv);
            for (int r = 0; r < MT; r++) {
                const float *xr = x + r * ldx + b * 32;
                for (int j = 0; j < 4; j++)
                    acc[i][r] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xr + j * 8), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) y[r * ldy + n0 + i] = hsum8(acc[i][r]);
}

#define MAX_ROWS 8

// M = 2..MAX_ROWS rows of a quantised weight: tile_rows with M (and NT outputs per tile: 2
// up to 4 rows, then 1, so the NT x MT accumulators stay in registers) compile-time constants.
// Against the buffered path at SmolLM2's shapes (Zen 1, 2 threads, min of 12): M=2 26 -> 21
// ms, M=5 40 -> 33 ms, M=8 59 -> 47 ms for the 121 matmuls of a step.
INLINE void tiles_rows(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                       int64_t ldy, int64_t n0, int64_t n1) {
#define ROWS_CASE(MT, NT)                                                           \
    case MT: {                                                                      \
        int64_t n = n0;                                                             \
        for (; n + NT <= n1; n += NT) tile_rows(w, n, NT, x, ldx, MT, y, ldy);      \
        for (; n < n1; n++) tile_rows(w, n, 1, x, ldx, MT, y, ldy);                 \
        break;                                                                      \
    }
    switch (M) {
        ROWS_CASE(2, 2) ROWS_CASE(3, 2) ROWS_CASE(4, 2)
        ROWS_CASE(5, 1) ROWS_CASE(6, 1) ROWS_CASE(7, 1) ROWS_CASE(8, 1)
        default: break;
    }
#undef ROWS_CASE
}

// Few rows (decode): many outputs per tile so enough independent FMA chains are in flight.
#define NT_FEW1 6
#define NT_FEW2 4
// Many rows (prefill, big batches): a 2 x 6 register tile, rows in panels that stay in L2.
#define NT_MANY 2
#define MT_MANY 6
#define PANEL 48

INLINE void tiles_few(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                      int64_t ldy, int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (M == 1 && w->kind == 0)
        for (; n + NT_FEW1 <= n1; n += NT_FEW1) tile_q4_1_m1(w, n, NT_FEW1, x, y);
    else if (M == 1)
        for (; n + NT_FEW1 <= n1; n += NT_FEW1) tile(w, n, NT_FEW1, x, ldx, 1, y, ldy);
    else
        for (; n + NT_FEW2 <= n1; n += NT_FEW2) tile(w, n, NT_FEW2, x, ldx, 2, y, ldy);
    for (; n < n1; n++) {
        if (M == 1) tile(w, n, 1, x, ldx, 1, y, ldy);
        else tile(w, n, 1, x, ldx, 2, y, ldy);
    }
}

static void rows_kind(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                      int64_t ldy, int64_t n0, int64_t n1) {
    if (M == 1 || (M == 2 && w->kind == 2)) {
        tiles_few(w, x, ldx, M, y, ldy, n0, n1);
        return;
    }
    if (M <= MAX_ROWS && w->kind != 2) {
        tiles_rows(w, x, ldx, M, y, ldy, n0, n1);
        return;
    }
    // Quantised weights: each pair of output rows is dequantised once per panel into a
    // float buffer (the same floats weights8 gives) and the float tile runs over it, so the
    // dequantisation is shared by the panel's rows instead of by one register tile.
    float *buf = w->kind == 2 ? NULL : (float *)aligned_alloc(32, NT_MANY * w->K * sizeof(float));
    if (w->kind != 2 && buf == NULL) {  // no buffer: one row at a time (same arithmetic)
        for (int r = 0; r < M; r++) tiles_few(w, x + (int64_t)r * ldx, ldx, 1, y + (int64_t)r * ldy, ldy, n0, n1);
        return;
    }
    weight_t wb = {2, buf, NULL, NULL, w->K, NT_MANY};
    for (int p0 = 0; p0 < M; p0 += PANEL) {
        const int pm = M - p0 < PANEL ? M - p0 : PANEL;
        const float *xp = x + (int64_t)p0 * ldx;
        float *yp = y + (int64_t)p0 * ldy;
        int64_t n = n0;
        for (; n + NT_MANY <= n1; n += NT_MANY) {
            const weight_t *wt = w;
            int64_t nt = n;
            if (buf != NULL) {
                for (int i = 0; i < NT_MANY; i++)
                    for (int64_t b = 0; b < w->K / 32; b++)
                        for (int j = 0; j < 4; j++)
                            _mm256_storeu_ps(buf + i * w->K + b * 32 + j * 8, weights8(w, n + i, b, j));
                wt = &wb;
                nt = 0;
            }
            // yt points at the tile's first output column relative to nt.
            float *yt = yp + (n - nt);
            int r = 0;
            for (; r + MT_MANY <= pm; r += MT_MANY)
                tile_f32(wt, nt, NT_MANY, xp + r * ldx, ldx, MT_MANY, yt + r * ldy, ldy);
            switch (pm - r) {
                case 5: tile_f32(wt, nt, NT_MANY, xp + r * ldx, ldx, 5, yt + r * ldy, ldy); break;
                case 4: tile_f32(wt, nt, NT_MANY, xp + r * ldx, ldx, 4, yt + r * ldy, ldy); break;
                case 3: tile_f32(wt, nt, NT_MANY, xp + r * ldx, ldx, 3, yt + r * ldy, ldy); break;
                case 2: tile_f32(wt, nt, NT_MANY, xp + r * ldx, ldx, 2, yt + r * ldy, ldy); break;
                case 1: tile_f32(wt, nt, NT_MANY, xp + r * ldx, ldx, 1, yt + r * ldy, ldy); break;
                default: break;
            }
        }
        for (; n < n1; n++)
            for (int r = 0; r < pm; r++) tile(w, n, 1, xp + r * ldx, ldx, 1, yp + r * ldy, ldy);
    }
    free(buf);
}

// One specialised copy per weight kind (the kind branch folds away inside each).
static void rows_q4_1(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                      int64_t ldy, int64_t n0, int64_t n1) {
    weight_t c = *w;
    c.kind = 0;
    rows_kind(&c, x, ldx, M, y, ldy, n0, n1);
}
static void rows_q8_0(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                      int64_t ldy, int64_t n0, int64_t n1) {
    weight_t c = *w;
    c.kind = 1;
    rows_kind(&c, x, ldx, M, y, ldy, n0, n1);
}
static void rows_f32(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                     int64_t ldy, int64_t n0, int64_t n1) {
    weight_t c = *w;
    c.kind = 2;
    rows_kind(&c, x, ldx, M, y, ldy, n0, n1);
}

// Entry point (ctypes). Output rows are split over threads in multiples of 6 (so a thread
// boundary never splits a tile differently; not needed for the numbers, kept for speed).
void gemm(int kind, const void *qs, const float *d, const float *m, const float *x,
          int64_t ldx, float *y, int64_t ldy, int64_t N, int64_t K, int M, int nthreads) {
    weight_t w = {kind, qs, d, m, K, N};
    void (*fn)(const weight_t *, const float *, int64_t, int, float *, int64_t, int64_t,
               int64_t) = kind == 0 ? rows_q4_1 : kind == 1 ? rows_q8_0 : rows_f32;
    if (nthreads <= 1 || N < 12) {
        fn(&w, x, ldx, M, y, ldy, 0, N);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        THREAD_INDEX(t, T);
        int64_t units = (N + 5) / 6, per = (units + T - 1) / T;
        int64_t n0 = t * per * 6, n1 = (t + 1) * per * 6;
        if (n1 > N) n1 = N;
        if (n0 < n1) fn(&w, x, ldx, M, y, ldy, n0, n1);
    }
}
