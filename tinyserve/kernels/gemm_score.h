// Prompt scoring (model_runner.py: `echo` with `logprobs`, `prompt_logprobs`) without the
// logits in memory: a header of gemm.c's, included after gemm(). Per row r of x [M, K] and
// its target id t_r, what ops.c's logprob_rows gives from the row's logits W x_r (the
// target's log-softmax value, its rank, the top k), computed from the head's tiles a slice of
// SCORE_SLICE outputs at a time:
//   1. each target's logit alone: a 1-row, 1-group tile, by the contract (gemm.c) the bits
//      the same output has in any tiling;
//   2. per slice (threads take contiguous runs of slices; its codes converted to bf16 pairs
//      once for all its panels where that pays: SCORE_PACKS) and panel of PANEL rows, the
//      tiles' outputs into this thread's [PANEL, SCORE_SLICE] buffer, then per row
//      logprob.h's scan (maximum, count above the target, top k carried from slice to
//      slice) and the slice's sum of exp(x - its maximum);
//   3. per row, the slices' sums merged in slice order (so the result does not depend on
//      the thread count), the top k of the threads merged in thread order (ascending ids).
// gemm() followed by logprob_rows writes every row's V logits (SmolLM2: 196 KB a row) and
// reads them back, and streams the head's weights again per call of a few rows; here the
// slice's weights and outputs stay in L2 while every row passes.
#ifndef TINYSERVE_GEMM_SCORE_H
#define TINYSERVE_GEMM_SCORE_H
#include "logprob.h"

#define SCORE_SLICE 256  // outputs: whole groups of 8 or 16

// Rows [r0, r0 + rows) of a call's activations, as a call of their own.
static act_t act_rows(const act_t *a, const weight_t *w, int r0, int rows) {
    act_t s = *a;
    s.x = a->x + (int64_t)r0 * a->ldx;
    if (w->kind == 0) s.sx = a->sx + (int64_t)r0 * w->nb;
    if (a->xb) s.xb = a->xb + (int64_t)r0 * a->ldxb;
    s.M = rows;
    return s;
}

// What the threads share: the targets' logits, each (slice, row)'s maximum and sum of exp,
// and each (thread, row)'s count above the target and top k.
typedef struct {
    const int64_t *targets;
    int k, M;
    float *xt, *sm, *bv;  // xt [M]; sm [slices, M]; bv [T, M, k]
    double *ss;           // [slices, M]
    int64_t *cnt;         // [T, M]
    int32_t *bi, *nk;     // [T, M, k]; [T, M]
} score_t;

// Whether score_slices converts a slice's codes to bf16 pairs once for all its panels (into
// `packed`, SCORE_SLICE x K/2 words a thread) rather than once a panel as gemm() does:
// where bf16 tiles read them from a buffer, there is more than one panel to share them
// (M > PANEL), and the slice's pairs fit beside a panel in L2 (K <= 1024: 512 KB; not
// measured beyond); not bf16 weights (pairs already). The same pairs, so the same bits.
// 511 rows of SmolLM2's Q8_0 head (K 576, 4 panels), Zen 4, 5 alternating runs' minima:
// 81.4-88.0 -> 78.3-84.5 ms (medians 84.2 -> 79.0).
#define SCORE_PACKS(bf16, kind, M, K) \
    ((bf16) && (kind) != 3 && (M) > PANEL && (M) > BF16_PATH_FEW && (K) <= 1024)

// Thread t's slices [s0, s1): every row through each, panel by panel.
static void score_slices(const weight_t *w, const act_t *a, const score_t *sc, int t,
                         int64_t s0, int64_t s1, float *buf, float *y, uint32_t *packed) {
    const int M = sc->M, k = sc->k, packs = SCORE_PACKS(a->xb != NULL, w->kind, M, w->K);
    const int64_t G = (w->N + GW - 1) / GW;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t g0 = s * (SCORE_SLICE / GW), g1 = g0 + SCORE_SLICE / GW < G ? g0 + SCORE_SLICE / GW : G;
        const int64_t first = s * SCORE_SLICE, valid = w->N - first < SCORE_SLICE ? w->N - first : SCORE_SLICE;
        if (packs) bf16_path_pack(w, g0, g1, packed);
        for (int p0 = 0; p0 < M; p0 += PANEL) {
            const int pm = M - p0 < PANEL ? M - p0 : PANEL;
            const act_t pa = act_rows(a, w, p0, pm);
            if (packs) bf16_path_rows_packed(w, &pa, (uint32_t *)buf, packed, y, SCORE_SLICE, g0, g1);
            else rows_any(w, &pa, buf, y, SCORE_SLICE, g0, g1);  // the padded group's zeros unread
            for (int i = 0; i < pm; i++) {
                const int64_t r = p0 + i, tr = (int64_t)t * M + r;
                const float *row = y + (int64_t)i * SCORE_SLICE;
                float mx;
                int64_t c;
                logprob_scan(row, valid, (int32_t)first, sc->xt[r], k, sc->bv + tr * k,
                             sc->bi + tr * k, &sc->nk[tr], &mx, &c);
                sc->cnt[tr] += c;
                sc->sm[s * M + r] = mx;
                sc->ss[s * M + r] = mx == -INFINITY ? 0.0 : logprob_sumexp(row, valid, mx);
            }
        }
    }
}

// Row r's results from the slices' and the threads' parts.
static void score_merge(const score_t *sc, int64_t slices, int T, int64_t r, float *lp,
                        int32_t *rank, int32_t *top_ids, float *top_lp) {
    const int M = sc->M, k = sc->k;
    float m = -INFINITY;
    for (int64_t s = 0; s < slices; s++) m = sc->sm[s * M + r] > m ? sc->sm[s * M + r] : m;
    double sum = 0.0;
    for (int64_t s = 0; s < slices; s++)
        if (sc->sm[s * M + r] != -INFINITY) sum += sc->ss[s * M + r] * exp((double)sc->sm[s * M + r] - m);
    const float lse = (float)log(sum);
    float bv[LOGPROB_MAX_K];
    int32_t bi[LOGPROB_MAX_K];
    int n = 0;
    int64_t count = 0;
    for (int t = 0; t < T; t++) {
        const int64_t tr = (int64_t)t * M + r;
        count += sc->cnt[tr];
        for (int j = 0; j < sc->nk[tr]; j++) {
            const float v = sc->bv[tr * k + j];
            if (n < k || v > bv[k - 1]) topk_insert(bv, bi, k, &n, v, sc->bi[tr * k + j]);
        }
    }
    lp[r] = (sc->xt[r] - m) - lse;
    rank[r] = (int32_t)count + 1;
    for (int j = 0; j < k; j++) {
        top_ids[r * k + j] = bi[j];
        top_lp[r * k + j] = (bv[j] - m) - lse;
    }
}

// Entry point (ctypes): gemm()'s arguments without y, then the targets [M] (ids < N), k (0..32)
// and the outputs lp [M], rank [M], top_ids / top_lp [M, k]. Returns gemm()'s codes, -3 for
// a k out of range.
int gemm_score(int flags, const void *qs, const float *d, const float *m, const float *x,
               int64_t ldx, int64_t N, int64_t K, int M, const int64_t *targets, int k,
               float *lp, int32_t *rank, int32_t *top_ids, float *top_lp, int nthreads) {
    const int bf16 = (flags & BF16_ACT) != 0, kind = flags & (BF16_ACT - 1);
    if (unserved(bf16, kind)) return -2;
    if (k < 0 || k > LOGPROB_MAX_K) return -3;
    if (M <= 0) return 0;
    const weight_t w = {kind, qs, d, m, K, N, K / 32};
    const int64_t slices = (N + SCORE_SLICE - 1) / SCORE_SLICE;
    if (nthreads < 1) nthreads = 1;
    const int T = nthreads;
    const size_t n_packed = SCORE_PACKS(bf16, kind, M, K) ? (size_t)SCORE_SLICE * K / 2 : 0;
    const size_t scratch = 2 * K * GW + PANEL * SCORE_SLICE + GW + n_packed;  // buf | y | yt | packed
    const size_t n_sx = kind == 0 ? ((size_t)M * w.nb + 15) / 16 * 16 : 0;
    const size_t n_xb = bf16 ? ((size_t)XB_ROWS(M) * K / 2 + 15) / 16 * 16 : 0;
    float *base = (float *)aligned_alloc(64, (n_sx + n_xb + T * scratch) * sizeof(float));
    float *xt = malloc(((size_t)M * (1 + slices + (size_t)T * k)) * sizeof(float));
    double *ss = malloc((size_t)M * slices * sizeof(double));
    int64_t *cnt = calloc((size_t)T * M, sizeof(int64_t));
    int32_t *bi = malloc((size_t)T * M * (k + 1) * sizeof(int32_t) + 4);
    int rc = base && xt && ss && cnt && bi ? 0 : -1;
    if (rc == 0) {
        uint32_t *xb = bf16 ? (uint32_t *)(base + n_sx) : NULL;
        const act_t a = {x, base, ldx, M, xb, K / 2};
        const score_t sc = {targets, k, M, xt, xt + M, xt + M + (size_t)M * slices, ss, cnt,
                            bi, bi + (size_t)T * M * k};
        memset(sc.nk, 0, (size_t)T * M * sizeof(int32_t));
        prepare_activations(&w, bf16, x, ldx, M, base, xb);
#pragma omp parallel num_threads(T)
        {
            THREAD_INDEX(t, Tn);  // Tn <= T (the parts of threads not started stay empty)
            float *buf = base + n_sx + n_xb + (size_t)t * scratch, *y = buf + 2 * K * GW;
            float *yt = y + PANEL * SCORE_SLICE;
            uint32_t *packed = n_packed ? (uint32_t *)(yt + GW) : NULL;
            for (int r = t; r < M; r += Tn) {  // step 1: the targets' logits
                const int64_t g = targets[r] / GW;
                const act_t one = act_rows(&a, &w, r, 1);
                rows_any(&w, &one, buf, yt, GW, g, g + 1);
                xt[r] = yt[targets[r] % GW];
            }
#pragma omp barrier
            const int64_t per = (slices + Tn - 1) / Tn, s0 = t * per;
            score_slices(&w, &a, &sc, t, s0, s0 + per < slices ? s0 + per : slices, buf, y, packed);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int r = 0; r < M; r++) score_merge(&sc, slices, T, r, lp, rank, top_ids, top_lp);
        }
    }
    free(base), free(xt), free(ss), free(cnt), free(bi);
    return rc;
}

#endif
