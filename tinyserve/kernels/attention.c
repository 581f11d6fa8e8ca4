// Paged attention for a flat (ragged) batch, float32, AVX2 + FMA (or, through the _tiles
// entry points, bf16 products: on AMX tiles in an AMX build, attention_amx.h; as AVX-512 BF16
// dot products in an avx512_bf16 build, attention_dp.h), read straight through the
// block table: no gather of the context into a padded rectangle, no mask. The cache holds
// float32 (paged_attention) or bf16 (paged_attention_bf16, --kv-cache-dtype bfloat16: half
// the bytes a decode row reads); bf16 keys and values widen to float32 exactly as loaded, so
// the arithmetic is the float32 kernel's on the rounded cache.
//
//   q      [T, *, D] with token stride q_stride (the step's queries, heads contiguous)
//   cache  k/v [num_blocks, block_size, KVH, D]
//   out    [T, H, D]
// Sequence s owns flat rows query_start_loc[s] .. query_start_loc[s+1]-1, at positions
// seq_lens[s] - q_len .. seq_lens[s] - 1; query row i sees keys 0 .. its position p, or with
// a sliding window W > 0 keys p - W + 1 .. p (transformers' sliding_window_overlay: the last
// W keys, its own included). A windowed row's chunks are those its keys touch, cut at the
// same multiples of CHUNK; keys left of its window in its first chunk are masked out of its
// softmax (p = 0), so its bits too depend only on its position and the window.
//
// A query row's keys are cut into chunks of CHUNK (flash-decoding): each chunk gives, for the
// H/KVH query heads sharing a KV head, its score maximum m, its sum l of exp(s - m) and its
// weighted sum o of the values; the chunks are then combined in order. The cut depends only
// on the row's own position, never on the batch, and a chunk's arithmetic is the same
// whichever thread computes it, so a row's output never depends on which other rows share
// the step (batch invariance). Chunks are what let one decode row use every thread.
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include "attention_chunk.h"  // CHUNK, chunk_partials: one chunk's partials for a group of rows
#include <math.h>

#define GROUP 8  // consecutive rows of one sequence that share each chunk's key/value reads
// The same on AMX tiles (attention_amx.h): reading and packing a chunk's keys and values is
// most of a tile chunk's cost, so the more rows the better while the work items still
// outnumber the threads (one layer of a 2048-token prompt in 512-row steps, Xeon AMX, 2
// threads: 16 rows 20.0 ms, 32 17.4, 64 13.5, 128 32.1 — 128 leaves 12 items, the per-chunk
// mode). The group is a scheduling choice only: no row's bits depend on it. The dot products
// (attention_dp.h) pack a chunk the same way and take the same groups (not measured apart).
#define GROUP_TILES 64
#if defined(__AMX_BF16__) || defined(TINYSERVE_AMX_EMULATE)
#include "attention_amx.h"  // chunk_partials_amx: the same on AMX tiles
// Whether this process may use the tiles (asked once; amx_tile.h).
static int attn_tiles_ready(void) {
    static int granted = -1;
    if (granted < 0) granted = amx_request() == 0;
    return granted;
}
int attention_amx(void) { return 1; }
#define chunk_partials_tiles chunk_partials_amx
#define chunk_scratch_tiles_bytes chunk_scratch_amx_bytes
#elif defined(__AVX512BF16__)
#include "attention_dp.h"  // chunk_partials_dp: bf16 products as AVX-512 BF16 dot products
static int attn_tiles_ready(void) { return 1; }
int attention_amx(void) { return 0; }
#define chunk_partials_tiles chunk_partials_dp
#define chunk_scratch_tiles_bytes chunk_scratch_dp_bytes
#else
int attention_amx(void) { return 0; }
#define chunk_partials_tiles chunk_partials
#endif
// Whether the _tiles entry points compute bf16 products (AMX tiles, their emulation, or
// AVX-512 BF16 dot products) for heads of whole 32s; else they are the float32 ones.
#if defined(ATTN_AMX) || defined(ATTN_DP)
#define ATTN_TILES 1
int attention_bf16_products(void) { return 1; }
#else
int attention_bf16_products(void) { return 0; }
#endif

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

// chunk_partials' scratch for up to GROUP rows (the key and value pointers, three pointers
// per query vector, and the queries' scores), or the tile chunk's.
static int64_t chunk_scratch_bytes(int G, int D, int tiles) {
    const int64_t M = (int64_t)GROUP * G;
#ifdef ATTN_TILES
    if (tiles) return chunk_scratch_tiles_bytes(D);
#endif
    (void)D, (void)tiles;
    return (4 * CHUNK + 3 * M) * (int64_t)sizeof(void *) + M * CHUNK * (int64_t)sizeof(float);
}


// A call's rows as attention_run plans them, and what every work item reads. Per row t:
// pos[t] its last key, lo[t] its first (0 without a window), first[t] the chunks before it;
// per group i: grp[i] its first row (grp[ng] = T), gfirst[i] the chunks of the groups
// before it (a group's chunks: from its first row's first to its last row's last). The
// chunk c of group i is the absolute chunk lo[grp[i]] / CHUNK + c.
typedef struct {
    attn_t a;
    const float *q;
    int64_t q_stride;
    const int64_t *seq_of_token;
    const int32_t *block_tables;
    int64_t max_blocks;
    float *out;
    int tiles, G;
    int64_t pf;  // floats of one chunk's partial
    int64_t window;  // W > 0: a sliding window of W keys; 0: none
    int64_t T, ng, *pos, *lo, *first, *grp, *gfirst;
} plan_t;

// p's rows cut into groups of up to `group` consecutive rows of one sequence (pos .. gfirst
// in one allocation at p->pos). Returns 0, or -1 if memory ran out.
static int plan_rows(plan_t *p, const int64_t *query_start_loc, const int64_t *seq_lens,
                     int group) {
    const int64_t T = p->T, *seq_of_token = p->seq_of_token;
    int64_t *buf = (int64_t *)malloc((5 * T + 3) * sizeof(int64_t));
    if (buf == NULL) return -1;
    int64_t *pos = buf, *lo = pos + T, *first = lo + T, *grp = first + T + 1,
            *gfirst = grp + T + 1, ng = 0;
    first[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = seq_of_token[t];
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        pos[t] = seq_lens[s] - q_len + (t - query_start_loc[s]);
        lo[t] = p->window > 0 && pos[t] >= p->window ? pos[t] - p->window + 1 : 0;
        first[t + 1] = first[t] + pos[t] / CHUNK - lo[t] / CHUNK + 1;
        if (t == 0 || seq_of_token[t - 1] != s || t - grp[ng - 1] == group) grp[ng++] = t;
    }
    grp[ng] = T;
    gfirst[0] = 0;
    for (int64_t i = 0; i < ng; i++) {
        int64_t last = 0;
        for (int64_t t = grp[i]; t < grp[i + 1]; t++) last = pos[t] > last ? pos[t] : last;
        gfirst[i + 1] = gfirst[i] + last / CHUNK - lo[grp[i]] / CHUNK + 1;
    }
    p->pos = pos, p->lo = lo, p->first = first, p->grp = grp, p->gfirst = gfirst, p->ng = ng;
    return 0;
}

// Chunk c of group i and KV head g as next_t (its keys: those of the group's last, longest
// row, at most CHUNK): what a thread prefetches while computing the chunk before it.
static inline next_t chunk_of(const plan_t *p, int64_t i, int64_t c, int64_t g) {
    const int64_t j0 = (p->lo[p->grp[i]] / CHUNK + c) * CHUNK;
    const int64_t left = p->pos[p->grp[i + 1] - 1] + 1 - j0;
    const next_t nx = {p->block_tables + p->seq_of_token[p->grp[i]] * p->max_blocks, g,
                       j0, left < CHUNK ? (int)left : CHUNK};
    return nx;
}

// Chunk c's partials for the rows of group i whose keys it holds (pos[t] and lo[t] increase
// within a group: rows ta .. tb-1, those reaching it and not windowed past it) and KV head g;
// row t's (t0: the group's first row) goes to rows[t - t0] + (its own chunk index) * pf.
static void group_chunk(const plan_t *p, int64_t i, int64_t c, int64_t g, float *const *rows,
                        void *sc, const next_t *next) {
    const int64_t t0 = p->grp[i], t1 = p->grp[i + 1], c0 = p->lo[t0] / CHUNK;
    const int64_t j0 = (c0 + c) * CHUNK;
    int64_t ta = t0, tb;
    while (p->pos[ta] < j0) ta++;
    for (tb = ta; tb < t1 && p->lo[tb] < j0 + CHUNK;) tb++;
    int b[GROUP_TILES], n[GROUP_TILES];
    float *pp[GROUP_TILES];
    for (int64_t t = ta; t < tb; t++) {
        b[t - ta] = p->lo[t] > j0 ? (int)(p->lo[t] - j0) : 0;
        n[t - ta] = p->pos[t] + 1 - j0 < CHUNK ? (int)(p->pos[t] + 1 - j0) : CHUNK;
        pp[t - ta] = rows[t - t0] + (c0 + c - p->lo[t] / CHUNK) * p->pf;
    }
    const int32_t *table = p->block_tables + p->seq_of_token[t0] * p->max_blocks;
    (p->tiles ? chunk_partials_tiles : chunk_partials)(&p->a, p->q + ta * p->q_stride,
                                                        p->q_stride, (int)(tb - ta), b, n, table,
                                                        g, j0, pp, sc, next);
}

// Row t's output heads of KV head g from its nc chunk partials at parts.
static void combine_row(const plan_t *p, const float *parts, int64_t nc, int64_t t, int64_t g) {
    combine(parts, nc, p->G, p->a.D, p->out + t * p->a.H * p->a.D + g * p->G * p->a.D);
}

// One (group i, KV head g) work item: its chunks in order into the thread's scratch, each
// prefetching the next (the last: after, the thread's next item's first), then its rows
// combined. Returns 0, or -1 if memory ran out.
static int group_item(const plan_t *p, int64_t i, int64_t g, const next_t *after) {
    const int64_t t0 = p->grp[i], t1 = p->grp[i + 1], ncm = p->gfirst[i + 1] - p->gfirst[i];
    const int64_t csb = chunk_scratch_bytes(p->G, p->a.D, p->tiles);
    char *sc = (char *)get_scratch(csb + (t1 - t0) * ncm * p->pf * sizeof(float));
    if (sc == NULL) return -1;
    float *parts = (float *)(sc + csb), *rows[GROUP_TILES];  // row t's: [ncm] chunks
    for (int64_t t = t0; t < t1; t++) rows[t - t0] = parts + (t - t0) * ncm * p->pf;
    for (int64_t c = 0; c < ncm; c++) {
        const next_t nx = c + 1 < ncm ? chunk_of(p, i, c + 1, g) : *after;
        group_chunk(p, i, c, g, rows, sc, &nx);
    }
    for (int64_t t = t0; t < t1; t++)
        combine_row(p, rows[t - t0], p->first[t + 1] - p->first[t], t, g);
    return 0;
}

// Many (group, KV head) pairs: each one work item (group_item), claimed one ahead (as in
// by_chunk) so that its last chunk prefetches the first of the thread's next item.
static int by_group(const plan_t *p, int nthreads) {
    const int64_t KVH = p->a.KVH, items = p->ng * KVH;
    const next_t none = {NULL, 0, 0, 0};
    int failed = 0;
    int64_t claimed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int64_t it = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (it < items) {
            const int64_t it2 = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const next_t after = it2 < items ? chunk_of(p, it2 / KVH, 0, it2 % KVH) : none;
            if (group_item(p, it / KVH, it % KVH, &after) != 0) {
                failed = 1;
                break;
            }
            it = it2;
        }
    }
    return failed ? -1 : 0;
}

// Few (group, KV head) pairs: every (group, KV head, chunk) one work item, into the call's
// partials (row t's: parts + (first[t] * KVH + g * nc_t + c) * pf), then every (row, KV
// head) combined.
static int by_chunk(const plan_t *p, int nthreads) {
    const int64_t KVH = p->a.KVH, pf = p->pf, *first = p->first, *gfirst = p->gfirst;
    const next_t none = {NULL, 0, 0, 0};
    float *parts = (float *)malloc(first[p->T] * KVH * pf * sizeof(float));
    if (parts == NULL) return -1;
    const int64_t items = gfirst[p->ng] * KVH;
    int64_t claimed = 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        void *sc = get_scratch(chunk_scratch_bytes(p->G, p->a.D, p->tiles));
        if (sc == NULL) failed = 1;
        // Items are claimed from a shared counter one ahead: a thread holding item it has
        // already claimed its next one, and prefetches that item's keys and values while it
        // computes this one (next_t). As dynamic as schedule(dynamic, 1): a thread the host
        // delays holds back at most one item.
        // A thread's claims increase, so its group index only moves forward (i, then i2).
        int64_t it = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), i = 0;
        while (it < items && sc != NULL) {
            const int64_t it2 = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int64_t gc = it / KVH, g = it % KVH;
            while (gfirst[i + 1] <= gc) i++;
            int64_t i2 = i;
            while (it2 < items && gfirst[i2 + 1] <= it2 / KVH) i2++;
            const next_t nx =
                it2 < items ? chunk_of(p, i2, it2 / KVH - gfirst[i2], it2 % KVH) : none;
            float *rows[GROUP_TILES];
            for (int64_t t = p->grp[i]; t < p->grp[i + 1]; t++)
                rows[t - p->grp[i]] = parts + (first[t] * KVH + g * (first[t + 1] - first[t])) * pf;
            group_chunk(p, i, gc - gfirst[i], g, rows, sc, &nx);
            it = it2, i = i2;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t it = 0; it < p->T * KVH; it++) {
            const int64_t t = it / KVH, g = it % KVH, nc = first[t + 1] - first[t];
            combine_row(p, parts + (first[t] * KVH + g * nc) * pf, nc, t, g);
        }
    }
    free(parts);
    return failed ? -1 : 0;
}

// The entry points' body (paged_attention, paged_attention_bf16 below; ctypes). block_tables:
// int32 [num_seqs, max_blocks]; seq_of_token: int64 [T]. Requires D % 8 == 0. Returns 0, or
// -1 if memory ran out.
//
// Work is cut into groups of up to GROUP (on tiles GROUP_TILES) consecutive rows of one
// sequence (a verification run, a prefill chunk's rows): a group reads each chunk of keys
// and values once for all its rows. With many (group, KV head) pairs each pair is a work
// item and walks its chunks (by_group); with few (decode at small batch, one verification
// run) every (group, KV head, chunk) is one (by_chunk). Either way a thread claims its next
// item before computing this one and prefetches the next chunk's keys and values into L2
// meanwhile (next_t): a decode step's attention had waited on memory for every chunk, since
// a layer's cache lines are evicted by the weights streamed between two layers (whole
// decode steps at 600 tokens 1.10x at one sequence, 1.31-1.40x at 8-32; at 1500 up to
// 1.76x; Zen 4, benchmarks/README.md).
static int attention_run(const float *q, int64_t q_stride, const void *k_cache,
                         const void *v_cache, int bf16, int block_size, int H, int KVH, int D,
                         const int64_t *query_start_loc, const int64_t *seq_lens,
                         const int64_t *seq_of_token, int64_t T, const int32_t *block_tables,
                         int64_t max_blocks, float scale, int64_t window, float *out,
                         int nthreads, int want_tiles) {
    if (T <= 0) return 0;
    plan_t p = {{k_cache, v_cache, block_size, H, KVH, D, bf16, scale}, q, q_stride,
                seq_of_token, block_tables, max_blocks, out, 0, H / KVH, 0, window, T, 0,
                NULL, NULL, NULL, NULL, NULL};
    // Tiles (asked for by the _tiles entry points): every row of the call, for head sizes of
    // whole tiles — one numeric path.
#ifdef ATTN_TILES
    p.tiles = want_tiles && D % 32 == 0 && attn_tiles_ready();
#else
    (void)want_tiles;
#endif
    p.pf = (int64_t)p.G * (D + 2);
    if (plan_rows(&p, query_start_loc, seq_lens, p.tiles ? GROUP_TILES : GROUP) != 0) return -1;
    const int rc = p.ng * KVH >= 8 * (int64_t)nthreads ? by_group(&p, nthreads)
                                                        : by_chunk(&p, nthreads);
    free(p.pos);
    return rc;
}

// The entry points (ctypes; step.c's attn_fn): paged_attention over a float32 cache,
// paged_attention_bf16 over a bf16 one (uint16 [num_blocks, block_size, KVH, D] each), and
// the same two in bf16 products (AMX tiles, attention_amx.h, or AVX-512 BF16 dot products,
// attention_dp.h) where this build has them and head_dim % 32 == 0, else as the first two:
// the _tiles pair for a model whose matmuls round their activations to bf16
// (--kernel-activations), chosen by the loader. window: the layer's sliding window (0: none).
#define ENTRY(name, KV_T, BF, TILES)                                                         \
    int name(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,     \
             int block_size, int H, int KVH, int D, const int64_t *query_start_loc,          \
             const int64_t *seq_lens, const int64_t *seq_of_token, int64_t T,                \
             const int32_t *block_tables, int64_t max_blocks, float scale, int64_t window,   \
             float *out, int nthreads) {                                                     \
        return attention_run(q, q_stride, k_cache, v_cache, BF, block_size, H, KVH, D,       \
                             query_start_loc, seq_lens, seq_of_token, T, block_tables,       \
                             max_blocks, scale, window, out, nthreads, TILES);               \
    }
// Whether the entry points take the window (benchmarks that load older builds ask).
int attention_window(void) { return 1; }
ENTRY(paged_attention, float, 0, 0)
ENTRY(paged_attention_bf16, uint16_t, 1, 0)
ENTRY(paged_attention_tiles, float, 0, 1)
ENTRY(paged_attention_bf16_tiles, uint16_t, 1, 1)
#undef ENTRY
