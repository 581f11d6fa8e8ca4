// Paged attention for a flat (ragged) batch, float32, AVX2 + FMA, read straight through the
// block table: no gather of the context into a padded rectangle, no mask. The cache holds
// float32 (paged_attention) or bf16 (paged_attention_bf16, --kv-cache-dtype bfloat16: half
// the bytes a decode row reads); bf16 keys and values widen to float32 exactly as loaded, so
// the arithmetic is the float32 kernel's on the rounded cache.
//
//   q      [T, *, D] with token stride q_stride (the step's queries, heads contiguous)
//   cache  k/v [num_blocks, block_size, KVH, D]
//   out    [T, H, D]
// Sequence s owns flat rows query_start_loc[s] .. query_start_loc[s+1]-1, at positions
// seq_lens[s] - q_len .. seq_lens[s] - 1; query row i sees keys 0 .. its position.
//
// A query row's keys are cut into chunks of CHUNK (flash-decoding): each chunk gives, for the
// H/KVH query heads sharing a KV head, its score maximum m, its sum l of exp(s - m) and its
// weighted sum o of the values; the chunks are then combined in order. The cut depends only
// on the row's own position, never on the batch, and a chunk's arithmetic is the same
// whichever thread computes it, so a row's output never depends on which other rows share
// the step (batch invariance). Chunks are what let one decode row use every thread.
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include <math.h>

#define CHUNK 64  // keys per chunk
#define GROUP 8  // consecutive rows of one sequence that share each chunk's key/value reads

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

// Prefetch lines [*at, *at + count) of the next chunk (its keys' lines, then its values'):
// lpr lines per key, n keys.
INLINE void prefetch_next(const void *const *nkp, const void *const *nvp, int n, int lpr,
                          int *at, int count) {
    const int half = n * lpr, end = *at + count < 2 * half ? *at + count : 2 * half;
    for (int l = *at; l < end; l++) {
        const int j = (l < half ? l : l - half) / lpr, w = (l < half ? l : l - half) % lpr;
        _mm_prefetch((const char *)(l < half ? nkp : nvp)[j] + 64 * w, _MM_HINT_T1);
    }
    *at = end > *at ? end : *at;
}

// The partials of keys j0 .. j0+n_row[r]-1 for rows r = 0 .. R-1 of a group (consecutive
// positions of one sequence: n_row[r] <= CHUNK, not decreasing) and the G heads of KV head g:
// parts[r] + h * (D + 2) holds m, l, o[D]. The chunk's keys and values are read once per QB /
// QV query vectors instead of once per (row, head). Each row's partial is bitwise what this
// gives for that row alone (R = 1): the passes do the same arithmetic per query, and keys
// past a row's own are masked out of its sums. scratch: chunk_scratch_bytes(G).
INLINE void chunk_partials_t(const attn_t *a, const float *q, int64_t q_stride, int R,
                             const int *n_row, const int32_t *table, int64_t g, int64_t j0,
                             float *const *parts, void *scratch, const next_t *next,
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
    const int per = (2 * nn * lpr + units - 1) / units;
    int pf_at = 0;
    for (int i = n; i < (n + 7) / 8 * 8; i++) kp[i] = kp[n - 1];  // padding lanes: masked below
    for (int m = 0; m < M; m++) {
        qs[m] = q + (m / G) * q_stride + (g * G + m % G) * D;
        ps[m] = p + (int64_t)m * CHUNK;
        os[m] = parts[m / G] + (m % G) * (D + 2) + 2;
    }
    const __m256 scale = _mm256_set1_ps(a->scale);
    // Scores of every query against every key some row of the group sees. The first query
    // alone: its pass streams the keys in from memory, its loads not held back by other
    // queries' FMAs (1-3 rows: ~1.1x); the rest QB at a time from cache.
    for (int i0 = 0; i0 < n; i0 += 8) scores8(kp, i0, qs, D, scale, ps, 1, BF);
    for (int i0 = 0; i0 < n; i0 += 8)
        for (int m0 = 1; m0 < M; m0 += QB) {
#define SCORES(NQ) scores8(kp, i0, qs + m0, D, scale, ps + m0, NQ, BF)
            BY_NQ(SCORES, M - m0 < QB ? M - m0 : QB, QB);
#undef SCORES
            if (nn) prefetch_next(nkp, nvp, nn, lpr, &pf_at, per);
        }
    // Per query, over its own keys: the maximum, exp(s - m) and their sum; zeros after them
    // up to n, so that a value pass may run to n for every query it serves.
    for (int m = 0; m < M; m++) {
        const int nr = n_row[m / G], last = (nr - 1) / 8 * 8;
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(nr - last), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        float *ph = ps[m], *out = parts[m / G] + (m % G) * (D + 2);
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int i0 = 0; i0 < nr; i0 += 8) {
            __m256 s = _mm256_loadu_ps(ph + i0);
            if (i0 == last) s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, keep);
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
            if (i0 == last) e = _mm256_and_ps(e, keep);
            _mm256_storeu_ps(ph + i0, e);
            sum = _mm256_add_ps(sum, e);
        }
        for (int i = last + 8; i < n; i++) ph[i] = 0.0f;
        out[1] = hsum8(sum);
    }
    // The weighted sums of the values: the first query alone, as above, then QV at a time.
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
        if (nn) prefetch_next(nkp, nvp, nn, lpr, &pf_at, per);
    }
}

static void chunk_partials(const attn_t *a, const float *q, int64_t q_stride, int R,
                           const int *n_row, const int32_t *table, int64_t g, int64_t j0,
                           float *const *parts, void *scratch, const next_t *next) {
    if (a->bf16) chunk_partials_t(a, q, q_stride, R, n_row, table, g, j0, parts, scratch, next, 1);
    else chunk_partials_t(a, q, q_stride, R, n_row, table, g, j0, parts, scratch, next, 0);
}

// The chunks' partials of one (row, KV head), in order, into its G output heads.
static void combine(const float *parts, int64_t nc, int G, int D, float *out) {
    const int64_t stride = (int64_t)G * (D + 2);
    for (int h = 0; h < G; h++) {
        float m = -INFINITY;
        for (int64_t c = 0; c < nc; c++) m = fmaxf(m, parts[c * stride + h * (D + 2)]);
        float l = 0.0f;
        float *o = out + h * D;
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_setzero_ps());
        for (int64_t c = 0; c < nc; c++) {
            const float *pc = parts + c * stride + h * (D + 2);
            const float w = expf(pc[0] - m);
            l += w * pc[1];
            const __m256 wv = _mm256_set1_ps(w);
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(pc + 2 + d), _mm256_loadu_ps(o + d)));
        }
        const __m256 inv = _mm256_set1_ps(1.0f / l);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
    }
}

static __thread char *scratch = NULL;
static __thread int64_t scratch_cap = 0;

static void *get_scratch(int64_t bytes) {
    if (bytes > scratch_cap) {
        free(scratch);
        scratch = (char *)aligned_alloc(32, (bytes + 31) / 32 * 32);
        scratch_cap = scratch ? bytes : 0;
    }
    return scratch;
}

// chunk_partials' scratch for up to GROUP rows: the key and value pointers, three pointers
// per query vector, and the queries' scores.
static int64_t chunk_scratch_bytes(int G) {
    const int64_t M = (int64_t)GROUP * G;
    return (4 * CHUNK + 3 * M) * (int64_t)sizeof(void *) + M * CHUNK * (int64_t)sizeof(float);
}


// Keys of chunk c that group i's rows see (those of its last, longest row), at most CHUNK.
static inline int chunk_keys(const int64_t *pos, const int64_t *grp, int64_t i, int64_t c) {
    const int64_t left = pos[grp[i + 1] - 1] + 1 - c * CHUNK;
    return left < CHUNK ? (int)left : CHUNK;
}

// Chunk c's partials for the rows of group t0 .. t1-1 that reach it (pos[t]: row t's last
// key, increasing within a group, so they are its last rows); row t's goes to part_of(t).
#define GROUP_CHUNK(part_of, next)                                                          \
    do {                                                                                    \
        const int64_t j0_ = c * CHUNK;                                                      \
        int64_t ta_ = t0;                                                                   \
        while (pos[ta_] < j0_) ta_++;                                                       \
        int n_[GROUP];                                                                      \
        float *pp_[GROUP];                                                                  \
        for (int64_t t = ta_; t < t1; t++) {                                                \
            n_[t - ta_] = pos[t] + 1 - j0_ < CHUNK ? (int)(pos[t] + 1 - j0_) : CHUNK;       \
            pp_[t - ta_] = (part_of);                                                       \
        }                                                                                   \
        chunk_partials(&a, q + ta_ * q_stride, q_stride, (int)(t1 - ta_), n_, table, g, j0_, \
                       pp_, sc, next);                                                      \
    } while (0)

// The entry points' body (paged_attention, paged_attention_bf16 below; ctypes). block_tables:
// int32 [num_seqs, max_blocks]; seq_of_token: int64 [T]. Requires D % 8 == 0. Returns 0, or
// -1 if memory ran out.
//
// Work is cut into groups of up to GROUP consecutive rows of one sequence (a verification
// run, a prefill chunk's rows): a group reads each chunk of keys and values once for all its
// rows. With many (group, KV head) pairs each pair is a work item and walks its chunks; with
// few (decode at small batch, one verification run) every (group, KV head, chunk) is one.
// Either way a thread claims its next item before computing this one and prefetches the
// next chunk's keys and values into L2 meanwhile (next_t): a decode step's attention had
// waited on memory for every chunk, since a layer's cache lines are evicted by the weights
// streamed between two layers (whole decode steps 1.13x at one sequence, 1.55x at 16-32,
// 600 tokens, Zen 4).
static int attention_run(const float *q, int64_t q_stride, const void *k_cache,
                         const void *v_cache, int bf16, int block_size, int H, int KVH, int D,
                         const int64_t *query_start_loc, const int64_t *seq_lens,
                         const int64_t *seq_of_token, int64_t T, const int32_t *block_tables,
                         int64_t max_blocks, float scale, float *out, int nthreads) {
    if (T <= 0) return 0;
    const attn_t a = {k_cache, v_cache, block_size, H, KVH, D, bf16, scale};
    const int G = H / KVH;
    const int64_t pf = (int64_t)G * (D + 2);  // floats of one chunk's partial
    // pos[t]: row t's last key; first[t]: chunks before row t; grp: group starts (ng + 1);
    // gfirst[i]: chunks of the groups before group i (a group has its longest row's chunks).
    int64_t *buf = (int64_t *)malloc((4 * T + 3) * sizeof(int64_t));
    if (buf == NULL) return -1;
    int64_t *pos = buf, *first = pos + T, *grp = first + T + 1, *gfirst = grp + T + 1, ng = 0;
    first[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = seq_of_token[t];
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        pos[t] = seq_lens[s] - q_len + (t - query_start_loc[s]);
        first[t + 1] = first[t] + pos[t] / CHUNK + 1;
        if (t == 0 || seq_of_token[t - 1] != s || t - grp[ng - 1] == GROUP) grp[ng++] = t;
    }
    grp[ng] = T;
    gfirst[0] = 0;
    for (int64_t i = 0; i < ng; i++) {
        int64_t last = 0;
        for (int64_t t = grp[i]; t < grp[i + 1]; t++) last = pos[t] > last ? pos[t] : last;
        gfirst[i + 1] = gfirst[i] + last / CHUNK + 1;
    }
    int failed = 0;
    if (ng * KVH >= 8 * (int64_t)nthreads) {
        int64_t claimed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            // (group, KV head) items claimed one ahead (as below): each chunk prefetches the
            // next, the item's last chunk the first of the thread's next item.
            int64_t it = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            while (it < ng * KVH) {
                const int64_t it2 = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
                const int64_t i = it / KVH, g = it % KVH, t0 = grp[i], t1 = grp[i + 1];
                const int64_t ncm = gfirst[i + 1] - gfirst[i];
                char *sc = (char *)get_scratch(chunk_scratch_bytes(G) +
                                               (t1 - t0) * ncm * pf * sizeof(float));
                if (sc == NULL) {
                    failed = 1;
                    break;
                }
                float *parts = (float *)(sc + chunk_scratch_bytes(G));
                const int32_t *table = block_tables + seq_of_token[t0] * max_blocks;
                for (int64_t c = 0; c < ncm; c++) {
                    next_t nx = {table, g, (c + 1) * CHUNK, 0};
                    if (c + 1 < ncm) nx.n = chunk_keys(pos, grp, i, c + 1);
                    else if (it2 < ng * KVH) {
                        nx.table = block_tables + seq_of_token[grp[it2 / KVH]] * max_blocks;
                        nx.g = it2 % KVH, nx.j0 = 0, nx.n = chunk_keys(pos, grp, it2 / KVH, 0);
                    }
                    GROUP_CHUNK(parts + ((t - t0) * ncm + c) * pf, &nx);
                }
                for (int64_t t = t0; t < t1; t++)
                    combine(parts + (t - t0) * ncm * pf, first[t + 1] - first[t], G, D,
                            out + t * H * D + g * G * D);
                it = it2;
            }
        }
        free(buf);
        return failed ? -1 : 0;
    }
    // Row t's partials: parts + (first[t] * KVH + g * nc_t + c) * pf.
    float *parts = (float *)malloc(first[T] * KVH * pf * sizeof(float));
    if (parts == NULL) {
        free(buf);
        return -1;
    }
    const int64_t items = gfirst[ng] * KVH;
    int64_t claimed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        void *sc = get_scratch(chunk_scratch_bytes(G));
        if (sc == NULL) failed = 1;
        // Items are claimed from a shared counter one ahead: a thread holding item it has
        // already claimed its next one, and prefetches that item's keys and values while it
        // computes this one (next_t). As dynamic as schedule(dynamic, 1): a thread the host
        // delays holds back at most one item.
        int64_t it = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (it < items && sc != NULL) {
            const int64_t it2 = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int64_t gc = it / KVH, g = it % KVH;
            int64_t i = 0;
            while (gfirst[i + 1] <= gc) i++;
            const int64_t c = gc - gfirst[i];
            const int32_t *table = block_tables + seq_of_token[grp[i]] * max_blocks;
            const int64_t t0 = grp[i], t1 = grp[i + 1];
            next_t nx = {NULL, 0, 0, 0};
            if (it2 < items) {
                const int64_t gc2 = it2 / KVH;
                int64_t i2 = 0;
                while (gfirst[i2 + 1] <= gc2) i2++;
                nx.table = block_tables + seq_of_token[grp[i2]] * max_blocks;
                nx.g = it2 % KVH, nx.j0 = (gc2 - gfirst[i2]) * CHUNK;
                nx.n = chunk_keys(pos, grp, i2, gc2 - gfirst[i2]);
            }
            GROUP_CHUNK(parts + (first[t] * KVH + g * (first[t + 1] - first[t]) + c) * pf, &nx);
            it = it2;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t it = 0; it < T * KVH; it++) {
            const int64_t t = it / KVH, g = it % KVH, nc = first[t + 1] - first[t];
            combine(parts + (first[t] * KVH + g * nc) * pf, nc, G, D, out + t * H * D + g * G * D);
        }
    }
    free(parts);
    free(buf);
    return failed ? -1 : 0;
}

int paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                    int block_size, int H, int KVH, int D, const int64_t *query_start_loc,
                    const int64_t *seq_lens, const int64_t *seq_of_token, int64_t T,
                    const int32_t *block_tables, int64_t max_blocks, float scale, float *out,
                    int nthreads) {
    return attention_run(q, q_stride, k_cache, v_cache, 0, block_size, H, KVH, D,
                         query_start_loc, seq_lens, seq_of_token, T, block_tables, max_blocks,
                         scale, out, nthreads);
}

// The same over a bf16 cache (uint16 [num_blocks, block_size, KVH, D] each).
int paged_attention_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, int block_size, int H, int KVH, int D,
                         const int64_t *query_start_loc, const int64_t *seq_lens,
                         const int64_t *seq_of_token, int64_t T, const int32_t *block_tables,
                         int64_t max_blocks, float scale, float *out, int nthreads) {
    return attention_run(q, q_stride, k_cache, v_cache, 1, block_size, H, KVH, D,
                         query_start_loc, seq_lens, seq_of_token, T, block_tables, max_blocks,
                         scale, out, nthreads);
}
