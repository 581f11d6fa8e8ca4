// The per-layer elementwise work of a decoder layer in one pass each (float32, AVX2 + FMA):
// residual add + RMSNorm, and SiLU(gate) * up. Each row is computed alone, in one fixed
// order, so results never depend on the other rows of the step (batch invariance) — and a
// decode step runs 2 calls per layer instead of ~15 small torch ops.
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include <math.h>
#include <string.h>  // memcpy (kernel_rows)

// If residual != NULL: residual[r] += x[r] first, and the norm is of the sum.
// out[r] = v * w / sqrt(mean(v^2) + eps). H % 8 == 0. Rows over threads.
void rms_norm(const float *x, float *residual, const float *w, float *out, int64_t rows,
              int64_t H, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * H;
        float *v = residual ? residual + r * H : (float *)xr;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 8) {
            __m256 t = _mm256_loadu_ps(xr + i);
            if (residual) {
                t = _mm256_add_ps(t, _mm256_loadu_ps(v + i));
                _mm256_storeu_ps(v + i, t);
            }
            ss = _mm256_fmadd_ps(t, t, ss);
        }
        const float inv = 1.0f / sqrtf(hsum8(ss) / (float)H + eps);
        const __m256 iv = _mm256_set1_ps(inv);
        float *o = out + r * H;
        for (int64_t i = 0; i < H; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                  _mm256_mul_ps(_mm256_loadu_ps(v + i), iv)));
    }
}

// One vector of n floats normalised in place: v = w * (v * inv), inv = 1 / sqrt(mean(v^2) +
// eps), the arithmetic of rms_norm above (n % 8 == 0).
INLINE void norm_in_place(float *v, const float *w, int64_t n, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 t = _mm256_loadu_ps(v + i);
        ss = _mm256_fmadd_ps(t, t, ss);
    }
    const __m256 iv = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(v + i), iv)));
}

// Qwen3's q/k norm: in the fused qkv rows [T, (H + 2 KVH) * D], each of the H query heads
// RMS-normalised over its D values with qw, each of the KVH key heads with kw, in place
// (the values untouched). D % 8 == 0. Tokens over threads.
void head_norm(float *qkv, const float *qw, const float *kw, int64_t T, int H, int KVH, int D,
               float eps, int nthreads) {
    const int64_t row = (int64_t)(H + 2 * KVH) * D;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 8)
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < H + KVH; h++)
            norm_in_place(qkv + t * row + (int64_t)h * D, h < H ? qw : kw, D, eps);
}

// gate_up [rows, 2I] -> out [rows, I]: silu(gate) * up, silu(g) = g / (1 + exp(-g)). I % 8 == 0.
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t I, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

// 8 floats -> 8 bf16, rounded to nearest even (torch's float -> bfloat16 for every finite
// value; a NaN stays a NaN), in integer AVX2 so that every ISA level writes the same bits.
INLINE __m128i bf16_round8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Rotary embedding (rotate-half) of q and k, in place in the fused qkv rows, and the step's
// K and V written into the paged cache at their slots (float32, or BF: bf16 rounded by
// bf16_round8): one pass instead of ~10 torch ops.
//   qkv [T, (H + 2 KVH) * D]; cos, sin [T, D/2] (this step's positions); caches
//   [num_blocks * block_size, KVH, D] flat by slot; slots [T]. D % 16 == 0.
// Same arithmetic as the torch path (x1 * c - x2 * s, x2 * c + x1 * s; no fused multiply-add).
INLINE void rope_and_cache_t(float *qkv, const float *cos, const float *sin, void *k_cache,
                             void *v_cache, const int64_t *slots, int64_t T, int H, int KVH,
                             int D, int nthreads, const int BF) {
    const int half = D / 2, heads = H + KVH;
    const int64_t row = (int64_t)(H + 2 * KVH) * D;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        float *r = qkv + t * row;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads; h++) {
            float *x = r + (int64_t)h * D;
            for (int i = 0; i < half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
                __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
                _mm256_storeu_ps(x + i, o1);
                _mm256_storeu_ps(x + half + i, o2);
            }
        }
        const int64_t at = slots[t] * KVH * D;
        const float *k = r + (int64_t)H * D, *v = k + (int64_t)KVH * D;
        if (BF) {
            uint16_t *kc = (uint16_t *)k_cache + at, *vc = (uint16_t *)v_cache + at;
            for (int i = 0; i < KVH * D; i += 8) {
                _mm_storeu_si128((__m128i *)(kc + i), bf16_round8(_mm256_loadu_ps(k + i)));
                _mm_storeu_si128((__m128i *)(vc + i), bf16_round8(_mm256_loadu_ps(v + i)));
            }
        } else {
            float *kc = (float *)k_cache + at, *vc = (float *)v_cache + at;
            for (int i = 0; i < KVH * D; i += 8) {
                _mm256_storeu_ps(kc + i, _mm256_loadu_ps(k + i));
                _mm256_storeu_ps(vc + i, _mm256_loadu_ps(v + i));
            }
        }
    }
}

void rope_and_cache(float *qkv, const float *cos, const float *sin, float *k_cache,
                    float *v_cache, const int64_t *slots, int64_t T, int H, int KVH, int D,
                    int nthreads) {
    rope_and_cache_t(qkv, cos, sin, k_cache, v_cache, slots, T, H, KVH, D, nthreads, 0);
}

// The same into a bf16 cache (uint16; --kv-cache-dtype bfloat16): K and V rounded as stored.
void rope_and_cache_bf16(float *qkv, const float *cos, const float *sin, uint16_t *k_cache,
                         uint16_t *v_cache, const int64_t *slots, int64_t T, int H, int KVH,
                         int D, int nthreads) {
    rope_and_cache_t(qkv, cos, sin, k_cache, v_cache, slots, T, H, KVH, D, nthreads, 1);
}

// Prompt logprobs from logits (model_runner.py, where the head is not gemm.c's: gemm_score.h
// fuses the same into the head's matmul): logprob.h's two passes a row.
#include "logprob.h"

void logprob_rows(const float *logits, int64_t rows, int64_t V, const int64_t *targets, int k,
                  float *lp, int32_t *rank, int32_t *top_ids, float *top_lp, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * V;
        const float xt = x[targets[r]];
        float bv[LOGPROB_MAX_K], m;
        int32_t bi[LOGPROB_MAX_K];
        int64_t count;
        int n = 0;
        logprob_scan(x, V, 0, xt, k, bv, bi, &n, &m, &count);
        const float lse = (float)log(logprob_sumexp(x, V, m));
        lp[r] = (xt - m) - lse;
        rank[r] = (int32_t)count + 1;
        for (int j = 0; j < k; j++) {
            top_ids[r * k + j] = bi[j];
            top_lp[r * k + j] = (bv[j] - m) - lse;
        }
    }
}

// Rows ids [T] of a weight in gemm.c's grouped layout (kernels/rows.py: a tied LM head's kernel
// copy read as the embedding table) into out [T, K] floats, the values the loader's copy held:
// kind 0 Q4_1 d * q + m (two roundings: -ffp-contract=off), 1 Q8_0 d * q, 2 float32, 3 bf16
// pairs (weight p in a word's low half, p + 16 in its high half). gw: outputs per group.
// Returns 0, or -1 (nothing written) for an id outside [0, N).
int kernel_rows(int kind, const void *qs, const float *d, const float *m, int64_t N, int64_t K,
                int gw, const int64_t *ids, int64_t T, float *out) {
    const int64_t nb = K / 32;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t g = ids[t] / gw, lane = ids[t] % gw;
        float *o = out + t * K;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t blk = g * nb + b;  // this output's block b: (blk * steps + step) * gw
            const float db = kind < 2 ? d[blk * gw + lane] : 0.0f;
            for (int p = 0; p < 32; p++) {
                float v;
                if (kind == 2) {
                    v = ((const float *)qs)[(g * K + b * 32 + p) * gw + lane];
                } else if (kind == 3) {
                    const uint32_t w = ((const uint32_t *)qs)[(blk * 16 + p % 16) * gw + lane];
                    const uint32_t bits = (p < 16 ? w & 0xFFFF : w >> 16) << 16;
                    memcpy(&v, &bits, 4);
                } else if (kind == 1) {
                    v = db * (float)((const int8_t *)qs)[(blk * 32 + p) * gw + lane];
                } else {
                    const uint8_t c = ((const uint8_t *)qs)[(blk * 16 + p % 16) * gw + lane];
                    v = db * (float)(p < 16 ? c & 15 : c >> 4) + m[blk * gw + lane];
                }
                o[b * 32 + p] = v;
            }
        }
    }
    return 0;
}
