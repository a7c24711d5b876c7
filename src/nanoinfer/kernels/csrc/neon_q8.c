/* The int8 activation tier on NEON (neon.h): matmul_q8.c's portable definition, its integer dots vectorized.
 *
 * Each chunk's integers come from matmul_q8.c's own decoder (q8_chunk_weights); isum_c = sum w_k t_k is exact on
 * any path, by SDOT (dotprod: the weights narrowed to int8, exact for every kind but Q6_K, whose folded scales
 * need int16) or by int16 widening multiplies; the fp32 epilogue is q8.h's q8_step, the one every path runs. The row
 * quantizer is q8.h's: each step one correctly rounded operation (vcvtnq rounds to nearest even, as nearbyintf
 * in the default mode), so the same bytes.
 */
#include "neon.h"

#if NI_NEON
#include <arm_neon.h>
#include <float.h>
#include <math.h>

#if defined(__APPLE__)
int ni_has_dotprod(void) { return 1; }   /* every Apple Silicon core (ARMv8.5-A and later) has it */
#else
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
int ni_has_dotprod(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }
#endif

/* SDOT in inline assembly (neon.h's NI_DOTPROD says why). */
NI_DOTPROD static inline int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    __asm__(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}

static inline int32_t isum_int16(const int16_t *w, const int8_t *t) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int j = 0; j < 32; j += 8) {
        const int16x8_t tv = vmovl_s8(vld1_s8(t + j)), wv = vld1q_s16(w + j);
        acc = vmlal_s16(acc, vget_low_s16(wv), vget_low_s16(tv));
        acc = vmlal_high_s16(acc, wv, tv);
    }
    return vaddvq_s32(acc);
}

NI_DOTPROD static inline int32_t isum_sdot(const int8_t *w, const int8_t *t) {
    const int32x4_t acc = sdot(sdot(vdupq_n_s32(0), vld1q_s8(w), vld1q_s8(t)), vld1q_s8(w + 16), vld1q_s8(t + 16));
    return vaddvq_s32(acc);
}

/* scratch: K int16, then K int8 (SDOT's copy), then 2 K / 32 floats */
NI_DOTPROD static void group(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M,
                             int K, float *y, long ys, void *scratch, int dots) {
    const int chunks = K / 32, with_min = q8_has_min(kind);
    int16_t *w = scratch;
    int8_t *w8 = (int8_t *)(w + K);
    float *a = (float *)(w8 + K), *b = a + chunks;
    for (int o = 0; o < C; o++) {
        for (int c = 0; c < chunks; c++) q8_chunk_weights(kind, w0 + o * row_bytes, c, w + 32 * c, a + c, b + c);
        if (dots)
            for (int k = 0; k < K; k += 8) vst1_s8(w8 + k, vmovn_s16(vld1q_s16(w + k)));
        for (int m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int c = 0; c < chunks; c++) {
                const long at = q8_at(M, m, c);
                const int8_t *t = xq->t + 32 * at;
                const int32_t isum = dots ? isum_sdot(w8 + 32 * c, t) : isum_int16(w + 32 * c, t);
                acc = q8_step(acc, isum, a[c], b[c], xq->d[at], xq->dsumt[at], with_min);
            }
            y[m * ys + o] = acc;
        }
    }
}

void ni_q8_group_neon(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M, int K,
                      float *y, long ys, void *scratch) {
    group(kind, w0, row_bytes, C, xq, M, K, y, ys, scratch, kind != NI_Q6_K && ni_has_dotprod());
}

void ni_q8_chunk_neon(const float *x, int8_t *t, float *d, int32_t *sumt, int32_t *sumt_lo) {
    float32x4_t v[8], amax = vdupq_n_f32(0.0f);
    uint32x4_t bad = vdupq_n_u32(0);
    for (int i = 0; i < 8; i++) {
        v[i] = vld1q_f32(x + 4 * i);
        const float32x4_t mag = vabsq_f32(v[i]);
        bad = vorrq_u32(bad, vmvnq_u32(vcleq_f32(mag, vdupq_n_f32(FLT_MAX))));   /* inf or NaN */
        amax = vmaxq_f32(amax, mag);   /* exact, any order; a NaN chunk is `bad` */
    }
    const float scale = vmaxvq_f32(amax) / 127.0f;
    const int finite = vmaxvq_u32(bad) == 0;
    if (!finite || scale == 0.0f) {
        for (int j = 0; j < 32; j++) t[j] = 0;
        *d = finite ? scale : NAN;
        *sumt = *sumt_lo = 0;
        return;
    }
    const float32x4_t s = vdupq_n_f32(scale);
    int32x4_t q[8];
    for (int i = 0; i < 8; i++)
        q[i] = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(vdivq_f32(v[i], s)), vdupq_n_s32(127)), vdupq_n_s32(-127));
    for (int i = 0; i < 8; i += 2) {
        const int16x8_t words = vcombine_s16(vmovn_s32(q[i]), vmovn_s32(q[i + 1]));
        vst1_s8(t + 4 * i, vmovn_s16(words));
    }
    const int32x4_t lo = vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3]));
    *sumt_lo = vaddvq_s32(lo);
    *sumt = vaddvq_s32(vaddq_s32(lo, vaddq_s32(vaddq_s32(q[4], q[5]), vaddq_s32(q[6], q[7]))));
    *d = scale;
}
#endif
