/* y (M, N) = x (M, K) W^T (+ bias) with fp32 activations and W kept as stored: fp32, or GGUF's Q8_0, Q4_0 and
 * Q4_1 blocks (32 weights each), never expanded to an fp32 matrix in memory.
 *
 * Each output y[m, n] is one sequence of fp32 operations fixed by this code:
 *   w_k    the weight as fp32: as stored, or its block's value d q (Q8_0), d (q - 8) (Q4_0), d q + m (Q4_1),
 *          rounded once: exactly the value gguf's own dequantize gives (d q is exact in fp32);
 *   lanes  16 accumulators; lane l takes fma(w_k, x_k, lane) for k = l, l + 16, ... in k order, up to K - K % 16;
 *   y      lanes 0-7 plus lanes 8-15 lanewise, those 8 summed ((0+4)+(2+6)) + ((1+5)+(3+7)), then the K % 16
 *          tail by fma in k order, then + bias.
 * So a packed matrix gives bit for bit what its dequantized fp32 twin gives; the AVX-512, AVX2 and scalar paths
 * agree; and y[m, :] has the same bits whatever M is, whatever the row's place and whatever the thread count:
 * batch invariance by construction, with no padding. Speed comes from register tiles (a few rows x a few
 * outputs, each output with its own lanes) and from decoding each block once, in registers, for all the rows
 * that share it (AVX-512 decodes a 4-bit block through a 16-entry table: one permute per 16 weights).
 * Threads split the outputs in contiguous groups of GROUP; all M rows share each read of W. Prefetching only
 * moves bytes earlier: the order of operations, and so the bits, are the same.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define GROUP 4      /* outputs per group: the unit threads split */
#define TILE_ROWS 4  /* rows per AVX-512 register tile */
#define FEW_ROWS 4   /* up to this many rows, AVX-512 decodes packed blocks in registers instead of to a buffer */

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

/* One block's 32 weights as fp32 (element j: byte j's low nibble for j < 16, byte j - 16's high nibble after). */
static void decode_block_scalar(int kind, const uint8_t *blk, float w[32]) {
    const float d = read_half(blk);
    if (kind == NI_Q8_0) {
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)blk[2 + j];
        return;
    }
    const uint8_t *nibbles = blk + (kind == NI_Q4_1 ? 4 : 2);
    for (int j = 0; j < 32; j++) {
        const float q = (float)(j < 16 ? nibbles[j] & 0x0F : nibbles[j - 16] >> 4);
        w[j] = kind == NI_Q4_1 ? d * q + read_half(blk + 2) : d * (q - 8.0f);   /* d q exact: one rounding */
    }
}

static void decode_row_scalar(int kind, const uint8_t *row, int K, float *w) {
    for (int b = 0; b < K / 32; b++) decode_block_scalar(kind, row + block_bytes(kind) * b, w + 32 * b);
}

/* The fixed lane order of every 8-lane sum here: ((0+4)+(2+6)) + ((1+5)+(3+7)), as ni_hsum256. */
static float hsum8(const float v[8]) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* y from its 8 folded lanes' sum: the K % 16 tail by fma in k order. */
static float tail(float y, const float *w, const float *x, int k16, int K) {
    for (int k = k16; k < K; k++) y = fmaf(w[k], x[k], y);
    return y;
}

/* ---- the portable path: one output at a time --------------------------------------------------------- */
static float output_scalar(const float *w, const float *x, int K) {
    float lanes[16] = {0}, folded[8];
    const int k16 = K - K % 16;
    for (int k = 0; k < k16; k += 16)
        for (int l = 0; l < 16; l++) lanes[l] = fmaf(w[k + l], x[k + l], lanes[l]);
    for (int l = 0; l < 8; l++) folded[l] = lanes[l] + lanes[8 + l];
    return tail(hsum8(folded), w, x, k16, K);
}

static void group_scalar(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                         float *y, long ys, float *wbuf) {
    for (int c = 0; c < C; c++) {
        const float *w = (const float *)rows[c];
        if (kind != NI_F32) {
            decode_row_scalar(kind, rows[c], K, wbuf);
            w = wbuf;
        }
        for (int m = 0; m < M; m++) y[m * ys + c] = output_scalar(w, x + m * xs, K);
    }
}

#define CASE_RC(R_, C_, STMT) case (R_) * 8 + (C_): { const int R = R_, C = C_; STMT; } break;
/* STMT with R (rows) and C (outputs) as constants, so a tile's accumulators stay in registers. */
#define DISPATCH_RC(ROWS, COLS, STMT)                                                                              \
    switch ((ROWS) * 8 + (COLS)) {                                                                                 \
    CASE_RC(1, 1, STMT) CASE_RC(1, 2, STMT) CASE_RC(1, 3, STMT) CASE_RC(1, 4, STMT)                                \
    CASE_RC(2, 1, STMT) CASE_RC(2, 2, STMT) CASE_RC(2, 3, STMT) CASE_RC(2, 4, STMT)                                \
    CASE_RC(3, 1, STMT) CASE_RC(3, 2, STMT) CASE_RC(3, 3, STMT) CASE_RC(3, 4, STMT)                                \
    CASE_RC(4, 1, STMT) CASE_RC(4, 2, STMT) CASE_RC(4, 3, STMT) CASE_RC(4, 4, STMT)                                \
    }

#define DISPATCH_RC2(ROWS, COLS, STMT)                                                                             \
    switch ((ROWS) * 8 + (COLS)) { CASE_RC(1, 1, STMT) CASE_RC(1, 2, STMT) CASE_RC(2, 1, STMT) CASE_RC(2, 2, STMT) }

#if NI_X86
NI_AVX2 static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* ---- AVX2: 16 lanes as two 8-lane halves --------------------------------------------------------------- */
/* A block's 32 weights as four vectors of 8 (the values decode_block_scalar gives). */
NI_AVX2 static inline void decode_avx2(int kind, const uint8_t *blk, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_f16c(blk));
    if (kind == NI_Q8_0) {
        for (int a = 0; a < 4; a++)
            w[a] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                        _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * a)))));
        return;
    }
    const uint8_t *nibbles = blk + (kind == NI_Q4_1 ? 4 : 2);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)nibbles));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nibbles + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i q[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask),
                          _mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    const __m256 m = _mm256_set1_ps(kind == NI_Q4_1 ? half_f16c(blk + 2) : 0.0f);
    for (int a = 0; a < 4; a++) {
        const __m256 qf = _mm256_cvtepi32_ps(q[a]);
        w[a] = kind == NI_Q4_1 ? _mm256_fmadd_ps(d, qf, m) : _mm256_mul_ps(d, _mm256_sub_ps(qf, _mm256_set1_ps(8.0f)));
    }
}

/* An R x C tile (R, C <= 2), each output's 16 lanes as lo (k % 16 < 8) and hi halves. */
NI_AVX2 static inline __attribute__((always_inline)) void f32_tile_avx2(const float *const *w, const float *x, long xs,
                                                                       int K, float *y, long ys, const int R,
                                                                       const int C) {
    __m256 lo[2][2], hi[2][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
    const int k16 = K - K % 16;
    for (int k = 0; k < k16; k += 16)
        for (int r = 0; r < R; r++) {
            const __m256 xl = _mm256_loadu_ps(x + r * xs + k), xh = _mm256_loadu_ps(x + r * xs + k + 8);
            for (int c = 0; c < C; c++) {
                lo[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[c] + k), xl, lo[r][c]);
                hi[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[c] + k + 8), xh, hi[r][c]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            y[r * ys + c] = tail(ni_hsum256(_mm256_add_ps(lo[r][c], hi[r][c])), w[c], x + r * xs, k16, K);
}

NI_AVX2 static void group_avx2(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                               float *y, long ys, float *wbuf) {
    const float *w[GROUP];
    for (int c = 0; c < C; c++) {
        if (kind == NI_F32) {
            w[c] = (const float *)rows[c];
            continue;
        }
        float *wc = wbuf + (long)c * K;
        for (int b = 0; b < K / 32; b++) {
            __m256 v[4];
            decode_avx2(kind, rows[c] + block_bytes(kind) * b, v);
            for (int a = 0; a < 4; a++) _mm256_storeu_ps(wc + 32 * b + 8 * a, v[a]);
        }
        w[c] = wc;
    }
    for (int c = 0; c < C; c += 2)
        for (int m = 0; m < M; m += 2) {
            const int rs = M - m < 2 ? M - m : 2, cs = C - c < 2 ? C - c : 2;
            DISPATCH_RC2(rs, cs, f32_tile_avx2(w + c, x + m * xs, xs, K, y + m * ys + c, ys, R, C))
        }
}

/* ---- AVX-512: 16 lanes in one vector ------------------------------------------------------------------- */
NI_AVX512 static inline float finish512(__m512 lanes, const float *w, const float *x, int k16, int K) {
    return tail(ni_hsum256(_mm256_add_ps(_mm512_castps512_ps256(lanes), _mm512_extractf32x8_ps(lanes, 1))), w, x,
                k16, K);
}

/* A block's scale d and offset m (Q4_1: its min; the others: 0), each in every lane, read from the block's own
 * header in registers: the exact conversions half_f16c makes. (Converted in a pass of their own, to a buffer,
 * they cost a third of a batch-1 matmul.) */
NI_AVX512 static inline __attribute__((always_inline)) void block_scale512(int kind, const uint8_t *blk, __m512 *d,
                                                                          __m512 *m) {
    if (kind == NI_Q4_1) {
        uint32_t halves;   /* d, then m */
        memcpy(&halves, blk, sizeof halves);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
        *d = _mm512_broadcastss_ps(dm);
        *m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    } else {   /* only d: the bytes after it, read as a half, may be subnormal (slow to convert) */
        *d = _mm512_set1_ps(half_f16c(blk));
        *m = _mm512_setzero_ps();
    }
}

/* A block's 32 weights as two vectors of 16: elements 0..15 and 16..31 (the values decode_block_scalar gives).
 * A 4-bit block builds its 16 possible values once and picks each weight by its nibble (vpermps reads the low 4
 * bits of each index, so the low nibbles need no mask). */
NI_AVX512 static inline __attribute__((always_inline)) void decode512(int kind, const uint8_t *blk, __m512 w[2]) {
    __m512 d, min;
    block_scale512(kind, blk, &d, &min);
    if (kind == NI_Q8_0) {
        w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
        return;
    }
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = kind == NI_Q4_1 ? _mm512_fmadd_ps(d, q, min)
                                          : _mm512_mul_ps(d, _mm512_sub_ps(q, _mm512_set1_ps(8.0f)));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (kind == NI_Q4_1 ? 4 : 2))));
    w[0] = _mm512_permutexvar_ps(bytes, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
}

/* fp32 W (rows, or blocks decoded to a buffer): an R x C tile, R <= TILE_ROWS, C <= GROUP. */
NI_AVX512 static inline __attribute__((always_inline)) void f32_tile512(const float *const *w, const float *x, long xs,
                                                                       int K, float *y, long ys, const int R,
                                                                       const int C) {
    __m512 acc[TILE_ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int k16 = K - K % 16;
    for (int k = 0; k < k16; k += 16) {
        __m512 wv[GROUP];
        for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_ps(w[c] + k);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * xs + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    if (R * C % 8 == 0 && k16 == K) {   /* eight outputs' sums at once: the same additions, fewer shuffles */
        __m256 folded[TILE_ROWS * GROUP];
        float sums[TILE_ROWS * GROUP];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                folded[r * C + c] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]), _mm512_extractf32x8_ps(acc[r][c], 1));
        for (int i = 0; i < R * C; i += 8) _mm256_storeu_ps(sums + i, ni_hsum8x8(folded + i));
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) y[r * ys + c] = sums[r * C + c];
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ys + c] = finish512(acc[r][c], w[c], x + r * xs, k16, K);
}

/* Packed W, R <= FEW_ROWS rows: each block decoded in registers once and used by every row at once. */
NI_AVX512 static inline __attribute__((always_inline)) void packed_tile512(int kind, const uint8_t *const *rows,
                                                                          const float *x, long xs, int K, float *y,
                                                                          long ys, const int R, const int C) {
    const long bb = block_bytes(kind);
    __m512 acc[FEW_ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++)
        for (int c = 0; c < C; c++) {
            __m512 w[2];
            decode512(kind, rows[c] + bb * b, w);
            for (int r = 0; r < R; r++) {
                const float *xb = x + r * xs + 32 * b;
                acc[r][c] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16),
                                            _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), acc[r][c]));
            }
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ys + c] = finish512(acc[r][c], NULL, NULL, K, K);
}

NI_AVX512 static void group512(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                               float *y, long ys, float *wbuf) {
    const int blocks = K / 32;
    if (kind != NI_F32 && M <= FEW_ROWS) {
        /* The tile reads the C rows' blocks interleaved; touching the group's bytes in address order first (they
         * are contiguous) keeps the hardware prefetcher streaming (without this, a batch-1 step's matmuls took
         * 45% longer). */
        for (long at = 0; at < C * block_bytes(kind) * blocks; at += 64) __builtin_prefetch(rows[0] + at, 0, 3);
        DISPATCH_RC(M, C, packed_tile512(kind, rows, x, xs, K, y, ys, R, C))
        return;
    }
    const float *w[GROUP];
    for (int c = 0; c < C; c++) {
        if (kind == NI_F32) {
            w[c] = (const float *)rows[c];
            continue;
        }
        float *wc = wbuf + (long)c * K;
        for (int b = 0; b < blocks; b++) {
            __m512 v[2];
            decode512(kind, rows[c] + block_bytes(kind) * b, v);
            _mm512_storeu_ps(wc + 32 * b, v[0]);
            _mm512_storeu_ps(wc + 32 * b + 16, v[1]);
        }
        w[c] = wc;
    }
    for (int m = 0; m < M; m += TILE_ROWS) {
        const int r = M - m < TILE_ROWS ? M - m : TILE_ROWS;
        DISPATCH_RC(r, C, f32_tile512(w, x + m * xs, xs, K, y + m * ys, ys, R, C))
    }
}
#endif

int ni_matmul(const float *x, long xs, int M, int K, const uint8_t *w, int kind, int N, const float *bias,
              float *y, long ys, int threads) {
    const long row_bytes = ni_row_bytes(kind, K);
    if (row_bytes < 0 || (kind != NI_F32 && K % 32)) return -1;
    int simd = 0, wide = 0;   /* AVX2, AVX-512 */
#if NI_X86
    simd = ni_has_avx2();
    wide = simd && ni_has_avx512();
#endif
    const int groups = (N + GROUP - 1) / GROUP;
#pragma omp parallel num_threads(threads)
    {
        float *wbuf = kind == NI_F32 ? NULL : malloc(sizeof(float) * (size_t)K * GROUP);   /* decoded rows */
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const int n0 = g * GROUP, C = N - n0 < GROUP ? N - n0 : GROUP;
            const uint8_t *rows[GROUP];
            for (int c = 0; c < C; c++) rows[c] = w + (long)(n0 + c) * row_bytes;
            if (M > FEW_ROWS && g + 1 < groups) {
                /* Many rows compute long on each group, reading its weights in one burst at the start: fetch the
                 * next group's into L2 meanwhile (the hardware prefetcher runs out between bursts; 8 rows: -13%,
                 * 32 rows: -6% a step). Fewer rows stream the weights, which it keeps up with alone. */
                const char *next = (const char *)(w + (long)(n0 + GROUP) * row_bytes);
                const long span = (long)(N - n0 - GROUP < GROUP ? N - n0 - GROUP : GROUP) * row_bytes;
                for (long at = 0; at < span; at += 64) __builtin_prefetch(next + at, 0, 2);
            }
#if NI_X86
            if (wide) group512(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf);
            else if (simd) group_avx2(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf);
            else
#endif
                group_scalar(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf);
            if (bias)
                for (int m = 0; m < M; m++)
                    for (int c = 0; c < C; c++) y[m * ys + n0 + c] += bias[n0 + c];
        }
        free(wbuf);
    }
    return 0;
}

int ni_dequantize_rows(const uint8_t *w, int kind, int K, const long *row_ids, int count, float *out) {
    const long row_bytes = ni_row_bytes(kind, K);
    if (row_bytes < 0 || (kind != NI_F32 && K % 32)) return -1;
    for (int i = 0; i < count; i++) {
        const uint8_t *row = w + row_ids[i] * row_bytes;
        if (kind == NI_F32)
            memcpy(out + (long)i * K, row, sizeof(float) * (size_t)K);
        else
            decode_row_scalar(kind, row, K, out + (long)i * K);
    }
    return 0;
}
