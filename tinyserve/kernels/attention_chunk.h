// One chunk of attention.c's block-table attention: the partial (score maximum, exp-sum,
// weighted value sum) of up to CHUNK keys for the rows of a group and the G query heads of
// one KV head, with the next chunk's cache lines prefetched meanwhile. A header of
// attention.c's (and attention_amx.h's); see attention.c for the layout and the rules.
#ifndef TINYSERVE_ATTENTION_CHUNK_H
#define TINYSERVE_ATTENTION_CHUNK_H
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include <math.h>

#define CHUNK 64  // keys per chunk

// Lane i = hsum of a[i]: the 8 dot products of a key group as one vector.
INLINE __m256 hsum8x8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Elements d .. d+7 of a cache row as floats: float32 (BF 0) or bf16 widened (BF 1).
INLINE __m256 load_kv(const void *row, int64_t d, const int BF) {
    if (BF) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + d);
}

typedef struct {
    const void *k_cache, *v_cache;  // float32, or bf16 (uint16) when bf16
    int block_size, H, KVH, D, bf16;
    float scale;
} attn_t;

// Query vectors per pass over a chunk's keys (QB) and values (QV): each key or value vector
// loaded once serves that many queries (the G heads of a row, then the next rows of the
// group). 8 * QB score accumulators or 8 * QV value accumulators, plus the operands, must
// stay in registers: 3 with AVX-512VL's 32 vector registers, 1 with AVX2's 16.
#ifdef __AVX512VL__
#define QB 3
#define QV 3
#else
#define QB 1
#define QV 1
#endif

// Scores of NQ queries qs[m] against keys i0 .. i0+7: lane d%8 of acc[m][i] sums q[d] k_i[d]
// over d in order, then hsum8x8 and the scale — per (query, key) the same operations
// whatever NQ is, so a row's scores do not depend on the rows it shares a pass with.
INLINE void scores8(const void *const *kp, int i0, const float *const *qs, int D, __m256 scale,
                    float *const *ps, const int NQ, const int BF) {
    __m256 acc[QB][8];
    for (int m = 0; m < NQ; m++)
        for (int i = 0; i < 8; i++) acc[m][i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 qv[QB];
        for (int m = 0; m < NQ; m++) qv[m] = _mm256_loadu_ps(qs[m] + d);
        for (int i = 0; i < 8; i++) {
            const __m256 kv = load_kv(kp[i0 + i], d, BF);
            for (int m = 0; m < NQ; m++) acc[m][i] = _mm256_fmadd_ps(qv[m], kv, acc[m][i]);
        }
    }
    for (int m = 0; m < NQ; m++)
        _mm256_storeu_ps(ps[m] + i0, _mm256_mul_ps(hsum8x8(acc[m]), scale));
}

// os[m][d0 .. d0+8*NV) = sum_{i < n} ps[m][i] * v_i[d0 ..] for NQ queries, the accumulators
// in registers; each value vector is loaded once for the NQ queries. Per output element the
// same FMA sequence whatever NQ is (a query whose own keys end before n has p = 0 there:
// adding 0 * v leaves its sum bitwise as it was, and the sum never holds -0).
INLINE void weighted_sums(const void *const *vp, const float *const *ps, int n, int64_t d0,
                          float *const *os, const int NQ, const int NV, const int BF) {
    __m256 acc[QV][8];
    for (int m = 0; m < NQ; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm256_setzero_ps();
    for (int i = 0; i < n; i++) {
        __m256 pb[QV];
        for (int m = 0; m < NQ; m++) pb[m] = _mm256_set1_ps(ps[m][i]);
        for (int v = 0; v < NV; v++) {
            const __m256 x = load_kv(vp[i], d0 + v * 8, BF);
            for (int m = 0; m < NQ; m++) acc[m][v] = _mm256_fmadd_ps(pb[m], x, acc[m][v]);
        }
    }
    for (int m = 0; m < NQ; m++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(os[m] + d0 + v * 8, acc[m][v]);
}

// call(NQ) with NQ = nq as a compile-time constant (1 .. maxq, maxq <= 3).
#define BY_NQ(call, nq, maxq)                          \
    do {                                               \
        if ((nq) == (maxq)) call(maxq);                \
        else if ((nq) == 1) call(1);                   \
        else if ((maxq) > 2 && (nq) == 2) call(2);     \
    } while (0)

// The chunk a thread computes next (n == 0: none): its keys' cache lines are prefetched into
// L2 while this chunk's passes compute, so that the next chunk's first pass does not wait on
// memory (a one-stream step reads its ~1 MB per layer of keys and values cold: the weights
// streamed between two layers' attention evict them).
typedef struct {
    const int32_t *table;
    int64_t g, j0;
    int n;
} next_t;

// Slot pointers of keys j0 .. j0+n-1 of KV head g (k and v), no division per key.
INLINE void slot_ptrs(const attn_t *a, const int32_t *table, int64_t g, int64_t j0, int n,
                      const void **kp, const void **vp, const int64_t esize) {
    const int64_t row = (int64_t)a->KVH * a->D;  // elements per cache slot
    int64_t blk = j0 / a->block_size, off = j0 % a->block_size;
    for (int i = 0; i < n; i++) {
        const int64_t at = (((int64_t)table[blk] * a->block_size + off) * row + g * a->D) * esize;
        kp[i] = (const char *)a->k_cache + at;
        vp[i] = (const char *)a->v_cache + at;
        if (++off == a->block_size) off = 0, blk++;
    }
}

// The next chunk's cache lines as this chunk's passes prefetch them: its keys' slots kp and
// values' vp, n keys (0: no next chunk) of lpr lines each, per lines a pass, from line at.
typedef struct {
    const void **kp, **vp;
    int n, lpr, per, at;
} next_lines_t;

// Prefetch lines [*at, *at + count) of the next chunk (its keys' lines, then its values'):
// lpr lines per key, n keys.
INLINE void prefetch_next(const void *const *nkp, const void *const *nvp, int n, int lpr,
                          int *at, int count) {
    const int half = n * lpr, end = *at + count < 2 * half ? *at + count : 2 * half;
    for (; *at < end; ++*at) {
        const int l = *at < half ? *at : *at - half;  // line l % lpr of key l / lpr
        _mm_prefetch((const char *)(*at < half ? nkp : nvp)[l / lpr] + 64 * (l % lpr), _MM_HINT_T1);
    }
}

// One pass's share of the next chunk's lines (none without a next chunk).
INLINE void prefetch_pass(next_lines_t *nl) {
    if (nl->n) prefetch_next(nl->kp, nl->vp, nl->n, nl->lpr, &nl->at, nl->per);
}

// Scores of M queries qs[m] into ps[m] against keys 0 .. n-1 (padded to a multiple of 8).
// The first query alone: its pass streams the keys in from memory, its loads not held back
// by other queries' FMAs (1-3 rows: ~1.1x); the rest QB at a time from cache.
INLINE void chunk_scores(const void *const *kp, const float *const *qs, float *const *ps,
                         int M, int n, int D, __m256 scale, next_lines_t *nl, const int BF) {
    for (int i0 = 0; i0 < n; i0 += 8) scores8(kp, i0, qs, D, scale, ps, 1, BF);
    for (int i0 = 0; i0 < n; i0 += 8)
        for (int m0 = 1; m0 < M; m0 += QB) {
#define SCORES(NQ) scores8(kp, i0, qs + m0, D, scale, ps + m0, NQ, BF)
            BY_NQ(SCORES, M - m0 < QB ? M - m0 : QB, QB);
#undef SCORES
            prefetch_pass(nl);
        }
}

// Lanes i0 .. i0+7 of a query's keys as a mask: all ones for those in b .. nr-1.
INLINE __m256 keep8(int b, int nr, int i0) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(nr - i0), iota),
                                                _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(b - i0 - 1))));
}

// One query's softmax over its own keys b .. nr-1 of the chunk's n (b > 0: the first keys
// are left of its sliding window): ph its scores, then exp(s - m), and zeros before and
// after them up to n, so that a value pass may run over 0 .. n for every query it serves;
// out[0] = the maximum m, out[1] = the sum l. With b = 0 a block's lanes below nr are all
// kept, and blending or masking by all-ones changes no bit; only the blocks a bound cuts
// (i0 < b, or the last) are masked.
INLINE void softmax_query(float *ph, int b, int nr, int n, float *out) {
    const int last = (nr - 1) / 8 * 8;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int i0 = 0; i0 < nr; i0 += 8) {
        __m256 s = _mm256_loadu_ps(ph + i0);
        if (i0 < b || i0 == last) s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, keep8(b, nr, i0));
        mx = _mm256_max_ps(mx, s);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    out[0] = _mm_cvtss_f32(m4);
    const __m256 mv = _mm256_set1_ps(out[0]);
    __m256 sum = _mm256_setzero_ps();
    for (int i0 = 0; i0 < nr; i0 += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(ph + i0), mv));
        if (i0 < b || i0 == last) e = _mm256_and_ps(e, keep8(b, nr, i0));
        _mm256_storeu_ps(ph + i0, e);
        sum = _mm256_add_ps(sum, e);
    }
    for (int i = last + 8; i < n; i++) ph[i] = 0.0f;
    out[1] = hsum8(sum);
}

// The weighted sums of the values into os[m] for M queries (query m: row m / G, whose keys
// are n_row[m / G]): the first query alone, as chunk_scores, then QV at a time.
INLINE void chunk_values(const void *const *vp, float *const *ps, float *const *os,
                         const int *n_row, int G, int M, int D, next_lines_t *nl, const int BF) {
    for (int m0 = 0; m0 < M; m0 += m0 ? QV : 1) {
        const int nq = m0 == 0 ? 1 : M - m0 < QV ? M - m0 : QV;
        const int nm = n_row[(m0 + nq - 1) / G];  // the last query's keys: the most
        const float *const *pq = (const float *const *)ps + m0;
        int64_t d0 = 0;
#define WSUM(NQ) weighted_sums(vp, pq, nm, d0, os + m0, NQ, NV, BF)
#define NV 8
        for (; d0 + 64 <= D; d0 += 64) BY_NQ(WSUM, nq, QV);
#undef NV
#define NV 4
        for (; d0 + 32 <= D; d0 += 32) BY_NQ(WSUM, nq, QV);
#undef NV
#define NV 1
        for (; d0 < D; d0 += 8) BY_NQ(WSUM, nq, QV);
#undef NV
#undef WSUM
        prefetch_pass(nl);
    }
}

// The partials of keys j0+b_row[r] .. j0+n_row[r]-1 for rows r = 0 .. R-1 of a group
// (consecutive positions of one sequence: b_row[r] < n_row[r] <= CHUNK, neither decreasing;
// b_row[r] > 0 where a sliding window starts inside the chunk) and the G heads of KV head g:
// parts[r] + h * (D + 2) holds m, l, o[D]. The chunk's keys and values are read once per QB /
// QV query vectors instead of once per (row, head). Each row's partial is bitwise what this
// gives for that row alone (R = 1): the passes do the same arithmetic per query, and keys
// outside a row's own are masked out of its sums. scratch: chunk_scratch_bytes(G).
INLINE void chunk_partials_t(const attn_t *a, const float *q, int64_t q_stride, int R,
                             const int *b_row, const int *n_row, const int32_t *table,
                             int64_t g, int64_t j0, float *const *parts, void *scratch, const next_t *next,
                             const int BF) {
    const int G = a->H / a->KVH, D = a->D, M = R * G, n = n_row[R - 1];
    const void **kp = (const void **)scratch, **vp = kp + CHUNK;
    const void **nkp = vp + CHUNK, **nvp = nkp + CHUNK;  // the next chunk's
    const float **qs = (const float **)(nvp + CHUNK);  // query m: row m / G, head g * G + m % G
    float **ps = (float **)(qs + M), **os = ps + M;
    float *p = (float *)(os + M);  // [M][CHUNK]: scores, then exponentials
    const int64_t esize = BF ? 2 : 4;
    slot_ptrs(a, table, g, j0, n, kp, vp, esize);
    // The next chunk's lines, spread evenly over this chunk's passes after the first (units:
    // one per key pass of up to QB queries over 8 keys, one per weighted-sum pass).
    const int nn = next ? next->n : 0, lpr = (int)((D * esize + 63) / 64);
    if (nn) slot_ptrs(a, next->table, next->g, next->j0, nn, nkp, nvp, esize);
    const int units = (n + 7) / 8 * ((M - 1 + QB - 1) / QB) + 1 + (M - 1 + QV - 1) / QV;
    next_lines_t nl = {nkp, nvp, nn, lpr, (2 * nn * lpr + units - 1) / units, 0};
    for (int i = n; i < (n + 7) / 8 * 8; i++) kp[i] = kp[n - 1];  // padding lanes: masked below
    for (int m = 0; m < M; m++) {
        qs[m] = q + (m / G) * q_stride + (g * G + m % G) * D;
        ps[m] = p + (int64_t)m * CHUNK;
        os[m] = parts[m / G] + (m % G) * (D + 2) + 2;
    }
    // Scores of every query against every key some row of the group sees, then per query
    // over its own keys the softmax, then the values.
    chunk_scores(kp, qs, ps, M, n, D, _mm256_set1_ps(a->scale), &nl, BF);
    for (int m = 0; m < M; m++)
        softmax_query(ps[m], b_row[m / G], n_row[m / G], n, parts[m / G] + (m % G) * (D + 2));
    chunk_values(vp, ps, os, n_row, G, M, D, &nl, BF);
}

static void chunk_partials(const attn_t *a, const float *q, int64_t q_stride, int R,
                           const int *b_row, const int *n_row, const int32_t *table, int64_t g,
                           int64_t j0, float *const *parts, void *scratch, const next_t *next) {
    if (a->bf16) chunk_partials_t(a, q, q_stride, R, b_row, n_row, table, g, j0, parts, scratch, next, 1);
    else chunk_partials_t(a, q, q_stride, R, b_row, n_row, table, g, j0, parts, scratch, next, 0);
}

#endif
