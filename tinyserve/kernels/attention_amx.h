// attention.c's chunk on AMX tiles (built at the ISA level "amx", or with
// -DTINYSERVE_AMX_EMULATE on any CPU through amx_tile.h's scalar tiles): the same partial
// (score maximum m, exp-sum l, weighted value sum o) of up to CHUNK keys for the queries of a
// group of rows, with q.k and p.v as TDPBF16PS products instead of float32 FMAs. A header
// of attention.c's, over attention_chunk.h (attn_t, next_t, slot_ptrs, CHUNK).
//
// Per query (a row's head), whatever the other queries of its tile or group, the rows of the
// step and the thread:
//   qr = bf16(q), kr = bf16(k), vr = bf16(v) (nearest even, denormals to zero: bf16_round)
//   s_j = scale * ((0 + tdp(qr[0:32], kr_j[0:32])) + tdp(qr[32:64], ...) ...): the tile's sum
//         of each 32 elements of d (amx_tile.h: two chains, then C + (te + to)), d in order
//   m = max over the query's own keys j < n; e_j = exp256(s_j - m) (exp512: the same
//         operations per lane), 0 past its keys
//   p_j = bf16(e_j); l = the sum of p_j in 16 lanes by j % 16 over j in order, the two
//         halves added lane by lane, then hsum8 (softmax_row)
//   o[d] = the tile's sum of p_j * vr_j[d] over each 32 keys in order from key 0
// Keys past a query's own have p = 0 and keys past the chunk's zero k and v rows, so a tile
// that spans more keys than a query sees adds exact zeros to it (its sums never hold -0):
// a decode row alone, a prompt row among 63 others and a row after a prefix-cache hit get
// the same bits, in either form below (few queries transposed, or many). Requires
// D % 32 == 0 (else attention.c keeps the float chunk).
#ifndef TINYSERVE_ATTENTION_AMX_H
#define TINYSERVE_ATTENTION_AMX_H
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE, exp256 / exp512, hsum8
#include "attention_chunk.h"  // attn_t, next_t, slot_ptrs, CHUNK
#include "amx_tile.h"
#include "attention_bf16.h"  // bf16_round, to_bf16_32, pack_kv_bf16, softmax_row
#include <math.h>
#include <string.h>

#define ATTN_AMX 1

// Up to this many queries (one A tile) a chunk runs in the transposed form below: a decode
// row (G queries) or a short verification run.
#ifndef AMX_FEW_QUERIES
#define AMX_FEW_QUERIES 16
#endif

// The chunk for M <= 16 queries with the scores transposed, S^T = K Q^T: the keys' bf16 rows
// are the A tiles as they are (no transpose of 64 keys for a few queries), Q^T (pairs of d x
// queries) the B tile. Per (key, query) the tile sums the same products in the same order as
// q.k in the main form (k_2p q_2p = q_2p k_2p exactly), and p.v is the main form's, so both
// give the same bits: which one runs may follow M. Tiles: 0-1 S^T (16 keys x M), 2 the keys,
// 3 Q^T, 4-5 the outputs (M x 16 of d), 6 p, 7 the values.
static void chunk_few_queries(const attn_t *a, const float *q, int64_t q_stride, int64_t g, int M,
                              const int *b_row, const int *n_row, int nk, const uint32_t *kr, uint32_t *qt,
                              const uint32_t *vt, uint16_t *qb, uint16_t *pb, float *sb,
                              float *srow, float *const *parts) {
    const int G = a->H / a->KVH, D = a->D, hd = D / 2, ns = D / 32, nd = D / 16, nkb = nk / 16;
    for (int m = 0; m < M; m++) {  // query m: row m / G, head g * G + m % G
        const float *qr = q + (m / G) * q_stride + (g * G + m % G) * D;
        for (int d = 0; d < D; d += 32) to_bf16_32(qr + d, qb + m * D + d);
        const uint32_t *row = (const uint32_t *)(qb + m * D);
        for (int e = 0; e < hd; e++) qt[(e / 16) * 256 + (e % 16) * 16 + m] = row[e];
    }
    const uint8_t rows[8] = {16, 16, 16, 16, (uint8_t)M, (uint8_t)M, (uint8_t)M, 16};
    const uint16_t colsb[8] = {(uint16_t)(4 * M), (uint16_t)(4 * M), 64, (uint16_t)(4 * M),
                               64, 64, 64, 64};
    tile_config_shapes(rows, colsb);
    float *st = sb;  // [nk][16]: key j's scores at st + 16 j
    for (int kb = 0; kb < nkb; kb += 2) {
        const int two = kb + 1 < nkb;
        TILE_ZERO(0);
        if (two) TILE_ZERO(1);
        for (int s = 0; s < ns; s++) {
            TILE_LOAD(3, qt + s * 256, 64);
            TILE_LOAD(2, kr + kb * 16 * hd + s * 16, hd * 4);
            TILE_DPBF16(0, 2, 3);
            if (two) {
                TILE_LOAD(2, kr + (kb + 1) * 16 * hd + s * 16, hd * 4);
                TILE_DPBF16(1, 2, 3);
            }
        }
        TILE_STORE(0, st + kb * 256, 64);
        if (two) TILE_STORE(1, st + (kb + 1) * 256, 64);
    }
    for (int m = 0; m < M; m++) {
        float *sr = srow + m * CHUNK;
        for (int j = 0; j < nk; j++) sr[j] = st[j * 16 + m];
        softmax_row(sr, b_row[m / G], n_row[m / G], nk, a->scale, pb + m * CHUNK, parts[m / G] + (m % G) * (D + 2));
    }
    float *ob = sb;  // [M][D]
    for (int db = 0; db < nd; db += 2) {
        const int two = db + 1 < nd;
        TILE_ZERO(4);
        if (two) TILE_ZERO(5);
        for (int t = 0; t < nk / 32; t++) {
            TILE_LOAD(6, pb + t * 32, CHUNK * 2);
            TILE_LOAD(7, vt + (t * nd + db) * 256, 64);
            TILE_DPBF16(4, 6, 7);
            if (two) {
                TILE_LOAD(7, vt + (t * nd + db + 1) * 256, 64);
                TILE_DPBF16(5, 6, 7);
            }
        }
        TILE_STORE(4, ob + db * 16, D * 4);
        if (two) TILE_STORE(5, ob + (db + 1) * 16, D * 4);
    }
    for (int m = 0; m < M; m++) memcpy(parts[m / G] + (m % G) * (D + 2) + 2, ob + m * D, D * sizeof(float));
}

// The many-query form's tiles (64 bytes wide; 0-5 with the query tile's rows, 6-7 16): 0-3
// four C tiles (four key blocks of scores, or four 16-wide slices of the outputs) so that
// four multiplies are in flight, 4 the A tile (queries or p), 6-7 the B tiles (keys or
// values). IF_C(C, ...): only for the C tiles c < nc in use.
#define IF_C(C, ...) if ((C) < nc) __VA_ARGS__

// Scores of the query tile (qb [16][D] bf16) against the nkb <= 4 key blocks of kt into sb
// [16][CHUNK], each summed over d in order (ns steps of 32).
static void amx_scores(const uint32_t *kt, const uint16_t *qb, float *sb, int nkb, int ns, int D) {
#define SCORE(C, BT) IF_C(C, { TILE_LOAD(BT, kt + (s * nkb + C) * 256, 64); TILE_DPBF16(C, 4, BT); })
    const int nc = nkb;
    IF_C(0, TILE_ZERO(0)); IF_C(1, TILE_ZERO(1)); IF_C(2, TILE_ZERO(2)); IF_C(3, TILE_ZERO(3));
    for (int s = 0; s < ns; s++) {
        TILE_LOAD(4, qb + s * 32, D * 2);
        SCORE(0, 6); SCORE(1, 7); SCORE(2, 6); SCORE(3, 7);
    }
    IF_C(0, TILE_STORE(0, sb, CHUNK * 4)); IF_C(1, TILE_STORE(1, sb + 16, CHUNK * 4));
    IF_C(2, TILE_STORE(2, sb + 32, CHUNK * 4)); IF_C(3, TILE_STORE(3, sb + 48, CHUNK * 4));
#undef SCORE
}

// The query tile's outputs ob [16][D] = p (pb [16][CHUNK] bf16) times the values vt over
// the nk keys: four 16-wide slices of d at a time, each summed over the keys in order.
static void amx_outputs(const uint32_t *vt, const uint16_t *pb, float *ob, int nk, int nd, int D) {
#define WSUM(C, BT) IF_C(C, { TILE_LOAD(BT, vt + (t * nd + db + C) * 256, 64); TILE_DPBF16(C, 4, BT); })
    for (int db = 0; db < nd; db += 4) {
        const int nc = nd - db < 4 ? nd - db : 4;
        IF_C(0, TILE_ZERO(0)); IF_C(1, TILE_ZERO(1)); IF_C(2, TILE_ZERO(2)); IF_C(3, TILE_ZERO(3));
        for (int t = 0; t < nk / 32; t++) {
            TILE_LOAD(4, pb + t * 32, CHUNK * 2);
            WSUM(0, 6); WSUM(1, 7); WSUM(2, 6); WSUM(3, 7);
        }
        float *o = ob + db * 16;
        IF_C(0, TILE_STORE(0, o, D * 4)); IF_C(1, TILE_STORE(1, o + 16, D * 4));
        IF_C(2, TILE_STORE(2, o + 32, D * 4)); IF_C(3, TILE_STORE(3, o + 48, D * 4));
    }
#undef WSUM
}
#undef IF_C

// Queries m0 .. m0+mq-1 (mq <= 16, one A tile; query m: row m / G, head g * G + m % G) in the
// many-query form, over the packed keys kt and values vt of nk keys: their partials into
// parts. qb [16][D], pb [16][CHUNK], sb [16][max(CHUNK, D)]: chunk_partials_amx_t's scratch.
static void amx_query_tile(const attn_t *a, const float *q, int64_t q_stride, int64_t g,
                           int m0, int mq, const int *b_row, const int *n_row, int nk, const uint32_t *kt,
                           const uint32_t *vt, uint16_t *qb, uint16_t *pb, float *sb,
                           float *const *parts) {
    const int G = a->H / a->KVH, D = a->D;
    for (int m = m0; m < m0 + mq; m++) {
        const float *qr = q + (m / G) * q_stride + (g * G + m % G) * D;
        for (int d = 0; d < D; d += 32) to_bf16_32(qr + d, qb + (m - m0) * D + d);
    }
    const uint8_t r = (uint8_t)mq, rows[8] = {r, r, r, r, r, r, 16, 16};
    const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    tile_config_shapes(rows, colsb);
    amx_scores(kt, qb, sb, nk / 16, D / 32, D);
    for (int m = m0; m < m0 + mq; m++)
        softmax_row(sb + (m - m0) * CHUNK, b_row[m / G], n_row[m / G], nk, a->scale, pb + (m - m0) * CHUNK,
                    parts[m / G] + (m % G) * (D + 2));
    float *ob = sb;  // the scores are spent: the outputs [16][D]
    amx_outputs(vt, pb, ob, nk, D / 16, D);
    for (int m = m0; m < m0 + mq; m++)
        memcpy(parts[m / G] + (m % G) * (D + 2) + 2, ob + (m - m0) * D, D * sizeof(float));
}

// chunk_partials (attention_chunk.h's contract of arguments; numerics above). scratch:
// chunk_scratch_amx_bytes. Up to AMX_FEW_QUERIES queries the transposed form, else the
// many-query form one tile of 16 queries at a time.
static void chunk_partials_amx_t(const attn_t *a, const float *q, int64_t q_stride, int R,
                                 const int *b_row, const int *n_row, const int32_t *table, int64_t g, int64_t j0,
                                 float *const *parts, void *scratch, const next_t *next,
                                 const int BF) {
    const int G = a->H / a->KVH, D = a->D, M = R * G, n = n_row[R - 1], nk = (n + 31) / 32 * 32;
    const void **kp = (const void **)scratch, **vp = kp + CHUNK;
    char *base = (char *)(vp + CHUNK);
    uint32_t *kr = (uint32_t *)base, *kt = kr + CHUNK * D / 2, *vt = kt + CHUNK * D / 2;
    uint16_t *qb = (uint16_t *)(vt + CHUNK * D / 2);  // [16][D]
    uint16_t *pb = qb + TILE_ROWS * D;  // [16][CHUNK]
    float *sb = (float *)(pb + TILE_ROWS * CHUNK);  // [16][CHUNK], then [16][D] outputs
    float *srow = sb + TILE_ROWS * (CHUNK > D ? CHUNK : D);  // [16][CHUNK] (few queries)
    const int64_t esize = BF ? 2 : 4, few = M <= AMX_FEW_QUERIES;
    slot_ptrs(a, table, g, j0, n, kp, vp, esize);
    pack_kv_bf16(kp, vp, n, nk, D, kr, few ? NULL : kt, vt, BF);
    // No prefetch of the next chunk (attention_chunk.h's float chunk has one): the tile work
    // is too short to hide it behind. Issued in a burst after the tiles, or a few lines per
    // key as the keys are packed, it stalled on the line fill buffers and made a decode
    // row's chunks 1.15-1.4x slower than without (30 layers x 32 rows x 1500 keys: 116 and
    // 109 ms against 107; prefill level either way); the hardware's streamer follows a
    // block's contiguous slots.
    (void)next;
    if (few)
        chunk_few_queries(a, q, q_stride, g, M, b_row, n_row, nk, kr, kt, vt, qb, pb, sb, srow, parts);
    else
        for (int m0 = 0; m0 < M; m0 += TILE_ROWS)
            amx_query_tile(a, q, q_stride, g, m0, M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS, b_row,
                           n_row, nk, kt, vt, qb, pb, sb, parts);
    TILE_RELEASE();
}

// Bytes of chunk_partials_amx's scratch (D elements per head).
static int64_t chunk_scratch_amx_bytes(int D) {
    return 2 * CHUNK * (int64_t)sizeof(void *) + 3 * CHUNK * D / 2 * 4 + TILE_ROWS * D * 2 +
           TILE_ROWS * CHUNK * 2 + TILE_ROWS * (CHUNK > D ? CHUNK : D) * 4 + TILE_ROWS * CHUNK * 4;
}

static void chunk_partials_amx(const attn_t *a, const float *q, int64_t q_stride, int R,
                               const int *b_row, const int *n_row, const int32_t *table,
                               int64_t g, int64_t j0, float *const *parts, void *scratch,
                               const next_t *next) {
    if (a->bf16) chunk_partials_amx_t(a, q, q_stride, R, b_row, n_row, table, g, j0, parts, scratch, next, 1);
    else chunk_partials_amx_t(a, q, q_stride, R, b_row, n_row, table, g, j0, parts, scratch, next, 0);
}

#endif
