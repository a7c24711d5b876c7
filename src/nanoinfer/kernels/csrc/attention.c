/* Attention with a reduction order fixed by this code: softmax(q k^T * scale) v, one query at a time.
 *
 * Every (row b, head h, query i) is computed start to finish by one thread, in one order: the scores over keys
 * 0..n-1, their max, the exponentials summed in key order, then the weighted values summed in key order. Threads
 * split whole (b, h, i) items among themselves, so the bits of a query's output depend on nothing but its own
 * q, keys and values: not the thread count, the batch size, nor the row's place in the batch.
 *
 * Query i of row b sees the first key_counts[b * Tq + i] keys of its row (the cache stores keys so that what a
 * query may see is always a prefix of the slots). Heads share K/V heads in groups (GQA): head h reads kv head
 * h / (H / Hkv). Every tensor is addressed by (b, h, t) strides in floats; the last dimension is contiguous.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

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

void ni_attention(const float *q, const ni_strides *qs, const float *k, const ni_strides *ks, const float *v,
                  const ni_strides *vs, float *out, const ni_strides *os, const int *key_counts, int B, int H,
                  int Hkv, int Tq, int D, float scale, int threads) {
    dot_fn dot = dot_scalar;
    axpy_fn axpy = axpy_scalar;
#if NI_X86
    if (ni_has_avx2()) {
        dot = dot_avx2;
        axpy = axpy_avx2;
    }
#endif
    int max_keys = 0;
    for (long i = 0; i < (long)B * Tq; i++) max_keys = key_counts[i] > max_keys ? key_counts[i] : max_keys;
    const int group = H / Hkv;
    const long items = (long)B * H * Tq;
#pragma omp parallel num_threads(threads)
    {
        float *weights = malloc(sizeof(float) * (size_t)(max_keys > 0 ? max_keys : 1));
        float *acc = malloc(sizeof(float) * (size_t)D);
#pragma omp for schedule(static)
        for (long item = 0; item < items; item++) {
            const int i = (int)(item % Tq), h = (int)(item / Tq % H), b = (int)(item / Tq / H);
            const int n = key_counts[(long)b * Tq + i], hk = h / group;
            const float *qi = q + b * qs->b + h * qs->h + i * qs->t;
            const float *kb = k + b * ks->b + hk * ks->h;
            const float *vb = v + b * vs->b + hk * vs->h;
            float *oi = out + b * os->b + h * os->h + i * os->t;
            float top = -INFINITY;
            for (int j = 0; j < n; j++) {
                weights[j] = dot(qi, kb + j * ks->t, D) * scale;
                top = weights[j] > top ? weights[j] : top;
            }
            float total = 0.0f;
            for (int j = 0; j < n; j++) {
                weights[j] = expf(weights[j] - top);
                total += weights[j];
            }
            for (int d = 0; d < D; d++) acc[d] = 0.0f;
            for (int j = 0; j < n; j++) axpy(acc, weights[j], vb + j * vs->t, D);
            const float inv = n > 0 ? 1.0f / total : 0.0f;
            for (int d = 0; d < D; d++) oi[d] = acc[d] * inv;
        }
        free(weights);
        free(acc);
    }
}
