/* Shared declarations of nanoinfer's CPU kernels: strides, CPU feature dispatch, and each kernel's entry point. */
#ifndef NANOINFER_KERNELS_H
#define NANOINFER_KERNELS_H

#if defined(__x86_64__) || defined(_M_X64)
#define NI_X86 1
#define NI_AVX2 __attribute__((target("avx2,fma,f16c")))
#include <immintrin.h>

static inline int ni_has_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

#define NI_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))

static inline int ni_has_avx512(void) {
    return ni_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

/* Sum of 8 lanes in one fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)). */
NI_AVX2 static inline float ni_hsum256(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define NI_X86 0
#endif

/* Strides in elements of a (batch, head, token, dim) view whose last dimension is contiguous. */
typedef struct {
    long b, h, t;
} ni_strides;

/* Weight storage kinds: GGUF's ggml_type numbers. */
enum { NI_F32 = 0, NI_Q4_0 = 2, NI_Q4_1 = 3, NI_Q8_0 = 8 };

long ni_row_bytes(int kind, int K);
int ni_matmul(const float *x, long xs, int M, int K, const unsigned char *w, int kind, int N, const float *bias,
              float *y, long ys, int threads);
int ni_dequantize_rows(const unsigned char *w, int kind, int K, const long *row_ids, int count, float *out);

void ni_rmsnorm(const float *x, long xs, const float *w, float *y, long ys, int rows, int D, float eps, int threads);

void ni_rope(float *x, const ni_strides *xs, const float *cos, const float *sin, int B, int T, int heads, int D,
             int threads);

void ni_attention(const float *q, const ni_strides *qs, const float *k, const ni_strides *ks, const float *v,
                  const ni_strides *vs, float *out, const ni_strides *os, const int *key_counts, int B, int H,
                  int Hkv, int Tq, int D, float scale, int threads);

#endif
