/* The ARM64 NEON paths (neon_*.c, and beside their x86 twins where they share a file's constants and helpers:
 * elementwise.c, sample.c, greedy_head.c), chosen at run time as the x86 ones are: NEON is part of every ARMv8-A CPU, so
 * it runs whenever the instruction-set cap allows SIMD (ni_simd_cap >= 1; 0 keeps the portable C). Each gives the
 * portable path's bits: the same fp32 operations in the same association, lane for lane (fmaf as vfmaq_f32, a
 * fused multiply-add; a separate multiply and add as vmulq_f32 then vaddq_f32, this tree building with
 * -ffp-contract=off). */
#ifndef NANOINFER_NEON_H
#define NANOINFER_NEON_H

#include <stdint.h>

#include "kernels.h"
#include "q8.h"

/* matmul_q8.c's portable decoder: chunk b of a row as integers w[32], its scale *a and min *min. */
void q8_chunk_weights(int kind, const uint8_t *row, int b, int16_t w[32], float *a, float *min);

#if defined(__aarch64__)
#define NI_NEON 1

static inline int ni_has_neon(void) { return ni_simd_cap >= 1; }
int ni_has_dotprod(void);   /* the CPU has SDOT (AT_HWCAP's ASIMDDP) */

/* A function that runs SDOT, written as inline assembly after ".arch armv8.2-a+dotprod": GCC 12 and clang 14
 * disagree on how a function enables dotprod for the intrinsics (GCC: the assembler's .arch; clang: the target
 * attribute), so both are given. */
#if defined(__clang__)
#define NI_DOTPROD __attribute__((target("dotprod")))
#else
#define NI_DOTPROD
#endif

/* matmul.c's group_scalar on NEON: outputs [0, C) of the rows `rows` (kind `kind`, K weights) for the M rows of x,
 * into y; wbuf holds two decoded rows (2 K floats). */
void ni_group_neon(int kind, const uint8_t *const *rows, int C, const float *x, long xs, int M, int K, float *y,
                   long ys, float *wbuf);

/* attention.c's dot_scalar (norm.c's sum of squares is ni_dot_neon(x, x, n)) and axpy_scalar on NEON: 8 lanes as
 * two 4-lane vectors, summed ((0+4)+(2+6)) + ((1+5)+(3+7)), the tail by plain products and sums. */
float ni_dot_neon(const float *a, const float *b, int n);
void ni_axpy_neon(float *acc, float p, const float *x, int n);
float ni_sum_squares_neon(const float *x, int n);

/* The int8 tier (neon_q8.c): ni_q8_group and q8.h's row quantizer on NEON; the integer dots by SDOT where the CPU
 * has dotprod (AT_HWCAP's ASIMDDP), else by widening multiplies. */
void ni_q8_group_neon(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M, int K, float *y,
                      long ys, void *scratch);
void ni_q8_chunk_neon(const float *x, int8_t *t, float *d, int32_t *sumt, int32_t *sumt_lo);   /* q8_chunk_fn */

/* rope.c's rotation of pairs (v[i], v[i + half]) for i < half - half % 4, each product rounded then the difference
 * or sum; returns where the portable loop goes on. */
int ni_rope_neon(float *v, const float *cos, const float *sin, int half);

/* norm.c's centered_sum: the sum of (x - c)^2 (squares) or of x - c, products and sums each rounded. */
float ni_centered_sum_neon(const float *x, int D, float c, int squares);

/* sample.c's row_best on NEON: the largest of s[0..n), a NaN skipped as ni_max skips it (attention.c's row max),
 * and whether a NaN is among them; the first j < n with s[j] == top. A maximum and a first index have no order to
 * keep. */
float ni_max_neon(const float *s, long n, int *nan);
long ni_first_equal_neon(const float *s, long n, float top);
#else
#define NI_NEON 0
#endif

#endif
