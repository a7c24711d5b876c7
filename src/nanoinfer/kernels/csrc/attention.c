/* Attention with a reduction order fixed by this code: softmax(q k^T * scale) v, one query at a time.
 *
 * Every (row b, head h, query i) is computed start to finish by one thread (with the other heads that share its
 * K/V head), in one order: the scores over keys 0..n-1, their max, the exponentials (elementwise.c's exp) summed
 * in key order, then the weighted values summed in key order. Threads split whole (b, h, i) items among
 * themselves, so the bits of a query's output depend on nothing but its own q, keys and values: not the thread
 * count, the batch size, nor the row's place in the batch.
 *
 * Query i of row b reads the keys of its row's positions in order, from the first in its window up to itself
 * (ni_key_spans): in the row's own slots, or through the row's block table in a pool of fixed-size blocks, where
 * n samples of one prompt name the same prompt blocks and so read them once from memory. Where a key lives
 * changes which address is read, never the order of the sums. Heads share K/V heads in groups (GQA): head h reads kv head h / (H / Hkv). Every tensor is addressed by
 * (b, h, t) strides in floats; the last dimension is contiguous.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "parallel.h"

/* The portable twins of the AVX2 functions below, with the same bits: 8 lanes by fma, summed as ni_hsum256 does,
 * and a tail of plain products and sums. */
static float dot_scalar(const float *a, const float *b, int n) {
    float lanes[8] = {0};
    int d = 0;
    for (; d + 8 <= n; d += 8)
        for (int l = 0; l < 8; l++) lanes[l] = fmaf(a[d + l], b[d + l], lanes[l]);
    float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

static void axpy_scalar(float *acc, float p, const float *x, int n) {
    const int whole = n - n % 8;   /* the AVX2 twin's full vectors */
    int d = 0;
    for (; d < whole; d++) acc[d] = fmaf(p, x[d], acc[d]);
    for (; d < n; d++) acc[d] += p * x[d];
}

#if NI_X86
#include <immintrin.h>

NI_AVX2 static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    float sum = ni_hsum256(acc);
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

NI_AVX2 static void axpy_avx2(float *acc, float p, const float *x, int n) {
    __m256 pv = _mm256_set1_ps(p);
    int d = 0;
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(acc + d)));
    for (; d < n; d++) acc[d] += p * x[d];
}
#endif

typedef float (*dot_fn)(const float *, const float *, int);
typedef void (*axpy_fn)(float *, float, const float *, int);

/* One query's scores in place: minus their max, then exp. The softmax's denominator, the sum of these in key
 * order, is one chain of dependent adds: the fast paths take it while they read the values (where it costs
 * nothing; on its own it was a fifth of the kernel), the portable one after. */
static void exp_shifted_(float *w, int n, float top) {
    for (int j = 0; j < n; j++) w[j] -= top;
    ni_exp_(w, n);
}

/* A query's largest score is ni_max's: any order finds the same value (scores are finite; a NaN is skipped, and
 * which of +0 and -0 wins changes no exp), so max512 below gives the same bits downstream. */

/* The keys and values one query reads: n keys from position start on, in position order. Position p lives in
 * slot p of the row, or, with a block table, in slot table[p >> shift] << shift | (p & mask) of the pool; its key
 * at k + slot * kt, its value at v + slot * vt. */
typedef struct {
    const float *k, *v;
    long kt, vt;
    int n, start, shift;
    const int *table;
} key_rows;

static inline long slot_of(const key_rows *r, int j) {
    const int p = j + r->start;
    return r->table ? ((long)r->table[p >> r->shift] << r->shift) | (p & ((1 << r->shift) - 1)) : p;
}
static inline const float *key_at(const key_rows *r, int j) { return r->k + slot_of(r, j) * r->kt; }
static inline const float *value_at(const key_rows *r, int j) { return r->v + slot_of(r, j) * r->vt; }

/* The G query heads that share one K/V head, over its first n keys: any D, through dot and axpy. */
static void attend(dot_fn dot, axpy_fn axpy, const float *const *qg, float *const *og, int G, const key_rows *r,
                   int D, float scale, float *weights, float *acc) {
    const int n = r->n;
    for (int g = 0; g < G; g++) {
        for (int j = 0; j < n; j++) weights[j] = dot(qg[g], key_at(r, j), D) * scale;
        exp_shifted_(weights, n, ni_max(weights, n));
        float total = 0.0f;
        for (int j = 0; j < n; j++) total += weights[j];
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int j = 0; j < n; j++) axpy(acc, weights[j], value_at(r, j), D);
        const float inv = n > 0 ? 1.0f / total : 0.0f;
        for (int d = 0; d < D; d++) og[g][d] = acc[d] * inv;
    }
}

#if NI_X86
/* Start fetching the values of keys j..j + count - 1, which the weighted sum reads after the scores. */
NI_AVX2 static inline void fetch_values(const key_rows *r, int j, int count, int D) {
    for (int kk = 0; kk < count; kk++)
        for (int a = 0; a < D; a += 16) _mm_prefetch((const char *)(value_at(r, j + kk) + a), _MM_HINT_T0);
}

/* Keys from j on of scores_avx2, one at a time. */
NI_AVX2 static inline __attribute__((always_inline)) void scores_tail_avx2(const float *const *qg, int G,
                                                                          const key_rows *r, const int D,
                                                                          float scale, float *weights, int j) {
    const int V = D / 8, n = r->n;
    for (; j < n; j++) {
        const float *key = key_at(r, j);
        for (int g = 0; g < G; g++) {
            __m256 s = _mm256_mul_ps(_mm256_loadu_ps(qg[g]), _mm256_loadu_ps(key));   /* fma onto zero, as dot_avx2 */
            for (int a = 1; a < V; a++) s = _mm256_fmadd_ps(_mm256_loadu_ps(qg[g] + 8 * a), _mm256_loadu_ps(key + 8 * a), s);
            weights[(long)g * n + j] = ni_hsum256(s) * scale;
        }
    }
}

/* The scores of G query heads over n keys, as attend computes them with dot_avx2 (D a multiple of 8, a constant
 * here): eight keys at a time, eight independent chains summed by one transposed hsum. Up to D 128 the query
 * stays in registers (AVX-512 machines compile this with 32 of them); a wider one (Gemma 3's 256) is read 8
 * floats at a time, once for the 8 keys, each chain still taking its products in d order. weights (G, n). */
NI_AVX2 static inline __attribute__((always_inline)) void scores_avx2(const float *const *qg, int G, const key_rows *r,
                                                                     const int D, float scale, float *weights) {
    const int V = D / 8, n = r->n, held = V <= 16;
    int j = 0;
    for (; j + 8 <= n; j += 8)
        for (int g = 0; g < G; g++) {
            __m256 qv[16], s[8];
            const float *key[8];
            for (int a = 0; held && a < V; a++) qv[a] = _mm256_loadu_ps(qg[g] + 8 * a);
            for (int kk = 0; kk < 8; kk++) key[kk] = key_at(r, j + kk);
            if (g == 0) fetch_values(r, j, 8, D);
            if (held)
                for (int kk = 0; kk < 8; kk++) {
                    s[kk] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(key[kk]));
                    for (int a = 1; a < V; a++) s[kk] = _mm256_fmadd_ps(qv[a], _mm256_loadu_ps(key[kk] + 8 * a), s[kk]);
                }
            else
                for (int a = 0; a < V; a++) {
                    const __m256 qa = _mm256_loadu_ps(qg[g] + 8 * a);
                    for (int kk = 0; kk < 8; kk++)
                        s[kk] = a ? _mm256_fmadd_ps(qa, _mm256_loadu_ps(key[kk] + 8 * a), s[kk])
                                  : _mm256_mul_ps(qa, _mm256_loadu_ps(key[kk]));
                }
            _mm256_storeu_ps(weights + (long)g * n + j, _mm256_mul_ps(ni_hsum8x8(s), _mm256_set1_ps(scale)));
        }
    scores_tail_avx2(qg, G, r, D, scale, weights, j);
}

/* attend with dot_avx2 and axpy_avx2: the weighted sum of each head in registers, 128 dimensions at a time
 * (each element's sum is its own, so a wide head's halves give the same bits one after the other). */
NI_AVX2 static inline __attribute__((always_inline)) void attend_avx2(const float *const *qg, float *const *og,
                                                                     int G, const key_rows *r, const int D,
                                                                     float scale, float *weights) {
    const int n = r->n;
    scores_avx2(qg, G, r, D, scale, weights);
    for (int g = 0; g < G; g++) {
        float *w = weights + (long)g * n;
        exp_shifted_(w, n, ni_max(w, n));
        float total = 0.0f;
        for (int d0 = 0; d0 < D; d0 += 128) {
            const int V = (D - d0 < 128 ? D - d0 : 128) / 8;
            __m256 acc[16];
            for (int a = 0; a < V; a++) acc[a] = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                if (d0 == 0) total += w[j];
                const __m256 p = _mm256_set1_ps(w[j]);
                const float *value = value_at(r, j) + d0;
                for (int a = 0; a < V; a++) acc[a] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * a), acc[a]);
            }
            const __m256 inv = _mm256_set1_ps(n > 0 ? 1.0f / total : 0.0f);
            for (int a = 0; a < V; a++) _mm256_storeu_ps(og[g] + d0 + 8 * a, _mm256_mul_ps(acc[a], inv));
        }
    }
}

NI_AVX2 static int attend_fast(const float *const *qg, float *const *og, int G, const key_rows *r, int D,
                               float scale, float *weights) {
    switch (D) {
    case 32: attend_avx2(qg, og, G, r, 32, scale, weights); return 1;
    case 64: attend_avx2(qg, og, G, r, 64, scale, weights); return 1;
    case 128: attend_avx2(qg, og, G, r, 128, scale, weights); return 1;
    case 256: attend_avx2(qg, og, G, r, 256, scale, weights); return 1;
    default: return 0;
    }
}

/* ni_max, 16 lanes at a time (one dependent compare per 16 scores, not per score: the serial loop took a
 * tenth of the kernel). max_ps returns its second operand when the first is NaN, so a NaN is skipped here too. */
NI_AVX512 static float max512(const float *w, int n) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= n; j += 16) top = _mm512_max_ps(_mm512_loadu_ps(w + j), top);
    const __mmask16 rest = (__mmask16)((1u << (n - j)) - 1);
    top = _mm512_mask_max_ps(top, rest, _mm512_maskz_loadu_ps(rest, w + j), top);
    return _mm512_reduce_max_ps(top);
}

/* Floats 8a..8a + 7 of query heads q0 (lanes 0-7) and q1 (lanes 8-15). */
NI_AVX512 static inline __m512 head_pair512(const float *q0, const float *q1, int a) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(q0 + 8 * a)), _mm256_loadu_ps(q1 + 8 * a), 1);
}

/* scores_avx2's scores with two query heads in each 16-lane vector: head g in lanes 0-7, head g + 1 in lanes 8-15
 * (an odd G's last head beside itself), each key's 8 floats at a time read once into both halves. Every lane takes
 * the fmas of its 8-lane twin in the same order, and four keys' 8 sums (4 keys x 2 heads) are one ni_hsum8x8: the
 * bits of scores_avx2, with half its fmas for an even G (SmolLM2's 3 heads per K/V head: two thirds). */
NI_AVX512 static inline __attribute__((always_inline)) void scores512(const float *const *qg, int G, const key_rows *r,
                                                                     const int D, float scale, float *weights) {
    const int V = D / 8, n = r->n, held = V <= 16, whole = n - n % 4;
    for (int g = 0; g < G; g += 2) {
        const float *q0 = qg[g], *q1 = qg[g + 1 < G ? g + 1 : g];
        __m512 qv[16];
        for (int a = 0; held && a < V; a++) qv[a] = head_pair512(q0, q1, a);
        for (int j = 0; j < whole; j += 4) {
            const float *key[4];
            __m512 s[4];
            for (int kk = 0; kk < 4; kk++) key[kk] = key_at(r, j + kk);
            if (g == 0) fetch_values(r, j, 4, D);
            for (int a = 0; a < V; a++) {
                const __m512 qa = held ? qv[a] : head_pair512(q0, q1, a);
                for (int kk = 0; kk < 4; kk++) {
                    const __m512 k8 = _mm512_broadcast_f32x8(_mm256_loadu_ps(key[kk] + 8 * a));
                    s[kk] = a ? _mm512_fmadd_ps(qa, k8, s[kk]) : _mm512_mul_ps(qa, k8);
                }
            }
            __m256 halves[8];
            for (int kk = 0; kk < 4; kk++) {
                halves[2 * kk] = _mm512_castps512_ps256(s[kk]);
                halves[2 * kk + 1] = _mm512_extractf32x8_ps(s[kk], 1);
            }
            float sums[8];
            _mm256_storeu_ps(sums, _mm256_mul_ps(ni_hsum8x8(halves), _mm256_set1_ps(scale)));
            for (int kk = 0; kk < 4; kk++) {
                weights[(long)g * n + j + kk] = sums[2 * kk];
                if (g + 1 < G) weights[(long)(g + 1) * n + j + kk] = sums[2 * kk + 1];
            }
        }
    }
    scores_tail_avx2(qg, G, r, D, scale, weights, whole);
}

/* The weighted values of C heads at once (D a multiple of 16, C * D <= 256). Every element is summed by fma in key
 * order from zero, then scaled by 1 / (the weights summed in key order), as in attend_avx2: the same bits. Heads
 * that share a K/V head (own 0) load each value once for all C; heads with K/V heads of their own (own 1: head c
 * reads rs[c]) run their C chains of dependent fmas side by side. */
NI_AVX512 static inline __attribute__((always_inline)) void values512(const float *weights, int n, const key_rows *rs,
                                                                     const int own, float *const *og, const int C,
                                                                     const int D) {
    const int V = D / 16;
    __m512 acc[8][16];
    float totals[8];
    for (int c = 0; c < C; c++) {
        totals[c] = 0.0f;
        for (int a = 0; a < V; a++) acc[c][a] = _mm512_setzero_ps();
    }
    for (int j = 0; j < n; j++) {
        __m512 v[16];
        for (int c = 0; c < C; c++) {
            if (c == 0 || own)
                for (int a = 0; a < V; a++) v[a] = _mm512_loadu_ps(value_at(rs + (own ? c : 0), j) + 16 * a);
            totals[c] += weights[(long)c * n + j];
            const __m512 p = _mm512_set1_ps(weights[(long)c * n + j]);
            for (int a = 0; a < V; a++) acc[c][a] = _mm512_fmadd_ps(p, v[a], acc[c][a]);
        }
    }
    for (int c = 0; c < C; c++) {
        const __m512 inv = _mm512_set1_ps(n > 0 ? 1.0f / totals[c] : 0.0f);
        for (int a = 0; a < V; a++) _mm512_storeu_ps(og[c] + 16 * a, _mm512_mul_ps(acc[c][a], inv));
    }
}

#define VALUES512_D(D, C_MAX, OWN)                                                                                 \
    for (int g = 0; g < G; g += (C_MAX)) {                                                                         \
        const int c = G - g < (C_MAX) ? G - g : (C_MAX);                                                          \
        for (int h = 1; h <= (C_MAX); h++)                                                                         \
            if (h == c) values512(weights + (long)g * n, n, rs + ((OWN) ? g : 0), OWN, og + g, h, D);            \
    }

/* attend_avx2's scores (scores512; a head with a K/V head of its own, scores_avx2 with 32 registers), then the
 * values of up to 256 / D heads at once in 16-lane vectors: G heads over the keys of rs[0] (own 0), or, D 32 only,
 * head g over those of rs[g] (own 1). */
NI_AVX512 static int attend512(const float *const *qg, float *const *og, int G, const key_rows *rs, int own, int D,
                               float scale, float *weights) {
    const int n = rs->n;
    if (own)
        for (int g = 0; g < G; g++) scores_avx2(qg + g, 1, rs + g, 32, scale, weights + (long)g * n);
    else
        switch (D) {
        case 32: scores512(qg, G, rs, 32, scale, weights); break;
        case 64: scores512(qg, G, rs, 64, scale, weights); break;
        case 128: scores512(qg, G, rs, 128, scale, weights); break;
        case 256: scores512(qg, G, rs, 256, scale, weights); break;
        default: return 0;
        }
    for (int g = 0; g < G; g++) exp_shifted_(weights + (long)g * n, n, max512(weights + (long)g * n, n));
    switch (D + own) {
    case 33: VALUES512_D(32, 4, 1) break;
    case 32: VALUES512_D(32, 8, 0) break;
    case 64: VALUES512_D(64, 4, 0) break;
    case 128: VALUES512_D(128, 2, 0) break;
    default: VALUES512_D(256, 1, 0) break;
    }
    return 1;
}
#endif

/* One ni_attention call's operands, as each worker's range of items reads them. */
typedef struct {
    const float *q, *k, *v;
    const ni_strides *qs, *ks, *vs, *os;
    float *out;
    const ni_key_spans *seen;
    const int *key_counts;
    int Hkv, Tq, D, G, span, spans, max_keys, simd;
    float scale;
    dot_fn dot;
    axpy_fn axpy;
} attention_job;

/* Items [from, to) of the job. */
static void attend_items(void *ctx, long from, long to, int worker) {
    const attention_job *j = ctx;
    const float *q = j->q, *k = j->k, *v = j->v;
    const ni_strides *qs = j->qs, *ks = j->ks, *vs = j->vs, *os = j->os;
    float *out = j->out;
    const ni_key_spans *seen = j->seen;
    const int *key_counts = j->key_counts;
    const int Hkv = j->Hkv, Tq = j->Tq, D = j->D, G = j->G, span = j->span, spans = j->spans, max_keys = j->max_keys;
    const int simd = j->simd;
    const float scale = j->scale;
    const dot_fn dot = j->dot;
    const axpy_fn axpy = j->axpy;
    (void)worker, (void)simd;
    float *weights = malloc(sizeof(float) * (size_t)(G * span) * (size_t)(max_keys > 0 ? max_keys : 1));
    float *acc = malloc(sizeof(float) * (size_t)D);   /* the portable path's sum of values */
    const float **qg = malloc(sizeof(float *) * (size_t)(G * span));
    float **og = malloc(sizeof(float *) * (size_t)(G * span));
    for (long item = from; item < to; item++) {
        const int i = (int)(item % Tq), first = (int)(item / Tq % spans) * span, b = (int)(item / Tq / spans);
        const int kv_heads = Hkv - first < span ? Hkv - first : span, seen_to = key_counts[(long)b * Tq + i];
        const int start = seen->window && seen_to > seen->window ? seen_to - seen->window : 0;
        const int *table = seen->tables ? seen->tables + (long)b * seen->width : NULL;
        key_rows rs[4];   /* span <= 4 */
        for (int s = 0; s < kv_heads; s++) {
            const int hk = first + s;
            rs[s] = (key_rows){k + b * ks->b + hk * ks->h, v + b * vs->b + hk * vs->h, ks->t, vs->t,
                               seen_to - start, start, seen->shift, table};
            for (int g = 0; g < G; g++) {
                qg[s * G + g] = q + b * qs->b + (long)(hk * G + g) * qs->h + i * qs->t;
                og[s * G + g] = out + b * os->b + (long)(hk * G + g) * os->h + i * os->t;
            }
        }
#if NI_X86
        if (simd == 2 && attend512(qg, og, span > 1 ? kv_heads : G, rs, span > 1, D, scale, weights)) continue;
        if (simd == 1 && attend_fast(qg, og, G, rs, D, scale, weights)) continue;
#endif
        attend(dot, axpy, qg, og, G, rs, D, scale, weights, acc);
    }
    free(weights);
    free(acc);
    free(qg);
    free(og);
}

void ni_attention(const float *q, const ni_strides *qs, const float *k, const ni_strides *ks, const float *v,
                  const ni_strides *vs, float *out, const ni_strides *os, const ni_key_spans *seen, int B, int H,
                  int Hkv, int Tq, int D, float scale, int threads) {
    const int *key_counts = seen->counts;
    dot_fn dot = dot_scalar;
    axpy_fn axpy = axpy_scalar;
    int simd = 0;   /* 1 AVX2, 2 AVX-512 */
#if NI_X86
    if (ni_has_avx2()) {
        dot = dot_avx2;
        axpy = axpy_avx2;
        simd = ni_has_avx512() ? 2 : 1;
    }
#endif
    int max_keys = 0;
    for (long i = 0; i < (long)B * Tq; i++) max_keys = key_counts[i] > max_keys ? key_counts[i] : max_keys;
    const int G = H / Hkv;
    /* An item is one (row, query) and either one K/V head with its G query heads, which read its keys once, or,
     * with one query head per K/V head of width 32 on AVX-512, up to 4 K/V heads side by side: such a head's sum
     * of values is two chains of dependent fmas in key order, too few to keep the FMA units busy (4 heads: -12%
     * a 16-row tiny-GPT attention; wider heads have enough chains, and measured slower spanned). Spans stay small
     * enough to give every thread two items. */
    int span = 1;
#if NI_X86
    if (simd == 2 && G == 1 && D == 32)
        while (2 * span <= 4 && (long)B * Tq * ((Hkv + 2 * span - 1) / (2 * span)) >= 2L * threads) span *= 2;
#endif
    const int spans = (Hkv + span - 1) / span;
    const long items = (long)B * spans * Tq;
    attention_job job = {q, k, v, qs, ks, vs, os, out, seen, key_counts, Hkv, Tq, D, G, span, spans, max_keys, simd,
                         scale, dot, axpy};
    ni_parallel_for(items, threads, attend_items, &job);
}
