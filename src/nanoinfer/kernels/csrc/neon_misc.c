/* The 8-lane reductions of attention.c and norm.c, and rope.c's rotation, on NEON (neon.h), with the portable
 * path's bits. */
#include "neon.h"

#if NI_NEON
#include <arm_neon.h>
#include <math.h>

float ni_dot_neon(const float *a, const float *b, int n) {
    float32x4_t lo = vdupq_n_f32(0.0f), hi = vdupq_n_f32(0.0f);   /* lanes 0-3, 4-7 */
    int d = 0;
    for (; d + 8 <= n; d += 8) {
        lo = vfmaq_f32(lo, vld1q_f32(a + d), vld1q_f32(b + d));
        hi = vfmaq_f32(hi, vld1q_f32(a + d + 4), vld1q_f32(b + d + 4));
    }
    const float32x4_t s = vaddq_f32(lo, hi);   /* 0+4, 1+5, 2+6, 3+7 */
    float sum = (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

float ni_sum_squares_neon(const float *x, int n) { return ni_dot_neon(x, x, n); }

float ni_centered_sum_neon(const float *x, int D, float c, int squares) {
    const float32x4_t cv = vdupq_n_f32(c);
    float32x4_t lo = vdupq_n_f32(0.0f), hi = vdupq_n_f32(0.0f);
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        const float32x4_t a = vsubq_f32(vld1q_f32(x + d), cv), b = vsubq_f32(vld1q_f32(x + d + 4), cv);
        lo = vaddq_f32(lo, squares ? vmulq_f32(a, a) : a);
        hi = vaddq_f32(hi, squares ? vmulq_f32(b, b) : b);
    }
    const float32x4_t s = vaddq_f32(lo, hi);
    float sum = (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
    for (; d < D; d++) sum += squares ? (x[d] - c) * (x[d] - c) : x[d] - c;
    return sum;
}

void ni_axpy_neon(float *acc, float p, const float *x, int n) {
    const int whole = n - n % 8;   /* fused up to here, as the portable path */
    const float32x4_t pv = vdupq_n_f32(p);
    int d = 0;
    for (; d < whole; d += 4) vst1q_f32(acc + d, vfmaq_f32(vld1q_f32(acc + d), pv, vld1q_f32(x + d)));
    for (; d < n; d++) acc[d] += p * x[d];
}

int ni_rope_neon(float *v, const float *cos, const float *sin, int half) {
    int i = 0;
    for (; i + 4 <= half; i += 4) {
        const float32x4_t x1 = vld1q_f32(v + i), x2 = vld1q_f32(v + i + half);
        const float32x4_t c = vld1q_f32(cos + i), s = vld1q_f32(sin + i);
        vst1q_f32(v + i, vsubq_f32(vmulq_f32(x1, c), vmulq_f32(x2, s)));
        vst1q_f32(v + i + half, vaddq_f32(vmulq_f32(x2, c), vmulq_f32(x1, s)));
    }
    return i;
}

float ni_max_neon(const float *s, long n, int *nan) {
    float32x4_t top = vdupq_n_f32(-INFINITY);
    uint32x4_t ordered = vdupq_n_u32(~0u);
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        const float32x4_t v = vld1q_f32(s + j);
        ordered = vandq_u32(ordered, vceqq_f32(v, v));
        top = vmaxnmq_f32(v, top);   /* maxNum: a NaN is skipped, as ni_max skips it */
    }
    float best = vmaxnmvq_f32(top);
    *nan = vminvq_u32(ordered) == 0;
    for (; j < n; j++) {
        *nan |= s[j] != s[j];
        best = s[j] > best ? s[j] : best;
    }
    return best;
}

long ni_first_equal_neon(const float *s, long n, float top) {
    const float32x4_t t = vdupq_n_f32(top);
    long j = 0;
    for (; j + 4 <= n; j += 4)
        if (vmaxvq_u32(vceqq_f32(vld1q_f32(s + j), t))) break;
    for (; j < n; j++)
        if (s[j] == top) return j;
    return 0;
}
#endif
