/* Every transformer block of one forward pass in one call: the hot path with no Python between ops.
 *
 * For each layer, on the residual stream x (rows = B * T tokens, each n_embd wide), in place:
 *   h = norm(x); qkv = h Wqkv^T + b; RoPE on the q and k heads, with (qk_norm) an RMSNorm of each q and k head
 *   before it (Qwen3, learned weights) or after it (nanochat, none);
 *   k, v written to the cache at each token's slot; a = attention over each token's key prefix;
 *   x += a Wo^T + b;  h = norm(x); u = h Wup^T + b; u = act(u); x += u Wdown^T + b.
 * Gemma 3 adds (post_norms) a norm of each of the two outputs before its add, and (a layer's window) local
 * layers whose queries read only the last `window` keys, rotated by the local RoPE table. The attention scale
 * is dims->attn_scale (1 / sqrt(D) unless the model says otherwise).
 * Each step is one of the fixed-order kernels (matmul.c, attention.c, rope.c, norm.c) or an elementwise op, so
 * a token's bits depend on nothing but its own inputs and its own keys: not the batch, the chunking or the
 * thread count. The Python model (model.py) is the same data path op by op, kept for the torch twins.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "parallel.h"

static void norm(const ni_dims *dims, const float *x, const float *w, const float *b, float *y, long rows,
                 int threads) {
    if (dims->layernorm)
        ni_layernorm(x, dims->n_embd, w, b, y, dims->n_embd, (int)rows, dims->n_embd, dims->eps, threads);
    else
        ni_rmsnorm(x, dims->n_embd, w, y, dims->n_embd, (int)rows, dims->n_embd, dims->eps, threads);
}

/* A per-token step's operands: the layer, its qkv rows and, for the cache writes, where each token's k and v go. */
typedef struct {
    const ni_dims *dims;
    const ni_layer *w;
    const float *qkv;
    int T, qkv_width;
    const long *slots;
    float *keys, *values;
    const ni_kv_strides *kvs;
} token_job;

/* Few rows run on one thread: too little work to share. */
static int token_threads(long rows, int threads) { return rows >= 8 ? threads : 1; }

/* RMSNorm of each q and k head of tokens [first, last) in the qkv rows: H heads of D with the q weight, then H_kv
 * with the k weight (NULL: none). Each head is one row of ni_rmsnorm, reduced in its fixed order. */
static void norm_heads(void *ctx, long first, long last, int worker) {
    const token_job *j = ctx;
    const int H = j->dims->n_head, Hkv = j->dims->n_kv_head, D = j->dims->head_dim;
    (void)worker;
    for (long r = first; r < last; r++) {
        float *q = (float *)j->qkv + r * j->qkv_width, *k = q + (long)H * D;
        ni_rmsnorm(q, D, j->w->q_norm, q, D, H, D, j->dims->eps, 1);
        ni_rmsnorm(k, D, j->w->k_norm, k, D, Hkv, D, j->dims->eps, 1);
    }
}

/* k and v of tokens [first, last) into their slots (first writes: cache misses). */
static void write_cache(void *ctx, long first, long last, int worker) {
    const token_job *j = ctx;
    const int H = j->dims->n_head, Hkv = j->dims->n_kv_head, D = j->dims->head_dim;
    const ni_kv_strides *kvs = j->kvs;
    (void)worker;
    for (long r = first; r < last; r++) {
        const long b = r / j->T, slot = j->slots[r];
        for (int hk = 0; hk < Hkv; hk++) {
            const long at = b * kvs->b + hk * kvs->h + slot * kvs->t;
            memcpy(j->keys + at, j->qkv + r * j->qkv_width + (long)(H + hk) * D, sizeof(float) * (size_t)D);
            memcpy(j->values + at, j->qkv + r * j->qkv_width + (long)(H + Hkv + hk) * D, sizeof(float) * (size_t)D);
        }
    }
}

/* floats on whole cache lines: the matmuls read these rows in 16-float vectors, and malloc's 16-byte alignment
 * split most of them across two lines (a 32-row Q5_0 matmul took 20% longer so, 1 thread) */
static float *scratch(long floats) { return aligned_alloc(64, ((size_t)floats * sizeof(float) + 63) / 64 * 64); }

int ni_blocks(const ni_layer *layers, int L, const ni_dims *dims, float *x, int B, int T, float *kv,
              const ni_kv_strides *kvs, const long *slots, const ni_key_spans *seen, const float *cos,
              const float *sin, const float *local_cos, const float *local_sin, int threads) {
    const int C = dims->n_embd, H = dims->n_head, Hkv = dims->n_kv_head, D = dims->head_dim;
    const int q_width = H * D, qkv_width = (H + 2 * Hkv) * D, hidden = dims->ffn_hidden;
    const int up_width = dims->mlp == NI_SWIGLU || dims->mlp == NI_GEGLU ? 2 * hidden : hidden;
    const long rows = (long)B * T;
    const int widest = up_width > qkv_width ? up_width : qkv_width;
    /* scratch: h (rows x C), qkv (or u) (rows x widest), a (rows x max(q_width, hidden)) */
    const int a_width = q_width > hidden ? q_width : hidden;
    float *h = scratch(rows * C), *wide = scratch(rows * widest), *a = scratch(rows * a_width);
    if (!h || !wide || !a) {
        free(h);
        free(wide);
        free(a);
        return -1;
    }
    const ni_strides qkv_heads = {(long)T * qkv_width, D, qkv_width};   /* (b, head, t) in the qkv rows */
    const ni_strides a_heads = {(long)T * q_width, D, q_width};
    const ni_strides cache_heads = {kvs->b, kvs->h, kvs->t};
    int (*const matmul)(const float *, long, int, int, const unsigned char *, int, int, const float *, float *, long,
                        int) = dims->activations == NI_ACTIVATIONS_INT8 ? ni_matmul_q8 : ni_matmul;
    int status = 0;
    for (int l = 0; l < L && !status; l++) {
        const ni_layer *w = &layers[l];
        /* its group's slots (groups, rows) and tables (groups, B, width), its layer of the group's blocks */
        const long *layer_slots = slots + w->group * rows;
        float *keys = kv + w->kv_layer * kvs->layer, *values = keys + kvs->kv;
        token_job tokens = {dims, w, wide, T, qkv_width, layer_slots, keys, values, kvs};
        norm(dims, x, w->attn_norm, w->attn_norm_bias, h, rows, threads);
        status |= matmul(h, C, (int)rows, C, w->qkv.weight, w->qkv.kind, qkv_width, w->qkv.bias, wide, qkv_width, threads);
        if (dims->qk_norm == NI_QK_NORM_BEFORE_ROPE) ni_parallel_for(rows, token_threads(rows, threads), norm_heads, &tokens);
        ni_rope(wide, &qkv_heads, w->window ? local_cos : cos, w->window ? local_sin : sin, B, T, H + Hkv, D, threads);
        if (dims->qk_norm == NI_QK_NORM_AFTER_ROPE) ni_parallel_for(rows, token_threads(rows, threads), norm_heads, &tokens);
        ni_parallel_for(rows, token_threads(rows, threads), write_cache, &tokens);
        ni_key_spans layer_seen = *seen;   /* a local layer reads only its sliding window, others seen->window */
        if (w->window) layer_seen.window = (int)w->window;
        if (seen->tables) layer_seen.tables = seen->tables + w->group * B * (long)seen->width;
        ni_attention(wide, &qkv_heads, keys, &cache_heads, values, &cache_heads, a, &a_heads, &layer_seen, B, H, Hkv,
                     T, D, dims->attn_scale, threads);
        status |= matmul(a, q_width, (int)rows, q_width, w->o.weight, w->o.kind, C, w->o.bias, h, C, threads);
        if (dims->post_norms) norm(dims, h, w->attn_post_norm, NULL, h, rows, threads);
        ni_add_(x, h, rows * C);
        norm(dims, x, w->mlp_norm, w->mlp_norm_bias, h, rows, threads);
        status |= matmul(h, C, (int)rows, C, w->up.weight, w->up.kind, up_width, w->up.bias, wide, up_width, threads);
        ni_activation(dims->mlp, wide, a, rows, hidden, threads);
        status |= matmul(a, hidden, (int)rows, hidden, w->down.weight, w->down.kind, C, w->down.bias, h, C, threads);
        if (dims->post_norms) norm(dims, h, w->mlp_post_norm, NULL, h, rows, threads);
        ni_add_(x, h, rows * C);
    }
    free(h);
    free(wide);
    free(a);
    return status;
}
