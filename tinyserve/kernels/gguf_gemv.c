// Matrix x vector(s) straight from GGUF's Q4_1 / Q8_0 blocks, dequantised in registers
// (AVX2 + FMA), for the small-batch decode steps whose cost is reading the weights.
//
//   y[r, n] = sum_k W[n, k] * x[r, k]      r < M (a few rows), n < N, k < K (K % 32 == 0)
//
// W is stored as GGUF does, one row of K/32 blocks per output n:
//   Q4_1 block (32 weights): qs[16] (low nibbles = weights 0..15, high = 16..31), and
//        per block d, m (float32 here): w = d * q + m
//   Q8_0 block (32 weights): qs[32] (int8), per block d: w = d * q
// The weights are exactly the GGUF ones (d and m widened from fp16 without rounding); only
// the summation order differs from dequantise-then-matmul.
#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_M 8

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// The 8 lanes of w . x over one block of 32 (the block's weights w0..w3 as floats).
static inline __m256 dot32(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *xb) {
    __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), t);
    t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), t);
    return _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), t);
}

// x block sums: sx[r * nb + b] = sum of x[r, 32b .. 32b+31] (the m term of Q4_1).
static void block_sums(const float *x, int64_t ldx, int M, int64_t nb, float *sx) {
    for (int r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *p = x + r * ldx + 32 * b;
            __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
            sx[r * nb + b] = hsum(s);
        }
    }
}

static void q4_1_rows(const uint8_t *qs, const float *d, const float *m, const float *x,
                      int64_t ldx, const float *sx, float *y, int64_t ldy, int64_t n0,
                      int64_t n1, int64_t K, int M) {
    const int64_t nb = K / 32;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *q = qs + n * nb * 16;
        const float *dn = d + n * nb, *mn = m + n * nb;
        // Rows of x in chunks of MAX_M: the weight row stays in L1 between chunks.
        for (int r0 = 0; r0 < M; r0 += MAX_M) {
            const int mc = M - r0 < MAX_M ? M - r0 : MAX_M;
            const float *xc = x + r0 * ldx, *sxc = sx + r0 * nb;
            __m256 acc[MAX_M];
            float macc[MAX_M];
            for (int r = 0; r < mc; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.0f; }
            for (int64_t b = 0; b < nb; b++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(q + 16 * b));
                __m128i lo = _mm_and_si128(raw, low);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                __m256 db = _mm256_set1_ps(dn[b]);
                for (int r = 0; r < mc; r++) {
                    __m256 t = dot32(w0, w1, w2, w3, xc + r * ldx + 32 * b);
                    acc[r] = _mm256_fmadd_ps(db, t, acc[r]);
                    macc[r] += mn[b] * sxc[r * nb + b];
                }
            }
            for (int r = 0; r < mc; r++) y[(r0 + r) * ldy + n] = hsum(acc[r]) + macc[r];
        }
    }
}

static void q8_0_rows(const int8_t *qs, const float *d, const float *x, int64_t ldx, float *y,
                      int64_t ldy, int64_t n0, int64_t n1, int64_t K, int M) {
    const int64_t nb = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *q = qs + n * K;
        const float *dn = d + n * nb;
        for (int r0 = 0; r0 < M; r0 += MAX_M) {
            const int mc = M - r0 < MAX_M ? M - r0 : MAX_M;
            const float *xc = x + r0 * ldx;
            __m256 acc[MAX_M];
            for (int r = 0; r < mc; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *qb = q + 32 * b;
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qb)));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8))));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 16))));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 24))));
                __m256 db = _mm256_set1_ps(dn[b]);
                for (int r = 0; r < mc; r++) {
                    __m256 t = dot32(w0, w1, w2, w3, xc + r * ldx + 32 * b);
                    acc[r] = _mm256_fmadd_ps(db, t, acc[r]);
                }
            }
            for (int r = 0; r < mc; r++) y[(r0 + r) * ldy + n] = hsum(acc[r]);
        }
    }
}

// Output rows split evenly over OpenMP threads (or all on the caller's thread).
typedef struct {
    int kind;  // 0 = Q4_1, 1 = Q8_0
    const void *qs;
    const float *d, *m, *x, *sx;
    float *y;
    int64_t ldx, ldy, K;
    int M;
} job_t;

static void run_rows(const job_t *j, int64_t n0, int64_t n1) {
    if (j->kind == 0)
        q4_1_rows((const uint8_t *)j->qs, j->d, j->m, j->x, j->ldx, j->sx, j->y, j->ldy, n0, n1,
                  j->K, j->M);
    else
        q8_0_rows((const int8_t *)j->qs, j->d, j->x, j->ldx, j->y, j->ldy, n0, n1, j->K, j->M);
}

static void run(const job_t *j, int64_t N, int nthreads) {
    if (nthreads <= 1) {
        run_rows(j, 0, N);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int t = 0, T = 1;
#endif
        int64_t chunk = (N + T - 1) / T, n0 = t * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        if (n0 < n1) run_rows(j, n0, n1);
    }
}

// Entry points (ctypes). Any M (rows go through in chunks of MAX_M); sx is scratch of
// M * K / 32 floats (Q4_1 only).
void gemv_q4_1(const uint8_t *qs, const float *d, const float *m, const float *x, int64_t ldx,
               float *sx, float *y, int64_t ldy, int64_t N, int64_t K, int M, int nthreads) {
    block_sums(x, ldx, M, K / 32, sx);
    job_t j = {0, qs, d, m, x, sx, y, ldx, ldy, K, M};
    run(&j, N, nthreads);
}

void gemv_q8_0(const int8_t *qs, const float *d, const float *x, int64_t ldx, float *y,
               int64_t ldy, int64_t N, int64_t K, int M, int nthreads) {
    job_t j = {1, qs, d, NULL, x, NULL, y, ldx, ldy, K, M};
    run(&j, N, nthreads);
}

int gemv_chunk_rows(void) { return MAX_M; }
