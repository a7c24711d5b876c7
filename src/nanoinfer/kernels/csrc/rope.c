/* RoPE in place, half-split pairs (x[i], x[i + D/2]) rotated by the angle of (token, i):
 *   x[i] <- x[i] cos - x[i + D/2] sin,   x[i + D/2] <- x[i + D/2] cos + x[i] sin
 * each product rounded, then the difference or sum (no fused multiply-add: this file builds with fp-contract off),
 * which is what the torch twin computes, so both give the same bits. One call rotates every head of q and k.
 */
#include "kernels.h"
#include "parallel.h"

typedef struct {
    float *x;
    const ni_strides *xs;
    const float *cos, *sin;
    int T, heads, D;
} rope_job;

/* Items (b, t, h) [first, last) of the job. */
static void rope_items(void *ctx, long first, long last, int worker) {
    const rope_job *j = ctx;
    float *x = j->x;
    const ni_strides *xs = j->xs;
    const float *cos = j->cos, *sin = j->sin;
    const int T = j->T, heads = j->heads, half = j->D / 2;
    (void)worker;
    for (long item = first; item < last; item++) {
        const int h = (int)(item % heads), t = (int)(item / heads % T), b = (int)(item / heads / T);
        float *v = x + b * xs->b + t * xs->t + h * xs->h;
        const float *c = cos + ((long)b * T + t) * half, *s = sin + ((long)b * T + t) * half;
        for (int i = 0; i < half; i++) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] - x2 * s[i];
            v[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

void ni_rope(float *x, const ni_strides *xs, const float *cos, const float *sin, int B, int T, int heads, int D,
             int threads) {
    const long items = (long)B * T * heads;
    rope_job job = {x, xs, cos, sin, T, heads, D};
    ni_parallel_for(items, items > 4096 ? threads : 1, rope_items, &job);
}
