/* The int8 activation tier's activations: each row of x quantized by itself, per 32-input chunk, once per matmul
 * input (matmul_q8.c multiplies them with a packed matrix's integers).
 *
 * Chunk c of a row (inputs k = 32c .. 32c + 31), all in fp32:
 *   amax  max |x_k|;
 *   d     amax / 127 (one rounding);
 *   t_k   x_k / d rounded to nearest, ties to even, in [-127, 127] (|x_k| <= amax makes the quotient at most
 *         127 in magnitude once rounded; d = 0, which amax = 0 or an amax too small for amax / 127 to stay
 *         above 0 gives, makes every t_k 0);
 *   sumt  the sum of the chunk's t_k (an exact integer: the term of the kinds with a min), and sumt_lo that of
 *         its first 16 (Q6_K's offset per 16 weights, matmul_q8.c's interleaved tiles).
 * A chunk holding an inf or a NaN gets d = NaN and t = 0, so every output that reads it is NaN, never a silent
 * number. Each step is one correctly rounded operation (a division, not a multiplication by 127 / amax: no
 * overflow of that reciprocal for a tiny amax), so the portable and the AVX2 quantizers give the same bytes, and
 * a row's bytes depend on that row alone: batch invariant by construction.
 */
#ifndef NANOINFER_Q8_H
#define NANOINFER_Q8_H

#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* Whether a packed kind's blocks carry a min (the epilogue's b_c d_c sumt_c term). */
static inline int q8_has_min(int kind) {
    return kind == NI_Q4_1 || kind == NI_Q5_1 || kind == NI_Q4_K || kind == NI_Q5_K;
}

/* One step of the fixed-order epilogue (matmul_q8.c's portable definition, and every path's): chunk (isum, a, b)
 * of an output on a row's chunk (d, dsumt: ni_q8_rows). */
static inline float q8_step(float acc, int32_t isum, float a, float b, float d, float dsumt, int with_min) {
    acc = fmaf((float)isum, a * d, acc);
    return with_min ? fmaf(b, dsumt, acc) : acc;
}

/* M quantized rows of K inputs, chunk-major: chunk c of row m is entry q8_at(M, m, c) = c M + m, its 32 t at
 * t + 32 q8_at(..), its d, sumt and sumt_lo at d[q8_at(..)], ... A chunk's rows sit side by side, so the rows that
 * one decoded chunk of weights serves (q8_tile, q8_panel_rows) are a constant stride apart, one pointer for all. */
static inline long q8_at(int M, int m, int c) { return (long)c * M + m; }

/* A matmul's quantized rows: t, d, sumt and sumt_lo as above, and dsumt = d * (float) sumt rounded to fp32, the
 * factor of the min's term in the epilogue (q8_step), made once per chunk (matmul.c's quantize_rows), not per
 * output: a broadcast load in the vector paths where it was a conversion, a product and a broadcast. */
typedef struct {
    const int8_t *t;
    const float *d, *dsumt;
    const int32_t *sumt, *sumt_lo;
} ni_q8_rows;

static inline void q8_chunk_scalar(const float *x, int8_t *t, float *d, int32_t *sumt, int32_t *sumt_lo) {
    float amax = 0.0f;
    int finite = 1;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(x[j]);
        finite &= a <= FLT_MAX;   /* false for inf and NaN */
        amax = a > amax ? a : amax;
    }
    const float scale = amax / 127.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; j++) {
        const float q = finite && scale != 0.0f ? nearbyintf(x[j] / scale) : 0.0f;
        t[j] = (int8_t)(q > 127.0f ? 127 : q < -127.0f ? -127 : (int)q);
        sum += t[j];
        if (j == 15) *sumt_lo = sum;
    }
    *d = finite ? scale : NAN;
    *sumt = sum;
}

#if NI_X86
/* The sum of the 8 int32 lanes of v. */
NI_AVX2 static inline int32_t q8_hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
}

NI_AVX2 static inline void q8_chunk_avx2(const float *x, int8_t *t, float *d, int32_t *sumt, int32_t *sumt_lo) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int a = 0; a < 4; a++) {
        v[a] = _mm256_loadu_ps(x + 8 * a);
        const __m256 mag = _mm256_andnot_ps(sign, v[a]);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(mag, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
        amax = _mm256_max_ps(amax, mag);   /* exact, any order, with no NaN (a NaN chunk is `bad`) */
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float scale = top / 127.0f;
    if (_mm256_movemask_ps(bad) || scale == 0.0f) {
        for (int j = 0; j < 32; j++) t[j] = 0;
        *d = _mm256_movemask_ps(bad) ? NAN : scale;
        *sumt = *sumt_lo = 0;
        return;
    }
    const __m256 s = _mm256_set1_ps(scale);
    __m256i q[4];
    for (int a = 0; a < 4; a++) {   /* cvtps rounds to nearest even (the default MXCSR mode, as nearbyintf) */
        q[a] = _mm256_cvtps_epi32(_mm256_div_ps(v[a], s));
        q[a] = _mm256_max_epi32(_mm256_min_epi32(q[a], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    }
    const __m256i lo = _mm256_add_epi32(q[0], q[1]);
    /* int32 -> int8 in order: packs keep each 128-bit lane's order, the permute puts the lanes back */
    const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)t, bytes);
    *d = scale;
    *sumt_lo = q8_hsum_epi32(lo);
    *sumt = q8_hsum_epi32(_mm256_add_epi32(lo, _mm256_add_epi32(q[2], q[3])));
}
#endif

/* One chunk's quantization (q8_chunk_scalar, q8_chunk_avx2, NEON's ni_q8_chunk_neon: the same bytes), as
 * ni_matmul_q8 picks it once for every chunk of its rows. */
typedef void (*q8_chunk_fn)(const float *x, int8_t *t, float *d, int32_t *sumt, int32_t *sumt_lo);

/* Outputs w0, w0 + row_bytes, ... (C <= Q8_WIDE_GROUP of them, `kind` blocks) for rows xq (M, K) into y (row
 * stride ys) in the int8 tier's order (matmul_q8.c); scratch: q8_scratch_bytes(K), 64-byte aligned (2 K + 8 K / 32
 * for the portable path, a panel of 768 per 32 inputs for the x86 panels). Threads split the outputs in groups of
 * Q8_GROUP up to Q8_FEW_ROWS rows, of Q8_WIDE_GROUP beyond: on x86 16, the lanes of VNNI's panels (two tiles or
 * panel halves of 8 on AVX2). Batch 1 keeps 8: matmul.c prefetches a fixed distance ahead of a group's start,
 * inside a group of 16 (SmolLM2's Q8_0 head at batch 1, 1 thread, AMD EPYC Zen 4: 2.25 -> 3.19 ms with 16). */
#define Q8_GROUP 8
#define Q8_FEW_ROWS 2
#if NI_NEON
#define Q8_WIDE_GROUP 8
#else
#define Q8_WIDE_GROUP 16
#endif
static inline long q8_scratch_bytes(int K) { return 768L * (K / 32); }

/* Up to Q8_FEW_ROWS rows the x86 tiles fetch W themselves, spread over the work: with each chunk, the bytes
 * Q8_AHEAD further on in each of its outputs' rows, a cache line at a time (q8_tile). matmul.c's fetch of a
 * whole span at each group's start, which other paths keep, left one thread streaming about half what a thread
 * reads alone (AMD EPYC Zen 4, 2 threads, batch-1 decode: SmolLM2 Q4_1 and Q4_K_M 25-30% more tok/s; 12 to 24
 * KiB measured alike). */
#define Q8_AHEAD 16384
static inline int q8_fetches_itself(int M, int simd) { return NI_X86 && simd && M <= Q8_FEW_ROWS; }
void ni_q8_group(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M, int K, float *y,
                 long ys, void *scratch);

#endif
