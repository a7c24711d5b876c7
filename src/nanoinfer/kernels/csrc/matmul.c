/* y (M, N) = x (M, K) W^T (+ bias) with fp32 activations and W kept as stored: fp32, or GGUF's Q8_0, Q4_0 and
 * Q4_1 blocks (32 weights each), never expanded to an fp32 matrix.
 *
 * Each output y[m, n] is reduced by one thread in one order fixed by this code:
 *   fp32 W:   acc (8 lanes) takes one FMA per 8 weights in k order; y = lanes summed in a fixed order, then a
 *             K % 8 tail added one by one.
 *   packed W: a block holds quants q (Q8_0: int8, Q4_x: 0..15), a scale d and an offset m (Q4_1: its min,
 *             Q4_0: -8d, Q8_0: none), so w = d q + m. Per block, t = q0 x0 (8 lanes) then t += q1 x1, q2 x2, q3 x3
 *             by FMA, and acc = fma(d, t, acc); y = lanes of acc summed in the fixed order + sum_b m_b s_b, where
 *             s_b is the block's sum of x (summed in a fixed order, once per row per call) and the m-terms are
 *             added in block order. One FMA per 8 weights and one per block: the offset never touches a weight.
 * Work is cut into register tiles of a few rows x a few outputs, each (m, n) with its own accumulators, so the
 * tile shape changes speed, never the sequence of operations any one output sees: y[m, :] has the same bits
 * whatever M is and whatever the thread count. That is batch invariance by construction, with no padding.
 * Threads split the outputs in contiguous groups; all M rows share each read of W.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define GROUP 4    /* outputs per group: the unit threads split */
#define ROWS 2     /* rows per register tile when M > 1 */
#define FEW_ROWS 16  /* up to this many rows, AVX-512 decodes each block in registers, not to memory */

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal half: normalize */
        int e = -1;
        uint32_t m = mant;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float read_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

static long block_bytes(int kind) { return kind == NI_Q8_0 ? 34 : kind == NI_Q4_1 ? 20 : 18; }

long ni_row_bytes(int kind, int K) {
    switch (kind) {
    case NI_F32: return 4L * K;
    case NI_Q8_0: case NI_Q4_0: case NI_Q4_1: return K / 32 * block_bytes(kind);
    default: return -1;
    }
}

/* One block's quants as floats, its scale and its offset (w = d q + m). */
static void unpack_block_scalar(int kind, const uint8_t *blk, float q[32], float *d, float *m) {
    *d = read_half(blk);
    if (kind == NI_Q8_0) {
        *m = 0.0f;
        for (int j = 0; j < 32; j++) q[j] = (float)(int8_t)blk[2 + j];
        return;
    }
    const uint8_t *nibbles = blk + (kind == NI_Q4_1 ? 4 : 2);
    *m = kind == NI_Q4_1 ? read_half(blk + 2) : -8.0f * *d;
    for (int j = 0; j < 16; j++) {
        q[j] = (float)(nibbles[j] & 0x0F);
        q[j + 16] = (float)(nibbles[j] >> 4);
    }
}

/* The fixed lane order of every 8-lane sum here: ((0+4)+(2+6)) + ((1+5)+(3+7)), as ni_hsum256. */
static float hsum8(const float v[8]) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* s_b for each block of one row: the four 8-lane quarters added ((X0 + X1) + (X2 + X3)) lanewise, then hsum8. */
static void block_sums_scalar(const float *x, int K, float *sums) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        float v[8];
        for (int l = 0; l < 8; l++) v[l] = (xb[l] + xb[8 + l]) + (xb[16 + l] + xb[24 + l]);
        sums[b] = hsum8(v);
    }
}

/* The m-terms of one output, in block order. */
static float offsets_dot(const uint8_t *row, int kind, const float *sums, int K) {
    float total = 0.0f;
    if (kind == NI_Q8_0) return total;
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = row + block_bytes(kind) * b;
        const float m = kind == NI_Q4_1 ? read_half(blk + 2) : -8.0f * read_half(blk);
        total += m * sums[b];
    }
    return total;
}

/* ---- the portable path: one output at a time --------------------------------------------------------- */
static float output_scalar(int kind, const uint8_t *row, const float *x, const float *sums, int K) {
    float acc[8] = {0};
    int k = 0;
    if (kind == NI_F32) {
        const float *w = (const float *)row;
        for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; l++) acc[l] += w[k + l] * x[k + l];
        float y = hsum8(acc);
        for (; k < K; k++) y += w[k] * x[k];
        return y;
    }
    for (int b = 0; b < K / 32; b++) {
        float q[32], d, m, t[8];
        unpack_block_scalar(kind, row + block_bytes(kind) * b, q, &d, &m);
        const float *xb = x + 32 * b;
        for (int l = 0; l < 8; l++) t[l] = q[l] * xb[l];
        for (int a = 1; a < 4; a++)
            for (int l = 0; l < 8; l++) t[l] += q[8 * a + l] * xb[8 * a + l];
        for (int l = 0; l < 8; l++) acc[l] += d * t[l];
    }
    return hsum8(acc) + offsets_dot(row, kind, sums, K);
}

#if NI_X86
NI_AVX2 static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* A block's 32 quants as four vectors of 8 floats (the values unpack_block_scalar gives). */
NI_AVX2 static inline __attribute__((always_inline)) void quants_avx2(int kind, const uint8_t *blk, __m256 q[4]) {
    if (kind == NI_Q8_0) {
        for (int a = 0; a < 4; a++)
            q[a] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * a))));
        return;
    }
    /* bytes j and j + 8 as dwords; element j is byte j's low nibble, element j + 16 its high nibble */
    const uint8_t *nibbles = blk + (kind == NI_Q4_1 ? 4 : 2);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)nibbles));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nibbles + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
}

NI_AVX2 static void block_sums_avx2(const float *x, int K, float *sums) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        sums[b] = ni_hsum256(v);
    }
}

/* fp32 W: an R x C tile of outputs, acc[r][c] one FMA per 8 weights in k order. R, C are constants at each call
 * site, so the accumulators stay in registers. */
NI_AVX2 static inline __attribute__((always_inline)) void f32_tile(const float *const *w, const float *x, long xs,
                                                                  int K, float *y, long ys, const int R, const int C) {
    __m256 acc[ROWS][2 * GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * xs + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[c] + k), xv, acc[r][c]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float sum = ni_hsum256(acc[r][c]);
            for (int t = k; t < K; t++) sum += w[c][t] * x[r * xs + t];
            y[r * ys + c] = sum;
        }
}

/* Packed W: an R x C tile over quants already unpacked to floats (q rows of K, d per block). Per block and output:
 * t = q0 x0, t += q1 x1 .. q3 x3, acc = fma(d, t, acc), exactly as output_scalar orders it. */
NI_AVX2 static inline __attribute__((always_inline)) void packed_tile(const float *const *q, const float *const *d,
                                                                     const float *x, long xs, int K, float *y, long ys,
                                                                     const int R, const int C) {
    __m256 acc[ROWS][GROUP], t[ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const int k = 32 * b;
        for (int c = 0; c < C; c++) {
            const __m256 qv = _mm256_loadu_ps(q[c] + k);
            for (int r = 0; r < R; r++) t[r][c] = _mm256_mul_ps(qv, _mm256_loadu_ps(x + r * xs + k));
        }
        for (int a = 1; a < 4; a++)
            for (int c = 0; c < C; c++) {
                const __m256 qv = _mm256_loadu_ps(q[c] + k + 8 * a);
                for (int r = 0; r < R; r++) t[r][c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(x + r * xs + k + 8 * a), t[r][c]);
            }
        for (int c = 0; c < C; c++) {
            const __m256 dv = _mm256_set1_ps(d[c][b]);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(dv, t[r][c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ys + c] = ni_hsum256(acc[r][c]);
}

/* A lone row against one output group of packed W, each block unpacked in registers and used at once. */
NI_AVX2 static void packed_gemv(int kind, const uint8_t *const *rows, int C, const float *const *d, const float *x,
                                int K, float *y) {
    const long bb = block_bytes(kind);
    __m256 acc[GROUP];
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = rows[c] + bb * b;
            __m256 q[4];
            quants_avx2(kind, blk, q);
            __m256 t = _mm256_mul_ps(q[0], x0);
            t = _mm256_fmadd_ps(q[1], x1, t);
            t = _mm256_fmadd_ps(q[2], x2, t);
            t = _mm256_fmadd_ps(q[3], x3, t);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d[c][b]), t, acc[c]);
        }
    }
    for (int c = 0; c < C; c++) y[c] = ni_hsum256(acc[c]);
}

#define DISPATCH_RC(CALL_R, CALL_C, STMT)                                                                          \
    switch (CALL_R * 16 + CALL_C) {                                                                                \
    case 16 + 1: { const int R = 1, C = 1; STMT; } break;                                                          \
    case 16 + 2: { const int R = 1, C = 2; STMT; } break;                                                          \
    case 16 + 3: { const int R = 1, C = 3; STMT; } break;                                                          \
    case 16 + 4: { const int R = 1, C = 4; STMT; } break;                                                          \
    case 32 + 1: { const int R = 2, C = 1; STMT; } break;                                                          \
    case 32 + 2: { const int R = 2, C = 2; STMT; } break;                                                          \
    case 32 + 3: { const int R = 2, C = 3; STMT; } break;                                                          \
    case 32 + 4: { const int R = 2, C = 4; STMT; } break;                                                          \
    }

/* ---- AVX-512: the same per-output sequence over 16-lane vectors (used for packed W where the CPU has it) ---- */
NI_AVX512 static inline float hsum512(__m512 v) {   /* halves added lanewise, then ni_hsum256's order */
    return ni_hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

/* A block's quants as two vectors of 16 floats: elements 0..15 and 16..31. */
NI_AVX512 static inline __attribute__((always_inline)) void quants512(int kind, const uint8_t *blk, __m512 q[2]) {
    if (kind == NI_Q8_0) {
        q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
        q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
        return;
    }
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (kind == NI_Q4_1 ? 4 : 2))));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));   /* low nibbles: 0..15 */
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));                          /* high nibbles: 16..31 */
}

NI_AVX512 static inline __attribute__((always_inline)) void packed_tile512(const float *const *q, const float *const *d,
                                                                          const float *x, long xs, int K, float *y,
                                                                          long ys, const int R, const int C) {
    __m512 acc[ROWS][GROUP], t[ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        const int k = 32 * b;
        for (int c = 0; c < C; c++) {
            const __m512 qv = _mm512_loadu_ps(q[c] + k);
            for (int r = 0; r < R; r++) t[r][c] = _mm512_mul_ps(qv, _mm512_loadu_ps(x + r * xs + k));
        }
        for (int c = 0; c < C; c++) {
            const __m512 qv = _mm512_loadu_ps(q[c] + k + 16);
            for (int r = 0; r < R; r++) t[r][c] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(x + r * xs + k + 16), t[r][c]);
        }
        for (int c = 0; c < C; c++) {
            const __m512 dv = _mm512_set1_ps(d[c][b]);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(dv, t[r][c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ys + c] = hsum512(acc[r][c]);
}

/* A few rows (R <= 4) against C <= GROUP rows of packed W, each block decoded in registers once and used by every
 * row: the sequence per output of packed_tile512, without unpacking quants to memory. */
NI_AVX512 static inline __attribute__((always_inline)) void packed_few_rows512(int kind, const uint8_t *const *rows,
                                                                              const float *const *d, const float *x,
                                                                              long xs, int K, float *y, long ys,
                                                                              const int R, int C) {
    const long bb = block_bytes(kind);
    __m512 acc[4][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        __m512 x0[4], x1[4];
        for (int r = 0; r < R; r++) {
            x0[r] = _mm512_loadu_ps(x + r * xs + 32 * b);
            x1[r] = _mm512_loadu_ps(x + r * xs + 32 * b + 16);
        }
        for (int c = 0; c < C; c++) {
            __m512 q[2];
            quants512(kind, rows[c] + bb * b, q);
            const __m512 dv = _mm512_set1_ps(d[c][b]);
            for (int r = 0; r < R; r++)
                acc[r][c] = _mm512_fmadd_ps(dv, _mm512_fmadd_ps(q[1], x1[r], _mm512_mul_ps(q[0], x0[r])), acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ys + c] = hsum512(acc[r][c]);
}

NI_AVX512 static void packed_rows_in_registers512(int kind, const uint8_t *const *rows, int C, const float *const *d,
                                                  const float *x, long xs, int M, int K, float *y, long ys) {
    for (int m = 0; m < M; m += 4) {
        switch (M - m < 4 ? M - m : 4) {
        case 1: packed_few_rows512(kind, rows, d, x + m * xs, xs, K, y + m * ys, ys, 1, C); break;
        case 2: packed_few_rows512(kind, rows, d, x + m * xs, xs, K, y + m * ys, ys, 2, C); break;
        case 3: packed_few_rows512(kind, rows, d, x + m * xs, xs, K, y + m * ys, ys, 3, C); break;
        default: packed_few_rows512(kind, rows, d, x + m * xs, xs, K, y + m * ys, ys, 4, C); break;
        }
    }
}

NI_AVX512 static void packed_rows512(const float *const *q, const float *const *d, int C, const float *x, long xs,
                                     int M, int K, float *y, long ys) {
    for (int m = 0; m < M; m += ROWS) {
        const int r = M - m < ROWS ? M - m : ROWS;
        DISPATCH_RC(r, C, packed_tile512(q, d, x + m * xs, xs, K, y + m * ys, ys, R, C))
    }
}

/* The m-terms of C outputs for all M rows: y[m, c] += sum_b off[c][b] * s_b(m), in block order, each term rounded
 * as a product and then added (no FMA), so eight rows side by side in a vector get exactly the scalar sums.
 * sums_t is block-major: s_b(m) at [b * M + m]. */
NI_AVX2 static void add_offsets(const float *const *off, int C, const float *sums_t, int M, int blocks, float *y,
                                long ys) {
    for (int c = 0; c < C; c++) {
        int m = 0;
        for (; m + 8 <= M; m += 8) {
            __m256 total = _mm256_setzero_ps();
            for (int b = 0; b < blocks; b++)
                total = _mm256_add_ps(total, _mm256_mul_ps(_mm256_set1_ps(off[c][b]),
                                                           _mm256_loadu_ps(sums_t + (long)b * M + m)));
            float lanes[8];
            _mm256_storeu_ps(lanes, total);
            for (int l = 0; l < 8; l++) y[(m + l) * ys + c] += lanes[l];
        }
        for (; m < M; m++) {
            float total = 0.0f;
            for (int b = 0; b < blocks; b++) total += off[c][b] * sums_t[(long)b * M + m];
            y[m * ys + c] += total;
        }
    }
}

/* One output group (C <= GROUP rows of W) against all M rows. `qbuf`, `dbuf`, `obuf`: per-thread scratch for the
 * group's unpacked quants, scales and offsets. */
NI_AVX2 static void group_avx2(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                               float *y, long ys, const float *sums_t, float *qbuf, float *dbuf, float *obuf,
                               int wide) {
    if (kind == NI_F32) {
        const float *w[GROUP];
        for (int c = 0; c < C; c++) w[c] = (const float *)rows[c];
        for (int m = 0; m < M; m += ROWS) {
            const int r = M - m < ROWS ? M - m : ROWS;
            DISPATCH_RC(r, C, f32_tile(w, x + m * xs, xs, K, y + m * ys, ys, R, C))
        }
        return;
    }
    const int blocks = K / 32;
    const long bb = block_bytes(kind);
    const float *q[GROUP], *d[GROUP], *off[GROUP];
    for (int c = 0; c < C; c++) {
        float *dc = dbuf + (long)c * blocks, *oc = obuf + (long)c * blocks;
        for (int b = 0; b < blocks; b++) {
            const uint8_t *blk = rows[c] + bb * b;
            dc[b] = half_f16c(blk);
            oc[b] = kind == NI_Q4_1 ? half_f16c(blk + 2) : -8.0f * dc[b];
        }
        d[c] = dc;
        off[c] = oc;
    }
    if (wide && M <= FEW_ROWS) {
        packed_rows_in_registers512(kind, rows, C, d, x, xs, M, K, y, ys);
    } else if (M == 1) {
        packed_gemv(kind, rows, C, d, x, K, y);
    } else {
        for (int c = 0; c < C; c++) {
            float *qc = qbuf + (long)c * K;
            for (int b = 0; b < blocks; b++) {
                __m256 v[4];
                quants_avx2(kind, rows[c] + bb * b, v);
                for (int a = 0; a < 4; a++) _mm256_storeu_ps(qc + 32 * b + 8 * a, v[a]);
            }
            q[c] = qc;
        }
        if (wide) {
            packed_rows512(q, d, C, x, xs, M, K, y, ys);
        } else {
            for (int m = 0; m < M; m += ROWS) {
                const int r = M - m < ROWS ? M - m : ROWS;
                DISPATCH_RC(r, C, packed_tile(q, d, x + m * xs, xs, K, y + m * ys, ys, R, C))
            }
        }
    }
    if (kind != NI_Q8_0) add_offsets(off, C, sums_t, M, blocks, y, ys);
}
#endif

static void group_scalar(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                         float *y, long ys, const float *sums) {
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) y[m * ys + c] = output_scalar(kind, rows[c], x + m * xs, sums + (long)m * (K / 32), K);
}

int ni_matmul(const float *x, long xs, int M, int K, const uint8_t *w, int kind, int N, const float *bias,
              float *y, long ys, int threads) {
    const long row_bytes = ni_row_bytes(kind, K);
    if (row_bytes < 0 || (kind != NI_F32 && K % 32)) return -1;
    int simd = 0, wide = 0;   /* AVX2, and AVX-512 for packed W */
#if NI_X86
    simd = ni_has_avx2();
    wide = simd && ni_has_avx512();
#endif
    /* s_b per row, for the offsets of Q4_0/Q4_1: row-major for the portable path, block-major for the vector one */
    const int blocks = K / 32;
    const size_t sums_size = sizeof(float) * (size_t)M * (size_t)(blocks > 0 ? blocks : 1);
    float *sums = kind == NI_F32 ? NULL : malloc(sums_size), *sums_t = kind == NI_F32 ? NULL : malloc(sums_size);
    if (sums) {
        for (int m = 0; m < M; m++) {
#if NI_X86
            if (simd) {
                block_sums_avx2(x + m * xs, K, sums + (long)m * blocks);
                continue;
            }
#endif
            block_sums_scalar(x + m * xs, K, sums + (long)m * blocks);
        }
        for (int m = 0; m < M; m++)
            for (int b = 0; b < blocks; b++) sums_t[(long)b * M + m] = sums[(long)m * blocks + b];
    }
    const int groups = (N + GROUP - 1) / GROUP;
#pragma omp parallel num_threads(threads)
    {
        const size_t per_group = (size_t)(blocks > 0 ? blocks : 1) * GROUP;
        float *qbuf = kind == NI_F32 ? NULL : malloc(sizeof(float) * (size_t)K * GROUP);
        float *dbuf = kind == NI_F32 ? NULL : malloc(sizeof(float) * per_group);
        float *obuf = kind == NI_F32 ? NULL : malloc(sizeof(float) * per_group);
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const int n0 = g * GROUP, C = N - n0 < GROUP ? N - n0 : GROUP;
            const uint8_t *rows[GROUP];
            for (int c = 0; c < C; c++) rows[c] = w + (long)(n0 + c) * row_bytes;
#if NI_X86
            if (simd) group_avx2(kind, rows, C, x, xs, M, K, y + n0, ys, sums_t, qbuf, dbuf, obuf, wide);
            else
#endif
                group_scalar(kind, rows, C, x, xs, M, K, y + n0, ys, sums);
            if (bias)
                for (int m = 0; m < M; m++)
                    for (int c = 0; c < C; c++) y[m * ys + n0 + c] += bias[n0 + c];
        }
        free(qbuf);
        free(dbuf);
        free(obuf);
    }
    free(sums);
    free(sums_t);
    return 0;
}

int ni_dequantize_rows(const uint8_t *w, int kind, int K, const long *row_ids, int count, float *out) {
    const long row_bytes = ni_row_bytes(kind, K);
    if (row_bytes < 0 || (kind != NI_F32 && K % 32)) return -1;
    for (int i = 0; i < count; i++) {
        const uint8_t *row = w + row_ids[i] * row_bytes;
        float *o = out + (long)i * K;
        if (kind == NI_F32) {
            memcpy(o, row, sizeof(float) * (size_t)K);
            continue;
        }
        for (int b = 0; b < K / 32; b++) {   /* w = d q + m: gguf's values (d q is exact, one rounding) */
            float q[32], d, m;
            unpack_block_scalar(kind, row + block_bytes(kind) * b, q, &d, &m);
            for (int j = 0; j < 32; j++) o[32 * b + j] = kind == NI_Q4_1 ? d * q[j] + m : d * (kind == NI_Q4_0 ? q[j] - 8.0f : q[j]);
        }
    }
    return 0;
}
