/* matmul.c's fp32 tier on NEON, for every weight kind: each packed row decoded to fp32 exactly as the portable
 * path decodes it (quants.h), then each output's 16 lanes as four 4-lane vectors (lane l in vector l / 4), folded
 * and summed in matmul.c's order: lanes l + (l + 8), then ((0+4)+(2+6)) + ((1+5)+(3+7)), then the K % 16 tail by
 * fma in k order. Tiles of up to 2 rows x 2 outputs share each load. */
#include "neon.h"

#if NI_NEON
#include <arm_neon.h>
#include <math.h>

#include "quants.h"

/* matmul.c's hsum8 of the folded lanes lo (0-3) and hi (4-7), then the tail. */
static inline float finish(float32x4_t lo, float32x4_t hi, const float *w, const float *x, int k16, int K) {
    const float32x4_t s = vaddq_f32(lo, hi);   /* 0+4, 1+5, 2+6, 3+7 */
    float y = (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
    for (int k = k16; k < K; k++) y = fmaf(w[k], x[k], y);
    return y;
}

/* An R x C tile (R, C <= 2) of outputs y[r, c] = x[r] . w[c]. */
static inline __attribute__((always_inline)) void tile(const float *const *w, const float *x, long xs, int K,
                                                       float *y, long ys, const int R, const int C) {
    float32x4_t acc[2][2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int v = 0; v < 4; v++) acc[r][c][v] = vdupq_n_f32(0.0f);
    const int k16 = K - K % 16;
    for (int k = 0; k < k16; k += 16)
        for (int r = 0; r < R; r++) {
            float32x4_t xv[4];
            for (int v = 0; v < 4; v++) xv[v] = vld1q_f32(x + r * xs + k + 4 * v);
            for (int c = 0; c < C; c++)
                for (int v = 0; v < 4; v++) acc[r][c][v] = vfmaq_f32(acc[r][c][v], vld1q_f32(w[c] + k + 4 * v), xv[v]);
        }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)   /* lanes l + (l + 8): vectors 0 + 2 and 1 + 3 */
            y[r * ys + c] = finish(vaddq_f32(acc[r][c][0], acc[r][c][2]), vaddq_f32(acc[r][c][1], acc[r][c][3]), w[c],
                                   x + r * xs, k16, K);
}

void ni_group_neon(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K, float *y,
                   long ys, float *wbuf) {
    for (int c = 0; c < C; c += 2) {
        const int cs = C - c < 2 ? C - c : 2;
        const float *w[2];
        for (int i = 0; i < cs; i++) {
            if (kind == NI_F32) {
                w[i] = (const float *)rows[c + i];
                continue;
            }
            float *row = wbuf + (long)i * K;
            FOR_KIND(kind, for (int b = 0; b < K / 32; b++) decode_chunk_scalar(KIND, rows[c + i], b, row + 32 * b))
            w[i] = row;
        }
        for (int m = 0; m < M; m += 2) {
            const int rs = M - m < 2 ? M - m : 2;
            if (rs == 2 && cs == 2) tile(w, x + m * xs, xs, K, y + m * ys + c, ys, 2, 2);
            else if (rs == 2) tile(w, x + m * xs, xs, K, y + m * ys + c, ys, 2, 1);
            else if (cs == 2) tile(w, x + m * xs, xs, K, y + m * ys + c, ys, 1, 2);
            else tile(w, x + m * xs, xs, K, y + m * ys + c, ys, 1, 1);
        }
    }
}
#endif
