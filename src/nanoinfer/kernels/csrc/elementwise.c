/* Elementwise ops: exp, erf, the MLP activations, the residual add. Same bits on every instruction set.
 *
 * exp and erf are our own: each a fixed sequence of fma, multiply, add, divide and floor, every one exactly
 * rounded by IEEE 754, so the scalar functions and their AVX2 and NEON twins give the same bits for every input,
 * and the softmax, SiLU and GELU built on them are vectorized without depending on the CPU. The rest (ReLU^2, the
 * gating products, the residual add) is one operation per value, scalar C on every CPU: the compiler vectorizes
 * those loops itself, and a vector does each value's one rounding as the scalar does.
 * exp: Cephes' single-precision polynomial, within about 2 ulp on [-87.3, 88.7]; inputs are clamped to that range
 * (exp(-87.3) is 1.2e-38, not 0). erf: a rational approximation on [-4, 4] (the one Eigen and XLA use), about
 * 1e-7 from the true erf; past 4, erf is 1 in fp32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "neon.h"
#include "parallel.h"

#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504019f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f      /* ln 2 in two parts: n * LN2_HI is exact */
#define LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};

#define ERF_EDGE 4.0f
static const float ERF_NUM[7] = {-2.72614225801306e-10f, 2.77068142495902e-08f, -2.10102402082508e-06f,
                                 -5.69250639462346e-05f, -7.34990630326855e-04f, -2.95459980854025e-03f,
                                 -1.60960333262415e-02f};
static const float ERF_DEN[5] = {-1.45660718464996e-05f, -2.13374055278905e-04f, -1.68282697438203e-03f,
                                 -7.37332916720468e-03f, -1.42647390514189e-02f};

static float erf_scalar(float x) {
    x = x > ERF_EDGE ? ERF_EDGE : x < -ERF_EDGE ? -ERF_EDGE : x;
    const float x2 = x * x;
    float p = ERF_NUM[0], q = ERF_DEN[0];
    for (int i = 1; i < 7; i++) p = fmaf(p, x2, ERF_NUM[i]);
    for (int i = 1; i < 5; i++) q = fmaf(q, x2, ERF_DEN[i]);
    return x * p / q;
}

static float exp_scalar(float x) {
    x = x > EXP_HI ? EXP_HI : x < EXP_LO ? EXP_LO : x;
    const float n = floorf(fmaf(x, LOG2E, 0.5f));
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, EXP_POLY[i]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#if NI_X86
NI_AVX2 static __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), n), _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), n), _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

NI_AVX2 static __m256 erf_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-ERF_EDGE)), _mm256_set1_ps(ERF_EDGE));
    const __m256 x2 = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(ERF_NUM[0]), q = _mm256_set1_ps(ERF_DEN[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(ERF_NUM[i]));
    for (int i = 1; i < 5; i++) q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(ERF_DEN[i]));
    return _mm256_div_ps(_mm256_mul_ps(x, p), q);
}

/* GELU of n values: 0.5 u (1 + erf(u / sqrt 2)) */
NI_AVX2 static void gelu_avx2(const float *u, float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(u + i);
        const __m256 e = erf_avx2(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752440f)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v),
                                              _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    }
    for (; i < n; i++) y[i] = 0.5f * u[i] * (1.0f + erf_scalar(u[i] * 0.70710678118654752440f));
}

NI_AVX2 static void exp_avx2_(float *v, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp_avx2(_mm256_loadu_ps(v + i)));
    for (; i < n; i++) v[i] = exp_scalar(v[i]);
}
#endif

#if NI_NEON
#include <arm_neon.h>

/* exp_scalar on 4 lanes (vfmaq_f32(a, b, c) = fmaf(b, c, a)); a NaN stays NaN, as in exp_scalar. */
static float32x4_t exp_neon(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(EXP_LO)), vdupq_n_f32(EXP_HI));
    const float32x4_t n = vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(LOG2E)));
    const float32x4_t minus_n = vnegq_f32(n);
    float32x4_t r = vfmaq_f32(x, minus_n, vdupq_n_f32(LN2_HI));
    r = vfmaq_f32(r, minus_n, vdupq_n_f32(LN2_LO));
    float32x4_t p = vdupq_n_f32(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = vfmaq_f32(vdupq_n_f32(EXP_POLY[i]), p, r);
    const float32x4_t y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0f));
    const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(bits));
}

static float32x4_t erf_neon(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-ERF_EDGE)), vdupq_n_f32(ERF_EDGE));
    const float32x4_t x2 = vmulq_f32(x, x);
    float32x4_t p = vdupq_n_f32(ERF_NUM[0]), q = vdupq_n_f32(ERF_DEN[0]);
    for (int i = 1; i < 7; i++) p = vfmaq_f32(vdupq_n_f32(ERF_NUM[i]), p, x2);
    for (int i = 1; i < 5; i++) q = vfmaq_f32(vdupq_n_f32(ERF_DEN[i]), q, x2);
    return vdivq_f32(vmulq_f32(x, p), q);
}

static void gelu_neon(const float *u, float *y, int n) {
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = vld1q_f32(u + i);
        const float32x4_t e = erf_neon(vmulq_f32(v, vdupq_n_f32(0.70710678118654752440f)));
        vst1q_f32(y + i, vmulq_f32(vmulq_f32(vdupq_n_f32(0.5f), v), vaddq_f32(vdupq_n_f32(1.0f), e)));
    }
    for (; i < n; i++) y[i] = 0.5f * u[i] * (1.0f + erf_scalar(u[i] * 0.70710678118654752440f));
}

static void exp_neon_(float *v, long n) {
    long i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(v + i, exp_neon(vld1q_f32(v + i)));
    for (; i < n; i++) v[i] = exp_scalar(v[i]);
}
#endif

void ni_exp_(float *v, long n) {
#if NI_X86
    if (ni_has_avx2()) {   /* AVX-512 machines too: 8 lanes a vector, the same speed per value on the CPUs we met */
        exp_avx2_(v, n);
        return;
    }
#elif NI_NEON
    if (ni_has_neon()) {
        exp_neon_(v, n);
        return;
    }
#endif
    for (long i = 0; i < n; i++) v[i] = exp_scalar(v[i]);
}

/* One row of the activation: u is (2 hidden) for swiglu and geglu (gate then up), else (hidden). */
static void activation_row(int mlp, const float *u, float *y, int hidden) {
    if (mlp == NI_SWIGLU || mlp == NI_GEGLU) {   /* gate / (1 + exp(-z)) * up */
        const float *gate = u, *up = u + hidden;
        if (mlp == NI_SWIGLU)   /* silu(g) = g / (1 + exp(-g)) */
            for (int i = 0; i < hidden; i++) y[i] = -gate[i];
        else   /* GELU, tanh form: 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g / (1 + exp(-2 c (g + 0.044715 g^3))) */
            for (int i = 0; i < hidden; i++) {
                const float g = gate[i];
                y[i] = -1.5957691216057308f * (g + 0.044715f * (g * g * g));   /* 2 c = 2 sqrt(2 / pi) */
            }
        ni_exp_(y, hidden);
        for (int i = 0; i < hidden; i++) y[i] = gate[i] / (1.0f + y[i]) * up[i];
    } else if (mlp == NI_RELU2) {
        for (int i = 0; i < hidden; i++) {
            const float r = u[i] > 0.0f ? u[i] : 0.0f;
            y[i] = r * r;
        }
    } else {   /* GELU, erf form */
#if NI_X86
        if (ni_has_avx2()) {
            gelu_avx2(u, y, hidden);
            return;
        }
#elif NI_NEON
        if (ni_has_neon()) {
            gelu_neon(u, y, hidden);
            return;
        }
#endif
        for (int i = 0; i < hidden; i++) y[i] = 0.5f * u[i] * (1.0f + erf_scalar(u[i] * 0.70710678118654752440f));
    }
}

typedef struct {
    int mlp, hidden;
    const float *u;
    float *y;
} activation_job;

static void activation_rows(void *ctx, long first, long last, int worker) {
    const activation_job *j = ctx;
    const int u_width = j->mlp == NI_SWIGLU || j->mlp == NI_GEGLU ? 2 * j->hidden : j->hidden;
    (void)worker;
    for (long r = first; r < last; r++) activation_row(j->mlp, j->u + r * u_width, j->y + r * j->hidden, j->hidden);
}

void ni_activation(int mlp, const float *u, float *y, long rows, int hidden, int threads) {
    activation_job job = {mlp, hidden, u, y};
    ni_parallel_for(rows, rows * hidden >= 16384 ? threads : 1, activation_rows, &job);
}

void ni_add_(float *x, const float *y, long n) {
    for (long i = 0; i < n; i++) x[i] += y[i];
}
