/* The greedy head: each row's exact argmax of x W^T without computing every logit.
 *
 * A greedy row needs one token: the first index of its largest logit. The logits' fp32 bits come from matmul.c;
 * here a cheap int8 estimate of every logit comes with a rigorous bound on its distance from those bits, so only
 * the few outputs whose bound reaches the best lower bound (the candidates) can hold the maximum. The caller
 * computes the candidates' logits exactly (matmul.c, the same bits as the full head) and takes their argmax:
 * the token is the full head's, ties and all, since every other output is strictly below a candidate.
 *
 * The estimate, per 64-wide chunk k of the input: the head's rows are quantized once, w = sigma q + eps with q
 * int8 and |eps| <= Ew (ni_greedy_shadow), each row's x = s t + e per step, t int8 and |e| <= E. Then
 *     w.x - sigma s (q.t) = w.e + eps.(s t),   so   |...| <= E L + Ew U,   L = sum |w|, U = s sum |t|,
 * an identity, not an estimate. The integer dots q.t are exact on every path (ni_greedy_dots: AMX's TDPBSSD,
 * AVX-512 VNNI's VPDPBUSD, AVX-512's or AVX2's VPMADDUBSW + VPMADDWD, ARM64's SDOT or NEON's widening multiplies,
 * plain C: the same integers), summed over
 * chunks in fp32 (acc = fma(q.t, s sigma, acc) in chunk order, the same bits on every path); the
 * fp32 rounding of that sum and of matmul.c's own sum (at most gamma_(K + chunks) times the sums of |terms|, with
 * rho >= that gamma) are added to the bound through X1 = E + rho max|x| and W2 = Ew + 127 rho sigma:
 *     bound = sum_k X1_k L_k + U_k W2_k.
 * The tables round these up. A candidate is an output whose estimate + bound reaches the row's best estimate -
 * bound, less tau, a slack (2^-16 of the largest |estimate| + bound a row can have) that covers the fp32 rounding
 * of the comparison itself.
 *
 * Layout: the shadow is blocks of 16 outputs; block b, chunk k is one AMX B tile (1 KB: its row kk holds, for
 * output j, inputs 64k + 4kk .. 64k + 4kk + 3 at bytes 4j .. 4j + 3), and its table holds sigma, L and W2 for the
 * 16 outputs (3 x 16 floats). A step's x is A tiles: 16 rows x 64 inputs per (row tile, chunk).
 */
#define _GNU_SOURCE   /* syscall, for AMX's permission */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "neon.h"
#include "parallel.h"

#if NI_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif NI_NEON
#include <arm_neon.h>
#endif

#define CHUNK 64
#define TILE_BYTES 1024   /* 16 x 64 int8 */
#define NI_INLINE static inline __attribute__((always_inline))   /* a row count n becomes a constant */

/* v as a float no smaller than v. */
static float round_up(double v) {
    const float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* One chunk (up to 64 values, the rest zero) as sigma q: q[e] = round(v[e] / sigma), |q| <= 127. Returns the
 * largest |v[e] - sigma q[e]| (exact in double); writes sigma, the largest |v| and sum |q|. A chunk too small for
 * a normal sigma keeps q = 0 and its values as the error. */
static double quantize_chunk(const float *v, int n, signed char *q, float *sigma, double *top, double *sum_q) {
    double mx = 0.0, err = 0.0, total = 0.0;
    for (int e = 0; e < n; e++) mx = fabs(v[e]) > mx ? fabs(v[e]) : mx;
    const float s = (float)mx / 127.0f;
    const int usable = s >= FLT_MIN;
    for (int e = 0; e < CHUNK; e++) {
        const float value = e < n ? v[e] : 0.0f;
        float level = usable ? nearbyintf(value / s) : 0.0f;
        level = level > 127.0f ? 127.0f : level < -127.0f ? -127.0f : level;
        q[e] = (signed char)level;
        const double miss = fabs((double)value - (double)(usable ? s : 0.0f) * level);
        err = miss > err ? miss : err;
        total += fabs(level);
    }
    *sigma = usable ? s : 0.0f;
    *top = mx;
    *sum_q = total;
    return err;
}

typedef struct {
    const float *w;
    long ws;
    int K, nc;
    double rho;
    signed char *wq;
    float *tab;
} shadow_job;

/* Blocks [first, last) of the shadow. */
static void shadow_blocks(void *ctx, long first, long last, int worker) {
    const shadow_job *job = ctx;
    const float *w = job->w;
    const long ws = job->ws;
    const int K = job->K, nc = job->nc;
    const double rho = job->rho;
    (void)worker;
    for (long b = first; b < last; b++)
        for (int k = 0; k < nc; k++) {
            signed char *tile = job->wq + (b * nc + k) * TILE_BYTES;
            float *t = job->tab + (b * nc + k) * 48;
            const int n = K - CHUNK * k < CHUNK ? K - CHUNK * k : CHUNK;
            for (int j = 0; j < 16; j++) {
                const float *row = w + (16L * b + j) * ws + CHUNK * k;
                signed char q[CHUNK];
                double top, sum_q, l1 = 0.0;
                const double err = quantize_chunk(row, n, q, &t[j], &top, &sum_q);
                for (int e = 0; e < n; e++) l1 += fabs(row[e]);
                for (int e = 0; e < CHUNK; e++) tile[(e / 4) * 64 + 4 * j + e % 4] = q[e];
                t[16 + j] = round_up(l1);
                t[32 + j] = round_up(err + 127.0 * rho * t[j]);
            }
        }
}

/* Plain C on every CPU, as the quantization of each step's rows in ni_greedy_candidates: once per head, and R x K
 * values a step beside the head's outputs x K of the dots. */
void ni_greedy_shadow(const float *w, long ws, int blocks, int K, int nc, double rho, signed char *wq, float *tab,
                      int threads) {
    shadow_job job = {w, ws, K, nc, rho, wq, tab};
    ni_parallel_for(blocks, threads, shadow_blocks, &job);
}

/* A row's candidates as one thread gathers them: indices and estimate + bound (ub), kept while ub >= thr, its
 * running (best lower bound - tau). A list that fills drops what its threshold has reached since, and doubles if
 * that frees nothing (early on, a thread's best lower bound can be far below the row's); past MAX_GATHERED the
 * bound cannot help, and the row is left undecided (it gets its logits). */
#define MAX_GATHERED 65536
typedef struct {
    int *index, count, room, overflow;
    float *ub, thr, best_lb;
} gathered;

static void keep(gathered *g, int n, float ub, float tau) {
    if (g->count == g->room) {
        g->thr = g->best_lb - tau;
        int kept = 0;
        for (int c = 0; c < g->count; c++)
            if (g->ub[c] >= g->thr) {
                g->index[kept] = g->index[c];
                g->ub[kept++] = g->ub[c];
            }
        g->count = kept;
        if (kept > g->room / 2) {
            if (g->room >= MAX_GATHERED) {
                g->overflow = 1;
                return;
            }
            g->room *= 2;
            g->index = realloc(g->index, sizeof(int) * (size_t)g->room);
            g->ub = realloc(g->ub, sizeof(float) * (size_t)g->room);
        }
    }
    g->index[g->count] = n;
    g->ub[g->count++] = ub;
}

/* A step's quantized rows, as the dots read them: xq, A tiles of 16 rows x 64 inputs per (row tile, chunk); bias,
 * 128 x the sum of each row's chunk of t, at (row tile * nc + chunk) * 16 + row (dots_vnni's offset). */
typedef struct {
    const signed char *xq;
    const int *bias;
    int nc, rows;   /* chunks; R, the real rows (the tiles' other rows are zero) */
} step_x;

/* Row r's candidates among 16 outputs' estimate -+ bound lb[j], ub[j] (n0: their first output, valid: how many are
 * real outputs), output by output. */
static void gather16(const float *lb, const float *ub, int n0, int valid, gathered *g, float tau) {
    for (int j = 0; j < valid; j++) {
        if (lb[j] > g->best_lb) {
            g->best_lb = lb[j];
            g->thr = lb[j] - tau > g->thr ? lb[j] - tau : g->thr;
        }
        if (ub[j] >= g->thr) keep(g, n0 + j, ub[j], tau);
    }
}

/* The 32-bit group of int8 at p, to broadcast. */
static inline int four_bytes(const signed char *p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

/* Row r's 16 estimates and bounds of block b (n0: its first output, valid: how many are real outputs), from the
 * integer dots dots[k * 256 + r * 16 + j] of its row tile. The AVX2 and AVX-512 twins below give the same bits. */
static void weigh_scalar(const int *dots, int r, const float *tab, const float *xt, int nc, int n0, int valid,
                         gathered *g, float tau) {
    float lb[16], ub[16];
    for (int j = 0; j < valid; j++) {
        float acc = 0.0f, bound = 0.0f;
        for (int k = 0; k < nc; k++) {
            const float *t = tab + k * 48, *x = xt + k * 3;
            acc = fmaf((float)dots[k * 256 + r * 16 + j], x[0] * t[j], acc);
            bound = fmaf(x[1], t[16 + j], bound);
            bound = fmaf(x[2], t[32 + j], bound);
        }
        lb[j] = acc - bound;
        ub[j] = acc + bound;
    }
    gather16(lb, ub, n0, valid, g, tau);
}

#if NI_X86
/* weigh_scalar with 8 outputs a vector, each lane taking its fmas in their order (the same bits); the row's list is
 * touched only where an output raises its best lower bound or reaches its threshold. */
NI_AVX2 static void weigh_256(const int *dots, int r, const float *tab, const float *xt, int nc, int n0, int valid,
                              gathered *g, float tau) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, bound[2] = {acc[0], acc[0]};
    for (int k = 0; k < nc; k++) {
        const float *t = tab + k * 48, *x = xt + k * 3;
        const __m256 s = _mm256_set1_ps(x[0]), x1 = _mm256_set1_ps(x[1]), x2 = _mm256_set1_ps(x[2]);
        for (int h = 0; h < 2; h++) {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(dots + k * 256 + r * 16 + 8 * h)));
            acc[h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_loadu_ps(t + 8 * h)), acc[h]);
            bound[h] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(t + 16 + 8 * h), bound[h]);
            bound[h] = _mm256_fmadd_ps(x2, _mm256_loadu_ps(t + 32 + 8 * h), bound[h]);
        }
    }
    float lb[16], ub[16];
    int notable = 0;
    for (int h = 0; h < 2; h++) {
        const __m256 low = _mm256_sub_ps(acc[h], bound[h]), high = _mm256_add_ps(acc[h], bound[h]);
        notable |= _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(low, _mm256_set1_ps(g->best_lb), _CMP_GT_OQ),
                                                   _mm256_cmp_ps(high, _mm256_set1_ps(g->thr), _CMP_GE_OQ))) << 8 * h;
        _mm256_storeu_ps(lb + 8 * h, low);
        _mm256_storeu_ps(ub + 8 * h, high);
    }
    if (notable & ((1 << valid) - 1)) gather16(lb, ub, n0, valid, g, tau);
}

/* weigh_scalar for n rows, n = 8 or 1 (r0..r0 + n - 1 of the row tile whose dots these are; gs, xt, tau: theirs),
 * 16 outputs at once, chunk after chunk: each chunk's table is read once for the n rows, each lane takes
 * weigh_scalar's fmas in its order (the same bits), and a row touches its list only when its best lower bound rises
 * or an output reaches its threshold (a few times a row, once it has its threshold). */
NI_AVX512 NI_INLINE void weigh_512(const int *dots, int r0, int n, const float *tab, const float *xt, int nc, int n0,
                                   int valid, gathered *gs, const float *tau) {
    __m512 acc[8], bound[8];
    for (int i = 0; i < n; i++) acc[i] = bound[i] = _mm512_setzero_ps();
    for (int k = 0; k < nc; k++) {
        const __m512 sigma = _mm512_loadu_ps(tab + k * 48), l1 = _mm512_loadu_ps(tab + k * 48 + 16),
                     w2 = _mm512_loadu_ps(tab + k * 48 + 32);
        for (int i = 0; i < n; i++) {
            const float *x = xt + ((long)i * nc + k) * 3;
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_loadu_si512(dots + k * 256 + (r0 + i) * 16));
            acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(_mm512_set1_ps(x[0]), sigma), acc[i]);
            bound[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), l1, bound[i]);
            bound[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[2]), w2, bound[i]);
        }
    }
    const __mmask16 real = (__mmask16)((1u << valid) - 1);
    for (int i = 0; i < n; i++) {
        gathered *g = gs + i;
        const __m512 lb = _mm512_sub_ps(acc[i], bound[i]), ub = _mm512_add_ps(acc[i], bound[i]);
        if (_mm512_mask_cmp_ps_mask(real, lb, _mm512_set1_ps(g->best_lb), _CMP_GT_OQ)) {
            g->best_lb = _mm512_mask_reduce_max_ps(real, lb);
            g->thr = g->best_lb - tau[i] > g->thr ? g->best_lb - tau[i] : g->thr;
        }
        __mmask16 pass = _mm512_mask_cmp_ps_mask(real, ub, _mm512_set1_ps(g->thr), _CMP_GE_OQ);
        if (!pass) continue;
        float ubs[16];
        _mm512_storeu_ps(ubs, ub);
        for (; pass; pass &= pass - 1) keep(g, n0 + __builtin_ctz(pass), ubs[__builtin_ctz(pass)], tau[i]);
    }
}

NI_AVX512 static void weigh8_512(const int *dots, int r0, const float *tab, const float *xt, int nc, int n0, int valid,
                                 gathered *gs, const float *tau) {
    weigh_512(dots, r0, 8, tab, xt, nc, n0, valid, gs, tau);
}

NI_AVX512 static void weigh1_512(const int *dots, int r0, const float *tab, const float *xt, int nc, int n0, int valid,
                                 gathered *gs, const float *tau) {
    weigh_512(dots, r0, 1, tab, xt, nc, n0, valid, gs, tau);
}

/* The integer dots with 16 x 64 of the shadow per instruction group: row kk of a shadow tile holds, per output lane
 * j, the 4 inputs 64k + 4kk..4kk + 3, so a row's 4 int8 of those inputs, broadcast, meet 16 outputs at once. Rows go
 * 4 at a time (4 independent sums), the last R % 4 one by one. */
#define NI_VNNI __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* VPDPBUSD multiplies unsigned by signed bytes: the shadow's q + 128 (q xor 0x80, in w) by t, less 128 sum t
 * (bias). Rows r..r + n - 1 of chunk k; one row sums even and odd kk apart (two chains of VPDPBUSD's latency). */
NI_VNNI NI_INLINE void vnni_rows(const step_x *x, const __m512i *w, int k, int r, int n, int *dots) {
    const long at = (long)(r / 16) * x->nc + k;
    const signed char *a = x->xq + at * TILE_BYTES + (r % 16) * 64;
    const int chains = n == 1 ? 2 : 1;
    __m512i acc[4][2];
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (int kk = 0; kk < 16; kk++)
        for (int i = 0; i < n; i++)
            acc[i][kk % chains] = _mm512_dpbusd_epi32(acc[i][kk % chains], w[kk],
                                                      _mm512_set1_epi32(four_bytes(a + i * 64 + 4 * kk)));
    for (int i = 0; i < n; i++)
        _mm512_storeu_si512(dots + at * 256 + (r % 16 + i) * 16,
                            _mm512_sub_epi32(_mm512_add_epi32(acc[i][0], acc[i][1]),
                                             _mm512_set1_epi32(x->bias[at * 16 + r % 16 + i])));
}

NI_VNNI static void dots_vnni(const step_x *x, const signed char *wq, int *dots) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int k = 0; k < x->nc; k++) {
        __m512i w[16];
        for (int kk = 0; kk < 16; kk++)
            w[kk] = _mm512_xor_si512(_mm512_loadu_si512(wq + (long)k * TILE_BYTES + kk * 64), flip);
        int r = 0;
        for (; r + 4 <= x->rows; r += 4) vnni_rows(x, w, k, r, 4, dots);
        for (; r < x->rows; r++) vnni_rows(x, w, k, r, 1, dots);
    }
}

/* VPMADDUBSW multiplies unsigned by signed bytes into saturating int16 pairs: |q| by t with q's sign (|q|, |t| <=
 * 127, so a pair is at most 32,258: exact), then VPMADDWD sums the pairs into int32. Rows r..r + n - 1 of chunk k. */
NI_AVX512 NI_INLINE void avx512_rows(const step_x *x, const signed char *wk, int k, int r, int n, int *dots) {
    const __m512i ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
    const long at = (long)(r / 16) * x->nc + k;
    const signed char *a = x->xq + at * TILE_BYTES + (r % 16) * 64;
    __m512i acc[4];
    for (int i = 0; i < n; i++) acc[i] = zero;
    for (int kk = 0; kk < 16; kk++) {
        const __m512i w = _mm512_loadu_si512(wk + kk * 64), size = _mm512_abs_epi8(w);
        const __mmask64 negative = _mm512_movepi8_mask(w);
        for (int i = 0; i < n; i++) {
            const __m512i t = _mm512_set1_epi32(four_bytes(a + i * 64 + 4 * kk));
            const __m512i signed_t = _mm512_mask_sub_epi8(t, negative, zero, t);
            acc[i] = _mm512_add_epi32(acc[i], _mm512_madd_epi16(_mm512_maddubs_epi16(size, signed_t), ones));
        }
    }
    for (int i = 0; i < n; i++) _mm512_storeu_si512(dots + at * 256 + (r % 16 + i) * 16, acc[i]);
}

NI_AVX512 static void dots_avx512(const step_x *x, const signed char *wq, int *dots) {
    for (int k = 0; k < x->nc; k++) {
        int r = 0;
        for (; r + 4 <= x->rows; r += 4) avx512_rows(x, wq + (long)k * TILE_BYTES, k, r, 4, dots);
        for (; r < x->rows; r++) avx512_rows(x, wq + (long)k * TILE_BYTES, k, r, 1, dots);
    }
}

/* avx512_rows in two 8-output halves, VPSIGNB giving t q's sign. */
NI_AVX2 NI_INLINE void avx2_rows(const step_x *x, const signed char *wk, int k, int r, int n, int *dots) {
    const __m256i ones = _mm256_set1_epi16(1);
    const long at = (long)(r / 16) * x->nc + k;
    const signed char *a = x->xq + at * TILE_BYTES + (r % 16) * 64;
    __m256i acc[4][2];
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int kk = 0; kk < 16; kk++)
        for (int h = 0; h < 2; h++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wk + kk * 64 + 32 * h)), size = _mm256_abs_epi8(w);
            for (int i = 0; i < n; i++) {
                const __m256i t = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(a + i * 64 + 4 * kk)), w);
                acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(_mm256_maddubs_epi16(size, t), ones));
            }
        }
    for (int i = 0; i < n; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_si256((__m256i *)(dots + at * 256 + (r % 16 + i) * 16 + 8 * h), acc[i][h]);
}

NI_AVX2 static void dots_avx2(const step_x *x, const signed char *wq, int *dots) {
    for (int k = 0; k < x->nc; k++) {
        int r = 0;
        for (; r + 4 <= x->rows; r += 4) avx2_rows(x, wq + (long)k * TILE_BYTES, k, r, 4, dots);
        for (; r < x->rows; r++) avx2_rows(x, wq + (long)k * TILE_BYTES, k, r, 1, dots);
    }
}

#define AMX __attribute__((target("amx-tile,amx-int8,avx512f")))

typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} tile_config;

/* Every row tile's dots on AMX tiles, whole tiles: tmm0 x (A), tmm2 the shadow (B), tmm1 the dots.
 * (Prefetching the next blocks' tiles made it slower: 0.93 against 0.52 us a block.) */
AMX static void dots_amx(const step_x *x, const signed char *wq, int *dots) {
    for (int k = 0; k < x->nc; k++) {
        _tile_loadd(2, wq + (long)k * TILE_BYTES, 64);
        for (int rt = 0; rt < (x->rows + 15) / 16; rt++) {
            _tile_loadd(0, x->xq + ((long)rt * x->nc + k) * TILE_BYTES, 64);
            _tile_zero(1);
            _tile_dpbssd(1, 0, 2);
            _tile_stored(1, dots + ((long)rt * x->nc + k) * 256, 64);
        }
    }
}

/* Tiles 0-2 as 16 rows of 64 bytes. A static configuration: GCC 12 drops stores to a local one before ldtilecfg. */
static const tile_config three_tiles = {1, 0, {0}, {64, 64, 64}, {16, 16, 16}};

AMX static void tiles_on(void) { _tile_loadconfig(&three_tiles); }

AMX static void tiles_off(void) { _tile_release(); }

/* The CPU's AMX-TILE and AMX-INT8 and the kernel's permission, asked once (the instruction-set cap is applied by
 * each caller, so a first call under a lowered cap does not turn AMX off for the process). */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) {
        unsigned a, b, c, d;
        granted = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
                  syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return granted;
}
#endif

#if NI_NEON
/* weigh_256 on NEON: 16 outputs as four 4-lane vectors, each lane taking weigh_scalar's fmas in their order
 * (vfmaq_f32(a, b, c) = fmaf(b, c, a): the same bits). */
static void weigh_neon(const int *dots, int r, const float *tab, const float *xt, int nc, int n0, int valid,
                       gathered *g, float tau) {
    float32x4_t acc[4], bound[4];
    for (int h = 0; h < 4; h++) acc[h] = bound[h] = vdupq_n_f32(0.0f);
    for (int k = 0; k < nc; k++) {
        const float *t = tab + k * 48, *x = xt + k * 3;
        const float32x4_t s = vdupq_n_f32(x[0]), x1 = vdupq_n_f32(x[1]), x2 = vdupq_n_f32(x[2]);
        for (int h = 0; h < 4; h++) {
            const float32x4_t dot = vcvtq_f32_s32(vld1q_s32(dots + k * 256 + r * 16 + 4 * h));
            acc[h] = vfmaq_f32(acc[h], dot, vmulq_f32(s, vld1q_f32(t + 4 * h)));
            bound[h] = vfmaq_f32(bound[h], x1, vld1q_f32(t + 16 + 4 * h));
            bound[h] = vfmaq_f32(bound[h], x2, vld1q_f32(t + 32 + 4 * h));
        }
    }
    float lb[16], ub[16];
    uint32x4_t notable = vdupq_n_u32(0);
    const uint32x4_t first = {0, 1, 2, 3};
    for (int h = 0; h < 4; h++) {
        const float32x4_t low = vsubq_f32(acc[h], bound[h]), high = vaddq_f32(acc[h], bound[h]);
        const uint32x4_t real = vcltq_u32(vaddq_u32(first, vdupq_n_u32(4 * h)), vdupq_n_u32((uint32_t)valid));
        notable = vorrq_u32(notable, vandq_u32(real, vorrq_u32(vcgtq_f32(low, vdupq_n_f32(g->best_lb)),
                                                               vcgeq_f32(high, vdupq_n_f32(g->thr)))));
        vst1q_f32(lb + 4 * h, low);
        vst1q_f32(ub + 4 * h, high);
    }
    if (vmaxvq_u32(notable)) gather16(lb, ub, n0, valid, g, tau);
}

/* The integer dots on ARM64. Row kk of a shadow tile holds, per output j, the 4 inputs 64k + 4kk..4kk + 3 at
 * bytes 4j..4j + 3, so 16 of its bytes against a row's 4 int8 of those inputs give 4 outputs' sums: SDOT by
 * element takes them from lane kk % 4 of the row's vector kk / 4. Rows r..r + n - 1 (n = 2 or 1) of chunk k. */
#define SDOT_LANE(acc, w, t, lane) \
    __asm__(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.4b[" #lane "]" : "+w"(acc) : "w"(w), "w"(t))

NI_DOTPROD NI_INLINE void sdot_rows(const step_x *x, const signed char *wk, int k, int r, int n, int *dots) {
    const long at = (long)(r / 16) * x->nc + k;
    const signed char *a = x->xq + at * TILE_BYTES + (r % 16) * 64;
    int8x16_t t[2][4];
    int32x4_t acc[2][4];
    for (int i = 0; i < n; i++)
        for (int v = 0; v < 4; v++) {
            t[i][v] = vld1q_s8(a + i * 64 + 16 * v);
            acc[i][v] = vdupq_n_s32(0);
        }
    for (int v = 0; v < 4; v++)   /* kk = 4 v + lane */
        for (int h = 0; h < 4; h++) {   /* outputs 4 h .. 4 h + 3 */
            const signed char *w = wk + 4 * v * 64 + 16 * h;
            const int8x16_t w0 = vld1q_s8(w), w1 = vld1q_s8(w + 64), w2 = vld1q_s8(w + 128), w3 = vld1q_s8(w + 192);
            for (int i = 0; i < n; i++) {
                SDOT_LANE(acc[i][h], w0, t[i][v], 0);
                SDOT_LANE(acc[i][h], w1, t[i][v], 1);
                SDOT_LANE(acc[i][h], w2, t[i][v], 2);
                SDOT_LANE(acc[i][h], w3, t[i][v], 3);
            }
        }
    for (int i = 0; i < n; i++)
        for (int h = 0; h < 4; h++) vst1q_s32(dots + at * 256 + (r % 16 + i) * 16 + 4 * h, acc[i][h]);
}

NI_DOTPROD static void dots_sdot(const step_x *x, const signed char *wq, int *dots) {
    for (int k = 0; k < x->nc; k++) {
        int r = 0;
        for (; r + 2 <= x->rows; r += 2) sdot_rows(x, wq + (long)k * TILE_BYTES, k, r, 2, dots);
        for (; r < x->rows; r++) sdot_rows(x, wq + (long)k * TILE_BYTES, k, r, 1, dots);
    }
}

/* Without dotprod: a row's 4 int8 (twice) times 8 bytes of row kk (2 outputs x 4 inputs) in int16 (|q t| <=
 * 16,129), adjacent products added into int32 lanes (2 per output), the pairs added at the end. */
static void dots_neon(const step_x *x, const signed char *wq, int *dots) {
    for (int r = 0; r < x->rows; r++)
        for (int k = 0; k < x->nc; k++) {
            const long at = (long)(r / 16) * x->nc + k;
            const signed char *a = x->xq + at * TILE_BYTES + (r % 16) * 64, *wk = wq + (long)k * TILE_BYTES;
            int32x4_t acc[8];   /* acc[p]: outputs 2p, 2p + 1, each as two partial sums */
            for (int p = 0; p < 8; p++) acc[p] = vdupq_n_s32(0);
            for (int kk = 0; kk < 16; kk++) {
                const int8x8_t t = vreinterpret_s8_s32(vdup_n_s32(four_bytes(a + 4 * kk)));
                for (int p = 0; p < 8; p++) acc[p] = vpadalq_s16(acc[p], vmull_s8(vld1_s8(wk + kk * 64 + 8 * p), t));
            }
            for (int q = 0; q < 4; q++)
                vst1q_s32(dots + at * 256 + (r % 16) * 16 + 4 * q, vpaddq_s32(acc[2 * q], acc[2 * q + 1]));
        }
}
#endif

/* The same integer dots in plain C. */
static void dots_scalar(const step_x *x, const signed char *wq, int *dots) {
    for (int r = 0; r < x->rows; r++)
        for (int k = 0; k < x->nc; k++) {
            const long at = (long)(r / 16) * x->nc + k;
            const signed char *a = x->xq + at * TILE_BYTES + (r % 16) * 64, *w = wq + (long)k * TILE_BYTES;
            for (int j = 0; j < 16; j++) {
                int sum = 0;
                for (int kk = 0; kk < 16; kk++)
                    for (int e = 0; e < 4; e++) sum += a[4 * kk + e] * w[kk * 64 + 4 * j + e];
                dots[at * 256 + (r % 16) * 16 + j] = sum;
            }
        }
}

int ni_greedy_dots(int most) {
#if NI_X86
    if (most >= NI_DOTS_AMX && ni_has_avx512() && amx_granted()) return NI_DOTS_AMX;
    if (most >= NI_DOTS_VNNI && ni_has_avx512() && __builtin_cpu_supports("avx512vnni")) return NI_DOTS_VNNI;
    if (most >= NI_DOTS_AVX512 && ni_has_avx512()) return NI_DOTS_AVX512;
    if (most >= NI_DOTS_AVX2 && ni_has_avx2()) return NI_DOTS_AVX2;
#elif NI_NEON
    if (most >= NI_DOTS_SDOT && ni_has_neon() && ni_has_dotprod()) return NI_DOTS_SDOT;
    if (most >= NI_DOTS_NEON && ni_has_neon()) return NI_DOTS_NEON;
#endif
    return NI_DOTS_PORTABLE;
}

/* One ni_greedy_candidates call's step, as each worker's range of blocks reads it. */
typedef struct {
    const step_x *step;
    void (*dots_of)(const step_x *, const signed char *, int *);
    const signed char *wq;
    const float *tab, *xt, *tau;
    int R, nc, rt_count, valid, path, wide, narrow;
    gathered *all;   /* worker t's row r: all[t * R + r] */
} candidates_job;

/* Blocks [first, last) of the head: each row's candidates among them, gathered in the worker's lists. */
static void candidate_blocks(void *ctx, long first, long last, int worker) {
    const candidates_job *j = ctx;
    const step_x step = *j->step;
    void (*const dots_of)(const step_x *, const signed char *, int *) = j->dots_of;
    const signed char *wq = j->wq;
    const float *tab = j->tab, *xt = j->xt, *tau = j->tau;
    const int R = j->R, nc = j->nc, rt_count = j->rt_count, valid = j->valid, path = j->path;
    const int wide = j->wide, narrow = j->narrow;
    (void)path, (void)wide, (void)narrow;
    int *dots = calloc(256 * (size_t)rt_count * nc, sizeof(int));   /* rows past R: 0 (paths write 0 or skip them) */
    gathered *mine = j->all + (long)worker * R;
#if NI_X86
    if (path == NI_DOTS_AMX) tiles_on();
#endif
    for (long b = first; b < last; b++) {
        dots_of(&step, wq + (long)b * nc * TILE_BYTES, dots);
        const int n0 = 16 * (int)b, real = valid - n0 < 16 ? valid - n0 : 16;
        const float *t = tab + (long)b * nc * 48;
#if NI_X86
        if (wide)
            for (int r = 0; r < R; r += R - r >= 8 ? 8 : 1)
                (R - r >= 8 ? weigh8_512 : weigh1_512)(dots + (long)(r / 16) * nc * 256, r % 16, t,
                                                       xt + (long)r * nc * 3, nc, n0, real, mine + r, tau + r);
        else if (narrow)
            for (int r = 0; r < R; r++)
                weigh_256(dots + (long)(r / 16) * nc * 256, r % 16, t, xt + (long)r * nc * 3, nc, n0, real, &mine[r],
                          tau[r]);
        else
#elif NI_NEON
        if (narrow)
            for (int r = 0; r < R; r++)
                weigh_neon(dots + (long)(r / 16) * nc * 256, r % 16, t, xt + (long)r * nc * 3, nc, n0, real, &mine[r],
                           tau[r]);
        else
#endif
            for (int r = 0; r < R; r++)
                weigh_scalar(dots + (long)(r / 16) * nc * 256, r % 16, t, xt + (long)r * nc * 3, nc, n0, real,
                             &mine[r], tau[r]);
    }
#if NI_X86
    if (path == NI_DOTS_AMX) tiles_off();
#endif
    free(dots);
}

void ni_greedy_candidates(const float *x, long xs, int R, int K, int nc, const signed char *wq, const float *tab,
                         const float *chunk_max, int blocks, int valid, double rho, int cap, int *cand, int *counts,
                         int most, int threads) {
    const int rt_count = (R + 15) / 16;
    signed char *xq = aligned_alloc(64, (size_t)rt_count * nc * TILE_BYTES);   /* A tiles: whole cache lines */
    memset(xq, 0, (size_t)rt_count * nc * TILE_BYTES);
    float *xt = malloc(sizeof(float) * (size_t)R * nc * 3);   /* per row and chunk: s, X1, U */
    float *tau = malloc(sizeof(float) * (size_t)R);
    int *bias = calloc((size_t)rt_count * nc * 16, sizeof(int));
    unsigned char *undecided = calloc((size_t)R, 1);   /* a non-finite x, or too many candidates */
    for (int r = 0; r < R; r++) {
        for (int e = 0; e < K; e++) undecided[r] |= !isfinite(x[r * xs + e]);
        double estimate = 0.0, bound = 0.0;   /* the largest |estimate| and bound row r can have */
        for (int k = 0; k < nc; k++) {
            float *t = xt + ((long)r * nc + k) * 3;
            t[0] = t[1] = t[2] = 0.0f;        /* an undecided row's: estimates and bounds 0 */
            if (undecided[r]) continue;
            const int n = K - CHUNK * k < CHUNK ? K - CHUNK * k : CHUNK;
            signed char q[CHUNK];
            float s;
            double top, sum_t;
            const double err = quantize_chunk(x + r * xs + CHUNK * k, n, q, &s, &top, &sum_t);
            const long at = (long)(r / 16) * nc + k;
            for (int e = 0; e < CHUNK; e++) {
                xq[at * TILE_BYTES + (r % 16) * 64 + e] = q[e];
                bias[at * 16 + r % 16] += 128 * q[e];
            }
            t[0] = s;
            t[1] = round_up(err + rho * top);
            t[2] = round_up((double)s * sum_t);
            estimate += 127.0 * chunk_max[k] * t[2];
            bound += t[1] * chunk_max[nc + k] + t[2] * chunk_max[2 * nc + k];
        }
        tau[r] = round_up((estimate + bound) * 0x1p-16 + 1e-30);
    }
    /* the weighing: 16 lanes (wide), 8 or NEON's 4 (narrow), or plain C, as the instruction-set cap allows */
    const int path = ni_greedy_dots(most);
    void (*dots_of)(const step_x *, const signed char *, int *) = dots_scalar;
#if NI_X86
    const int wide = ni_has_avx512(), narrow = ni_has_avx2();
    dots_of = path == NI_DOTS_AMX ? dots_amx : path == NI_DOTS_VNNI ? dots_vnni : path == NI_DOTS_AVX512 ? dots_avx512
            : path == NI_DOTS_AVX2 ? dots_avx2 : dots_scalar;
#elif NI_NEON
    const int wide = 0, narrow = ni_has_neon();
    dots_of = path == NI_DOTS_SDOT ? dots_sdot : path == NI_DOTS_NEON ? dots_neon : dots_scalar;
#else
    const int wide = 0, narrow = 0;
#endif
    const step_x step = {xq, bias, nc, R};
    gathered *all = malloc(sizeof(gathered) * (size_t)threads * R);   /* thread t's row r: all[t * R + r] */
    for (long i = 0; i < (long)threads * R; i++)
        all[i] = (gathered){malloc(sizeof(int) * 256), 0, 256, 0, malloc(sizeof(float) * 256), -INFINITY, -INFINITY};
    candidates_job job = {&step, dots_of, wq, tab, xt, tau, R, nc, rt_count, valid, path, wide, narrow, all};
    ni_parallel_for(blocks, threads, candidate_blocks, &job);
    /* Every thread's candidates of row r, in output order, against the row's best lower bound. */
    for (int r = 0; r < R; r++) {
        float best = -INFINITY;
        for (int t = 0; t < threads; t++) {
            const gathered *g = all + (long)t * R + r;
            best = g->best_lb > best ? g->best_lb : best;
            undecided[r] |= g->overflow;
        }
        counts[r] = 0;
        for (int t = 0; t < threads && !undecided[r]; t++) {
            const gathered *g = all + (long)t * R + r;
            for (int c = 0; c < g->count && !undecided[r]; c++)
                if (g->ub[c] >= best - tau[r]) {
                    undecided[r] = counts[r] == cap;
                    if (!undecided[r]) cand[(long)r * cap + counts[r]++] = g->index[c];
                }
        }
        if (undecided[r]) counts[r] = -1;
    }
    for (long i = 0; i < (long)threads * R; i++) {
        free(all[i].index);
        free(all[i].ub);
    }
    free(all), free(xq), free(xt), free(tau), free(bias), free(undecided);
}
