// The decoder layers of one step in one call: the same kernels, with the same arguments and
// in the same order as models/llama.py's kernel path calls them one by one from Python, so
// the results are bitwise the same, without ~8 Python -> ctypes round trips (and their
// tensor allocations) per layer. The kernels live in their own libraries (gemm.c, qgemm.c,
// ops.c, attention.c); their entry points arrive here as function pointers.
//
// Per layer l, with x the layer input and residual the residual stream ([M, H] each):
//   l == 0: residual = x; h = norm(x)           else: residual += x; h = norm(residual)
//   qkv = h W_qkv^T (+ bias); [q/k head norms]; rope + K/V cache write; o = attention(q);
//   x = o W_o^T [* branch_scale]; residual += x; h = norm(residual);
//   x = silu_and_mul(h W_gu^T) W_down^T [* branch_scale]
// The bracketed steps are other families' (models/qwen3.py's head norms, granite.py's
// residual multiplier); a NoPE layer (smollm3.py) rotates by the step's identity tables.
// Rows [0, nd) are decode rows (linear layers with int8_decode send them to qgemm).
#include "simd.h"  // immintrin, stdint, stdlib, omp, INLINE
#include <string.h>

typedef int (*gemm_fn)(int, const void *, const float *, const float *, const float *, int64_t,
                       float *, int64_t, int64_t, int64_t, int, int);
typedef int (*qgemm_fn)(int, const void *, const float *, const float *, const float *, int64_t,
                        float *, int64_t, int64_t, int64_t, int, int);
typedef void (*rms_fn)(const float *, float *, const float *, float *, int64_t, int64_t, float,
                       int);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t, int);
typedef void (*head_norm_fn)(float *, const float *, const float *, int64_t, int, int, int, float,
                             int);
typedef void (*rope_fn)(float *, const float *, const float *, float *, float *, const int64_t *,
                        int64_t, int, int, int, int);
typedef int (*attn_fn)(const float *, int64_t, const float *, const float *, int, int, int, int,
                       const int64_t *, const int64_t *, const int64_t *, int64_t,
                       const int32_t *, int64_t, float, float *, int);

#define KIND_MASK 15  // a weight kind without gemm_bf16.h's BF16_ACT (16): what qgemm takes

typedef struct {
    int64_t kind, int8_decode;  // kind as gemm takes it (| 16: bf16 activations); int8_decode:
                                // decode rows through qgemm
    const void *qs;             // qs, d, m: gemm.c's layout
    const float *d, *m, *bias;  // bias may be NULL
    int64_t N, K;
    const void *q8_qs;          // q8_*: the checkpoint layout qgemm.c reads (int8_decode only)
    const float *q8_d, *q8_m;
} linear_t;

typedef struct {
    const float *input_norm, *post_norm;
    linear_t qkv, o, gate_up, down;
    const float *q_norm, *k_norm;  // per-head q/k RMSNorm weights [D], or NULL (Qwen3)
    int64_t rope;                  // 0: no position encoding here (a NoPE layer)
} layer_t;

typedef struct {
    gemm_fn gemm;
    qgemm_fn qgemm;
    rms_fn rms_norm;
    silu_fn silu_and_mul;
    rope_fn rope_and_cache;
    attn_fn paged_attention;
    head_norm_fn head_norm;
    float branch_scale;  // each attention / MLP output times this (Granite; 1: none)
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    float eps, scale;
    const layer_t *layers;
} model_t;

typedef struct {  // this step's attention inputs (layers/attention.py KernelInputs)
    const float *cos, *sin;
    const float *cos_id, *sin_id;  // identity tables (1, 0) for NoPE layers, or NULL
    const int64_t *slot_mapping, *query_start_loc, *seq_lens, *seq_of_token;
    const int32_t *block_tables;
    int64_t max_blocks;
    float *const *k_caches, *const *v_caches;  // [num_layers] each
} step_t;

static int linear(const model_t *mo, const linear_t *w, const float *x, float *y, int M, int nd,
                  int nt) {
    int rc = 0;
    if (w->int8_decode && nd > 0) {
        rc = mo->qgemm((int)w->kind & KIND_MASK, w->q8_qs, w->q8_d, w->q8_m, x, w->K, y, w->N, w->N, w->K,
                       nd, nt);
        if (nd < M)
            rc |= mo->gemm((int)w->kind, w->qs, w->d, w->m, x + (int64_t)nd * w->K, w->K,
                     y + (int64_t)nd * w->N, w->N, w->N, w->K, M - nd, nt);
    } else {
        rc = mo->gemm((int)w->kind, w->qs, w->d, w->m, x, w->K, y, w->N, w->N, w->K, M, nt);
    }
    if (w->bias)  // y + bias, one rounding per element, as torch adds it
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < w->N; n++) y[r * w->N + n] += w->bias[n];
    return rc;
}

static void scale(float *x, int64_t n, float s) {  // one rounding each, as torch's x * s
    if (s != 1.0f)
        for (int64_t i = 0; i < n; i++) x[i] *= s;
}

// x [M, H]: the embeddings in, the last layer's output out; residual [M, H]: the residual
// stream out (the final norm is the caller's). Returns 0, or -1 when memory ran out.
int forward_layers(const model_t *mo, const step_t *st, float *x, float *residual, int M,
                   int nd, int nt) {
    const int64_t H = mo->hidden, I = mo->intermediate, D = mo->head_dim;
    const int64_t NH = mo->num_heads, KVH = mo->num_kv_heads, QKV = (NH + 2 * KVH) * D;
    float *h = (float *)malloc((size_t)M * H * sizeof(float));
    float *qkv = (float *)malloc((size_t)M * QKV * sizeof(float));
    float *o = (float *)malloc((size_t)M * NH * D * sizeof(float));
    float *gu = (float *)malloc((size_t)M * 2 * I * sizeof(float));
    float *act = (float *)malloc((size_t)M * I * sizeof(float));
    int rc = (h && qkv && o && gu && act) ? 0 : -1;
    for (int64_t l = 0; l < mo->num_layers && rc == 0; l++) {
        const layer_t *L = &mo->layers[l];
        if (l == 0) {
            memcpy(residual, x, (size_t)M * H * sizeof(float));
            mo->rms_norm(x, NULL, L->input_norm, h, M, H, mo->eps, nt);
        } else {
            mo->rms_norm(x, residual, L->input_norm, h, M, H, mo->eps, nt);
        }
        rc |= linear(mo, &L->qkv, h, qkv, M, nd, nt);
        if (L->q_norm)
            mo->head_norm(qkv, L->q_norm, L->k_norm, M, (int)NH, (int)KVH, (int)D, mo->eps, nt);
        mo->rope_and_cache(qkv, L->rope ? st->cos : st->cos_id, L->rope ? st->sin : st->sin_id,
                           st->k_caches[l], st->v_caches[l], st->slot_mapping, M, (int)NH,
                           (int)KVH, (int)D, nt);
        rc |= mo->paged_attention(qkv, QKV, st->k_caches[l], st->v_caches[l],
                                  (int)mo->block_size, (int)NH, (int)KVH, (int)D,
                                  st->query_start_loc, st->seq_lens, st->seq_of_token, M,
                                  st->block_tables, st->max_blocks, mo->scale, o, nt);
        rc |= linear(mo, &L->o, o, x, M, nd, nt);
        scale(x, M * H, mo->branch_scale);
        mo->rms_norm(x, residual, L->post_norm, h, M, H, mo->eps, nt);
        rc |= linear(mo, &L->gate_up, h, gu, M, nd, nt);
        mo->silu_and_mul(gu, act, M, I, nt);
        rc |= linear(mo, &L->down, act, x, M, nd, nt);
        scale(x, M * H, mo->branch_scale);
    }
    free(h);
    free(qkv);
    free(o);
    free(gu);
    free(act);
    return rc ? -1 : 0;
}
