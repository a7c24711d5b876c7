/* Attention with a reduction order fixed by this code: softmax(q k^T * scale) v, each query on its own sums.
 *
 * Every (row b, head h, query i) is computed in one order: the scores over keys 0..n-1 (each its own dot), their
 * max, the exponentials (elementwise.c's exp) summed in key order, then each element's weighted values summed in
 * key order. Threads split whole items among themselves (an item: queries over one K/V head, start to finish),
 * or at decode, where items are too few to share out, split a query's work where no sum is cut: its scores by
 * keys, its weighted values by dimensions (attend_split). So the bits of a query's output depend on nothing but
 * its own q, keys and values: not the thread count, the batch size, nor the row's place in the batch.
 *
 * An item is a block of up to QUERY_BLOCK consecutive queries (flat (b, i) order: a prefill chunk's tokens)
 * over one K/V head. A block walks its keys in tiles (key_tile), each tile read from memory once for
 * all its queries and then reused from cache (a long prompt's keys and values are megabytes per head: read once
 * per query, they made attention memory-bound); a query skips the tiles past its own keys (causal). Tiling moves
 * where a sum is paused, never its order: each score is its own dot, and each weighted sum and total is carried
 * from tile to tile in key order, so a query in a block has the bits it has alone.
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
#include "neon.h"
#include "parallel.h"

/* A block's queries at most, and the positions of a key tile on AVX-512: 512 keys of width 64 are 128 KiB of keys
 * (then as much of values), read once from memory for the block's 16 queries and then from L2. On the Zen 4 of this
 * project's machine (1 thread, SmolLM2's heads, 8,000 keys) this reads the keys 16 times less often for the same
 * time: that kernel is bound by its fmas, not by reading keys; 8 or 16 queries over 64-key tiles measured up to
 * 15% slower. The other paths take a tile whose values fill TILE_BYTES (key_tile). */
enum { QUERY_BLOCK = 16, KEY_TILE = 512, TILE_BYTES = 16384 };

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
 * which of +0 and -0 wins changes no exp), so max512 below, ni_max_avx2 and ni_max_neon give the same bits
 * downstream. */

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

/* The portable phases of the G heads that share r's keys, through dot and axpy (any D): their scores into
 * weights (G, ws), and one head's weighted values added to acc (D) and its weights to *total, in key order. */
static void scores_portable(dot_fn dot, const float *const *qg, int G, const key_rows *r, int D, float scale,
                            float *weights, long ws) {
    for (int g = 0; g < G; g++)
        for (int j = 0; j < r->n; j++) weights[g * ws + j] = dot(qg[g], key_at(r, j), D) * scale;
}

static void values_portable(axpy_fn axpy, const float *w, const key_rows *r, int D, float *acc, float *total) {
    float sum = *total;
    for (int j = 0; j < r->n; j++) {
        sum += w[j];
        axpy(acc, w[j], value_at(r, j), D);
    }
    *total = sum;
}

#if NI_X86
/* How many keys from j on (of r's n) lie one after another in memory: the rest of j's block through a table. */
static inline int run_of(const key_rows *r, int j) {
    const int p = j + r->start, rest = r->n - j;
    if (!r->table) return rest;
    const int in_block = (1 << r->shift) - (p & ((1 << r->shift) - 1));
    return in_block < rest ? in_block : rest;
}

/* Start fetching the values of keys j..j + count - 1, which the weighted sum reads after the scores. */
NI_AVX2 static inline void fetch_values(const key_rows *r, int j, int count, int D) {
    for (int kk = 0; kk < count; kk++)
        for (int a = 0; a < D; a += 16) _mm_prefetch((const char *)(value_at(r, j + kk) + a), _MM_HINT_T0);
}

/* Keys from j on of scores_avx2, one at a time. */
NI_AVX2 static inline __attribute__((always_inline)) void scores_tail_avx2(const float *const *qg, int G,
                                                                          const key_rows *r, const int D,
                                                                          float scale, float *weights, long ws,
                                                                          int j) {
    const int V = D / 8, n = r->n;
    for (; j < n; j++) {
        const float *key = key_at(r, j);
        for (int g = 0; g < G; g++) {
            __m256 s = _mm256_mul_ps(_mm256_loadu_ps(qg[g]), _mm256_loadu_ps(key));   /* fma onto zero, as dot_avx2 */
            for (int a = 1; a < V; a++) s = _mm256_fmadd_ps(_mm256_loadu_ps(qg[g] + 8 * a), _mm256_loadu_ps(key + 8 * a), s);
            weights[g * ws + j] = ni_hsum256(s) * scale;
        }
    }
}

/* The scores of G query heads over n keys, as dot_avx2 computes them (D a multiple of 8, a constant here): eight
 * keys at a time (their addresses found once for the G heads), eight independent chains summed by one transposed
 * hsum. Up to D 128 the query stays in registers (AVX-512 machines compile this with 32 of them); a wider one
 * (Gemma 3's 256) is read 8 floats at a time, once for the 8 keys, each chain still taking its products in d
 * order. weights (G, ws): head g's at weights + g * ws. With fetch, the values of the keys are fetched too, for a
 * weighted sum that follows soon. */
NI_AVX2 static inline __attribute__((always_inline)) void scores_avx2(const float *const *qg, int G, const key_rows *r,
                                                                     const int D, float scale, float *weights,
                                                                     long ws, const int fetch) {
    const int V = D / 8, n = r->n, held = V <= 16;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const float *key[8];
        for (int kk = 0; kk < 8; kk++) key[kk] = key_at(r, j + kk);
        if (fetch) fetch_values(r, j, 8, D);
        for (int g = 0; g < G; g++) {
            __m256 qv[16], s[8];
            for (int a = 0; held && a < V; a++) qv[a] = _mm256_loadu_ps(qg[g] + 8 * a);
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
            _mm256_storeu_ps(weights + g * ws + j, _mm256_mul_ps(ni_hsum8x8(s), _mm256_set1_ps(scale)));
        }
    }
    scores_tail_avx2(qg, G, r, D, scale, weights, ws, j);
}

/* values_portable with axpy_avx2 for C heads that share r's values (weights (C, ws), acc (C, D), totals (C)), on
 * the piece of W vectors from dimension d0: each key's 8W values read once for the C heads, whose C x W sums (at
 * most 8: with the weights, their totals and a value, 13 of AVX2's 16 registers; 12 sums spilled the totals) run as
 * independent chains of fmas in key order, keys a run at a time (run_of: no table lookup per key). Each element's
 * sum is its own, so the pieces give the same bits one after the other; the weights' totals are summed, in key
 * order, with the first. */
NI_AVX2 static inline __attribute__((always_inline)) void values_piece_avx2(const float *w, long ws,
                                                                           const key_rows *r, const int C,
                                                                           const int W, int d0, int D, float *acc,
                                                                           float *totals) {
    const int n = r->n;
    __m256 sum[8];
    float weights[2];
    for (int c = 0; c < C; c++) {
        weights[c] = totals[c];
        for (int a = 0; a < W; a++) sum[c * W + a] = _mm256_loadu_ps(acc + (long)c * D + d0 + 8 * a);
    }
    for (int j = 0; j < n;) {
        const float *value = value_at(r, j) + d0;
        for (const int end = j + run_of(r, j); j < end; j++, value += r->vt) {
            __m256 p[2];
            for (int c = 0; c < C; c++) {
                if (d0 == 0) weights[c] += w[c * ws + j];
                p[c] = _mm256_set1_ps(w[c * ws + j]);
            }
            for (int a = 0; a < W; a++) {
                const __m256 v = _mm256_loadu_ps(value + 8 * a);
                for (int c = 0; c < C; c++) sum[c * W + a] = _mm256_fmadd_ps(p[c], v, sum[c * W + a]);
            }
        }
    }
    for (int c = 0; c < C; c++) {
        for (int a = 0; a < W; a++) _mm256_storeu_ps(acc + (long)c * D + d0 + 8 * a, sum[c * W + a]);
        if (d0 == 0) totals[c] = weights[c];
    }
}

/* values_piece_avx2 over all D dimensions (a multiple of 16) of C heads, W vectors a piece. */
NI_AVX2 static inline __attribute__((always_inline)) void values_heads_avx2(const float *w, long ws,
                                                                           const key_rows *r, const int C,
                                                                           const int W, int D, float *acc,
                                                                           float *totals) {
    for (int d0 = 0; d0 < D; d0 += 8 * W) values_piece_avx2(w, ws, r, C, W, d0, D, acc, totals);
}

/* scores_avx2 for the head widths it takes (0: another width, for the portable phases). */
NI_AVX2 static int scores_fast(const float *const *qg, int G, const key_rows *r, int D, float scale, float *weights,
                               long ws, int fetch) {
    switch (D) {
    case 32: scores_avx2(qg, G, r, 32, scale, weights, ws, fetch); return 1;
    case 64: scores_avx2(qg, G, r, 64, scale, weights, ws, fetch); return 1;
    case 128: scores_avx2(qg, G, r, 128, scale, weights, ws, fetch); return 1;
    case 256: scores_avx2(qg, G, r, 256, scale, weights, ws, fetch); return 1;
    default: return 0;
    }
}

/* The weighted values of G heads sharing r's values (D a multiple of 16): two heads at once in pieces of 32
 * dimensions, a last odd one in pieces of 64; pieces as wide as D allows where it is not a multiple of those. Against
 * one head at a time over up to 128 dimensions (AVX2-capped Zen 4, 256 prefill queries over 4,096 keys, the whole
 * kernel): SmolLM2's 3 heads per K/V head of 64 0.84x the time, Gemma 3's 4 of 256 0.85x. */
NI_AVX2 static int values_fast(const float *weights, long ws, const key_rows *r, int G, int D, float *acc,
                               float *totals) {
    if (D % 16) return 0;
    for (int g = 0; g < G; g += 2) {
        const float *w = weights + g * ws;
        float *sums = acc + (long)g * D, *total = totals + g;
        if (g + 1 < G && D % 32 == 0) values_heads_avx2(w, ws, r, 2, 4, D, sums, total);
        else if (g + 1 < G) values_heads_avx2(w, ws, r, 2, 2, D, sums, total);
        else if (D % 64 == 0) values_heads_avx2(w, ws, r, 1, 8, D, sums, total);
        else if (D % 32 == 0) values_heads_avx2(w, ws, r, 1, 4, D, sums, total);
        else values_heads_avx2(w, ws, r, 1, 2, D, sums, total);
    }
    return 1;
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
                                                                     const int D, float scale, float *weights,
                                                                     long ws, const int fetch) {
    const int V = D / 8, n = r->n, held = V <= 16, whole = n - n % 4;
    for (int g = 0; g < G; g += 2) {
        const float *q0 = qg[g], *q1 = qg[g + 1 < G ? g + 1 : g];
        __m512 qv[16];
        for (int a = 0; held && a < V; a++) qv[a] = head_pair512(q0, q1, a);
        for (int j = 0; j < whole; j += 4) {
            const float *key[4];
            __m512 s[4];
            for (int kk = 0; kk < 4; kk++) key[kk] = key_at(r, j + kk);
            if (fetch && g == 0) fetch_values(r, j, 4, D);
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
                weights[g * ws + j + kk] = sums[2 * kk];
                if (g + 1 < G) weights[(g + 1) * ws + j + kk] = sums[2 * kk + 1];
            }
        }
    }
    scores_tail_avx2(qg, G, r, D, scale, weights, ws, whole);
}

/* The weighted values of C heads at once (D a multiple of 16, C * D <= 256), added to acc (C, D) and their weights
 * to totals (C): every element is summed by fma in key order, as values_piece_avx2 sums it: the same bits. Heads that
 * share a K/V head (own 0) load each value once for all C; heads with K/V heads of their own (own 1: head c
 * reads rs[c]) run their C chains of dependent fmas side by side. weights (C, ws). */
NI_AVX512 static inline __attribute__((always_inline)) void values512(const float *weights, long ws, const key_rows *rs,
                                                                     const int own, float *acc, float *totals,
                                                                     const int C, const int D) {
    const int V = D / 16, n = rs->n;
    __m512 sum[8][16];
    float weight_sums[8];
    for (int c = 0; c < C; c++) {
        weight_sums[c] = totals[c];
        for (int a = 0; a < V; a++) sum[c][a] = _mm512_loadu_ps(acc + c * D + 16 * a);
    }
    for (int j = 0; j < n; j++) {
        __m512 v[16];
        for (int c = 0; c < C; c++) {
            if (c == 0 || own)
                for (int a = 0; a < V; a++) v[a] = _mm512_loadu_ps(value_at(rs + (own ? c : 0), j) + 16 * a);
            weight_sums[c] += weights[c * ws + j];
            const __m512 p = _mm512_set1_ps(weights[c * ws + j]);
            for (int a = 0; a < V; a++) sum[c][a] = _mm512_fmadd_ps(p, v[a], sum[c][a]);
        }
    }
    for (int c = 0; c < C; c++) {
        totals[c] = weight_sums[c];
        for (int a = 0; a < V; a++) _mm512_storeu_ps(acc + c * D + 16 * a, sum[c][a]);
    }
}

#define VALUES512_D(D, C_MAX, OWN)                                                                                 \
    for (int g = 0; g < G; g += (C_MAX)) {                                                                         \
        const int c = G - g < (C_MAX) ? G - g : (C_MAX);                                                          \
        for (int h = 1; h <= (C_MAX); h++)                                                                         \
            if (h == c) values512(weights + g * ws, ws, rs + ((OWN) ? g : 0), OWN, acc + g * (D), totals + g, h, D); \
    }

/* scores512 and values512 (of G heads sharing rs[0]) for the head widths they take (0: another width). */
NI_AVX512 static int scores_fast512(const float *const *qg, int G, const key_rows *r, int D, float scale,
                                    float *weights, long ws, int fetch) {
    switch (D) {
    case 32: scores512(qg, G, r, 32, scale, weights, ws, fetch); return 1;
    case 64: scores512(qg, G, r, 64, scale, weights, ws, fetch); return 1;
    case 128: scores512(qg, G, r, 128, scale, weights, ws, fetch); return 1;
    case 256: scores512(qg, G, r, 256, scale, weights, ws, fetch); return 1;
    default: return 0;
    }
}

NI_AVX512 static int values_fast512(const float *weights, long ws, const key_rows *rs, int G, int D, float *acc,
                                    float *totals) {
    switch (D) {
    case 16: VALUES512_D(16, 8, 0) return 1;
    case 32: VALUES512_D(32, 8, 0) return 1;
    case 64: VALUES512_D(64, 4, 0) return 1;
    case 128: VALUES512_D(128, 2, 0) return 1;
    case 256: VALUES512_D(256, 1, 0) return 1;
    default: return 0;
    }
}

/* One query whose G heads of width 32 have K/V heads of their own (head g reads rs[g]): scores_avx2 per head,
 * then values512 with the G chains side by side. weights (G, ws), acc (G, 32) and totals (G) zeroed. */
NI_AVX512 static void attend_own512(const float *const *qg, int G, const key_rows *rs, float scale, float *weights,
                                    long ws, float *acc, float *totals) {
    for (int g = 0; g < G; g++) {
        scores_avx2(qg + g, 1, rs + g, 32, scale, weights + g * ws, ws, 1);
        exp_shifted_(weights + g * ws, rs[g].n, max512(weights + g * ws, rs[g].n));
    }
    VALUES512_D(32, 4, 1)
}
#endif

/* The instruction set the phases run on (1 AVX2, 2 AVX-512, 0 portable C), and the portable phases' dot and axpy
 * (the AVX2 ones where there is AVX2: the same bits). */
typedef struct {
    int simd;
    dot_fn dot;
    axpy_fn axpy;
} paths;

static void scores(const paths *path, const float *const *qg, int G, const key_rows *r, int D, float scale,
                   float *weights, long ws, int fetch) {
#if NI_X86
    if (path->simd == 2 && scores_fast512(qg, G, r, D, scale, weights, ws, fetch)) return;
    if (path->simd == 1 && scores_fast(qg, G, r, D, scale, weights, ws, fetch)) return;
#endif
    scores_portable(path->dot, qg, G, r, D, scale, weights, ws);
}

static void values(const paths *path, const float *weights, long ws, const key_rows *r, int G, int D, float *acc,
                   float *totals) {
#if NI_X86
    if (path->simd == 2 && values_fast512(weights, ws, r, G, D, acc, totals)) return;
    if (path->simd == 1 && values_fast(weights, ws, r, G, D, acc, totals)) return;
#endif
    for (int g = 0; g < G; g++) values_portable(path->axpy, weights + g * ws, r, D, acc + g * D, totals + g);
}

static float row_max(const paths *path, const float *w, int n) {
    int nan;
#if NI_X86
    if (path->simd == 2) return max512(w, n);
    if (path->simd == 1) return ni_max_avx2(w, n, &nan);
#elif NI_NEON
    if (ni_has_neon()) return ni_max_neon(w, n, &nan);
#endif
    (void)nan;
    return ni_max(w, n);
}

/* The keys of r in positions [from, from + tile) as key rows of their own; the index in r of the first (-1: r has
 * none there, a tile past a causal query's last key). */
static int tile_of(const key_rows *r, int from, int tile, key_rows *part) {
    const int first = from > r->start ? from : r->start, end = r->start + r->n < from + tile ? r->start + r->n : from + tile;
    *part = *r;
    part->start = first;
    part->n = end - first;
    return end > first ? first - r->start : -1;
}

/* out = acc / total for each of `rows` (query, head) rows, row r reading the keys of rs[r / per]: 1 / (the weights
 * summed in key order) times each weighted sum, 0 for a query that sees no keys. */
static void finish(float *const *og, int rows, int per, const key_rows *rs, int D, const float *acc,
                   const float *totals) {
    for (int row = 0; row < rows; row++) {
        const float inv = rs[row / per].n > 0 ? 1.0f / totals[row] : 0.0f;
        for (int d = 0; d < D; d++) og[row][d] = acc[(long)row * D + d] * inv;
    }
}

/* attend_lanes512's lanes (a block's queries at most), the keys of a tile of its phases, its heads per K/V head
 * at most */
enum { LANES = 16, LANE_TILE = 64, LANE_HEADS = 8 };

#if NI_X86
/* A block's queries side by side, query q in lane q of 16 (AVX-512, heads of width 32, 64, 128 or 256, the block's
 * queries reading the keys of one row: block_keys). Each lane takes the operations its query takes alone:
 *   scores: lane l of a dot product's 8 is a chain over d = l, l + 8, ... (a product, then fmas), the 8 summed as
 *     ni_hsum256 sums them: here each of the 8 chains is a vector of 16 queries, summed by vector adds in that
 *     tree, so no horizontal sum is left (it and the keys' broadcasts were half of scores512's instructions);
 *   max: ni_max's value, by a masked max over the query's own keys;
 *   weights: exp(score - max), elementwise;
 *   values and totals: one fma per key in key order into each element, and a masked add per key into each total.
 * So a query has the bits of attend_queries', alone or in any block. The scores are held key-major, (keys, G, 16)
 * floats, and the phase after the max walks them in tiles of LANE_TILE keys that stay in L1 with their values. */

/* Queries' heads transposed: qt (G, D, 16), lane q of qt[c][d] = head c of query q at d, 0 past Q. */
static void transpose_queries(const float *const *qg, int Q, int G, int D, float *qt) {
    for (int c = 0; c < G; c++)
        for (int d = 0; d < D; d++)
            for (int q = 0; q < LANES; q++) qt[((long)c * D + d) * LANES + q] = q < Q ? qg[q * G + c][d] : 0.0f;
}

/* Lanes whose query reads position p: starts[q] <= p < ends[q]. */
NI_AVX512 static inline __mmask16 reading(__m512i starts, __m512i ends, int p) {
    const __m512i at = _mm512_set1_epi32(p);
    return _mm512_cmple_epi32_mask(starts, at) & _mm512_cmplt_epi32_mask(at, ends);
}

/* Head c's scores of K consecutive keys from position p for all lanes: K x 8 chains (K <= 3), each a product then
 * fmas in d order, summed in ni_hsum256's tree and scaled; key k's 16 scores to out + k * stride, and into *top
 * (each lane's largest score: max_ps keeps top where a score is NaN, as max512) where the lane reads the key. */
NI_AVX512 static inline __attribute__((always_inline)) void key_scores512(const float *qt, const float *const *key,
                                                                         const int K, const int D, __m512 scale,
                                                                         float *out, long stride, int p,
                                                                         __m512i starts, __m512i ends, __m512 *top) {
    __m512 part[3][8];
    for (int l = 0; l < 8; l++) {
        const __m512 ql = _mm512_loadu_ps(qt + l * LANES);
        for (int k = 0; k < K; k++) part[k][l] = _mm512_mul_ps(ql, _mm512_set1_ps(key[k][l]));
    }
    for (int d = 8; d < D; d += 8)
        for (int l = 0; l < 8; l++) {
            __m512 ql = _mm512_loadu_ps(qt + (d + l) * LANES);
            __asm__("" : "+v"(ql));   /* kept in a register: gcc otherwise reads it from memory into each of the K fmas
                                         * and broadcasts the keys apart, two loads an fma (-15% on Zen 4) */
            for (int k = 0; k < K; k++) part[k][l] = _mm512_fmadd_ps(ql, _mm512_set1_ps(key[k][d + l]), part[k][l]);
        }
    for (int k = 0; k < K; k++) {
        const __m512 *c = part[k];
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c[0], c[4]), _mm512_add_ps(c[2], c[6])),
                                         _mm512_add_ps(_mm512_add_ps(c[1], c[5]), _mm512_add_ps(c[3], c[7])));
        const __m512 score = _mm512_mul_ps(sum, scale);
        _mm512_storeu_ps(out + k * stride, score);
        *top = _mm512_mask_max_ps(*top, reading(starts, ends, p + k), score, *top);
    }
}

/* Every lane's scores of G heads over positions [lo, hi) of src (positions from 0): st ((hi - lo), G, 16), and
 * their largest, top (G) (each lane over the keys it reads, [starts, ends)). Keys a tile at a time (read from memory
 * once for all heads), three keys at a time per head. */
NI_AVX512 static inline __attribute__((always_inline)) void lane_scores512(const float *qt, int G, const key_rows *src,
                                                                          int lo, int hi, const int D, float scale,
                                                                          float *st, __m512i starts, __m512i ends,
                                                                          __m512 *top) {
    const __m512 scale16 = _mm512_set1_ps(scale);
    const long stride = (long)G * LANES;
    for (int t0 = lo; t0 < hi; t0 += LANE_TILE) {
        const int t1 = hi - t0 < LANE_TILE ? hi : t0 + LANE_TILE;
        for (int c = 0; c < G; c++) {
            const float *qc = qt + (long)c * D * LANES;
            int p = t0;
            for (; p + 3 <= t1; p += 3) {
                const float *key[3] = {key_at(src, p), key_at(src, p + 1), key_at(src, p + 2)};
                key_scores512(qc, key, 3, D, scale16, st + (p - lo) * stride + c * LANES, stride, p, starts, ends, top + c);
            }
            for (; p < t1; p++) {
                const float *key[1] = {key_at(src, p)};
                key_scores512(qc, key, 1, D, scale16, st + (p - lo) * stride + c * LANES, stride, p, starts, ends, top + c);
            }
        }
    }
}

/* rows (query, head) pairs' weighted values over keys [t0, t1) (R rows, R * D / 16 <= 24 accumulators): row r is
 * lane lane[r], head head[r], reading [first[r], last[r]); its weight of key p at st[(p - lo) * stride + head * 16 +
 * lane], its sum at acc[r] (read, carried, written back). */
NI_AVX512 static inline __attribute__((always_inline)) void lane_values512(const float *st, long stride, int lo,
                                                                          const key_rows *src, int t0, int t1,
                                                                          const int *lane, const int *head,
                                                                          const int *first, const int *last,
                                                                          const int R, const int D,
                                                                          float *const *acc) {
    const int V = D / 16;
    __m512 sum[12][8];
    int from = t1, to = t0;
    for (int r = 0; r < R; r++) {
        for (int a = 0; a < V; a++) sum[r][a] = _mm512_loadu_ps(acc[r] + 16 * a);
        from = first[r] < from ? first[r] : from;
        to = last[r] > to ? last[r] : to;
    }
    from = from > t0 ? from : t0;
    to = to < t1 ? to : t1;
    for (int p = from; p < to; p++) {
        const float *value = value_at(src, p), *w = st + (p - lo) * stride;
        __m512 v[8];
        for (int a = 0; a < V; a++) v[a] = _mm512_loadu_ps(value + 16 * a);
        for (int r = 0; r < R; r++)
            if (p >= first[r] && p < last[r]) {
                const __m512 weight = _mm512_set1_ps(w[head[r] * LANES + lane[r]]);
                for (int a = 0; a < V; a++) sum[r][a] = _mm512_fmadd_ps(weight, v[a], sum[r][a]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int a = 0; a < V; a++) _mm512_storeu_ps(acc[r] + 16 * a, sum[r][a]);
}

/* lane_values512 for R rows of heads of width D (32, 64, 128, 256): as many at once as the accumulators hold
 * (full), else one at a time; a head of 256 in halves of 128, each its values' dimensions as split_values takes a
 * part, src's v moved to the half's first (each element's sum is its own: the same bits). */
NI_AVX512 static void values_rows512(const float *st, long stride, int lo, const key_rows *src, int t0, int t1,
                                     const int *lane, const int *head, const int *first, const int *last, int R,
                                     int full, int D, float *const *acc) {
#define VALUES_AT(RR, DD, SRC, SUMS) lane_values512(st, stride, lo, SRC, t0, t1, lane, head, first, last, RR, DD, SUMS)
#define VALUES_ONE(DD, SRC, SUMS)                                                                                  \
    for (int r = 0; r < R; r++)                                                                                   \
        lane_values512(st, stride, lo, SRC, t0, t1, lane + r, head + r, first + r, last + r, 1, DD, SUMS + r)
    switch (D) {
    case 32: if (full) VALUES_AT(12, 32, src, acc); else VALUES_ONE(32, src, acc); break;
    case 64: if (full) VALUES_AT(6, 64, src, acc); else VALUES_ONE(64, src, acc); break;
    case 128: if (full) VALUES_AT(3, 128, src, acc); else VALUES_ONE(128, src, acc); break;
    default:
        for (int half = 0; half < 256; half += 128) {
            key_rows dims = *src;
            float *sums[3];
            dims.v += half;
            for (int r = 0; r < R; r++) sums[r] = acc[r] + half;
            if (full) VALUES_AT(3, 128, &dims, sums); else VALUES_ONE(128, &dims, sums);
        }
        break;
    }
#undef VALUES_AT
#undef VALUES_ONE
}

/* attend_queries for such a block: Q <= 16 queries, query q reading rs[q], the positions [lo, hi) of keys that
 * they read alike (block_keys) in lanes, then each query's keys past hi (its own: decode rows that share a prompt's
 * blocks and then each wrote blocks of its own) on the paths of attend_queries, carrying each row's max, total and
 * weighted sums on in key order: the same operations, so the same bits. Heads qg/og as there; qt (G, D, 16) and
 * st (16 G x the widest query's count) scratch, acc (Q * G, D) and totals (Q * G). */
NI_AVX512 static void attend_lanes512(const paths *path, const float *const *qg, float *const *og, int Q, int G,
                                      const key_rows *rs, const key_rows *keys, int lo, int hi, const int D,
                                      float scale, float *qt, float *st, float *acc, float *totals) {
    int starts[LANES], ends[LANES], past = 0;   /* past: the most keys a query reads past hi */
    for (int q = 0; q < LANES; q++) {
        starts[q] = q < Q ? rs[q].start : 0;
        ends[q] = q < Q ? rs[q].start + rs[q].n : 0;
        past = ends[q] - hi > past ? ends[q] - hi : past;
        ends[q] = ends[q] < hi ? ends[q] : hi;
    }
    const __m512i first16 = _mm512_loadu_si512(starts), last16 = _mm512_loadu_si512(ends);
    const key_rows src = *keys;
    const long stride = (long)G * LANES;
    __m512 top[LANE_HEADS], total[LANE_HEADS];   /* per head: each lane's largest score, then its weights' sum */
    for (int c = 0; c < G; c++) {
        top[c] = _mm512_set1_ps(-INFINITY);
        total[c] = _mm512_setzero_ps();
    }
    transpose_queries(qg, Q, G, D, qt);
    switch (D) {
    case 32: lane_scores512(qt, G, &src, lo, hi, 32, scale, st, first16, last16, top); break;
    case 64: lane_scores512(qt, G, &src, lo, hi, 64, scale, st, first16, last16, top); break;
    case 128: lane_scores512(qt, G, &src, lo, hi, 128, scale, st, first16, last16, top); break;
    default: lane_scores512(qt, G, &src, lo, hi, 256, scale, st, first16, last16, top); break;
    }
    /* each query's own keys: their scores and exponentials in own (Q * G, past), after st's (hi - lo) * stride (a
     * query's keys end by the widest's count, the room st was given for each of 16 queries), their max into its
     * lane's */
    float *own = st + (hi - lo) * stride;
    key_rows mine[LANES];
    for (int q = 0; past && q < Q; q++) {
        if (tile_of(rs + q, hi, past, mine + q) < 0) mine[q].n = 0;
        if (!mine[q].n) continue;
        scores(path, qg + q * G, G, mine + q, D, scale, own + (long)q * G * past, past, 0);
        for (int c = 0; c < G; c++) {
            float *w = own + ((long)q * G + c) * past, lanes[LANES];
            _mm512_storeu_ps(lanes, top[c]);
            const float most = row_max(path, w, mine[q].n);
            lanes[q] = most > lanes[q] ? most : lanes[q];
            top[c] = _mm512_loadu_ps(lanes);
            exp_shifted_(w, mine[q].n, lanes[q]);
        }
    }
    for (long r = 0; r < (long)Q * G * D; r++) acc[r] = 0.0f;
    /* value rows at once: (query, head) pairs in (q, c) order, as many as 24 accumulators hold (of a head's
     * halves, for 256) */
    const int width = D < 128 ? D : 128, per = 24 / (width / 16) < 12 ? 24 / (width / 16) : 12, rows = Q * G;
    for (int t0 = lo; t0 < hi; t0 += LANE_TILE) {
        const int t1 = hi - t0 < LANE_TILE ? hi : t0 + LANE_TILE;
        float *tile = st + (t0 - lo) * stride;
        for (int p = t0; p < t1; p++)
            for (int c = 0; c < G; c++) {
                float *w = st + (p - lo) * stride + c * LANES;
                _mm512_storeu_ps(w, _mm512_sub_ps(_mm512_loadu_ps(w), top[c]));
            }
        ni_exp_(tile, (t1 - t0) * stride);
        for (int p = t0; p < t1; p++) {
            const __mmask16 m = reading(first16, last16, p);
            for (int c = 0; c < G; c++)
                total[c] = _mm512_mask_add_ps(total[c], m, total[c], _mm512_loadu_ps(st + (p - lo) * stride + c * LANES));
        }
        for (int r0 = 0; r0 < rows; r0 += per) {
            const int R = rows - r0 < per ? rows - r0 : per;
            int lane[12], head[12], first[12], last[12];
            float *sums[12];
            for (int r = 0; r < R; r++) {
                lane[r] = (r0 + r) / G;
                head[r] = (r0 + r) % G;
                first[r] = starts[lane[r]];
                last[r] = ends[lane[r]];
                sums[r] = acc + (long)(r0 + r) * D;
            }
            values_rows512(st, stride, lo, &src, t0, t1, lane, head, first, last, R, R == per, D, sums);
        }
    }
    float lane_totals[LANES];
    for (int c = 0; c < G; c++) {
        _mm512_storeu_ps(lane_totals, total[c]);
        for (int q = 0; q < Q; q++) totals[q * G + c] = lane_totals[q];
    }
    for (int q = 0; past && q < Q; q++)
        if (mine[q].n) values(path, own + (long)q * G * past, past, mine + q, G, D, acc + (long)q * G * D, totals + q * G);
    finish(og, Q * G, G, rs, D, acc, totals);
}
#endif

#if NI_X86
/* Whether attend_lanes512 takes a block: AVX-512, from LANES_FROM queries (fewer leave most lanes idle), widths up
 * to 256 (whose values it sums in halves), at most LANE_HEADS heads per K/V head. */
enum { LANES_FROM = 4 };
static int lanes_take(const paths *path, int Q, int G, int D) {
    return path->simd == 2 && Q >= LANES_FROM && Q <= LANES && G <= LANE_HEADS &&
           (D == 32 || D == 64 || D == 128 || D == 256);
}

/* The keys that a block's Q queries read alike as one key_rows read by position (key_at(keys, p), p in [*lo, *hi):
 * from the first position some query reads up to the first block where their tables part or that none reads), or 0
 * where the queries do not read one row's keys, or share no block. The engine runs each token as a row of its own
 * with a copy of its request's table: a prefill chunk's tokens read one table, so every position is shared; decode
 * rows that share a prompt's blocks (n samples, a cached prefix) part at the first block each wrote for itself,
 * and attend_lanes512 reads the rest of each query's keys on its own. Through tables the block's table is merged
 * (into merged, room for a table's width) from each query's entries. */
static int block_keys(const key_rows *rs, int Q, int *merged, key_rows *keys, int *lo, int *hi) {
    *lo = *hi = 0;
    int any = 0;
    for (int q = 0; q < Q; q++) {
        const key_rows *r = rs + q;
        if (r->k != rs[0].k || r->v != rs[0].v || r->kt != rs[0].kt || r->vt != rs[0].vt || r->shift != rs[0].shift ||
            !r->table != !rs[0].table)
            return 0;
        if (r->n > 0) {
            *lo = any && *lo < r->start ? *lo : r->start;
            *hi = any && *hi > r->start + r->n ? *hi : r->start + r->n;
            any = 1;
        }
    }
    *keys = rs[0];
    keys->start = 0;
    if (!rs[0].table || !any) return 1;
    const int shift = rs[0].shift, first = *lo >> shift;
    int blocks = ((*hi - 1) >> shift) - first + 1;   /* then those shared: [first, first + blocks) */
    for (int b = 0; b < blocks; b++) merged[b] = -2;   /* no query's yet (a table holds blocks >= -1) */
    for (int q = 0; q < Q; q++)
        for (int b = rs[q].start >> shift; rs[q].n > 0 && b <= (rs[q].start + rs[q].n - 1) >> shift; b++) {
            int *entry = merged + b - first;
            if (*entry != -2 && *entry != rs[q].table[b] && b - first < blocks) blocks = b - first;
            if (*entry == -2) *entry = rs[q].table[b];
        }
    int read = 0;   /* the blocks before the first that no query reads */
    while (read < blocks && merged[read] != -2) read++;
    blocks = read;
    if (blocks == 0) return 0;
    *hi = (first + blocks) << shift < *hi ? (first + blocks) << shift : *hi;
    keys->table = merged;
    keys->start = -(first << shift);   /* position p at merged[(p >> shift) - first] */
    return 1;
}
#endif

/* The positions of a block's key tile: KEY_TILE on AVX-512; elsewhere as many as keep the tile's values, TILE_BYTES,
 * in L1 while each of the block's queries sums them (AVX2, one query's heads at a time: against 512 keys, AVX2-capped
 * Zen 4, 1 thread, 256 queries over 4,096 keys through tables, 0.91x the time for SmolLM2's heads of 64 at 64 keys,
 * 0.86x for Gemma 3's of 256 at 16). */
static int key_tile(const paths *path, int D) {
    const int keys = TILE_BYTES / (4 * D);
    return path->simd == 2 ? KEY_TILE : keys > 16 ? keys : 16;
}

/* Q queries of the G heads that share one K/V head, query q reading the keys of rs[q]; query q's head g is
 * qg[q * G + g] -> og[q * G + g]. Phase by phase, each over the keys tile by tile (one tile of every key for one
 * query): the scores into weights (Q * G, ws), each row's softmax weights, the weighted values into acc
 * (Q * G, D) and the weights' totals (Q * G), then out = acc / total. */
static void attend_queries(const paths *path, const float *const *qg, float *const *og, int Q, int G,
                           const key_rows *rs, int D, float scale, float *weights, long ws, float *acc,
                           float *totals, float *qt, int *merged) {
#if NI_X86
    key_rows keys;
    int first, last;
    if (lanes_take(path, Q, G, D) && block_keys(rs, Q, merged, &keys, &first, &last)) {
        attend_lanes512(path, qg, og, Q, G, rs, &keys, first, last, D, scale, qt, weights, acc, totals);
        return;
    }
#endif
    int lo = rs[0].start, hi = rs[0].start + rs[0].n;
    for (int q = 1; q < Q; q++) {
        lo = rs[q].start < lo ? rs[q].start : lo;
        hi = rs[q].start + rs[q].n > hi ? rs[q].start + rs[q].n : hi;
    }
    const int tile = Q > 1 ? key_tile(path, D) : (hi > lo ? hi - lo : 1);
    key_rows part;
    for (int from = lo; from < hi; from += tile)
        for (int q = 0; q < Q; q++) {
            const int j = tile_of(rs + q, from, tile, &part);
            if (j >= 0) scores(path, qg + q * G, G, &part, D, scale, weights + q * G * ws + j, ws, Q == 1);
        }
    for (int row = 0; row < Q * G; row++) {
        float *w = weights + row * ws;
        const int n = rs[row / G].n;
        exp_shifted_(w, n, row_max(path, w, n));
        totals[row] = 0.0f;
        for (int d = 0; d < D; d++) acc[row * D + d] = 0.0f;
    }
    for (int from = lo; from < hi; from += tile)
        for (int q = 0; q < Q; q++) {
            const int j = tile_of(rs + q, from, tile, &part);
            if (j >= 0) values(path, weights + q * G * ws + j, ws, &part, G, D, acc + q * G * D, totals + q * G);
        }
    finish(og, Q * G, G, rs, D, acc, totals);
}

/* One ni_attention call's operands, as each worker's range of items reads them: an item is a block of queries over
 * one K/V head, or (span > 1) one query over span K/V heads. */
typedef struct {
    const float *q, *k, *v;
    const ni_strides *qs, *ks, *vs, *os;
    float *out;
    const ni_key_spans *seen;
    int Hkv, Tq, D, G, span, spans, block;
    long queries, blocks, ws;
    float scale;
    paths path;
} attention_job;

/* The keys r of query `query` (flat (b, i)) over K/V head hk, and its G heads' query and output rows. */
static void query_rows(const attention_job *j, long query, int hk, key_rows *r, const float **qg, float **og) {
    const ni_key_spans *seen = j->seen;
    const ni_strides *qs = j->qs, *ks = j->ks, *vs = j->vs, *os = j->os;
    const int b = (int)(query / j->Tq), i = (int)(query % j->Tq), seen_to = seen->counts[query];
    const int start = seen->window && seen_to > seen->window ? seen_to - seen->window : 0;
    const int *table = seen->tables ? seen->tables + (long)b * seen->width : NULL;
    *r = (key_rows){j->k + b * ks->b + hk * ks->h, j->v + b * vs->b + hk * vs->h, ks->t, vs->t, seen_to - start,
                    start, seen->shift, table};
    for (int g = 0; g < j->G; g++) {
        qg[g] = j->q + b * qs->b + (long)(hk * j->G + g) * qs->h + i * qs->t;
        og[g] = j->out + b * os->b + (long)(hk * j->G + g) * os->h + i * os->t;
    }
}

/* Items [from, to) of the job. */
static void attend_items(void *ctx, long from, long to, int worker) {
    const attention_job *j = ctx;
    const ni_key_spans *seen = j->seen;
    const int G = j->G, D = j->D, span = j->span, block = j->block;
    const long ws = j->ws, rows = (long)G * span * block;   /* rows: (query, head) pairs */
    (void)worker;
    float *weights = malloc(sizeof(float) * (size_t)(rows * ws)), *totals = malloc(sizeof(float) * (size_t)rows);
    float *acc = malloc(sizeof(float) * (size_t)(rows * D));
    const float **qg = malloc(sizeof(float *) * (size_t)rows);
    float **og = malloc(sizeof(float *) * (size_t)rows);
    float *qt = malloc(sizeof(float) * (size_t)(G * D * LANES));
    int *merged = malloc(sizeof(int) * (size_t)(seen->width + 1));
    key_rows rs[QUERY_BLOCK > 4 ? QUERY_BLOCK : 4];   /* a block's queries, or a query's span <= 4 K/V heads */
    for (long item = from; item < to; item++) {
        /* blocks in the order 0, last, 1, last - 1, ...: a causal chunk's later queries read more keys, and so the
         * workers' equal shares of items are shares of near-equal work */
        const long nth = item / j->spans, first_query = (nth % 2 ? j->blocks - 1 - nth / 2 : nth / 2) * block;
        const int first = (int)(item % j->spans) * span, kv_heads = j->Hkv - first < span ? j->Hkv - first : span;
        const int Q = j->queries - first_query < block ? (int)(j->queries - first_query) : block;
        for (int qi = 0; qi < Q; qi++)
            for (int s = 0; s < kv_heads; s++) {   /* Q is 1 or kv_heads is 1 */
                const int row = qi + s;
                query_rows(j, first_query + qi, first + s, rs + row, qg + row * G, og + row * G);
            }
#if NI_X86
        if (span > 1) {
            for (int row = 0; row < kv_heads; row++) totals[row] = 0.0f;
            for (int d = 0; d < kv_heads * D; d++) acc[d] = 0.0f;
            attend_own512(qg, kv_heads, rs, j->scale, weights, ws, acc, totals);
            finish(og, kv_heads, 1, rs, D, acc, totals);
            continue;
        }
#endif
        attend_queries(&j->path, qg, og, Q, G, rs, D, j->scale, weights, ws, acc, totals, qt, merged);
    }
    free(weights);
    free(totals);
    free(acc);
    free(qg);
    free(og);
    free(qt);
    free(merged);
}

/* Decode: few queries, each K/V head's work split across the threads in two phases (each thread reads about its
 * share of every K/V head's keys and values, which come from memory: the weights streamed between layers evict
 * them). The bits are attend_queries': every score is its own dot; each (query, head) row's max, exponentials and
 * total are computed from the full row of scores, by whichever workers need them; each output element's weighted
 * sum is one chain in key order over the dimensions a worker takes.
 *   phase 1: items (K/V head, key chunk, query): the scores of the chunk's keys into weights (queries * H, ws),
 *     fetching the chunk's values meanwhile (half the values a worker reads next are then in its own cache);
 *   phase 2: items (query, K/V head, dimension part): the G rows' softmax weights in the worker's own (G, ws)
 *     (kept while its next items are the same (query, K/V head)), then the weighted values and totals of the
 *     part's dimensions (multiples of 16 from its start: every axpy's fused lanes and tail stay where they were)
 *     in the worker's (G, D) and (G), and out = acc / total for those dimensions. */
typedef struct {
    const attention_job *job;
    float *weights, *own;   /* the scores; each worker's scratch of own_floats */
    long own_floats;
    int chunks, parts;      /* of each (query, K/V head)'s keys in phase 1, of its dimensions in phase 2 */
} split_job;

/* The start of piece p of n split in `pieces`, a multiple of `align` (the last ends at n). */
static int piece_edge(int n, int p, int pieces, int align) {
    return p == pieces ? n : (int)((long)n * p / pieces) / align * align;
}

static void split_scores(void *ctx, long from, long to, int worker) {
    const split_job *s = ctx;
    const attention_job *j = s->job;
    const int G = j->G;
    const float *qg[G];
    float *og[G];
    (void)worker;
    for (long item = from; item < to; item++) {
        const long query = item % j->queries, kv_chunk = item / j->queries;
        const int chunk = (int)(kv_chunk % s->chunks), hk = (int)(kv_chunk / s->chunks);
        key_rows r;
        query_rows(j, query, hk, &r, qg, og);
        const int j0 = piece_edge(r.n, chunk, s->chunks, 8), j1 = piece_edge(r.n, chunk + 1, s->chunks, 8);
        key_rows part;
        if (tile_of(&r, r.start + j0, j1 - j0, &part) >= 0)
            scores(&j->path, qg, G, &part, j->D, j->scale, s->weights + (query * j->Hkv + hk) * G * j->ws + j0, j->ws, 1);
    }
}

static void split_values(void *ctx, long from, long to, int worker) {
    const split_job *s = ctx;
    const attention_job *j = s->job;
    const int G = j->G, D = j->D;
    const long ws = j->ws;
    float *w = s->own + worker * s->own_floats, *acc = w + G * ws, *totals = acc + (long)G * D;
    const float *qg[G];
    float *og[G];
    long held = -1;   /* the (query, K/V head) whose weights w holds */
    for (long item = from; item < to; item++) {
        const long pair = item / s->parts;
        const int part = (int)(item % s->parts), hk = (int)(pair % j->Hkv);
        key_rows r;
        query_rows(j, pair / j->Hkv, hk, &r, qg, og);
        if (pair != held) {
            for (int g = 0; g < G; g++) {
                const float *scored = s->weights + (pair * G + g) * ws;
                for (int k = 0; k < r.n; k++) w[g * ws + k] = scored[k];
                exp_shifted_(w + g * ws, r.n, row_max(&j->path, w + g * ws, r.n));
            }
            held = pair;
        }
        const int d0 = piece_edge(D, part, s->parts, 16), width = piece_edge(D, part + 1, s->parts, 16) - d0;
        for (int g = 0; g < G; g++) {
            totals[g] = 0.0f;
            og[g] += d0;
        }
        for (long d = 0; d < (long)G * width; d++) acc[d] = 0.0f;
        key_rows dims = r;
        dims.v += d0;
        values(&j->path, w, ws, &dims, G, width, acc, totals);
        finish(og, G, G, &r, width, acc, totals);
    }
}

static int gcd(long a, long b) {
    while (b) {
        const long t = a % b;
        a = b;
        b = t;
    }
    return (int)a;
}

/* The job's queries by split_job's phases on `threads` workers, each (query, K/V head)'s keys cut in `pieces`, and
 * its dimensions too (in fewer where pieces of 16 run out). */
static void attend_split(const attention_job *j, int threads, int pieces) {
    const long pairs = j->queries * j->Hkv, scored = pairs * j->G * j->ws;
    const int parts = pieces < j->D / 16 ? pieces : (j->D / 16 > 1 ? j->D / 16 : 1);   /* none narrower than 16 */
    split_job s = {j, NULL, NULL, (long)j->G * (j->ws + j->D + 1), pieces, parts};
    s.weights = malloc(sizeof(float) * (size_t)(scored + threads * s.own_floats));
    s.own = s.weights + scored;
    ni_parallel_for(pairs * pieces, threads, split_scores, &s);
    ni_parallel_for(pairs * parts, threads, split_values, &s);
    free(s.weights);
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
#elif NI_NEON
    if (ni_has_neon()) dot = ni_dot_neon, axpy = ni_axpy_neon;
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
    const int spans = (Hkv + span - 1) / span, block = span > 1 ? 1 : QUERY_BLOCK;
    const long queries = (long)B * Tq, blocks = (queries + block - 1) / block;
    attention_job job = {q, k, v, qs, ks, vs, os, out, seen, Hkv, Tq, D, G, span, spans, block, queries, blocks,
                         max_keys > 0 ? max_keys : 1, scale, {simd, dot, axpy}};
    /* Decode (one block of queries): attend_split where the items would leave a thread idle, or where they are fewer
     * than two per thread and the rows' one query each (pairs of a query and a K/V head) share out whole, two or
     * more per thread; a pair is cut in pieces only so few that their count is a multiple of the threads.
     * Measured on Zen 4 at 2 threads, keys and values from memory, against the items: Gemma 3 (one K/V head, so one
     * thread idle) 1 row 0.62-0.68x the time, 8 rows 0.59-0.62x, 1 row of 5 or 16 queries 0.70-0.89x; SmolLM2's 8
     * rows 0.76-0.80x, 3 rows 0.83-0.91x. Left on items: SmolLM2's 1 row (3 pairs, items 2:1), cut in halves,
     * 0.86-1.18x (no gain above the noise), and its row of 5 queries, 1.03-1.14x (items read a tile of keys and
     * values once for all the row's queries; the values phase reads them once per query). */
    const long pairs = queries * Hkv, items = blocks * spans;
    const int pieces = pairs >= 2L * threads ? 1 : threads / gcd(pairs, threads);
    if (threads > 1 && queries <= QUERY_BLOCK && (items < threads || (Tq == 1 && pieces == 1 && items < 2L * threads)))
        attend_split(&job, threads, pieces);
    else
        ni_parallel_for(blocks * spans, threads, attend_items, &job);
}
