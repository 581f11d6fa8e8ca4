// y[r, n] = sum_k W[n, k] * x[r, k] for any number of rows r. K % 32 == 0. Built for AVX2 +
// FMA (GW = 8 lanes) or AVX-512 (GW = 16 lanes): the same source, the vector width from the
// compiler flags (simd.h's vf), the same float operations per output on both.
//
// Weights in the kernel layout (gemm.py PackedWeight.kernel): the N outputs in groups of GW
// (G = ceil(N / GW) groups, the last padded with zero weights), one vector lane per output
// of a group, so every FMA serves GW outputs and nothing is summed across lanes:
//   kind 0  Q4_1 (GGUF): qs [G, K/32, 16, GW] bytes, byte (g, b, p, c) = code byte p of block
//           b of output GW*g+c (low nibble: the block's weight p, high: weight p + 16);
//           d, m float32 [G, K/32, GW]: w = d * q + m
//   kind 1  Q8_0 (GGUF) or int8 per channel: qs int8 [G, K/32, 32, GW]; d [G, K/32, GW]: w = d * q
//   kind 2  float32: qs [G, K, GW] (a dense weight, for the batch-invariant path)
//   kind 3  bf16 (a dense weight, bf16 activations only: gemm_bf16.h, gemm_amx.h): qs uint32
//           [G, K/32, 16, GW], word (g, b, p, c) = bf16 weights p (low half) and p + 16 of
//           block b of output GW*g+c
//
// Batch invariance is the contract: every y[r, n] is this sequence of float operations,
// whatever M, the tiling, the thread count and the vector width:
//   kind 0  T = 0; per block b in order: S = 0; for p = 0..15: S = fma(q_p, x_p, S),
//           S = fma(q_{p+16}, x_{p+16}, S); then T = fma(d_b, S, T), T = fma(m_b, sx_b, T)
//           (sx_b: the block's sum of x, block_sum's fixed order); y = T
//   kind 1  T = 0; per block: S = 0; for j = 0..31: S = fma(q_j, x_j, S); T = fma(d_b, S, T)
//   kind 2  T = 0; for k = 0..K-1: T = fma(w_k, x_k, T)
// with the codes q converted to float exactly, the scale once per block of 32 products.
// Tiling only decides which (output group, row) pairs share a converted vector of codes and
// a broadcast x; T goes through y between blocks, which does not change its value.
#include "gemm_common.h"  // weight_t, act_t, the codes, prefetch_block (+ simd.h, string.h)
#include "gemm_bf16.h"    // the bf16-activation tiles (vdpbf16ps), BF16_ACT
#include "gemm_amx.h"     // the same on AMX tiles, bf16_path_rows / _activations, XB_ROWS

// The layout this file reads (bench_kernels.py times older revisions beside it) and its GW.
int gemm_layout(void) { return 1; }
int gemm_group_width(void) { return GW; }

// End of block b for a partial sum S: T (in y) takes the scale and (Q4_1) min x sum of x.
INLINE void block_end(const weight_t *w, int64_t g, int64_t b, vf S, float sx, float *yt) {
    const int64_t o = (g * w->nb + b) * GW;
    vf t = b ? VLOAD(yt) : VZERO();
    t = VFMA(VLOAD(w->d + o), S, t);
    if (w->kind == 0) t = VFMA(VLOAD(w->m + o), VSET1(sx), t);
    VSTORE(yt, t);
}

// Few rows (decode, a verification run): MT rows x NT groups straight from the codes, each
// converted vector used by all MT rows. x rows at ldx, sx [MT, nb], y: the tile's first output
// (group g0), rows at ldy. TREG: the sums T stay in registers (else through y between blocks).
INLINE void tile_codes(const weight_t *w, int64_t g0, const int NT, int prefetch,
                       const float *x, int64_t ldx, const float *sx, const int MT, float *y,
                       int64_t ldy, const int TREG, const int CF) {
    const int64_t nb = w->nb;
    vf T[8][4];
    for (int r = 0; TREG && r < MT; r++)
        for (int i = 0; i < NT; i++) T[r][i] = VZERO();
    for (int64_t b = 0; b < nb; b++) {
        if (prefetch) prefetch_block(w, g0 + PF_TILES(MT) * NT, NT, b, MT <= 2);
        vf S[8][4];
        for (int r = 0; r < MT; r++)
            for (int i = 0; i < NT; i++) S[r][i] = VZERO();
        // NI groups at a time: their codes, then each row's broadcasts serve all NI. CF: all
        // NT at once (fewer broadcasts), else one (fewer registers for codes).
        const int NI = CF ? NT : 1;
        if (w->kind == 0) {
#pragma GCC unroll 16  // as tile_buffered's j loop (1.03-1.14x at 2-16 rows, Zen 3)
            for (int p = 0; p < 16; p++)
                for (int i0 = 0; i0 < NT; i0 += NI) {
                    vf lo[4], hi[4];
                    for (int i = i0; i < i0 + NI; i++) q4_codes(w, g0 + i, b, p, &lo[i], &hi[i]);
                    for (int r = 0; r < MT; r++) {
                        const float *xr = x + r * ldx + b * 32 + p;
                        const vf xl = VBCAST(xr), xh = VBCAST(xr + 16);
                        for (int i = i0; i < i0 + NI; i++) S[r][i] = VFMA(hi[i], xh, VFMA(lo[i], xl, S[r][i]));
                    }
                }
        } else {
#pragma GCC unroll 32
            for (int j = 0; j < 32; j++)
                for (int i0 = 0; i0 < NT; i0 += NI) {
                    vf q[4];
                    for (int i = i0; i < i0 + NI; i++) q[i] = q8_codes(w, g0 + i, b, j);
                    for (int r = 0; r < MT; r++) {
                        const vf xv = VBCAST(x + r * ldx + b * 32 + j);
                        for (int i = i0; i < i0 + NI; i++) S[r][i] = VFMA(q[i], xv, S[r][i]);
                    }
                }
        }
        for (int r = 0; r < MT; r++)
            for (int i = 0; i < NT; i++) {
                const float s = w->kind == 0 ? sx[r * nb + b] : 0.0f;
                if (TREG) {
                    const int64_t o = ((g0 + i) * nb + b) * GW;
                    T[r][i] = VFMA(VLOAD(w->d + o), S[r][i], T[r][i]);
                    if (w->kind == 0)
                        T[r][i] = VFMA(VLOAD(w->m + o), VSET1(s), T[r][i]);
                } else {
                    block_end(w, g0 + i, b, S[r][i], s, y + r * ldy + i * GW);
                }
            }
    }
    for (int r = 0; TREG && r < MT; r++)
        for (int i = 0; i < NT; i++) VSTORE(y + r * ldy + i * GW, T[r][i]);
}

// Rows per buffered tile; T in registers across blocks with AVX-512's 32 (6 x 2 x (S, T) + 2
// weight vectors + a broadcast; ~6% faster than 8 rows), through y with AVX2's 16.
#define MTB 6
#define BUF_TREG (GW == 16)

// Many rows: the codes of NB groups converted once per panel into buf [NB, K, GW] floats (in
// the contract's order: Q4_1 p, p + 16, p + 1, ...), then MT rows x NB groups over them.
INLINE void tile_buffered(const weight_t *w, int64_t g0, const float *buf, const int NB,
                          const float *x, int64_t ldx, const float *sx, const int MT, float *y,
                          int64_t ldy) {
    const int64_t nb = w->nb, K = w->K;
    vf T[MTB][2];
    for (int r = 0; BUF_TREG && r < MT; r++)
        for (int i = 0; i < NB; i++) T[r][i] = VZERO();
    for (int64_t b = 0; b < nb; b++) {
        vf S[MTB][2];
        for (int r = 0; r < MT; r++)
            for (int i = 0; i < NB; i++) S[r][i] = VZERO();
#pragma GCC unroll 32  // constant x offsets: no index arithmetic per step (1.10-1.32x, Zen 3)
        for (int j = 0; j < 32; j++) {
            const int kk = w->kind == 0 ? (j & 1) * 16 + (j >> 1) : j;  // x index in the block
            vf wv[2];
            for (int i = 0; i < NB; i++) wv[i] = VLOADA(buf + (i * K + b * 32 + j) * GW);
            for (int r = 0; r < MT; r++) {
                vf xv = VBCAST(x + r * ldx + b * 32 + kk);
                for (int i = 0; i < NB; i++) S[r][i] = VFMA(wv[i], xv, S[r][i]);
            }
        }
        for (int r = 0; r < MT; r++)
            for (int i = 0; i < NB; i++) {
                const float s = w->kind == 0 ? sx[r * nb + b] : 0.0f;
                if (BUF_TREG) {
                    const int64_t o = ((g0 + i) * nb + b) * GW;
                    T[r][i] = VFMA(VLOAD(w->d + o), S[r][i], T[r][i]);
                    if (w->kind == 0) T[r][i] = VFMA(VLOAD(w->m + o), VSET1(s), T[r][i]);
                } else {
                    block_end(w, g0 + i, b, S[r][i], s, y + r * ldy + i * GW);
                }
            }
    }
    for (int r = 0; BUF_TREG && r < MT; r++)
        for (int i = 0; i < NB; i++) VSTORE(y + r * ldy + i * GW, T[r][i]);
}

// float32 weights: MT rows x NT groups, T in registers over all of K.
INLINE void tile_f32(const weight_t *w, int64_t g0, const int NT, const float *x, int64_t ldx,
                     const int MT, float *y, int64_t ldy) {
    const float *wq = (const float *)w->qs;
    vf T[6][8];
    for (int r = 0; r < MT; r++)
        for (int i = 0; i < NT; i++) T[r][i] = VZERO();
    for (int64_t k = 0; k < w->K; k++) {
        vf wv[8];
        for (int i = 0; i < NT; i++) wv[i] = VLOAD(wq + ((g0 + i) * w->K + k) * GW);
        for (int r = 0; r < MT; r++) {
            vf xv = VBCAST(x + r * ldx + k);
            for (int i = 0; i < NT; i++) T[r][i] = VFMA(wv[i], xv, T[r][i]);
        }
    }
    for (int r = 0; r < MT; r++)
        for (int i = 0; i < NT; i++) VSTORE(y + r * ldy + i * GW, T[r][i]);
}

#define MAX_ROWS 8  // up to this many rows the tiles read the codes directly
#define FEW_ROWS (GW == 8 ? 2 * MAX_ROWS : MAX_ROWS)  // AVX2: up to 16 rows in pieces, not panels

// Rows [0, M) x groups [g0, g1) into y (group g0's first output; full groups only).
static void f32_rows(const weight_t *w, const float *x, int64_t ldx, int M, float *y,
                     int64_t ldy, int64_t g0, int64_t g1) {
    for (int r0 = 0; r0 < M; r0 += 6) {
        const int mt = M - r0 < 6 ? M - r0 : 6;
        const float *xr = x + (int64_t)r0 * ldx;
        float *yr = y + (int64_t)r0 * ldy;
        int64_t g = g0;
#define F32_CASE(MT, NT)                                                                    \
    case MT:                                                                                \
        for (; g + NT <= g1; g += NT) tile_f32(w, g, NT, xr, ldx, MT, yr + (g - g0) * GW, ldy); \
        for (; g + 2 <= g1; g += 2) tile_f32(w, g, 2, xr, ldx, MT, yr + (g - g0) * GW, ldy);   \
        for (; g < g1; g++) tile_f32(w, g, 1, xr, ldx, MT, yr + (g - g0) * GW, ldy);           \
        break;
        // NT x MT >= 6 accumulators: enough independent FMA chains in flight
        switch (mt) {
            F32_CASE(1, 8) F32_CASE(2, 4) F32_CASE(3, 2) F32_CASE(4, 2) F32_CASE(5, 2) F32_CASE(6, 2)
            default: break;
        }
#undef F32_CASE
    }
}

// The rows [r0, r0 + piece) a few-row call takes next. AVX-512: all of them (up to MAX_ROWS).
// AVX2 from 7 rows: ceil(M / 5) pieces as even as possible (7 = 4 + 3, 8 = 4 + 4, 9 = 5 + 4,
// 12 = 4 + 4 + 4, 16 = 4 x 4), each reading the codes again (a layer's weight is in cache by
// then): the 4-6-row tiles take 2 groups, codes first, where 7-8 rows fit 1 group only
// (1.05-1.13x at 7-8 and 11-16 rows; benchmarks/README.md, "Few-row pieces on Zen 3").
INLINE int few_rows_piece(int M, int r0) {
#if GW == 16
    (void)r0;
    return M;
#else
    if (M < 7) return M;
    const int n = (M + 4) / 5, q = M / n, extra = M % n;  // the first `extra` take q + 1
    return r0 < extra * (q + 1) ? q + 1 : q;
#endif
}

// Few rows (up to FEW_ROWS): rows [0, M) x groups [g0, g1) into y (group g0's first output)
// in tiles straight from the codes; AVX2 takes 7-16 rows in pieces. The tile shapes per
// row count were measured (benchmarks/README.md, "AVX-512", "Few-row tiles on Zen 3"): 16
// lanes, 2 groups at every row count; AVX2, Zen 3: 4-6 rows x 2 groups codes first
// (1.07-1.37x 1 group).
INLINE void codes_rows_few(const weight_t *w, const float *x, int64_t ldx, const float *sx,
                           int M, float *y, int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t nb = w->nb;
#define CODES_CASE(MT, NT, TREG, CF)                                                           \
    case MT: {                                                                               \
        int64_t g = g0;                                                                      \
        for (; g + NT <= g1; g += NT)                                                        \
            tile_codes(w, g, NT, g + (PF_TILES(MT) + 1) * NT <= g1, xr, ldx, sr, MT,           \
                       yr + (g - g0) * GW, ldy, TREG, CF);                                    \
        if (NT > 2)                                                                          \
            for (; g + 2 <= g1; g += 2)                                                      \
                tile_codes(w, g, 2, 0, xr, ldx, sr, MT, yr + (g - g0) * GW, ldy, TREG, CF);    \
        for (; g < g1; g++)                                                                  \
            tile_codes(w, g, 1, 0, xr, ldx, sr, MT, yr + (g - g0) * GW, ldy, TREG, 0);        \
        break;                                                                               \
    }
    for (int r0 = 0, mh; r0 < M; r0 += mh) {
        mh = few_rows_piece(M, r0);
        const float *xr = x + (int64_t)r0 * ldx, *sr = w->kind ? sx : sx + (int64_t)r0 * nb;
        float *yr = y + (int64_t)r0 * ldy;
        switch (mh) {
#if GW == 16
        CODES_CASE(1, 2, 1, 0) CODES_CASE(2, 2, 1, 0) CODES_CASE(3, 2, 1, 0) CODES_CASE(4, 2, 1, 0)
        CODES_CASE(5, 2, 1, 0) CODES_CASE(6, 2, 1, 0) CODES_CASE(7, 2, 0, 0) CODES_CASE(8, 2, 0, 0)
#else
        CODES_CASE(1, 4, 1, 0) CODES_CASE(2, 4, 0, 0) CODES_CASE(3, 2, 1, 0) CODES_CASE(4, 2, 0, 1)
        CODES_CASE(5, 2, 0, 1) CODES_CASE(6, 2, 0, 1) CODES_CASE(7, 1, 0, 0) CODES_CASE(8, 1, 0, 0)
#endif
        default: break;
        }
    }
#undef CODES_CASE
}

// The codes of groups g .. g+NB-1 as floats into buf [NB, K, GW], in the contract's order
// (Q4_1: weights p, p + 16, p + 1, ...; tile_buffered reads them so).
INLINE void buffer_codes(const weight_t *w, int64_t g, int NB, float *buf) {
    for (int i = 0; i < NB; i++)
        for (int64_t b = 0; b < w->nb; b++) {
            float *o = buf + (i * w->K + b * 32) * GW;
            if (w->kind == 0) {
                for (int p = 0; p < 16; p++) {
                    vf lo, hi;
                    q4_codes(w, g + i, b, p, &lo, &hi);
                    VSTOREA(o + (2 * p) * GW, lo);
                    VSTOREA(o + (2 * p + 1) * GW, hi);
                }
            } else {
                for (int j = 0; j < 32; j++) VSTOREA(o + j * GW, q8_codes(w, g + i, b, j));
            }
        }
}

// Many rows: per row panel, each pair of groups' codes converted once into buf (this
// thread's [2, K, GW] floats), then tiles of up to MTB rows over them.
INLINE void codes_rows_buffered(const weight_t *w, const float *x, int64_t ldx, const float *sx,
                                float *buf, int M, float *y, int64_t ldy, int64_t g0,
                                int64_t g1) {
    const int64_t nb = w->nb;
    for (int p0 = 0; p0 < M; p0 += PANEL) {
        const int pm = M - p0 < PANEL ? M - p0 : PANEL;
        for (int64_t g = g0; g < g1; g += 2) {
            const int NB = g + 2 <= g1 ? 2 : 1;
            buffer_codes(w, g, NB, buf);
            for (int r = p0; r < p0 + pm; r += MTB) {
                const int mt = p0 + pm - r < MTB ? p0 + pm - r : MTB;
                const float *xr = x + (int64_t)r * ldx, *sr = sx + (int64_t)r * nb;
                float *yr = y + (int64_t)r * ldy + (g - g0) * GW;
#define BUF_CASE(MT)                                                                        \
    case MT:                                                                                \
        if (NB == 2) tile_buffered(w, g, buf, 2, xr, ldx, sr, MT, yr, ldy);                 \
        else tile_buffered(w, g, buf, 1, xr, ldx, sr, MT, yr, ldy);                         \
        break;
                switch (mt) {
                    BUF_CASE(1) BUF_CASE(2) BUF_CASE(3) BUF_CASE(4) BUF_CASE(5) BUF_CASE(6) default: break;
                }
#undef BUF_CASE
            }
        }
    }
}

// Quantised weights: rows [0, M) x groups [g0, g1) into y (group g0's first output); buf:
// this thread's [2, K, GW] floats (many rows only).
INLINE void codes_rows(const weight_t *w, const float *x, int64_t ldx, const float *sx,
                       float *buf, int M, float *y, int64_t ldy, int64_t g0, int64_t g1) {
    if (M <= FEW_ROWS) codes_rows_few(w, x, ldx, sx, M, y, ldy, g0, g1);
    else codes_rows_buffered(w, x, ldx, sx, buf, M, y, ldy, g0, g1);
}

// One specialised copy per weight kind (the kind branch folds away inside each).
#define ROWS_OF_KIND(name, KIND)                                                            \
    static void name(const weight_t *w, const act_t *a, float *buf, float *y, int64_t ldy,  \
                     int64_t g0, int64_t g1) {                                               \
        weight_t c = *w;                                                                     \
        c.kind = KIND;                                                                       \
        codes_rows(&c, a->x, a->ldx, a->sx, buf, a->M, y, ldy, g0, g1);                      \
    }
ROWS_OF_KIND(rows_q4_1, 0)
ROWS_OF_KIND(rows_q8_0, 1)
static void rows_any(const weight_t *w, const act_t *a, float *buf, float *y, int64_t ldy,
                     int64_t g0, int64_t g1) {
    if (a->xb) bf16_path_rows(w, a, (uint32_t *)buf, y, ldy, g0, g1);
    else if (w->kind == 2) f32_rows(w, a->x, a->ldx, a->M, y, ldy, g0, g1);
    else if (w->kind == 0) rows_q4_1(w, a, buf, y, ldy, g0, g1);
    else rows_q8_0(w, a, buf, y, ldy, g0, g1);
}

// The groups [g0, g1) of this thread. The padded last group (N % GW) is computed into tail
// ([M, GW]) and copied, so that no store lands past output N - 1 of a row.
static void run_groups(const weight_t *w, const act_t *a, float *buf, float *tail, float *y,
                       int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t full = w->N / GW;
    if (g0 < full) rows_any(w, a, buf, y + g0 * GW, ldy, g0, g1 < full ? g1 : full);
    if (g1 > full && full >= g0) {
        rows_any(w, a, buf, tail, GW, full, full + 1);
        for (int r = 0; r < a->M; r++)
            memcpy(y + (int64_t)r * ldy + full * GW, tail + r * GW, (w->N - full * GW) * sizeof(float));
    }
}

// A call's activations, once: the bf16 pairs xb (and their Q4_1 block sums into sx), or the
// float rows' Q4_1 block sums.
static void prepare_activations(const weight_t *w, int bf16, const float *x, int64_t ldx, int M,
                                float *sx, uint32_t *xb) {
    if (bf16) bf16_path_activations(x, ldx, M, w->K, w->kind, xb, sx);
    else for (int r = 0; r < (w->kind == 0 ? M : 0); r++)
        for (int64_t b = 0; b < w->nb; b++) sx[r * w->nb + b] = block_sum(x + (int64_t)r * ldx + b * 32);
}

// A call this build cannot serve: bf16 activations without its bf16 tiles (or AMX's grant),
// or for float32 weights; bf16 weights without bf16 activations.
static int unserved(int bf16, int kind) {
    return (bf16 && (!gemm_bf16() || kind == 2 || !amx_ready())) || (kind == 3 && !bf16);
}

// Entry point (ctypes); threads split the groups in units of 32 outputs. flags: a weight kind
// | BF16_ACT. Returns 0, -1 without scratch memory, -2 for a bf16 call this build cannot serve.
int gemm(int flags, const void *qs, const float *d, const float *m, const float *x,
         int64_t ldx, float *y, int64_t ldy, int64_t N, int64_t K, int M, int nthreads) {
    const int bf16 = (flags & BF16_ACT) != 0, kind = flags & (BF16_ACT - 1);
    if (unserved(bf16, kind)) return -2;
    if (M <= 0) return 0;
    weight_t w = {kind, qs, d, m, K, N, K / 32};
    const int64_t G = (N + GW - 1) / GW, nb = K / 32;
    if (nthreads < 1 || N < 64) nthreads = 1;
    // Scratch: sx [M, nb] | bufs [threads, 2K x GW] | tail [M, GW], each 64-byte aligned.
    const size_t n_sx = kind == 0 ? ((size_t)M * nb + 15) / 16 * 16 : 0;
    const size_t scratch = 2 * K * GW;  // a thread's
    const size_t n_buf = kind < 2 && M > FEW_ROWS ? (size_t)nthreads * scratch : 0;  // bf16: in place
    const size_t n_xb = bf16 ? ((size_t)XB_ROWS(M) * K / 2 + 15) / 16 * 16 : 0;  // | xb
    float *base = (float *)aligned_alloc(64, (n_sx + n_buf + (size_t)M * 16 + n_xb) * sizeof(float));
    if (base == NULL) return -1;
    float *bufs = base + n_sx, *tail = bufs + n_buf;
    uint32_t *xb = bf16 ? (uint32_t *)(tail + (size_t)M * 16) : NULL;
    const act_t a = {x, base, ldx, M, xb, K / 2};
    prepare_activations(&w, bf16, x, ldx, M, base, xb);
    if (nthreads == 1) {
        run_groups(&w, &a, bufs, tail, y, ldy, 0, G);
    } else {
#pragma omp parallel num_threads(nthreads)
        {
            THREAD_INDEX(t, T);
            const int64_t U = 32 / GW, units = (G + U - 1) / U, per = (units + T - 1) / T;
            int64_t g0 = t * per * U, g1 = (t + 1) * per * U;
            if (g1 > G) g1 = G;
            if (g0 < g1) run_groups(&w, &a, bufs + (size_t)t * scratch, tail, y, ldy, g0, g1);
        }
    }
    free(base);
    return 0;
}

#include "gemm_score.h"  // gemm_score: prompt logprobs straight from the head's tiles
