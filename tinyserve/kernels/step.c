// The decoder layers of one step in one call: the same kernels, with the same arguments and
// in the same order as models/llama.py's kernel path calls them one by one from Python, so
// the results are bitwise the same, without ~8 Python -> ctypes round trips (and their
// tensor allocations) per layer. The kernels live in their own libraries (gemm.c, qgemm.c,
// ops.c, attention.c); their entry points arrive here as function pointers.
//
// Per layer l, with x the layer input and residual the residual stream ([M, H] each):
//   l == 0: residual = x; h = norm(x)           else: residual += x; h = norm(residual)
//   qkv = h W_qkv^T (+ bias); [q/k head norms]; rope + K/V cache write; o = attention(q);
//   x = o W_o^T [* branch_scale] [x = norm(x)]; residual += x; h = norm(residual);
//   x = act_and_mul(h W_gu^T) W_down^T [* branch_scale] [x = norm(x)]
// The bracketed steps are other families' (models/qwen3.py's head norms, granite.py's
// residual multiplier, gemma3.py's norms of the attention and MLP outputs); act_and_mul is
// SiLU's, or Gemma 3's tanh GELU (gelu_tanh_and_mul below); a NoPE layer (smollm3.py)
// rotates by the step's identity tables, a Gemma 3 local layer by its second table; a layer
// with a sliding window passes it to the attention; a hybrid model's layer reads its layer
// group's slots and block tables.
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
                       const int32_t *, int64_t, float, int64_t, float *, int);

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
    const float *attn_out_norm, *mlp_out_norm;  // norms of the branch outputs, or NULL (Gemma 3)
    int64_t rope;  // the step's table: 0 the identity (a NoPE layer), 1 the table, 2 the second
    int64_t window;  // the layer's sliding window (0: none; Gemma 3's local layers, Mistral)
    int64_t group;   // a hybrid model's layer group whose slots and tables it reads (0: step's)
} layer_t;

typedef struct {
    gemm_fn gemm;
    qgemm_fn qgemm;
    rms_fn rms_norm;
    silu_fn act_and_mul;  // silu_and_mul (ops.c) or gelu_tanh_and_mul: the MLP's activation
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
    const float *cos2, *sin2;      // the second table (Gemma 3's local layers), or NULL
    const int64_t *slot_mapping, *query_start_loc, *seq_lens, *seq_of_token;
    const int32_t *block_tables;
    int64_t max_blocks;
    float *const *k_caches, *const *v_caches;  // [num_layers] each
    // A hybrid model's layer groups 1, 2, ... (utils/kv_groups.py): each one's slots, block
    // tables and their width, [group - 1]; NULL where every layer reads the ones above.
    const int64_t *const *group_slots;
    const int32_t *const *group_tables;
    const int64_t *group_max_blocks;
} step_t;

// gate_up [rows, 2I] -> out [rows, I]: gelu_tanh(gate) * up, where gelu_tanh(g) =
// 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3): the form of
// silu_and_mul (ops.c). I % 8 == 0. The Python loop calls it too (kernels/step.py).
void gelu_tanh_and_mul(const float *gate_up, float *out, int64_t rows, int64_t I, int nthreads) {
    const __m256 k = _mm256_set1_ps(-2.0f * 0.7978845608028654f), c = _mm256_set1_ps(0.044715f);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 cg2 = _mm256_mul_ps(c, _mm256_mul_ps(gv, gv));
            __m256 inner = _mm256_mul_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), cg2));
            __m256 e = exp256(_mm256_mul_ps(k, inner));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

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

// x = norm(x) through the scratch t, where the layer norms a branch's output (Gemma 3).
static void out_norm(const model_t *mo, const float *w, float *x, float *t, int M, int nt) {
    if (!w)
        return;
    mo->rms_norm(x, NULL, w, t, M, mo->hidden, mo->eps, nt);
    memcpy(x, t, (size_t)M * mo->hidden * sizeof(float));
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
    float *t = (float *)malloc((size_t)M * H * sizeof(float));
    const float *cos[3] = {st->cos_id, st->cos, st->cos2};  // by layer_t.rope
    const float *sin[3] = {st->sin_id, st->sin, st->sin2};
    int rc = (h && qkv && o && gu && act && t) ? 0 : -1;
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
        const int64_t g = st->group_tables ? L->group : 0;  // its layer group's (hybrid)
        mo->rope_and_cache(qkv, cos[L->rope], sin[L->rope], st->k_caches[l], st->v_caches[l],
                           g ? st->group_slots[g - 1] : st->slot_mapping, M, (int)NH, (int)KVH,
                           (int)D, nt);
        rc |= mo->paged_attention(qkv, QKV, st->k_caches[l], st->v_caches[l],
                                  (int)mo->block_size, (int)NH, (int)KVH, (int)D,
                                  st->query_start_loc, st->seq_lens, st->seq_of_token, M,
                                  g ? st->group_tables[g - 1] : st->block_tables,
                                  g ? st->group_max_blocks[g - 1] : st->max_blocks, mo->scale,
                                  L->window, o, nt);
        rc |= linear(mo, &L->o, o, x, M, nd, nt);
        scale(x, M * H, mo->branch_scale);
        out_norm(mo, L->attn_out_norm, x, t, M, nt);
        mo->rms_norm(x, residual, L->post_norm, h, M, H, mo->eps, nt);
        rc |= linear(mo, &L->gate_up, h, gu, M, nd, nt);
        mo->act_and_mul(gu, act, M, I, nt);
        rc |= linear(mo, &L->down, act, x, M, nd, nt);
        scale(x, M * H, mo->branch_scale);
        out_norm(mo, L->mlp_out_norm, x, t, M, nt);
    }
    free(h);
    free(qkv);
    free(o);
    free(gu);
    free(act);
    free(t);
    return rc ? -1 : 0;
}
