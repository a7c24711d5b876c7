/* y (M, N) = x (M, K) W^T (+ bias) with fp32 activations and W kept as stored: fp32, or GGUF's quantized blocks
 * (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL of 32 weights; Q4_K, Q5_K, Q6_K of 256: quants.h), never expanded to an
 * fp32 matrix in memory.
 *
 * Each output y[m, n] is one sequence of fp32 operations fixed by this code:
 *   w_k    the weight as fp32: as stored, or its block's value, computed exactly as gguf's own dequantize
 *          computes it (quants.h);
 *   lanes  16 accumulators; lane l takes fma(w_k, x_k, lane) for k = l, l + 16, ... in k order, up to K - K % 16;
 *   y      lanes 0-7 plus lanes 8-15 lanewise, those 8 summed ((0+4)+(2+6)) + ((1+5)+(3+7)), then the K % 16
 *          tail by fma in k order, then + bias.
 * So a packed matrix gives bit for bit what its dequantized fp32 twin gives; the AVX-512, AVX2 and scalar paths
 * agree; and y[m, :] has the same bits whatever M is, whatever the row's place and whatever the thread count:
 * batch invariance by construction, with no padding. Speed comes from register tiles (a few rows x a few
 * outputs, each output with its own lanes) and from decoding each block once, in registers, for all the rows
 * that share it (AVX-512 decodes a 4- or 5-bit chunk through a table of its 16 or 32 values: one permute per 16
 * weights).
 * Threads split the outputs in contiguous groups of GROUP (WIDE_GROUP with more than FEW_ROWS rows); all M rows
 * share each read of W. Prefetching only moves bytes earlier: the order of operations, and so the bits, are the
 * same.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "neon.h"
#include "parallel.h"
#include "q8.h"
#include "quants.h"

#define GROUP 4      /* outputs per group, the unit threads split, with up to FEW_ROWS rows */
#define WIDE_GROUP 6 /* outputs per group (and per AVX-512 tile) with more rows: a 4 x 6 tile loads 10 vectors per
                      * 24 fmas, not 8 per 16 (1 thread, 32 rows, Q8_0 1536 x 576: 62 -> 73 GFMA/s; a 512-token
                      * prefill of SmolLM2 Q4_K_M, 2 threads: 10% faster) */
#define TILE_ROWS 4  /* rows per AVX-512 register tile */
#define FEW_ROWS 4   /* up to this many rows, AVX-512 decodes packed blocks in registers instead of to a buffer */
#define Q8_SPLIT_ROWS 8   /* rows from which the quantization is shared out (ni_matmul_q8) */
#define AHEAD 4096   /* bytes of W fetched ahead of the group being computed, with few rows */

long ni_row_bytes(int kind, int K) {
    if (kind == NI_F32) return 4L * K;
    const long bytes = block_bytes(kind);
    return bytes < 0 || K % block_weights(kind) ? -1 : K / block_weights(kind) * bytes;
}

/* Floats of one row's block_halves512: a (d, m) pair per 32 weights, rounded up to whole 8-block conversions. */
static long halves_floats(int K) { return 16L * ((K / 32 + 7) / 8); }

static void decode_row_scalar(int kind, const uint8_t *row, int K, float *w) {
    FOR_KIND(kind, for (int b = 0; b < K / 32; b++) decode_chunk_scalar(KIND, row, b, w + 32 * b))
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
/* R's cases for C = 1..4 (CASES_C4) and 1..6 (CASES_C6). */
#define CASES_C4(R_, STMT) CASE_RC(R_, 1, STMT) CASE_RC(R_, 2, STMT) CASE_RC(R_, 3, STMT) CASE_RC(R_, 4, STMT)
#define CASES_C6(R_, STMT) CASES_C4(R_, STMT) CASE_RC(R_, 5, STMT) CASE_RC(R_, 6, STMT)
#define DISPATCH_RC(ROWS, COLS, STMT)                                                                              \
    switch ((ROWS) * 8 + (COLS)) { CASES_C4(1, STMT) CASES_C4(2, STMT) CASES_C4(3, STMT) CASES_C4(4, STMT) }
/* DISPATCH_RC with C up to WIDE_GROUP. */
#define DISPATCH_RC6(ROWS, COLS, STMT)                                                                             \
    switch ((ROWS) * 8 + (COLS)) { CASES_C6(1, STMT) CASES_C6(2, STMT) CASES_C6(3, STMT) CASES_C6(4, STMT) }

#define DISPATCH_RC2(ROWS, COLS, STMT)                                                                             \
    switch ((ROWS) * 8 + (COLS)) { CASE_RC(1, 1, STMT) CASE_RC(1, 2, STMT) CASE_RC(2, 1, STMT) CASE_RC(2, 2, STMT) }

#if NI_X86
/* ---- AVX2: 16 lanes as two 8-lane halves --------------------------------------------------------------- */
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

NI_AVX2 static void decode_row_avx2(int kind, const uint8_t *row, int K, float *w) {
    FOR_KIND(kind, for (int b = 0; b < K / 32; b++) {
        __m256 v[4];
        decode_avx2(KIND, row, b, v);
        for (int a = 0; a < 4; a++) _mm256_storeu_ps(w + 32 * b + 8 * a, v[a]);
    })
}

NI_AVX2 static void group_avx2(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                               float *y, long ys, float *wbuf) {
    const float *w[WIDE_GROUP];
    for (int c = 0; c < C; c++) {
        if (kind == NI_F32) {
            w[c] = (const float *)rows[c];
            continue;
        }
        decode_row_avx2(kind, rows[c], K, wbuf + (long)c * K);
        w[c] = wbuf + (long)c * K;
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

/* fp32 W (rows, or blocks decoded to a buffer): an R x C tile, R <= TILE_ROWS, C <= WIDE_GROUP. */
NI_AVX512 static inline __attribute__((always_inline)) void f32_tile512(const float *const *w, const float *x, long xs,
                                                                       int K, float *y, long ys, const int R,
                                                                       const int C) {
    __m512 acc[TILE_ROWS][WIDE_GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int k16 = K - K % 16;
    for (int k = 0; k < k16; k += 16) {
        __m512 wv[WIDE_GROUP];
        for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_ps(w[c] + k);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * xs + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    if (R * C % 8 == 0 && k16 == K) {   /* eight outputs' sums at once: the same additions, fewer shuffles */
        __m256 folded[TILE_ROWS * WIDE_GROUP];
        float sums[TILE_ROWS * WIDE_GROUP];
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

/* 32 weights (w[0], w[1]) into each of the R rows' lanes, x at k = 32 b. */
NI_AVX512 static inline __attribute__((always_inline)) void fma_chunk512(__m512 acc[FEW_ROWS][GROUP], int c,
                                                                        const __m512 w[2], const float *x, long xs,
                                                                        int b, const int R) {
    for (int r = 0; r < R; r++) {
        const float *xb = x + r * xs + 32 * b;
        acc[r][c] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xb), acc[r][c]));
    }
}

/* Packed W, R <= FEW_ROWS rows: each block decoded in registers once and used by every row at once. A K-quant
 * super-block's header is decoded once for its 8 chunks, each output's chunks still in k order. */
NI_AVX512 static inline __attribute__((always_inline)) void packed_tile512(int kind, const uint8_t *const *rows,
                                                                          const float *x, long xs, int K, float *y,
                                                                          long ys, float *halves, const int R,
                                                                          const int C) {
    __m512 acc[FEW_ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    if (is_k_quant(kind)) {
        for (int sb = 0; sb < K / 256; sb++)
            for (int c = 0; c < C; c++) {
                const uint8_t *blk = rows[c] + block_bytes(kind) * sb;
                KHeader h;
                k_header512(kind, blk, &h);
                for (int p = 0; p < 4; p++) {
                    __m512 w[4];
                    k_pair512(kind, blk, p, &h, w);
                    fma_chunk512(acc, c, w, x, xs, 8 * sb + 2 * p, R);
                    fma_chunk512(acc, c, w + 2, x, xs, 8 * sb + 2 * p + 1, R);
                }
            }
    } else {
        const long stride = halves_floats(K);   /* each output's block_halves512 */
        for (int c = 0; c < C; c++) block_halves512(kind, rows[c], K / 32, halves + stride * c);
        for (int b = 0; b < K / 32; b++)
            for (int c = 0; c < C; c++) {
                __m512 w[2];
                decode512(kind, rows[c], b, halves + stride * c + 2 * b, w);
                fma_chunk512(acc, c, w, x, xs, b, R);
            }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * ys + c] = finish512(acc[r][c], NULL, NULL, K, K);
}

NI_AVX512 static void decode_row512(int kind, const uint8_t *row, int K, float *w, float *halves) {
    FOR_KIND(kind, if (is_k_quant(KIND)) {
        for (int sb = 0; sb < K / 256; sb++) {
            const uint8_t *blk = row + block_bytes(KIND) * sb;
            KHeader h;
            k_header512(KIND, blk, &h);
            for (int p = 0; p < 4; p++) {
                __m512 v[4];
                k_pair512(KIND, blk, p, &h, v);
                for (int i = 0; i < 4; i++) _mm512_storeu_ps(w + 256 * sb + 64 * p + 16 * i, v[i]);
            }
        }
    } else {
        block_halves512(KIND, row, K / 32, halves);
        for (int b = 0; b < K / 32; b++) {
            __m512 v[2];
            decode512(KIND, row, b, halves + 2 * b, v);
            _mm512_storeu_ps(w + 32 * b, v[0]);
            _mm512_storeu_ps(w + 32 * b + 16, v[1]);
        }
    })
}

/* The group's outputs for all M rows; the `ahead` bytes at `next` (the next group's weights, with more than
 * FEW_ROWS rows; none otherwise: ni_matmul fetched them) are prefetched a slice before each tile of rows. */
NI_AVX512 static void group512(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K,
                               float *y, long ys, float *wbuf, const char *next, long ahead) {
    if (kind != NI_F32 && M <= FEW_ROWS) {
        FOR_KIND(kind, DISPATCH_RC(M, C, packed_tile512(KIND, rows, x, xs, K, y, ys, wbuf + (long)WIDE_GROUP * K, R, C)))
        return;
    }
    const float *w[WIDE_GROUP];
    for (int c = 0; c < C; c++) {
        if (kind == NI_F32) {
            w[c] = (const float *)rows[c];
            continue;
        }
        decode_row512(kind, rows[c], K, wbuf + (long)c * K, wbuf + (long)WIDE_GROUP * K);
        w[c] = wbuf + (long)c * K;
    }
    const long slice = (ahead / ((M + TILE_ROWS - 1) / TILE_ROWS) + 63) / 64 * 64;
    for (int m = 0; m < M; m += TILE_ROWS) {
        const long from = slice * (m / TILE_ROWS), to = from + slice < ahead ? from + slice : ahead;
        for (long at = from; at < to; at += 64) __builtin_prefetch(next + at, 0, 2);
        const int r = M - m < TILE_ROWS ? M - m : TILE_ROWS;
        DISPATCH_RC6(r, C, f32_tile512(w, x + m * xs, xs, K, y + m * ys, ys, R, C))
    }
}
#endif

/* One ni_matmul call's operands, as each worker's range of output groups reads them. */
typedef struct {
    const float *x;
    long xs, row_bytes, ys;
    int M, K, kind, N, group, simd, wide;   /* simd, wide: AVX2 or NEON, AVX-512 */
    const uint8_t *w;
    const float *bias;
    float *y;
    const ni_q8_rows *xq;
} matmul_job;

/* Output groups [first, last) of the job. */
static void matmul_groups(void *ctx, long first, long last, int worker) {
    const matmul_job *j = ctx;
    const float *x = j->x, *bias = j->bias;
    const long xs = j->xs, ys = j->ys, row_bytes = j->row_bytes;
    const int M = j->M, K = j->K, kind = j->kind, N = j->N, group = j->group, wide = j->wide;
    const uint8_t *w = j->w;
    float *y = j->y;
    const ni_q8_rows *xq = j->xq;
    (void)worker;
    /* decoded rows, then each output's block halves (AVX-512), on whole cache lines: with malloc's 16-byte
     * alignment most vector loads of a decoded row straddled two (a 32-row Q8_0 head, 1 thread: 8% slower) */
    const size_t f32_bytes = sizeof(float) * ((size_t)K + halves_floats(K)) * WIDE_GROUP;
    const size_t wbuf_bytes = xq && (size_t)q8_scratch_bytes(K) > f32_bytes ? (size_t)q8_scratch_bytes(K) : f32_bytes;
    float *wbuf = kind == NI_F32 ? NULL : aligned_alloc(64, (wbuf_bytes + 63) / 64 * 64);
    for (long g = first; g < last; g++) {
        const int n0 = (int)g * group, C = N - n0 < group ? N - n0 : group;
        /* Fetch W ahead of this group into L2 meanwhile: the hardware prefetcher alone falls behind. Few rows
         * stream W: the AHEAD bytes after this group's (batch-1 decode, 2 threads: SmolLM2 Q4_K_M +20% tok/s,
         * Q4_1 +12%, Gemma 3 +10%). Many rows compute long on each group, reading its weights at the start:
         * the next group's, on AVX-512 a slice before each tile of rows (a burst of 64 lines stalled on the
         * line fill buffers: spread, a 32-row step is 6% faster on SmolLM2 Q4_K_M, 11% on Gemma 3, 8 rows
         * 8%), elsewhere in one burst here (8 rows: 13% faster than none, 32 rows 6%). The int8 tier's x86
         * tiles with few rows fetch for themselves, a line per chunk (q8.h's Q8_AHEAD). */
        const long span = (long)C * row_bytes;
        const char *next = (const char *)w + (long)n0 * row_bytes + (M > FEW_ROWS ? span : AHEAD);
        const char *end = (const char *)w + (long)N * row_bytes;
        const long ahead = next + span <= end ? span : next < end ? end - next : 0;
        const int spread = wide && M > FEW_ROWS && !xq;
        if (!spread && !(xq && q8_fetches_itself(M, j->simd)))
            for (long at = 0; at < ahead; at += 64) __builtin_prefetch(next + at, 0, 2);
        if (xq) {
            ni_q8_group(kind, w + (long)n0 * row_bytes, row_bytes, C, xq, M, K, y + n0, ys, wbuf);
        } else {
            const uint8_t *rows[WIDE_GROUP];
            for (int c = 0; c < C; c++) rows[c] = w + (long)(n0 + c) * row_bytes;
#if NI_X86
            if (wide) group512(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf, next, spread ? ahead : 0);
            else if (j->simd) group_avx2(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf);
            else
#endif
#if NI_NEON
            if (j->simd) ni_group_neon(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf);
            else
#endif
                group_scalar(kind, rows, C, x, xs, M, K, y + n0, ys, wbuf);
        }
        if (bias)
            for (int m = 0; m < M; m++)
                for (int c = 0; c < C; c++) y[m * ys + n0 + c] += bias[n0 + c];
    }
    free(wbuf);
}

/* ni_matmul's work, for the fp32 tier (xq NULL) or the int8 tier (xq: x quantized, q8.h; packed W). */
static int matmul(const float *x, long xs, int M, int K, const uint8_t *w, int kind, int N, const float *bias,
                  float *y, long ys, int threads, const ni_q8_rows *xq) {
    int simd = 0, wide = 0;   /* AVX2 or NEON, AVX-512 */
#if NI_X86
    simd = ni_has_avx2();
    wide = simd && ni_has_avx512();
#elif NI_NEON
    simd = ni_has_neon();
#endif
    const int group = xq ? (M > Q8_FEW_ROWS ? Q8_WIDE_GROUP : Q8_GROUP) : M > FEW_ROWS ? WIDE_GROUP : GROUP;
    const int groups = (N + group - 1) / group;
    matmul_job job = {x, xs, ni_row_bytes(kind, K), ys, M, K, kind, N, group, simd, wide, w, bias, y, xq};
    ni_parallel_for(groups, threads, matmul_groups, &job);
    return 0;
}

int ni_matmul(const float *x, long xs, int M, int K, const uint8_t *w, int kind, int N, const float *bias,
              float *y, long ys, int threads) {
    if (ni_row_bytes(kind, K) < 0) return -1;
    return matmul(x, xs, M, K, w, kind, N, bias, y, ys, threads, NULL);
}

/* x's rows and where their quantized entries go (q8.h), as each worker's range of rows reads them. */
typedef struct {
    const float *x;
    long xs;
    int M, K;
    int8_t *t;
    float *d, *dsumt;
    int32_t *sumt, *sumt_lo;
} quantize_job;

/* Rows [first, last) of x (row stride xs floats, K a multiple of 32) into their entries (q8_at) of t, d, sumt,
 * sumt_lo and dsumt, a chunk at a time on the widest quantizer here. */
static void quantize_rows(void *ctx, long first, long last, int worker) {
    const quantize_job *j = ctx;
    (void)worker;
    q8_chunk_fn chunk = q8_chunk_scalar;
#if NI_X86
    if (ni_has_avx2()) chunk = q8_chunk_avx2;
#elif NI_NEON
    if (ni_has_neon()) chunk = ni_q8_chunk_neon;
#endif
    for (long m = first; m < last; m++)
        for (int c = 0; c < j->K / 32; c++) {
            const long at = q8_at(j->M, (int)m, c);
            chunk(j->x + m * j->xs + 32 * c, j->t + 32 * at, j->d + at, j->sumt + at, j->sumt_lo + at);
            j->dsumt[at] = j->d[at] * (float)j->sumt[at];
        }
}

int ni_matmul_q8(const float *x, long xs, int M, int K, const uint8_t *w, int kind, int N, const float *bias,
                 float *y, long ys, int threads) {
    if (ni_row_bytes(kind, K) < 0) return -1;
    if (kind == NI_F32) return matmul(x, xs, M, K, w, kind, N, bias, y, ys, threads, NULL);
    /* each row quantized once, here, for every group: t (M, K) then d, dsumt, sumt and sumt_lo (M, K / 32),
     * chunk-major.
     * Rows are shared out from Q8_SPLIT_ROWS: one thread alone left the others waiting (Gemma 3's 128-token
     * prefill, 2 threads: 6% of its time) */
    const long chunks = (long)M * (K / 32);
    int8_t *t = aligned_alloc(64, ((size_t)M * K + 16 * chunks + 63) / 64 * 64);
    if (!t) return -2;
    float *d = (float *)(t + (long)M * K), *dsumt = d + chunks;
    int32_t *sumt = (int32_t *)(dsumt + chunks), *sumt_lo = sumt + chunks;
    quantize_job quantize = {x, xs, M, K, t, d, dsumt, sumt, sumt_lo};
    ni_parallel_for(M, M >= Q8_SPLIT_ROWS ? threads : 1, quantize_rows, &quantize);
    const ni_q8_rows xq = {t, d, dsumt, sumt, sumt_lo};
    const int status = matmul(x, xs, M, K, w, kind, N, bias, y, ys, threads, &xq);
    free(t);
    return status;
}

int ni_dequantize_rows(const uint8_t *w, int kind, int K, const long *row_ids, int count, float *out) {
    const long row_bytes = ni_row_bytes(kind, K);
    if (row_bytes < 0) return -1;
    for (int i = 0; i < count; i++) {
        const uint8_t *row = w + row_ids[i] * row_bytes;
        if (kind == NI_F32)
            memcpy(out + (long)i * K, row, sizeof(float) * (size_t)K);
        else
            decode_row_scalar(kind, row, K, out + (long)i * K);
    }
    return 0;
}
