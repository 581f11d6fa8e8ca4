// Shared helpers of the CPU kernels: the widest float vector built for (vf: GW lanes), a
// fixed-order horizontal sum and a vector exp (AVX2).
#ifndef TINYSERVE_SIMD_H
#define TINYSERVE_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
/* Inside a parallel region: this thread's index t and the team size T. */
#define THREAD_INDEX(t, T) int t = omp_get_thread_num(), T = omp_get_num_threads()
#else
#define THREAD_INDEX(t, T) int t = 0, T = 1
#endif

#define INLINE static inline __attribute__((always_inline))

// The float vector of GW lanes: AVX-512 where the build's flags allow it, else AVX2.
#ifdef __AVX512F__
#define GW 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VLOADA(p) _mm512_load_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSTOREA(p, v) _mm512_store_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSET1(s) _mm512_set1_ps(s)
#else
#define GW 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VLOADA(p) _mm256_load_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSTOREA(p, v) _mm256_store_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSET1(s) _mm256_set1_ps(s)
#endif
#define VBCAST(p) VSET1(*(p))

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// exp(x), |x| <= 87 (clamped), ~1 ulp: x = n ln2 + r, a degree-5 polynomial for exp(r).
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(n));
}

#ifdef __AVX512F__
// exp256's operations on 16 lanes: per lane bitwise exp256's result.
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(n));
}
#endif

// One cache line prefetched into L1 and L2 (prefetcht0) or, L2 set, into L2 only (prefetcht1).
INLINE void prefetch_line(const void *a, const int L2) {
    if (L2) _mm_prefetch((const char *)a, _MM_HINT_T1);
    else _mm_prefetch((const char *)a, _MM_HINT_T0);
}

// Prefetch, one block step at a time, the weights of the tile of NT output rows starting at
// row na (rows of nb blocks: cb code bytes each in qs, one float in d and, if m, in m). Called
// for b = 0 .. nb-1 while an earlier tile computes, so its rows (contiguous: NT * nb * cb
// bytes) arrive one cache line per step — the memory-level parallelism the hardware
// prefetcher does not reach at one decode row.
INLINE void prefetch_tile(const void *qs, const float *d, const float *m, int64_t na,
                          int NT, int64_t nb, int64_t cb, int64_t b) {
    const char *q = (const char *)qs + na * nb * cb;
    const int64_t span = NT * nb * cb, per = (NT * cb + 63) / 64 * 64;
    for (int64_t off = b * per; off < span && off < (b + 1) * per; off += 64)
        _mm_prefetch(q + off, _MM_HINT_T0);
    if (b * 64 < NT * nb * 4) {
        _mm_prefetch((const char *)(d + na * nb) + b * 64, _MM_HINT_T0);
        if (m) _mm_prefetch((const char *)(m + na * nb) + b * 64, _MM_HINT_T0);
    }
}

#endif
