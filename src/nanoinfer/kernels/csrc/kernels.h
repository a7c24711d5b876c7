/* Shared declarations of nanoinfer's CPU kernels: strides, CPU feature dispatch, and each kernel's entry point. */
#ifndef NANOINFER_KERNELS_H
#define NANOINFER_KERNELS_H

#include <math.h>

/* The largest of v[0..n), -inf for none; a NaN is skipped (any order finds the same value). */
static inline float ni_max(const float *v, long n) {
    float top = -INFINITY;
    for (long j = 0; j < n; j++) top = v[j] > top ? v[j] : top;
    return top;
}

/* The widest instruction set the kernels may use: 2 AVX-512, 1 AVX2, 0 the portable C (module.c; tests lower it
 * to check that every path gives the same bits). */
extern int ni_simd_cap;

#if defined(__x86_64__) || defined(_M_X64)
#define NI_X86 1
#define NI_AVX2 __attribute__((target("avx2,fma,f16c")))
#include <cpuid.h>
#include <immintrin.h>

/* F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c" for __builtin_cpu_supports. Asked once
 * (in a VM, CPUID traps to the hypervisor: microseconds). */
static inline int ni_has_f16c(void) {
    static int known = -1;
    if (known < 0) {
        unsigned a, b, c, d;
        known = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    }
    return known;
}

static inline int ni_has_avx2(void) {
    return ni_simd_cap >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && ni_has_f16c();
}

#define NI_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))

static inline int ni_has_avx512(void) {
    return ni_simd_cap >= 2 && ni_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

/* Sum of 8 lanes in one fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)). */
NI_AVX2 static inline float ni_hsum256(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ni_hsum256 of each of s[0..7], as one vector: the same additions in the same association, eight sums at once. */
NI_AVX2 static inline __m256 ni_hsum8x8(const __m256 s[8]) {
    __m256 u[4];   /* u[p]: vectors 2p and 2p + 1, lanes l + (l + 4), l < 4 */
    for (int p = 0; p < 4; p++)
        u[p] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * p], s[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * p], s[2 * p + 1], 0x31));
    /* (0+4)+(2+6) and (1+5)+(3+7) of vectors 0, 2 | 1, 3, then of vectors 4, 6 | 5, 7 */
    const __m256 v0 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
    const __m256 v1 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xEE));
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(v0, v1, 0x88), _mm256_shuffle_ps(v0, v1, 0xDD));   /* 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* ni_max, 8 lanes at a time (a NaN skipped, as there), and whether it met one (sample.c). */
NI_AVX2 float ni_max_avx2(const float *s, long n, int *nan);
#else
#define NI_X86 0
static inline int ni_has_avx2(void) { return 0; }
static inline int ni_has_avx512(void) { return 0; }
#endif

/* Strides in elements of a (batch, head, token, dim) view whose last dimension is contiguous. */
typedef struct {
    long b, h, t;
} ni_strides;

/* Weight storage kinds: GGUF's ggml_type numbers. */
enum {
    NI_F32 = 0, NI_Q4_0 = 2, NI_Q4_1 = 3, NI_Q5_0 = 6, NI_Q5_1 = 7, NI_Q8_0 = 8, NI_Q4_K = 12, NI_Q5_K = 13,
    NI_Q6_K = 14, NI_IQ4_NL = 20
};

long ni_row_bytes(int kind, int K);
int ni_matmul(const float *x, long xs, int M, int K, const unsigned char *w, int kind, int N, const float *bias,
              float *y, long ys, int threads);
/* The same product in the int8 activation tier (matmul_q8.c): each row of x quantized to int8 per 32 inputs, integer
 * dots with W's blocks, a fixed-order fp32 epilogue. An fp32 W runs ni_matmul. -1: an unknown kind or width;
 * -2: out of memory. */
int ni_matmul_q8(const float *x, long xs, int M, int K, const unsigned char *w, int kind, int N, const float *bias,
                 float *y, long ys, int threads);
int ni_dequantize_rows(const unsigned char *w, int kind, int K, const long *row_ids, int count, float *out);

void ni_rmsnorm(const float *x, long xs, const float *w, float *y, long ys, int rows, int D, float eps, int threads);
void ni_layernorm(const float *x, long xs, const float *w, const float *b, float *y, long ys, int rows, int D,
                  float eps, int threads);

void ni_rope(float *x, const ni_strides *xs, const float *cos, const float *sin, int B, int T, int heads, int D,
             int threads);

/* The keys each query sees. Query i of row b is at position counts[b * Tq + i] - 1 and reads the keys of positions
 * max(0, counts[..] - window) .. counts[..] - 1 (window 0: from position 0), in position order. With tables, the
 * key of position j of row b lives in slot tables[b * width + (j >> shift)] << shift | (j & ((1 << shift) - 1))
 * of the (shared, batch-free) pool: blocks of 1 << shift tokens; without, in slot j of row b. */
typedef struct {
    const int *counts, *tables;
    int width, shift, window;
} ni_key_spans;

void ni_attention(const float *q, const ni_strides *qs, const float *k, const ni_strides *ks, const float *v,
                  const ni_strides *vs, float *out, const ni_strides *os, const ni_key_spans *seen, int B, int H,
                  int Hkv, int Tq, int D, float scale, int threads);

/* MLP kinds, in config.MLPS order. */
enum { NI_SWIGLU = 0, NI_RELU2 = 1, NI_GELU = 2, NI_GEGLU = 3 };

void ni_activation(int mlp, const float *u, float *y, long rows, int hidden, int threads);
void ni_exp_(float *v, long n);
void ni_add_(float *x, const float *y, long n);
int ni_draw_rows(const void *scores, int f32, long stride, long rows, long n, const double *temperature,
                 const double *u, long *out, int threads);
/* The draw's weights (sample.c): w[j] = exp((s[j] - best) / temperature), j < n. */
void ni_draw_weights(const double *s, long n, double best, double temperature, double *w);
void ni_row_best(const float *scores, long stride, long rows, long n, float *best, long *index, int threads);

/* The greedy head (greedy_head.c): a head's int8 shadow with its bounds' tables, and each row's candidates, their
 * integer dots on one of these paths (plain C, then ARM64's, then x86's, each CPU's slowest first, so AMX, the
 * last, caps nothing; kernels/__init__.py's GREEDY_DOTS names them). */
enum {
    NI_DOTS_PORTABLE = 0, NI_DOTS_NEON = 1, NI_DOTS_SDOT = 2, NI_DOTS_AVX2 = 3, NI_DOTS_AVX512 = 4, NI_DOTS_VNNI = 5,
    NI_DOTS_AMX = 6
};
int ni_greedy_dots(int most);   /* the fastest path here at most `most`, under the instruction-set cap */
void ni_greedy_shadow(const float *w, long ws, int blocks, int K, int nc, double rho, signed char *wq, float *tab,
                      int threads);
void ni_greedy_candidates(const float *x, long xs, int R, int K, int nc, const signed char *wq, const float *tab,
                          const float *chunk_max, int blocks, int valid, double rho, int cap, int *cand, int *counts,
                          int most, int threads);

/* Where the RMSNorm of each q and k head runs (config.qk_norm, qk_norm_before_rope), as kernels/__init__.py says. */
enum { NI_QK_NORM_NONE = 0, NI_QK_NORM_AFTER_ROPE = 1, NI_QK_NORM_BEFORE_ROPE = 2 };

/* The activations' tier: fp32 (ni_matmul) or int8 (ni_matmul_q8). */
enum { NI_ACTIVATIONS_F32 = 0, NI_ACTIVATIONS_INT8 = 1 };

/* What ni_blocks needs to know of the architecture (config.ModelConfig), and the tier its matmuls run. */
typedef struct {
    int n_embd, n_head, n_kv_head, head_dim, ffn_hidden, mlp, layernorm, qk_norm, post_norms, activations;
    float eps, attn_scale;
} ni_dims;

/* A matrix as ni_matmul takes it: its rows as stored, their kind, and a bias (NULL when absent). */
typedef struct {
    const unsigned char *weight;
    long kind;
    const float *bias;
} ni_matrix;

/* One block's tensors: norms' weight and bias (NULL when absent), its four matrices, the q/k norms' learned
 * (head_dim,) weights (NULL when the q/k norm has none), the norms of the attention's and the MLP's outputs
 * (Gemma; NULL when absent), its sliding window (0: none, the layer reads every earlier key, and the global
 * RoPE table) and its place in the pool (kv/groups.py): its layer group, whose slots and block tables it reads,
 * and its index among the group's layers in the pool's blocks; every field 8 bytes, so Python fills it as a row
 * of int64 (model.Transformer._layer_table). */
typedef struct {
    const float *attn_norm, *attn_norm_bias;
    ni_matrix qkv, o;
    const float *mlp_norm, *mlp_norm_bias;
    ni_matrix up, down;
    const float *q_norm, *k_norm;
    const float *attn_post_norm, *mlp_post_norm;
    long window;
    long group, kv_layer;
} ni_layer;

/* Strides in floats of the cache (L, 2, B, H_kv, T, D): layer, k -> v, row, head, slot. */
typedef struct {
    long layer, kv, b, h, t;
} ni_kv_strides;

int ni_blocks(const ni_layer *layers, int L, const ni_dims *dims, float *x, int B, int T, float *kv,
              const ni_kv_strides *kvs, const long *slots, const ni_key_spans *seen, const float *cos,
              const float *sin, const float *local_cos, const float *local_sin, int threads);

#endif
