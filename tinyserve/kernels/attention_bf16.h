// The bf16 operands of attention.c's bf16-product chunks, shared by AMX tiles
// (attention_amx.h) and AVX-512 BF16 dot products (attention_dp.h): rounding float32 to bf16
// as vcvtneps2bf16 does (every build the same bits), a chunk's keys and values packed as bf16
// pairs (kr rows, kt transposed, vt key pairs) and one query's softmax with bf16 weights. A
// header of attention.c's, over attention_chunk.h (keep8, CHUNK).
#ifndef TINYSERVE_ATTENTION_BF16_H
#define TINYSERVE_ATTENTION_BF16_H
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE, exp256 / exp512, hsum8
#include "attention_chunk.h"  // keep8, CHUNK
#include <math.h>
#include <string.h>

// float32 -> bf16 bits, nearest even, a denormal becoming a zero of its sign: what
// vcvtneps2bf16 does to finite inputs, in AVX2 integer arithmetic for the builds without
// AVX512-BF16 (every build packs the same bits). 8 lanes, the bits in each int32's low half.
INLINE __m256i bf16_round(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)),
                                            _mm256_setzero_si256());
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000));
    return _mm256_blendv_epi8(r, sign, tiny);
}

// 16 bf16 words from two vectors of 8 bf16 lanes (bf16_round's), in order.
INLINE __m256i bf16_words(__m256i lo, __m256i hi) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}

// 32 floats -> 32 bf16 words.
INLINE void to_bf16_32(const float *src, uint16_t *dst) {
#ifdef __AVX512BF16__
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    _mm512_storeu_si512(dst, (__m512i)w);
#else
    for (int h = 0; h < 32; h += 16)
        _mm256_storeu_si256((__m256i *)(dst + h),
                            bf16_words(bf16_round(_mm256_loadu_ps(src + h)),
                                       bf16_round(_mm256_loadu_ps(src + h + 8))));
#endif
}

// 8x8 int32 transpose in registers.
INLINE void transpose8(__m256i r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
        t[i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// Values d .. d+15 of keys j and j + 1 (j + 1 < n when hi) as 16 pairs (v_j[d], v_j+1[d]).
INLINE void value_pairs16(const void *vj, const void *vj1, int64_t d, int hi, uint32_t *dst,
                          const int BF) {
#ifdef __AVX512BF16__
    __m512i w;
    if (BF) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)((const uint16_t *)vj + d));
        const __m256i b = hi ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)vj1 + d))
                             : _mm256_setzero_si256();
        w = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    } else {
        const __m512 b = hi ? _mm512_loadu_ps((const float *)vj1 + d) : _mm512_setzero_ps();
        w = (__m512i)_mm512_cvtne2ps_pbh(b, _mm512_loadu_ps((const float *)vj + d));
    }
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(zip, w));
#else
    for (int h = 0; h < 16; h += 8) {
        __m256i lo, up = _mm256_setzero_si256();
        if (BF) {
            lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)vj + d + h)));
            if (hi) up = _mm256_slli_epi32(_mm256_cvtepu16_epi32(
                              _mm_loadu_si128((const __m128i *)((const uint16_t *)vj1 + d + h))), 16);
        } else {
            lo = bf16_round(_mm256_loadu_ps((const float *)vj + d + h));
            if (hi) up = _mm256_slli_epi32(bf16_round(_mm256_loadu_ps((const float *)vj1 + d + h)), 16);
        }
        _mm256_storeu_si256((__m256i *)(dst + h), _mm256_or_si256(lo, up));
    }
#endif
}

// The bf16 operands of one chunk (D elements per head, nk keys, a multiple of 32, of which n
// are real, the rest zeros), in 16 x 16 blocks of pairs (an AMX B tile; a block's row of 16
// pairs one zmm of the dot products):
//   kt  [D/32][nk/16] blocks: row r, column c = key c's pair (d 2r, 2r+1) of that 32 of d
//   vt  [nk/32][D/16] blocks: row r, column c = (v_2r[d_c], v_2r+1[d_c]) of 32 keys x 16 d
// kr [CHUNK][D/2]: the keys' rows as bf16 pairs (before the transpose; the A tiles of
// attention_amx.h's few-query form).
static void pack_kv_bf16(const void *const *kp, const void *const *vp, int n, int nk, int D,
                         uint32_t *kr, uint32_t *kt, uint32_t *vt, const int BF) {  // kt NULL: no transpose
    const int hd = D / 2, nkb = nk / 16, nd = D / 16;
    for (int j = 0; j < n; j++) {
        if (BF) memcpy(kr + j * hd, kp[j], D * 2);
        else for (int d = 0; d < D; d += 32) to_bf16_32((const float *)kp[j] + d, (uint16_t *)(kr + j * hd + d / 2));
    }
    memset(kr + n * hd, 0, (size_t)(nk - n) * hd * 4);
    for (int j0 = 0; j0 < (kt ? nk : 0); j0 += 8)
        for (int e0 = 0; e0 < hd; e0 += 8) {  // pairs e0 .. e0+7 of keys j0 .. j0+7
            __m256i r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(kr + (j0 + i) * hd + e0));
            transpose8(r);  // r[i]: pair e0 + i of the 8 keys
            for (int i = 0; i < 8; i++) {
                const int e = e0 + i;
                uint32_t *dst = kt + ((e / 16) * nkb + j0 / 16) * 256 + (e % 16) * 16 + j0 % 16;
                _mm256_storeu_si256((__m256i *)dst, r[i]);
            }
        }
    for (int j = 0; j < nk; j += 2) {
        uint32_t *row = vt + (j / 32) * nd * 256 + ((j % 32) / 2) * 16;
        if (j >= n) {
            for (int db = 0; db < nd; db++) memset(row + db * 256, 0, 64);
            continue;
        }
        for (int d = 0; d < D; d += 16)
            value_pairs16(vp[j], j + 1 < n ? vp[j + 1] : vp[j], d, j + 1 < n, row + (d / 16) * 256, BF);
    }
}

// One query's softmax over its keys b .. nr-1 of a chunk's nk (sr: its raw q.k sums, CHUNK
// floats; b > 0: left of its window): out[0] = m, out[1] = l, pr [nk] the bf16 p (0 outside). l sums p_j into 16 lanes by
// j % 16 in order of j, then adds the halves lane by lane and hsum8s: the same bits from the
// 16-lane and the 8-lane code.
INLINE void softmax_row(float *sr, int b, int nr, int nk, float scale, uint16_t *pr, float *out) {
#ifdef __AVX512BF16__
    __m512 mx = _mm512_set1_ps(-INFINITY);
#define KEEP16(j) (__mmask16)((nr - (j) >= 16 ? 0xFFFF : (1u << (nr - (j))) - 1) & \
                             ~(b - (j) <= 0 ? 0u : b - (j) >= 16 ? 0xFFFFu : (1u << (b - (j))) - 1))
    for (int j = 0; j < nr; j += 16) {
        const __mmask16 k = KEEP16(j);
        const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), k,
                                            _mm512_mul_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(scale)));
        _mm512_storeu_ps(sr + j, s);
        mx = _mm512_max_ps(mx, s);
    }
    out[0] = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(out[0]);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nk; j += 16) {
        __m256i w = _mm256_setzero_si256();
        if (j < nr) {
            const __mmask16 k = KEEP16(j);
            const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)));
            w = (__m256i)_mm512_cvtneps_pbh(e);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16)));
        }
        _mm256_storeu_si256((__m256i *)(pr + j), w);
    }
    out[1] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(sum),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1))));
#undef KEEP16
#else
    const __m256 scale8 = _mm256_set1_ps(scale);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < nr; j += 8) {
        const __m256 keep = keep8(b, nr, j);
        const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                          _mm256_mul_ps(_mm256_loadu_ps(sr + j), scale8), keep);
        _mm256_storeu_ps(sr + j, s);
        mx = _mm256_max_ps(mx, s);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    out[0] = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 mv = _mm256_set1_ps(out[0]);
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int j = 0; j < nk; j += 16) {
        __m256i w[2];
        for (int h = 0; h < 2; h++) {
            const int jj = j + 8 * h;
            w[h] = _mm256_setzero_si256();
            if (jj < nr) {
                const __m256 keep = keep8(b, nr, jj);
                const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + jj), mv)), keep);
                w[h] = bf16_round(e);
                sum[h] = _mm256_add_ps(sum[h], _mm256_castsi256_ps(_mm256_slli_epi32(w[h], 16)));
            }
        }
        _mm256_storeu_si256((__m256i *)(pr + j), bf16_words(w[0], w[1]));
    }
    out[1] = hsum8(_mm256_add_ps(sum[0], sum[1]));
#endif
}

#endif
