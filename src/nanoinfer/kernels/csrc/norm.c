/* RMSNorm of each row: y = x / sqrt(mean(x^2) + eps) (* w), the sum of squares in one fixed order per row
 * (8 lanes over the row, lanes summed as ni_hsum256 sums them, then the D % 8 tail), so a row's bits never depend
 * on how many rows share the call or on the thread count. */
#include <math.h>
#include <stddef.h>

#include "kernels.h"
#include "neon.h"
#include "parallel.h"

static float sum_squares_scalar(const float *x, int D) {
    float lanes[8] = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) lanes[l] = fmaf(x[d + l], x[d + l], lanes[l]);   /* as the AVX2 twin */
    float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (; d < D; d++) sum += x[d] * x[d];
    return sum;
}

#if NI_X86
NI_AVX2 static float sum_squares_avx2(const float *x, int D) {
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 v = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = ni_hsum256(acc);
    for (; d < D; d++) sum += x[d] * x[d];
    return sum;
}
#endif

/* One norm call's operands (b: LayerNorm's bias; sum_squares: RMSNorm's), as each worker's rows read them. */
typedef struct {
    const float *x, *w, *b;
    float *y;
    long xs, ys;
    int D;
    float eps;
    float (*sum_squares)(const float *, int);
} norm_job;

/* Rows under 64 run on one thread: too little work to share. */
static int norm_threads(int rows, int threads) { return rows >= 64 ? threads : 1; }

static void rmsnorm_rows(void *ctx, long first, long last, int worker) {
    const norm_job *j = ctx;
    const int D = j->D;
    (void)worker;
    for (long r = first; r < last; r++) {
        const float *xr = j->x + r * j->xs, *w = j->w;
        float *yr = j->y + r * j->ys;
        const float scale = 1.0f / sqrtf(j->sum_squares(xr, D) / (float)D + j->eps);
        if (w)
            for (int d = 0; d < D; d++) yr[d] = xr[d] * scale * w[d];
        else
            for (int d = 0; d < D; d++) yr[d] = xr[d] * scale;
    }
}

void ni_rmsnorm(const float *x, long xs, const float *w, float *y, long ys, int rows, int D, float eps, int threads) {
    norm_job job = {x, w, NULL, y, xs, ys, D, eps, sum_squares_scalar};
#if NI_X86
    if (ni_has_avx2()) job.sum_squares = sum_squares_avx2;
#elif NI_NEON
    if (ni_has_neon()) job.sum_squares = ni_sum_squares_neon;
#endif
    ni_parallel_for(rows, norm_threads(rows, threads), rmsnorm_rows, &job);
}

/* sum of (x - c)^2 or of x (squares = 0), in the 8-lane order of sum_squares_scalar */
static float centered_sum(const float *x, int D, float c, int squares) {
#if NI_NEON
    if (ni_has_neon()) return ni_centered_sum_neon(x, D, c, squares);
#endif
    float lanes[8] = {0};
    int d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) {
            const float v = x[d + l] - c;
            lanes[l] += squares ? v * v : v;
        }
    float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (; d < D; d++) sum += squares ? (x[d] - c) * (x[d] - c) : x[d] - c;
    return sum;
}

static void layernorm_rows(void *ctx, long first, long last, int worker) {
    const norm_job *j = ctx;
    const float *w = j->w, *b = j->b;
    const int D = j->D;
    (void)worker;
    for (long r = first; r < last; r++) {
        const float *xr = j->x + r * j->xs;
        float *yr = j->y + r * j->ys;
        const float mean = centered_sum(xr, D, 0.0f, 0) / (float)D;
        const float scale = 1.0f / sqrtf(centered_sum(xr, D, mean, 1) / (float)D + j->eps);
        for (int d = 0; d < D; d++) {
            const float v = (xr[d] - mean) * scale;
            yr[d] = w ? (b ? v * w[d] + b[d] : v * w[d]) : (b ? v + b[d] : v);
        }
    }
}

/* LayerNorm of each row: y = (x - mean) / sqrt(var + eps) (* w + b), mean and variance each in one fixed order. */
void ni_layernorm(const float *x, long xs, const float *w, const float *b, float *y, long ys, int rows, int D,
                  float eps, int threads) {
    norm_job job = {x, w, b, y, xs, ys, D, eps, NULL};
    ni_parallel_for(rows, norm_threads(rows, threads), layernorm_rows, &job);
}
