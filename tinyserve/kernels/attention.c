// Paged attention for a flat (ragged) batch, float32, AVX2 + FMA, read straight through the
// block table: no gather of the context into a padded rectangle, no mask.
//
//   q      [T, *, D] with token stride q_stride (the step's queries, heads contiguous)
//   cache  k/v [num_blocks, block_size, KVH, D]
//   out    [T, H, D]
// Sequence s owns flat rows query_start_loc[s] .. query_start_loc[s+1]-1, at positions
// seq_lens[s] - q_len .. seq_lens[s] - 1; query row i sees keys 0 .. its position.
//
// One work item is (query row, KV head): its H/KVH query heads share each key and value
// read. Every item computes its scores, softmax and weighted sum in one fixed order over
// the keys, so a row's output never depends on which other rows share the step (batch
// invariance), only on its own context.
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include <math.h>

static inline float dot(const float *a, const float *b, int D) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int d = 8; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum8(acc);
}

static __thread float *scratch = NULL;
static __thread int64_t scratch_cap = 0;

static float *get_scratch(int64_t n) {
    if (n > scratch_cap) {
        free(scratch);
        scratch = (float *)aligned_alloc(32, ((n + 7) / 8) * 8 * sizeof(float));
        scratch_cap = scratch ? n : 0;
    }
    return scratch;
}

// Returns 0, or -1 when scratch memory could not be had.
static int attend(const float *q, const float *k_cache, const float *v_cache,
                  int block_size, int H, int KVH, int D, const int32_t *table, int64_t pos,
                  int64_t g, float scale, float *out) {
    const int G = H / KVH;
    const int64_t n_keys = pos + 1, stride = (n_keys + 7) / 8 * 8;
    float *s = get_scratch(G * stride + G * D);
    if (s == NULL) return -1;
    float *acc = s + G * stride;
    float mx[16];
    for (int h = 0; h < G; h++) mx[h] = -INFINITY;
    for (int64_t j = 0; j < n_keys; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        const float *k = k_cache + (slot * KVH + g) * D;
        for (int h = 0; h < G; h++) {
            float v = dot(q + (g * G + h) * D, k, D) * scale;
            s[h * stride + j] = v;
            if (v > mx[h]) mx[h] = v;
        }
    }
    float inv[16];
    for (int h = 0; h < G; h++) {
        float *sh = s + h * stride;
        for (int64_t j = n_keys; j < stride; j++) sh[j] = -INFINITY;
        __m256 m = _mm256_set1_ps(mx[h]), sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < stride; j += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + j), m));
            if (j + 8 > n_keys) {  // the padding lanes count for nothing
                __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n_keys - j)), lane);
                e = _mm256_and_ps(e, _mm256_castsi256_ps(keep));
            }
            _mm256_storeu_ps(sh + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        inv[h] = 1.0f / hsum8(sum);
        for (int d = 0; d < D; d++) acc[h * D + d] = 0.0f;
    }
    for (int64_t j = 0; j < n_keys; j++) {
        const int64_t slot = (int64_t)table[j / block_size] * block_size + j % block_size;
        const float *v = v_cache + (slot * KVH + g) * D;
        for (int h = 0; h < G; h++) {
            __m256 p = _mm256_set1_ps(s[h * stride + j]);
            float *a = acc + h * D;
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(a + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(a + d)));
        }
    }
    for (int h = 0; h < G; h++) {
        __m256 iv = _mm256_set1_ps(inv[h]);
        float *o = out + (g * G + h) * D;
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + d), iv));
    }
    return 0;
}

// Entry point (ctypes). block_tables: int32 [num_seqs, max_blocks]; seq_of_token: int64 [T].
// Requires D % 8 == 0 and H / KVH <= 16. Returns 0, or -1 if scratch memory ran out.
int paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                    int block_size, int H, int KVH, int D, const int64_t *query_start_loc,
                    const int64_t *seq_lens, const int64_t *seq_of_token, int64_t T,
                    const int32_t *block_tables, int64_t max_blocks, float scale, float *out,
                    int nthreads) {
    const int64_t items = T * KVH;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) reduction(| : failed)
    for (int64_t it = 0; it < items; it++) {
        const int64_t t = it / KVH, g = it % KVH, s = seq_of_token[t];
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int64_t pos = seq_lens[s] - q_len + (t - query_start_loc[s]);
        failed |= attend(q + t * q_stride, k_cache, v_cache, block_size, H, KVH, D,
                         block_tables + s * max_blocks, pos, g, scale, out + t * H * D);
    }
    return failed ? -1 : 0;
}
