// attention.c's chunk with AVX-512 BF16 dot products (VDPBF16PS; built at the ISA level
// "avx512_bf16", which has no AMX tiles: Zen 4 and 5, Cooper Lake, a Xeon whose tiles Linux
// did not grant): the same partial (score maximum m, exp-sum l, weighted value sum o) of up to
// CHUNK keys for the queries of a group of rows, q.k and p.v as bf16 pair products summed in
// float32 — twice the float32 FMA's products a cycle, and the operands half the bytes. A
// header of attention.c's, over attention_bf16.h (the packing and softmax of the AMX chunk).
//
// Per query (a row's head), whatever the other queries of its pass, block or group, the rows
// of the step and the thread:
//   qr = bf16(q), kr = bf16(k), vr = bf16(v) (nearest even, denormals to zero)
//   s_j = scale * dp(... dp(dp(0, qr pair 0, kr_j pair 0), qr pair 1, kr_j pair 1) ...):
//         one VDPBF16PS lane, a chain over the D/2 pairs (d 2e, 2e+1) in order
//   m, e_j, p_j = bf16(e_j), l: attention_bf16.h's softmax_row (as on AMX tiles)
//   o[d] = the same chain over the key pairs (p_2t vr_2t[d], p_2t+1 vr_2t+1[d]) from key 0
// A lane's chain holds one (query, key) or (query, d) whatever the pass computes beside it;
// keys past a query's own have p = 0 and keys past the chunk are zero rows, so a pass over
// more keys than a query sees adds exact zeros (its sums never hold -0, barring a partial
// sum below 2^-126 flushed to zero, out of reach of real values): a decode row alone,
// a prompt row among 63 others and a row after a prefix-cache hit get the same bits. Not
// the AMX tiles' bits (TDPBF16PS sums each 32 elements in two chains first): each CPU's
// attention is invariant on its own. Requires D % 32 == 0 (else attention.c keeps the
// float chunk).
#ifndef TINYSERVE_ATTENTION_DP_H
#define TINYSERVE_ATTENTION_DP_H
#include "attention_bf16.h"  // pack_kv_bf16, to_bf16_32, softmax_row; attn_t, slot_ptrs

#define ATTN_DP 1
#define DP_Q 6  // queries a pass: 6 x 4 accumulators, 4 operands and a broadcast in 32 zmm
#define DP_BLOCK 48  // queries whose scores and weights the scratch holds at once

// Raw q.k of NQ queries (bf16 pairs at qp + m * hd) against NKB blocks of 16 keys from block
// kb0 of the transposed keys kt (nkb blocks): into sr + m * CHUNK + key. The same chains as
// dp_values below, kept apart: folded into one function with a run-time stride for the
// broadcasts, the value pass lost its constant one (six broadcasts at immediate offsets of
// one register) and an 8-row verification run's attention came out 5-7% slower (Zen 4).
INLINE void dp_scores(const uint32_t *kt, int nkb, int kb0, const uint32_t *qp, int hd,
                      float *sr, next_lines_t *nl, const int NQ, const int NKB) {
    __m512 acc[DP_Q][4];
    for (int m = 0; m < NQ; m++)
        for (int b = 0; b < NKB; b++) acc[m][b] = _mm512_setzero_ps();
    next_lines_t lines = *nl;  // in registers: the loop stored nl->at every pass
    for (int e = 0; e < hd; e++) {
        const uint32_t *row = kt + ((e / 16) * nkb + kb0) * 256 + (e % 16) * 16;
        __m512bh k[4];
        for (int b = 0; b < NKB; b++) k[b] = (__m512bh)_mm512_loadu_si512(row + b * 256);
        prefetch_pass(&lines);
        for (int m = 0; m < NQ; m++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[m * hd + e]);
            for (int b = 0; b < NKB; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], k[b], qb);
        }
    }
    nl->at = lines.at;
    for (int m = 0; m < NQ; m++)
        for (int b = 0; b < NKB; b++) _mm512_storeu_ps(sr + m * CHUNK + (kb0 + b) * 16, acc[m][b]);
}

// os[m][16 db .. 16 db + 15] for NDB blocks of 16 d from db0 = the chain over the ntp key
// pairs of NQ queries' weights (bf16 pairs at pp + m * CHUNK / 2) times the values vt.
INLINE void dp_values(const uint32_t *vt, int nd, int db0, const uint32_t *pp, int ntp,
                      float *const *os, next_lines_t *nl, const int NQ, const int NDB) {
    __m512 acc[DP_Q][4];
    for (int m = 0; m < NQ; m++)
        for (int b = 0; b < NDB; b++) acc[m][b] = _mm512_setzero_ps();
    next_lines_t lines = *nl;
    for (int t = 0; t < ntp; t++) {
        const uint32_t *row = vt + ((t / 16) * nd + db0) * 256 + (t % 16) * 16;
        __m512bh v[4];
        for (int b = 0; b < NDB; b++) v[b] = (__m512bh)_mm512_loadu_si512(row + b * 256);
        prefetch_pass(&lines);
        for (int m = 0; m < NQ; m++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[m * (CHUNK / 2) + t]);
            for (int b = 0; b < NDB; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], v[b], pb);
        }
    }
    nl->at = lines.at;
    for (int m = 0; m < NQ; m++)
        for (int b = 0; b < NDB; b++) _mm512_storeu_ps(os[m] + (db0 + b) * 16, acc[m][b]);
}

// call(NQ, NB) with NQ = nq in 1 .. DP_Q and NB = nb in {2, 4} as compile-time constants
// (blocks of 16 keys or d come in pairs: D % 32 == 0, keys padded to 32).
#define DP_BY(call, nq, nb)                                                        \
    do {                                                                           \
        switch ((nq) * 8 + (nb)) {                                                 \
        case 1 * 8 + 2: call(1, 2); break; case 1 * 8 + 4: call(1, 4); break;     \
        case 2 * 8 + 2: call(2, 2); break; case 2 * 8 + 4: call(2, 4); break;     \
        case 3 * 8 + 2: call(3, 2); break; case 3 * 8 + 4: call(3, 4); break;     \
        case 4 * 8 + 2: call(4, 2); break; case 4 * 8 + 4: call(4, 4); break;     \
        case 5 * 8 + 2: call(5, 2); break; case 5 * 8 + 4: call(5, 4); break;     \
        case 6 * 8 + 2: call(6, 2); break; case 6 * 8 + 4: call(6, 4); break;     \
        default: __builtin_trap(); /* a pass skipped would leave stale partials */ \
        }                                                                          \
    } while (0)

// Queries m0 .. m0+mb-1 (query m: row m / G, head g * G + m % G) over the packed keys kt and
// values vt of nk keys: their partials into parts. qp [DP_BLOCK][D/2], sb [DP_BLOCK][CHUNK],
// pb [DP_BLOCK][CHUNK]: chunk_partials_dp_t's scratch.
static void dp_query_block(const attn_t *a, const float *q, int64_t q_stride, int64_t g, int m0,
                           int mb, const int *b_row, const int *n_row, int nk, const uint32_t *kt,
                           const uint32_t *vt, uint32_t *qp, float *sb, uint16_t *pb,
                           float *const *parts, next_lines_t *nl) {
    const int G = a->H / a->KVH, D = a->D, hd = D / 2, nkb = nk / 16, nd = D / 16;
    float *os[DP_BLOCK];
    for (int m = m0; m < m0 + mb; m++) {
        const float *qr = q + (m / G) * q_stride + (g * G + m % G) * D;
        for (int d = 0; d < D; d += 32) to_bf16_32(qr + d, (uint16_t *)(qp + (m - m0) * hd) + d);
        os[m - m0] = parts[m / G] + (m % G) * (D + 2) + 2;
    }
    for (int i = 0; i < mb; i += DP_Q) {
        const int nq = mb - i < DP_Q ? mb - i : DP_Q;
        for (int kb0 = 0; kb0 < nkb; kb0 += 4) {
#define SCORES(NQ, NB) dp_scores(kt, nkb, kb0, qp + i * hd, hd, sb + i * CHUNK, nl, NQ, NB)
            DP_BY(SCORES, nq, nkb - kb0 < 4 ? nkb - kb0 : 4);
#undef SCORES
        }
    }
    for (int m = m0; m < m0 + mb; m++)
        softmax_row(sb + (m - m0) * CHUNK, b_row[m / G], n_row[m / G], nk, a->scale,
                    pb + (m - m0) * CHUNK, parts[m / G] + (m % G) * (D + 2));
    for (int i = 0; i < mb; i += DP_Q) {
        const int nq = mb - i < DP_Q ? mb - i : DP_Q;
        for (int db0 = 0; db0 < nd; db0 += 4) {
            const uint32_t *pp = (const uint32_t *)(pb + i * CHUNK);  // weights as key pairs
#define VALUES(NQ, NB) dp_values(vt, nd, db0, pp, nk / 2, os + i, nl, NQ, NB)
            DP_BY(VALUES, nq, nd - db0 < 4 ? nd - db0 : 4);
#undef VALUES
        }
    }
}

// chunk_partials (attention_chunk.h's contract of arguments; numerics above). scratch:
// chunk_scratch_dp_bytes. The keys and values packed once, then the queries DP_BLOCK at a
// time.
static void chunk_partials_dp_t(const attn_t *a, const float *q, int64_t q_stride, int R,
                                const int *b_row, const int *n_row, const int32_t *table,
                                int64_t g, int64_t j0, float *const *parts, void *scratch,
                                const next_t *next, const int BF) {
    const int G = a->H / a->KVH, D = a->D, hd = D / 2, M = R * G, n = n_row[R - 1];
    const int nk = (n + 31) / 32 * 32;
    const void **kp = (const void **)scratch, **vp = kp + CHUNK;
    uint32_t *kr = (uint32_t *)(vp + CHUNK), *kt = kr + CHUNK * hd, *vt = kt + CHUNK * hd;
    uint32_t *qp = vt + CHUNK * hd;  // [DP_BLOCK][hd]
    float *sb = (float *)(qp + DP_BLOCK * hd);  // [DP_BLOCK][CHUNK]
    uint16_t *pb = (uint16_t *)(sb + DP_BLOCK * CHUNK);  // [DP_BLOCK][CHUNK]
    const int64_t esize = BF ? 2 : 4;
    slot_ptrs(a, table, g, j0, n, kp, vp, esize);
    pack_kv_bf16(kp, vp, n, nk, D, kr, kt, vt, BF);
    // The next chunk's key and value lines into L2 (prefetcht1), a few with each pair of the
    // first passes over the scores and the weighted sums: between two layers' attention the
    // matmuls' weights evict this layer's cache lines, so a decode row's chunks read them
    // cold (as attention_chunk.h's float chunk does; without it a decode step at 3000 keys
    // was slower than the float chunk's).
    const void **nkp = (const void **)(pb + DP_BLOCK * CHUNK), **nvp = nkp + CHUNK;
    const int nn = next ? next->n : 0, lpr = (int)((D * esize + 63) / 64), iters = hd + nk / 2;
    if (nn) slot_ptrs(a, next->table, next->g, next->j0, nn, nkp, nvp, esize);
    next_lines_t nl = {nkp, nvp, nn, lpr, (2 * nn * lpr + iters - 1) / iters, 0};
    for (int m0 = 0; m0 < M; m0 += DP_BLOCK)
        dp_query_block(a, q, q_stride, g, m0, M - m0 < DP_BLOCK ? M - m0 : DP_BLOCK, b_row, n_row,
                       nk, kt, vt, qp, sb, pb, parts, &nl);
}

// Bytes of chunk_partials_dp's scratch (D elements per head).
static int64_t chunk_scratch_dp_bytes(int D) {
    return 4 * CHUNK * (int64_t)sizeof(void *) + 3 * CHUNK * D / 2 * 4 + DP_BLOCK * D / 2 * 4 +
           DP_BLOCK * CHUNK * 4 + DP_BLOCK * CHUNK * 2;
}

static void chunk_partials_dp(const attn_t *a, const float *q, int64_t q_stride, int R,
                              const int *b_row, const int *n_row, const int32_t *table, int64_t g,
                              int64_t j0, float *const *parts, void *scratch, const next_t *next) {
    if (a->bf16) chunk_partials_dp_t(a, q, q_stride, R, b_row, n_row, table, g, j0, parts, scratch, next, 1);
    else chunk_partials_dp_t(a, q, q_stride, R, b_row, n_row, table, g, j0, parts, scratch, next, 0);
}

#endif
