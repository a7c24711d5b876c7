/* The sampler's draw (sampling.py): one token per row by inverse CDF over softmax((s - best) / T), in float64
 * (fp32 scores are widened first, exactly: the tokens of their float64 copy).
 *
 * For each row, in this order: best = its largest score (-1 is the token of a row with none finite), t_j =
 * (s_j - best) / T (two IEEE operations, as torch's sub_ and div_ give them), w_j = exp(t_j) with our own exp,
 * the CDF of the w_j in a fixed order (draw_row), target = u times its total, and the token is the first j at
 * which the CDF exceeds target; if none does (u total rounded up to the total), the first j at which it reaches
 * the total, the last token with mass. softmax divides every w_j by the total; drawing at u total instead draws
 * from the same distribution without that pass.
 *
 * exp is a fixed sequence of fma, floor, add and multiply, each exactly rounded, so the portable function and its
 * AVX2 (AVX-512 machines run it too) and NEON twins give the same bits; within about 1 ulp of the true exp; exp(-inf) = 0
 * and results below the smallest double round to it or to 0. A row's token depends on nothing but that row:
 * threads split whole rows. The weights are the only vectorized part: the widening, the row's max (one pass of
 * compares) and the CDF's fixed-order segment sums (eight strided chains: a vector would only gather them) are
 * the same C on every CPU.
 *
 * Greedy rows need no draw: ni_row_best gives each row's largest score and the first index holding it, as torch's
 * amax and argmax give them (a NaN counts as the largest, so the first NaN), in one read of the row and a second
 * up to that index (torch's argmax over 32 rows of Gemma 3's 262,144 scores took 11 ms, 11% of a decode step).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "neon.h"
#include "parallel.h"

#define EXP_HI 709.7                     /* exp(709.7) is finite, 0.9 of the largest double */
#define EXP_LO -750.0                    /* exp(-750) rounds to 0 */
#define LOG2E 1.4426950408889634
#define LN2_HI 0.6931471803691238        /* ln 2 in two parts (Cody and Waite): n LN2_HI is exact for |n| < 2^21 */
#define LN2_LO 1.9082149292705877e-10
#define SEGMENTS 8                       /* the CDF's independent partial sums (draw_row) */
/* 1/k! for k = 12 down to 2: Taylor on |r| <= ln(2) / 2, whose first dropped term is below 2e-16 */
static const double EXP_POLY[11] = {2.08767569878680989792e-09, 2.50521083854417187751e-08,
                                    2.75573192239858906526e-07, 2.75573192239858906526e-06,
                                    2.48015873015873015873e-05, 1.98412698412698412698e-04,
                                    1.38888888888888888889e-03, 8.33333333333333333333e-03,
                                    4.16666666666666666667e-02, 1.66666666666666666667e-01, 0.5};

/* 2^k for an integer-valued k in [-1022, 1023]: its exponent bits */
static double pow2(double k) {
    const int64_t bits = (int64_t)(k + 1023.0) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

static double exp_scalar(double x) {
    x = x > EXP_HI ? EXP_HI : x < EXP_LO ? EXP_LO : x;   /* also -inf -> EXP_LO; NaN is never passed here */
    const double n = floor(fma(x, LOG2E, 0.5));
    double r = fma(-n, LN2_HI, x);
    r = fma(-n, LN2_LO, r);
    double p = EXP_POLY[0];
    for (int i = 1; i < 11; i++) p = fma(p, r, EXP_POLY[i]);
    const double y = fma(fma(p, r, 1.0), r, 1.0);
    const double half = floor(n * 0.5);   /* 2^n as 2^half 2^(n - half): each normal, down to n = -1082 */
    return y * pow2(half) * pow2(n - half);
}

#if NI_X86
NI_AVX2 static inline __m256d pow2_avx2(__m256d k) {   /* k + 1023 + 2^52 holds k + 1023 in its low bits */
    const __m256i bits = _mm256_castpd_si256(_mm256_add_pd(k, _mm256_set1_pd(1023.0 + 4503599627370496.0)));
    return _mm256_castsi256_pd(_mm256_slli_epi64(bits, 52));
}

NI_AVX2 static inline __m256d exp_avx2(__m256d x) {
    x = _mm256_min_pd(_mm256_max_pd(x, _mm256_set1_pd(EXP_LO)), _mm256_set1_pd(EXP_HI));
    const __m256d n = _mm256_floor_pd(_mm256_fmadd_pd(x, _mm256_set1_pd(LOG2E), _mm256_set1_pd(0.5)));
    const __m256d minus_n = _mm256_sub_pd(_mm256_setzero_pd(), n);
    __m256d r = _mm256_fmadd_pd(minus_n, _mm256_set1_pd(LN2_HI), x);
    r = _mm256_fmadd_pd(minus_n, _mm256_set1_pd(LN2_LO), r);
    __m256d p = _mm256_set1_pd(EXP_POLY[0]);
    for (int i = 1; i < 11; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(EXP_POLY[i]));
    const __m256d one = _mm256_set1_pd(1.0);
    const __m256d y = _mm256_fmadd_pd(_mm256_fmadd_pd(p, r, one), r, one);
    const __m256d half = _mm256_floor_pd(_mm256_mul_pd(n, _mm256_set1_pd(0.5)));
    return _mm256_mul_pd(_mm256_mul_pd(y, pow2_avx2(half)), pow2_avx2(_mm256_sub_pd(n, half)));
}

/* w[j] = exp((s[j] - best) / T) for j < n */
NI_AVX2 static void weights_avx2(const double *s, long n, double best, double temperature, double *w) {
    const __m256d b = _mm256_set1_pd(best), t = _mm256_set1_pd(temperature);
    long j = 0;
    for (; j + 4 <= n; j += 4)
        _mm256_storeu_pd(w + j, exp_avx2(_mm256_div_pd(_mm256_sub_pd(_mm256_loadu_pd(s + j), b), t)));
    for (; j < n; j++) w[j] = exp_scalar((s[j] - best) / temperature);
}
#endif

#if NI_NEON
#include <arm_neon.h>

/* exp_scalar on 2 lanes (vfmaq_f64(a, b, c) = fma(b, c, a)); 2^k from k + 1023 in the exponent bits, as pow2. */
static inline float64x2_t pow2_neon(float64x2_t k) {
    return vreinterpretq_f64_s64(vshlq_n_s64(vaddq_s64(vcvtq_s64_f64(k), vdupq_n_s64(1023)), 52));
}

static inline float64x2_t exp_neon(float64x2_t x) {
    x = vminq_f64(vmaxq_f64(x, vdupq_n_f64(EXP_LO)), vdupq_n_f64(EXP_HI));
    const float64x2_t n = vrndmq_f64(vfmaq_f64(vdupq_n_f64(0.5), x, vdupq_n_f64(LOG2E)));
    const float64x2_t minus_n = vnegq_f64(n);
    float64x2_t r = vfmaq_f64(x, minus_n, vdupq_n_f64(LN2_HI));
    r = vfmaq_f64(r, minus_n, vdupq_n_f64(LN2_LO));
    float64x2_t p = vdupq_n_f64(EXP_POLY[0]);
    for (int i = 1; i < 11; i++) p = vfmaq_f64(vdupq_n_f64(EXP_POLY[i]), p, r);
    const float64x2_t one = vdupq_n_f64(1.0);
    const float64x2_t y = vfmaq_f64(one, vfmaq_f64(one, p, r), r);
    const float64x2_t half = vrndmq_f64(vmulq_f64(n, vdupq_n_f64(0.5)));
    return vmulq_f64(vmulq_f64(y, pow2_neon(half)), pow2_neon(vsubq_f64(n, half)));
}

static void weights_neon(const double *s, long n, double best, double temperature, double *w) {
    const float64x2_t b = vdupq_n_f64(best), t = vdupq_n_f64(temperature);
    long j = 0;
    for (; j + 2 <= n; j += 2) vst1q_f64(w + j, exp_neon(vdivq_f64(vsubq_f64(vld1q_f64(s + j), b), t)));
    for (; j < n; j++) w[j] = exp_scalar((s[j] - best) / temperature);
}
#endif

void ni_draw_weights(const double *s, long n, double best, double temperature, double *w) {
#if NI_X86
    if (ni_has_avx2()) {   /* AVX-512 machines too: an 8-lane twin drew 32 rows 0.3 ms faster, 0.4% of a step */
        weights_avx2(s, n, best, temperature, w);
        return;
    }
#elif NI_NEON
    if (ni_has_neon()) {
        weights_neon(s, n, best, temperature, w);
        return;
    }
#endif
    for (long j = 0; j < n; j++) w[j] = exp_scalar((s[j] - best) / temperature);
}

/* The first j of segment s (w[s seg] up to the segment's end, or n) at which before + (the segment's weights up to
 * j, summed in j order) exceeds target (`strict`) or reaches it; -1 if none does. */
static long crossing(const double *w, long n, long seg, int s, double before, double target, int strict) {
    const long to = (s + 1) * seg < n ? (s + 1) * seg : n;
    double partial = 0.0;
    for (long j = s * seg; j < to; j++) {
        partial += w[j];
        const double at = before + partial;
        if (strict ? at > target : at >= target) return j;
    }
    return -1;
}

/* The CDF of w (n) at j in segment s (SEGMENTS contiguous segments of `seg` weights, the last one shorter) is
 * before[s] + segment s's weights up to j summed in j order, before[s] being the sums of segments 0..s-1 added in
 * order: a fixed order whose segment sums run as independent chains (one chain over the row took 3x as long),
 * reaching before[s + 1] at the end of segment s and the total at the end of the row. */
static long draw_row(const double *w, long n, double u) {
    const long seg = (n + SEGMENTS - 1) / SEGMENTS;
    double part[SEGMENTS] = {0}, before[SEGMENTS + 1] = {0};
    for (long i = 0; i < seg; i++)
        for (int s = 0; s < SEGMENTS; s++)
            if (s * seg + i < n) part[s] += w[s * seg + i];
    for (int s = 0; s < SEGMENTS; s++) before[s + 1] = before[s] + part[s];
    const double total = before[SEGMENTS], target = u * total;
    for (int s = 0; s < SEGMENTS; s++)   /* the first j past u total */
        if (before[s + 1] > target) return crossing(w, n, seg, s, before[s], target, 1);
    for (int s = 0; s < SEGMENTS; s++)   /* none: u total rounded up to the total; the first j that reaches it */
        if (before[s + 1] >= total) return crossing(w, n, seg, s, before[s], total, 0);
    return n - 1;   /* not reached: the CDF ends at the total */
}

/* The largest of s[0..n): any order finds the same value. */
static double row_max(const double *s, long n) {
    double top = -INFINITY;
    for (long j = 0; j < n; j++) top = s[j] > top ? s[j] : top;
    return top;
}

typedef struct {
    const void *scores;
    int f32, failed;   /* failed: some worker had no memory for its weights */
    long stride, n;
    const double *temperature, *u;
    long *out;
} draw_job;

/* Rows [first, last) of the draw. */
static void draw_range(void *ctx, long first, long last, int worker) {
    draw_job *job = ctx;
    const long n = job->n, stride = job->stride;
    long *out = job->out;
    double *w = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    (void)worker;
    if (!w) __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    for (long r = first; r < last; r++) {
        out[r] = -1;
        if (!w) continue;
        const double *s = (const double *)job->scores + r * stride;
        if (job->f32) {   /* fp32 scores widened exactly, then the weights computed over them in place */
            const float *row = (const float *)job->scores + r * stride;
            for (long j = 0; j < n; j++) w[j] = row[j];
            s = w;
        }
        const double best = row_max(s, n);
        if (best == -INFINITY) continue;
        ni_draw_weights(s, n, best, job->temperature[r], w);
        out[r] = draw_row(w, n, job->u[r]);
    }
    free(w);
}

int ni_draw_rows(const void *scores, int f32, long stride, long rows, long n, const double *temperature,
                 const double *u, long *out, int threads) {
    draw_job job = {scores, f32, 0, stride, n, temperature, u, out};
    ni_parallel_for(rows, rows > 1 ? threads : 1, draw_range, &job);
    return job.failed ? -1 : 0;
}

/* The first index of a NaN in s[0..n), -1 for none. */
static long first_nan(const float *s, long n) {
    for (long j = 0; j < n; j++)
        if (s[j] != s[j]) return j;
    return -1;
}

/* The first j with s[j] == top, top being in s[0..n). */
static long first_equal_scalar(const float *s, long n, float top) {
    for (long j = 0; j < n; j++)
        if (s[j] == top) return j;
    return 0;
}

#if NI_X86
NI_AVX2 float ni_max_avx2(const float *s, long n, int *nan) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(s + j);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(v, top);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    float best = ni_max(lanes, 8), rest = ni_max(s + j, n - j);
    *nan = _mm256_movemask_ps(unordered) != 0 || first_nan(s + j, n - j) >= 0;
    return rest > best ? rest : best;
}

/* first_equal_scalar, 8 at a time. */
NI_AVX2 static long first_equal_avx2(const float *s, long n, float top) {
    const __m256 t = _mm256_set1_ps(top);
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + j), t, _CMP_EQ_OQ));
        if (hits) return j + __builtin_ctz((unsigned)hits);
    }
    return j + first_equal_scalar(s + j, n - j, top);
}
#endif

typedef struct {
    const float *scores;
    long stride, n;
    float *best;
    long *index;
} best_job;

/* Rows [first, last) of ni_row_best. */
static void best_range(void *ctx, long first, long last, int worker) {
    const best_job *job = ctx;
    const long n = job->n;
    float *best = job->best;
    long *index = job->index;
    (void)worker;
    for (long r = first; r < last; r++) {
        const float *s = job->scores + r * job->stride;
        int nan = 0;
        float top;
#if NI_X86
        if (ni_has_avx2())
            top = ni_max_avx2(s, n, &nan);
        else
#elif NI_NEON
        if (ni_has_neon())
            top = ni_max_neon(s, n, &nan);
        else
#endif
        {
            nan = first_nan(s, n) >= 0;
            top = ni_max(s, n);
        }
        if (nan) {
            best[r] = NAN;
            index[r] = first_nan(s, n);
            continue;
        }
        best[r] = top;
#if NI_X86
        if (ni_has_avx2())
            index[r] = first_equal_avx2(s, n, top);
        else
#elif NI_NEON
        if (ni_has_neon())
            index[r] = ni_first_equal_neon(s, n, top);
        else
#endif
            index[r] = first_equal_scalar(s, n, top);
    }
}

void ni_row_best(const float *scores, long stride, long rows, long n, float *best, long *index, int threads) {
    best_job job = {scores, stride, n, best, index};
    ni_parallel_for(rows, rows > 1 ? threads : 1, best_range, &job);
}
