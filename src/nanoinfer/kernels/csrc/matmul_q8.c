/* The int8 activation tier's matmul: y (M, N) = x (M, K) W^T with x quantized row by row (q8.h) and W's packed
 * blocks read as integers, for a group of up to Q8_WIDE_GROUP outputs (ni_matmul_q8 in matmul.c splits the outputs
 * in such groups across threads, as ni_matmul does).
 *
 * Each 32-weight chunk c of an output's row is integers w_k with an fp32 scale a_c and, for the kinds with a
 * min, an fp32 b_c, the values gguf's dequantize gives being a_c w_k (+ b_c):
 *   Q8_0 q, d   Q4_0 q - 8, d   Q5_0 q - 16, d   IQ4_NL table[q], d   Q6_K sc_j (q - 32), d   (sc_j: the int8
 *   scale of each 16 weights, folded into the integer)   Q4_1, Q5_1 q, d, b = m   Q4_K, Q5_K q, d sc, b = -(dmin mn)
 * (every a_c and b_c an exact product of the block's values, as quants.h computes them). With a row's chunk
 * (t_k, d_c, sumt_c) from q8.h, isum_c = sum_k w_k t_k is an exact integer (|isum_c| < 2^24 for every kind, so
 * (float) isum_c is exact too), and each output is the one fp32 sequence
 *   acc = 0; for c in k order: acc = fma(isum_c, a_c * d_c, acc); then, with a min, acc = fma(b_c, d_c * sumt_c, acc)
 *   y = acc (+ bias, added by matmul.c)
 * on every path: the portable C below defines it; AVX2 and AVX-512 compute isum_c with other integer operations
 * (exact: vpmaddubsw's int16 pairs stay below 2 * 128 * 127 = 32512, no saturation) and then the same fp32
 * operations, eight outputs in the eight lanes of a vector (sixteen in a 512-bit one: AVX-512 VNNI with more than
 * Q8_FEW_ROWS rows, q8_panel). So a row's bits do not depend on the batch, the thread count or the instruction
 * set.
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "neon.h"
#include "q8.h"
#include "quants.h"

/* ---- the portable path: the definition ------------------------------------------------------------------ */
/* Chunk b of a row as integers w[32] (offsets, table and Q6_K's sub-scales folded in), its scale *a and min *b
 * (0 without one). */
void q8_chunk_weights(int kind, const uint8_t *row, int b, int16_t w[32], float *a, float *min) {
    int sub;
    const uint8_t *blk = chunk_block(kind, row, b, &sub);
    *min = 0.0f;
    switch (kind) {
    case NI_Q8_0:
        *a = read_half(blk);
        for (int j = 0; j < 32; j++) w[j] = (int8_t)blk[2 + j];
        break;
    case NI_Q4_0: case NI_IQ4_NL:
        *a = read_half(blk);
        for (int j = 0; j < 32; j++) w[j] = kind == NI_Q4_0 ? nibble(blk + 2, j) - 8 : IQ4_NL_VALUES[nibble(blk + 2, j)];
        break;
    case NI_Q4_1:
        *a = read_half(blk);
        *min = read_half(blk + 2);
        for (int j = 0; j < 32; j++) w[j] = nibble(blk + 4, j);
        break;
    case NI_Q5_0: case NI_Q5_1: {
        const int with_min = kind == NI_Q5_1;
        const uint32_t fifth = read_u32(blk + 2 + 2 * with_min);
        *a = read_half(blk);
        if (with_min) *min = read_half(blk + 2);
        for (int j = 0; j < 32; j++) {
            const int q = nibble(blk + 6 + 2 * with_min, j) | (int)((fifth >> j) & 1) << 4;
            w[j] = with_min ? q : q - 16;
        }
        break;
    }
    case NI_Q4_K: case NI_Q5_K: {
        float scale, m;
        k_chunk_scale(blk, sub, read_half(blk), read_half(blk + 2), &scale, &m);
        *a = scale;
        *min = -m;
        const int fifths = kind == NI_Q5_K;
        const uint8_t *nibbles = blk + 16 + 32 * fifths + 32 * (sub / 2);
        for (int j = 0; j < 32; j++) {
            int q = (nibbles[j] >> (4 * (sub % 2))) & 0x0F;
            if (fifths) q |= ((blk[16 + j] >> sub) & 1) << 4;
            w[j] = q;
        }
        break;
    }
    default: {   /* NI_Q6_K */
        const int8_t *scales = (const int8_t *)(blk + 192);
        const uint8_t *ql = blk + q6_ql_at(sub), *qh = blk + 128 + 32 * (sub / 4);
        *a = read_half(blk + 208);
        for (int j = 0; j < 32; j++) {
            const int q = ((ql[j] >> q6_ql_shift(sub)) & 0x0F) | ((qh[j] >> (2 * (sub % 4))) & 3) << 4;
            w[j] = scales[2 * sub + j / 16] * (q - 32);
        }
        break;
    }
    }
}

/* scratch: K int16 and 2 K / 32 floats */
static void q8_group_scalar(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M, int K,
                            float *y, long ys, void *scratch) {
    const int chunks = K / 32, with_min = q8_has_min(kind);
    int16_t *w = scratch;
    float *a = (float *)(w + K), *b = a + chunks;
    for (int o = 0; o < C; o++) {
        for (int c = 0; c < chunks; c++) q8_chunk_weights(kind, w0 + o * row_bytes, c, w + 32 * c, a + c, b + c);
        for (int m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int c = 0; c < chunks; c++) {
                const long at = q8_at(M, m, c);
                int32_t isum = 0;
                for (int j = 0; j < 32; j++) isum += w[32 * c + j] * xq->t[32 * at + j];
                acc = q8_step(acc, isum, a[c], b[c], xq->d[at], xq->dsumt[at], with_min);
            }
            y[m * ys + o] = acc;
        }
    }
}

#if NI_X86
#define NI_VNNI __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define Q8_TILE_ROWS 8   /* rows whose accumulators a chunk's decoded weights serve before the next chunk */
#define Q8_PANEL_ROWS 16        /* rows whose accumulators a panel serves before the next (q8_panel_rows) */

/* ---- AVX2 and AVX-512 VNNI: eight outputs in the lanes of a vector -------------------------------------- */
/* Q5_0/Q5_1's fifth bits as 0x10 bytes: byte j of the low 128 bits from bit 8 first_lo + j of the word lo, byte j
 * of the high 128 bits from bit 8 first_hi + j of hi (j < 16; firsts in bytes). */
NI_AVX2 static inline __m256i q5_fifths(uint32_t lo, uint32_t hi, int first_lo, int first_hi) {
    const long long ones = 0x0101010101010101LL;
    /* byte j of each half takes byte j / 8 of its word (from first), and keeps bit j % 8: 0xFF where it is set */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_setr_epi32((int)lo, (int)lo, (int)lo, (int)lo, (int)hi, (int)hi, (int)hi, (int)hi),
        _mm256_setr_epi64x(first_lo * ones, (first_lo + 1) * ones, first_hi * ones, (first_hi + 1) * ones));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* The same 0x10 bytes where bit j of `bits` is set (byte j), one masked move (AVX-512 BW and VL): the VNNI path's
 * fifth bits, a third of q5_fifths' instructions. */
NI_VNNI static inline __m256i q5_fifths_vnni(uint32_t bits) {
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
}

/* Chunk b of a row as 32 bytes: q (0..31, Q6_K's 0..63) for the kinds with a min and for Q4_0, Q5_0 and Q6_K
 * (their offset o is taken off the sum: sum (q - o) t = sum q t - o sumt, Q6_K's per 16 weights, q8_tile); the
 * signed integers of Q8_0 and IQ4_NL. */
NI_AVX2 static inline __attribute__((always_inline)) __m256i q8_bytes_avx2(int kind, const uint8_t *row, int b,
                                                                          const int vnni) {
    int sub;
    const uint8_t *blk = chunk_block(kind, row, b, &sub);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (kind) {
    case NI_Q8_0: return _mm256_loadu_si256((const __m256i *)(blk + 2));
    case NI_Q4_0: case NI_Q4_1: case NI_IQ4_NL: {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + (kind == NI_Q4_1 ? 4 : 2)));
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low4);
        if (kind != NI_IQ4_NL) return q;
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES)), q);
    }
    case NI_Q5_0: case NI_Q5_1: {
        const int with_min = kind == NI_Q5_1;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 6 + 2 * with_min));
        const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low4);
        const uint32_t fifths = read_u32(blk + 2 + 2 * with_min);
        return _mm256_or_si256(q, vnni ? q5_fifths_vnni(fifths) : q5_fifths(fifths, fifths, 0, 2));
    }
    case NI_Q6_K: return _mm256_add_epi8(k_quant_bytes_avx2(kind, blk, sub), _mm256_set1_epi8(32));   /* q */
    default: return k_quant_bytes_avx2(kind, blk, sub);   /* Q4_K, Q5_K */
    }
}

static inline int q8_signed(int kind) { return kind == NI_Q8_0 || kind == NI_IQ4_NL; }

/* VNNI's weights of a signed kind as the unsigned bytes vpdpbusd reads: w ^ 0x80 = w + 128 (the offset of 128 sumt
 * taken off the sum, as Q4_0's 8 sumt); other kinds and AVX2 as they are. */
NI_AVX2 static inline __m256i q8_unsigned(int kind, __m256i w, const int vnni) {
    return vnni && q8_signed(kind) ? _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)) : w;
}

/* The offset o of each weight taken off the sum, sum (w - o) t = sum w t - o sumt: Q4_0's 8, Q5_0's 16, and 128
 * for VNNI's signed kinds (q8_unsigned). */
static inline int q8_offset(int kind, const int vnni) {
    return kind == NI_Q4_0 ? 8 : kind == NI_Q5_0 ? 16 : vnni && q8_signed(kind) ? 128 : 0;
}

/* Whether a tile of M rows reads two outputs per vector (q8_tile's `paired`). Q4_K only from Q8_FEW_ROWS + 1 rows:
 * streaming its weights, a row or two ran 10% faster reading each output's 32 nibble bytes once for two chunks
 * (2 threads, Zen 4, weights from memory), while 32 rows on AVX2 run 1.23x as fast paired. */
static inline int q8_pairs(int kind, int M) {
    return kind == NI_Q4_0 || kind == NI_Q4_1 || kind == NI_IQ4_NL || kind == NI_Q5_0 || kind == NI_Q5_1 ||
           (kind == NI_Q4_K && M > Q8_FEW_ROWS);
}

/* The kinds whose panels are made from the stored bytes: VNNI's by q8_panel_direct, AVX2's (of these, only the
 * unsigned Q4_0 and Q4_1 reach its panels) by q8_half_direct (Q5_0/Q5_1's fifth bits, spread to the transposed
 * lanes, cost more than their shuffles save: VNNI, 8 rows, 5% slower). */
static inline int q8_direct_panel(int kind) {
    return kind == NI_Q8_0 || kind == NI_Q4_0 || kind == NI_Q4_1 || kind == NI_IQ4_NL;
}

/* Where a block's 16 nibble bytes start (the paired kinds but Q4_K). */
static inline int q8_nibbles_at(int kind) {
    return kind == NI_Q4_1 ? 4 : kind == NI_Q5_0 ? 6 : kind == NI_Q5_1 ? 8 : 2;
}

/* vpdpbusd: acc + the dot of each 4 unsigned bytes of u with the signed bytes of s (AVX512-VNNI with VL), as
 * inline assembly so that one body (q8_tile) serves the AVX2 and the VNNI path. */
NI_AVX2 static inline __m256i q8_dpbusd(__m256i acc, __m256i u, __m256i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

/* 8 int32 partial sums of one output's chunk: w's 32 bytes (as q8_bytes_avx2 gives them; VNNI's signed kinds as
 * w ^ 0x80 = w + 128, q8_unsigned) times t's, lanes 0-3 over weights 0-15, lanes 4-7 over 16-31. */
NI_AVX2 static inline __attribute__((always_inline)) __m256i q8_dot(int kind, __m256i w, __m256i t, const int vnni) {
    if (q8_signed(kind) && !vnni) {   /* |w| times t with w's sign */
        t = _mm256_sign_epi8(t, w);
        w = _mm256_abs_epi8(w);
    }
    if (vnni) return q8_dpbusd(_mm256_setzero_si256(), w, t);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, t), _mm256_set1_epi16(1));
}

/* q8_dot(w_lo, t_lo) + q8_dot(w_hi, t_hi) (q8_tile's paired kinds), fewer instructions: VNNI's second vpdpbusd adds
 * onto the first; AVX2 adds the two vpmaddubsw pair sums before widening them where that cannot leave int16:
 * weights of 5 bits at most, unsigned (all but IQ4_NL: 2 x 2 x 31 x 127 = 15,748). */
NI_AVX2 static inline __attribute__((always_inline)) __m256i q8_dot2(int kind, __m256i w_lo, __m256i t_lo,
                                                                    __m256i w_hi, __m256i t_hi, const int vnni) {
    if (vnni) return q8_dpbusd(q8_dpbusd(_mm256_setzero_si256(), w_lo, t_lo), w_hi, t_hi);
    if (kind == NI_IQ4_NL) return _mm256_add_epi32(q8_dot(kind, w_lo, t_lo, 0), q8_dot(kind, w_hi, t_hi, 0));
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w_lo, t_lo), _mm256_maddubs_epi16(w_hi, t_hi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* Lane o of lo: the sum of p[o]'s lanes 0-3, of hi: of its lanes 4-7 (integers: exact in any order). */
NI_AVX2 static inline void q8_sum8x8_halves(const __m256i p[8], __m256i *lo, __m256i *hi) {
    /* a: lanes 0-3 of p[0..3] summed, then lanes 4-7; b the same of p[4..7] */
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    *lo = _mm256_permute2x128_si256(a, b, 0x20);
    *hi = _mm256_permute2x128_si256(a, b, 0x31);
}

/* Lane o of the result: the sum of p[o]'s 8 lanes. */
NI_AVX2 static inline __m256i q8_sum8x8(const __m256i p[8]) {
    __m256i lo, hi;
    q8_sum8x8_halves(p, &lo, &hi);
    return _mm256_add_epi32(lo, hi);
}

/* Q6_K's chunk sums, lanes = outputs: sc_lo (sum_lo - 32 sumt_lo) + sc_hi (sum_hi - 32 sumt_hi), sum_lo and sum_hi
 * the sums of q t over the chunk's weights 0-15 and 16-31, sc_lo and sc_hi their int8 scales. */
NI_AVX2 static inline __m256i q6_isum(__m256i sum_lo, __m256i sum_hi, __m256i sc_lo, __m256i sc_hi, int32_t sumt_lo,
                                      int32_t sumt) {
    const __m256i lo = _mm256_sub_epi32(sum_lo, _mm256_set1_epi32(32 * sumt_lo));
    const __m256i hi = _mm256_sub_epi32(sum_hi, _mm256_set1_epi32(32 * (sumt - sumt_lo)));
    return _mm256_add_epi32(_mm256_mullo_epi32(lo, sc_lo), _mm256_mullo_epi32(hi, sc_hi));
}

/* The output in lane l of a tile's sums: l, or (`paired` tiles) 0, 2, 4, 6, 1, 3, 5, 7. */
static inline int q8_lane_output(int l, const int paired) { return paired ? l < 4 ? 2 * l : 2 * l - 7 : l; }

/* The int32 at `at` + o row_bytes of each lane's output o < C (others 0), loaded one by one: a gather took half the time
 * of a batch-1 Q4_1 matmul (AVX-512 VNNI, Zen 4). */
NI_AVX2 static inline __attribute__((always_inline)) __m256i q8_words(const uint8_t *at, long row_bytes, int C,
                                                                      const int paired) {
    uint32_t v[8];
    for (int l = 0; l < 8; l++) {
        const int o = q8_lane_output(l, paired);
        v[l] = o < C ? read_u32(at + o * row_bytes) : 0;
    }
    return _mm256_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], (int)v[6], (int)v[7]);
}

/* The two halves at `at` + o row_bytes of the outputs o < C (others 0), as fp32: lo the first, hi the second
 * (the exact conversions read_half makes). */
NI_AVX2 static inline __attribute__((always_inline)) void q8_halves(const uint8_t *at, long row_bytes, int C,
                                                                   const int paired, __m256 *lo, __m256 *hi) {
    const __m256i split = _mm256_shuffle_epi8(q8_words(at, row_bytes, C, paired),
                                              _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                               0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i halves = _mm256_permute4x64_epi64(split, 0xD8);   /* lo of outputs 0-7, then hi of 0-7 */
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

/* Q4_K/Q5_K: the 8 chunks' a = d sc and b = -(dmin mn) of a super-block at `blk` (output 0's), lanes = outputs
 * (q8_lane_output): k_scale_min's bits, 4 chunks per 32-bit word. */
NI_AVX2 static inline __attribute__((always_inline)) void k_factors(const uint8_t *blk, long row_bytes, int C,
                                                                   const int paired, __m256 a[8], __m256 b[8]) {
    __m256 d, dmin;
    q8_halves(blk, row_bytes, C, paired, &d, &dmin);
    const __m256i low = q8_words(blk + 4, row_bytes, C, paired), mid = q8_words(blk + 8, row_bytes, C, paired);
    const __m256i high = q8_words(blk + 12, row_bytes, C, paired);
    const __m256i m6 = _mm256_set1_epi32(0x3F), m4 = _mm256_set1_epi32(0x0F), top2 = _mm256_set1_epi32(0x30);
    for (int s = 0; s < 4; s++) {
        const __m128i by = _mm_cvtsi32_si128(8 * s), by2 = _mm_cvtsi32_si128(8 * s + 2), by4 = _mm_cvtsi32_si128(8 * s + 4);
        const __m256i sc_lo = _mm256_and_si256(_mm256_srl_epi32(low, by), m6);
        const __m256i mn_lo = _mm256_and_si256(_mm256_srl_epi32(mid, by), m6);
        const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(high, by), m4),
                                              _mm256_and_si256(_mm256_srl_epi32(low, by2), top2));
        const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(high, by4), m4),
                                              _mm256_and_si256(_mm256_srl_epi32(mid, by2), top2));
        const __m256 minus = _mm256_set1_ps(-0.0f);
        a[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc_lo));
        a[s + 4] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc_hi));
        b[s] = _mm256_xor_ps(minus, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn_lo)));
        b[s + 4] = _mm256_xor_ps(minus, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn_hi)));
    }
}

/* What a tile carries from chunk to chunk: a K-quant super-block's scales a and b (q8_scales) and Q4_K's nibble
 * bytes (q8_chunk_bytes), zero at the start (q8_state_init). */
typedef struct {
    __m256 a[8], b[8];
    __m256i nibbles[8];
} q8_state;

NI_AVX2 static inline void q8_state_init(q8_state *st) {
    for (int s = 0; s < 8; s++) {
        st->a[s] = st->b[s] = _mm256_setzero_ps();
        st->nibbles[s] = _mm256_setzero_si256();
    }
}

/* A chunk's scales, lanes = outputs (q8_lane_output): *ac = a_c, *bc = b_c. a and b hold a K-quant super-block's
 * 8 chunks' (read at its first chunk), else the chunk's own in a[0], b[0]. */
NI_AVX2 static inline __attribute__((always_inline)) void q8_scales(const int kind, const uint8_t *blk, long row_bytes,
                                                                   int C, int sub, const int paired, __m256 a[8],
                                                                   __m256 b[8], __m256 *ac, __m256 *bc) {
    const int super = is_k_quant(kind);
    if (!super) {
        q8_halves(blk, row_bytes, C, paired, &a[0], &b[0]);
    } else if (sub == 0 && kind == NI_Q6_K) {
        __m256 ignored;
        q8_halves(blk + 206, row_bytes, C, 0, &ignored, &a[0]);   /* d, the block's last two bytes */
    } else if (sub == 0) {
        k_factors(blk, row_bytes, C, paired, a, b);
    }
    *ac = super && kind != NI_Q6_K ? a[sub] : a[0];
    *bc = super && kind != NI_Q6_K ? b[sub] : b[0];
}

/* Chunk c's 32 bytes of each output o < C (q8_bytes_avx2, then q8_unsigned; 0 past C) in w[o]. Q4_K reads each
 * output's 32 nibble bytes once for two chunks: nibbles[o] keeps them from an even chunk to the next. */
NI_AVX2 static inline __attribute__((always_inline)) void q8_chunk_bytes(const int kind, const uint8_t *w0,
                                                                        long row_bytes, int C, int c,
                                                                        __m256i nibbles[8], __m256i w[8],
                                                                        const int vnni) {
    const int sub = c & 7;
    for (int o = 0; kind == NI_Q4_K && o < 8; o++) {
        const uint8_t *blk = w0 + block_bytes(kind) * (c >> 3);
        if (!(sub & 1))
            nibbles[o] = o < C ? _mm256_loadu_si256((const __m256i *)(blk + o * row_bytes + 16 + 16 * sub))
                               : _mm256_setzero_si256();
        w[o] = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(nibbles[o], 4) : nibbles[o], _mm256_set1_epi8(0x0F));
    }
    for (int o = 0; kind != NI_Q4_K && o < 8; o++)
        w[o] = o < C ? q8_unsigned(kind, q8_bytes_avx2(kind, w0 + o * row_bytes, c, vnni), vnni)
                     : _mm256_setzero_si256();
}

/* Q6_K's int8 scales of chunk `sub`'s halves (weights 0-15, 16-31), lanes = outputs. */
NI_AVX2 static inline __attribute__((always_inline)) void q6_scales(const uint8_t *blk, long row_bytes, int C, int sub,
                                                                   __m256i *sc_lo, __m256i *sc_hi) {
    const __m256i pairs = q8_words(blk + 192 + 2 * sub, row_bytes, C, 0);
    *sc_lo = _mm256_srai_epi32(_mm256_slli_epi32(pairs, 24), 24);
    *sc_hi = _mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 24);
}

/* Chunks per 64-byte line of a row (at least 1): how often q8_tile fetches ahead. */
static inline int q8_chunks_per_line(int kind) {
    const int per_line = 64 * (block_weights(kind) / 32) / block_bytes(kind);
    return per_line > 1 ? per_line : 1;
}

/* C <= 8 outputs (rows w0 + o row_bytes) for rows m0 .. m0 + R - 1 of xq: each chunk's weights decoded once for
 * the R rows. Each row's chunk sums come from a dot per output summed across lanes (q8_dot, q8_sum8x8), or
 * (`paired`: Q4_0, Q4_1, IQ4_NL, Q5_0, Q5_1) from two outputs per vector, the 16 low nibbles of each beside each
 * other and then the 16 high ones (with their fifth bits), against the row's inputs 0-15 and 16-31 in both halves:
 * half the dots and three sums across lanes, the outputs in lanes 0, 2, 4, 6, 1, 3, 5, 7 (q8_lane_output). Q6_K's
 * q (0..63) are summed per 16 weights, then scaled in int32 with the offset taken off (q6_isum): no per-output
 * scales. With `fetch`, each line's first chunk also fetches the outputs' bytes Q8_AHEAD further on (q8.h). */
NI_AVX2 static inline __attribute__((always_inline)) void q8_tile(const int kind, const uint8_t *w0, long row_bytes,
                                                                 int C, const ni_q8_rows *xq, int M, int m0, int R,
                                                                 int K, float *y, long ys, const int vnni,
                                                                 const int fetch, const int paired) {
    const int chunks = K / 32, with_min = q8_has_min(kind), super = is_k_quant(kind);
    const int q6 = kind == NI_Q6_K;   /* the offset and the scale per 16 weights: q6_isum */
    const int offset = q8_offset(kind, vnni);
    __m256 acc[Q8_TILE_ROWS];
    q8_state st;
    q8_state_init(&st);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const uint8_t *blk = w0 + block_bytes(kind) * (super ? c >> 3 : c);
        const int sub = c & 7;
        if (fetch && c % q8_chunks_per_line(kind) == 0)   /* chunk c's bytes (Q6_K's a quarter byte early) */
            for (int o = 0; o < C; o++)
                __builtin_prefetch(w0 + o * row_bytes + (long)block_bytes(kind) * c / (block_weights(kind) / 32) +
                                   Q8_AHEAD, 0, 2);
        __m256 ac, bc;
        q8_scales(kind, blk, row_bytes, C, sub, paired, st.a, st.b, &ac, &bc);
        __m256i w[8];
        for (int p = 0; paired && kind == NI_Q4_K && p < 4; p++) {
            /* w[p]: weights 0-15 of outputs 2p, 2p + 1, w[4 + p] 16-31: nibble sub % 2 of 32 bytes */
            const uint8_t *bytes = blk + 16 + 32 * (sub / 2) + 2 * p * row_bytes;
            const __m128i zero = _mm_setzero_si128();
            const int first = 2 * p < C, second = 2 * p + 1 < C;
            const __m256i lo = _mm256_set_m128i(second ? _mm_loadu_si128((const __m128i *)(bytes + row_bytes)) : zero,
                                                first ? _mm_loadu_si128((const __m128i *)bytes) : zero);
            const __m256i hi = _mm256_set_m128i(second ? _mm_loadu_si128((const __m128i *)(bytes + row_bytes + 16)) : zero,
                                                first ? _mm_loadu_si128((const __m128i *)(bytes + 16)) : zero);
            const __m256i low4 = _mm256_set1_epi8(0x0F);
            w[p] = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(lo, 4) : lo, low4);
            w[4 + p] = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(hi, 4) : hi, low4);
        }
        for (int p = 0; paired && kind != NI_Q4_K && p < 4; p++) {   /* w[p]: outputs 2p, 2p + 1's low nibbles, w[4 + p] the high */
            const uint8_t *nibbles = blk + q8_nibbles_at(kind) + 2 * p * row_bytes;
            const __m128i first = 2 * p < C ? _mm_loadu_si128((const __m128i *)nibbles) : _mm_setzero_si128();
            const __m128i second = 2 * p + 1 < C ? _mm_loadu_si128((const __m128i *)(nibbles + row_bytes))
                                                 : _mm_setzero_si128();
            const __m256i both = _mm256_set_m128i(second, first), low4 = _mm256_set1_epi8(0x0F);
            w[p] = _mm256_and_si256(both, low4);
            w[4 + p] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low4);
            if (kind == NI_Q5_0 || kind == NI_Q5_1) {   /* the fifth bits of weights 0-15, then of 16-31 */
                const uint8_t *fifths = nibbles - 4;
                const uint32_t first = 2 * p < C ? read_u32(fifths) : 0;
                const uint32_t second = 2 * p + 1 < C ? read_u32(fifths + row_bytes) : 0;
                if (vnni) {   /* w[p]'s bytes: weights 0-15 of output 2p, then of 2p + 1; w[4 + p]'s: 16-31 */
                    w[p] = _mm256_or_si256(w[p], q5_fifths_vnni((first & 0xFFFF) | second << 16));
                    w[4 + p] = _mm256_or_si256(w[4 + p], q5_fifths_vnni(first >> 16 | (second & 0xFFFF0000u)));
                } else {
                    w[p] = _mm256_or_si256(w[p], q5_fifths(first, second, 0, 0));
                    w[4 + p] = _mm256_or_si256(w[4 + p], q5_fifths(first, second, 2, 2));
                }
            }
            if (kind == NI_IQ4_NL) {
                const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
                w[p] = q8_unsigned(kind, _mm256_shuffle_epi8(table, w[p]), vnni);
                w[4 + p] = q8_unsigned(kind, _mm256_shuffle_epi8(table, w[4 + p]), vnni);
            }
        }
        if (!paired) q8_chunk_bytes(kind, w0, row_bytes, C, c, st.nibbles, w, vnni);
        __m256i sc_lo = _mm256_setzero_si256(), sc_hi = sc_lo;
        if (q6) q6_scales(blk, row_bytes, C, sub, &sc_lo, &sc_hi);
        for (int r = 0; r < R; r++) {
            const long at = q8_at(M, m0 + r, c);
            __m256i isum;
            if (paired) {
                const __m256i t_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq->t + at * 32)));
                const __m256i t_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq->t + at * 32 + 16)));
                __m256i q[4];
                for (int p = 0; p < 4; p++) q[p] = q8_dot2(kind, w[p], t_lo, w[4 + p], t_hi, vnni);
                isum = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
            } else {
                const __m256i t = _mm256_loadu_si256((const __m256i *)(xq->t + at * 32));
                __m256i p[8];
                for (int o = 0; o < 8; o++) p[o] = q8_dot(kind, w[o], t, vnni);
                if (q6) {
                    __m256i lo, hi;
                    q8_sum8x8_halves(p, &lo, &hi);
                    isum = q6_isum(lo, hi, sc_lo, sc_hi, xq->sumt_lo[at], xq->sumt[at]);
                } else {
                    isum = q8_sum8x8(p);
                }
            }
            if (offset) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * xq->sumt[at]));
            const float d = xq->d[at];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ac, _mm256_set1_ps(d)), acc[r]);
            if (with_min) acc[r] = _mm256_fmadd_ps(bc, _mm256_set1_ps(xq->dsumt[at]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float out[8];
        _mm256_storeu_ps(out, acc[r]);
        for (int l = 0; l < 8; l++)
            if (q8_lane_output(l, paired) < C) y[(long)r * ys + q8_lane_output(l, paired)] = out[l];
    }
}

/* C <= Q8_WIDE_GROUP outputs in tiles of 8 (q8_tile), rows in tiles of Q8_TILE_ROWS; `kind` a constant. */
NI_AVX2 static inline __attribute__((always_inline)) void q8_tiles_of(const int kind, const uint8_t *w0,
                                                                     long row_bytes, int C, const ni_q8_rows *xq,
                                                                     int M, int K, float *y, long ys, const int vnni) {
    for (int o = 0; o < C; o += 8) {
        const int C8 = C - o < 8 ? C - o : 8;
        const uint8_t *w = w0 + o * row_bytes;
        for (int m = 0; m < M; m += Q8_TILE_ROWS) {
            const int R = M - m < Q8_TILE_ROWS ? M - m : Q8_TILE_ROWS;
            float *ym = y + m * ys + o;
            const int fetch = m == 0 && q8_fetches_itself(M, 1);   /* its first row tile streams W */
            if (C8 == 8 && R == 1 && M <= Q8_FEW_ROWS)   /* decode: constants, so no lane test, sums in registers */
                q8_tile(kind, w, row_bytes, 8, xq, M, m, 1, K, ym, ys, vnni, fetch, q8_pairs(kind, 1));
            else if (q8_pairs(kind, M))
                q8_tile(kind, w, row_bytes, C8, xq, M, m, R, K, ym, ys, vnni, fetch, 1);
            else
                q8_tile(kind, w, row_bytes, C8, xq, M, m, R, K, ym, ys, vnni, fetch, 0);
        }
    }
}

/* q8_tiles_of for each kind, the kind's switch outermost: loops around it had the compiler hoist every kind's
 * invariants to the function's start, run on each call (batch 1, SmolLM2 Q4_1 1536x576: 6% slower). */
NI_AVX2 static inline __attribute__((always_inline)) void q8_tiles(int kind, const uint8_t *w0, long row_bytes, int C,
                                                                  const ni_q8_rows *xq, int M, int K, float *y,
                                                                  long ys, const int vnni) {
    FOR_KIND(kind, q8_tiles_of(KIND, w0, row_bytes, C, xq, M, K, y, ys, vnni))
}

/* ---- more rows: outputs in the lanes of a vector, 16 (AVX-512 VNNI) or 8 (AVX2) --------------------------- */
/* Chunk c of the group's 16 outputs (lane o: output o) as every row reads it: v[g] lane o = weights 4g .. 4g + 3
 * of output o as unsigned bytes (VNNI's signed kinds as w ^ 0x80 = w + 128, the offset taken off the sum as Q4_0's
 * 8), its a_c and b_c, and Q6_K's int8 scales of its halves. The group's panels are made once (q8_panel_half) and
 * read by every tile of rows. VNNI: one vpdpbusd per 4 inputs of a row (the broadcast folded into it) serves 16
 * outputs, no sum across lanes. AVX2 (the unsigned kinds) reads each half of 8 outputs: one vpmaddubsw per 4
 * inputs, its pair sums added in int16 as far as they stay exact, then one vpmaddwd widens them
 * (q8_panel_rows_avx2): no sum across lanes either, where the tiles take three hadds per row and chunk. */
typedef struct {
    __m512i v[8];
    __m512 a, b;
    __m512i sc_lo, sc_hi;
} q8_panel;

/* v[g] lane o = 32-bit word g of w[o]: 4 weights of each of 8 outputs side by side. */
NI_AVX2 static inline void q8_transpose8(const __m256i w[8], __m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(w[i], w[i + 1]);       /* words 0, 1 | 4, 5 of outputs i, i + 1 */
        t[i + 1] = _mm256_unpackhi_epi32(w[i], w[i + 1]);   /* words 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            u[i + 2 * j] = _mm256_unpacklo_epi64(t[i + j], t[i + j + 2]);       /* word 2j | 2j + 4 of 4 outputs */
            u[i + 2 * j + 1] = _mm256_unpackhi_epi64(t[i + j], t[i + j + 2]);   /* word 2j + 1 | 2j + 5 */
        }
    for (int g = 0; g < 4; g++) {
        v[g] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x20);
        v[g + 4] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x31);
    }
}

/* q8_panel_direct's v for 8 outputs (blk + o row_bytes, o < C, 0 past C) of Q4_0 or Q4_1 on AVX2: their 16 nibble
 * bytes transposed as 4 words, outputs o and o + 4 side by side in the 128-bit lanes, then split into nibbles.
 * A third of the instructions of decoding each output's 32 weights and transposing those (q8_transpose8). */
NI_AVX2 static inline __attribute__((always_inline)) void q8_half_direct(const int kind, const uint8_t *blk,
                                                                        long row_bytes, int C, __m256i v[8]) {
    const uint8_t *nibbles = blk + q8_nibbles_at(kind);
    const __m128i zero = _mm_setzero_si128();
    __m256i z[4], t[4];
    for (int i = 0; i < 4; i++)   /* z[i]: output i in the low 128 bits, i + 4 in the high */
        z[i] = _mm256_set_m128i(i + 4 < C ? _mm_loadu_si128((const __m128i *)(nibbles + (i + 4) * row_bytes)) : zero,
                                i < C ? _mm_loadu_si128((const __m128i *)(nibbles + i * row_bytes)) : zero);
    for (int i = 0; i < 4; i += 2) {
        t[i] = _mm256_unpacklo_epi32(z[i], z[i + 1]);       /* words 0, 1 of outputs i, i + 1 per 128 bits */
        t[i + 1] = _mm256_unpackhi_epi32(z[i], z[i + 1]);   /* words 2, 3 */
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {   /* word g of the 8 outputs: their weights 4g .. 4g + 3, high nibbles 16 + 4g .. */
        const __m256i word = g % 2 ? _mm256_unpackhi_epi64(t[g / 2], t[g / 2 + 2])
                                   : _mm256_unpacklo_epi64(t[g / 2], t[g / 2 + 2]);
        v[g] = _mm256_and_si256(word, low4);
        v[g + 4] = _mm256_and_si256(_mm256_srli_epi16(word, 4), low4);
    }
}

/* The lanes 8 h .. 8 h + 7 of the `chunks` panels: outputs w0 + o row_bytes, o < C (0 past C, C <= 0 allowed),
 * for VNNI's panels (vnni: their v of q8_direct_panel's kinds left to q8_panel_direct) or AVX2's (those kinds' v
 * by q8_half_direct). */
NI_AVX2 static inline __attribute__((always_inline)) void q8_panel_half(const int kind, const uint8_t *w0,
                                                                       long row_bytes, int C, int chunks,
                                                                       q8_panel *panel, int h, const int vnni) {
    const int super = is_k_quant(kind);
    q8_state st;
    q8_state_init(&st);
    for (int c = 0; c < chunks; c++) {
        const uint8_t *blk = w0 + block_bytes(kind) * (super ? c >> 3 : c);
        const int sub = c & 7;
        q8_panel *p = panel + c;
        __m256 ac, bc;
        q8_scales(kind, blk, row_bytes, C, sub, 0, st.a, st.b, &ac, &bc);
        _mm256_store_ps((float *)&p->a + 8 * h, ac);
        _mm256_store_ps((float *)&p->b + 8 * h, bc);
        if (!q8_direct_panel(kind) || !vnni) {   /* VNNI's direct kinds: q8_panel_direct makes their v after */
            __m256i v[8];
            if (q8_direct_panel(kind)) {
                q8_half_direct(kind, blk, row_bytes, C, v);
            } else {
                __m256i w[8];
                q8_chunk_bytes(kind, w0, row_bytes, C, c, st.nibbles, w, vnni);
                q8_transpose8(w, v);
            }
            for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)&p->v[g] + h, v[g]);
        }
        if (kind == NI_Q6_K) {
            __m256i sc_lo, sc_hi;
            q6_scales(blk, row_bytes, C, sub, &sc_lo, &sc_hi);
            _mm256_store_si256((__m256i *)&p->sc_lo + h, sc_lo);
            _mm256_store_si256((__m256i *)&p->sc_hi + h, sc_hi);
        }
    }
}

/* The 128 bits at p + l stride of each l < n (0 past n) in the 128-bit lanes l of a vector. */
NI_VNNI static inline __m512i q8_load4x128(const uint8_t *p, long stride, int n) {
    __m128i q[4];
    for (int l = 0; l < 4; l++) q[l] = l < n ? _mm_loadu_si128((const __m128i *)(p + l * stride)) : _mm_setzero_si128();
    const __m512i lo = _mm512_inserti32x4(_mm512_castsi128_si512(q[0]), q[1], 1);
    return _mm512_inserti32x4(_mm512_inserti32x4(lo, q[2], 2), q[3], 3);
}

/* The 16 bytes at `at` + o row_bytes of the 16 outputs o < C (0 past C) as 4 words across the lanes: lane o of
 * p[g] = word g of output o's. */
NI_VNNI static inline __attribute__((always_inline)) void q8_transpose16x4(const uint8_t *at, long row_bytes, int C,
                                                                          __m512i p[4]) {
    __m512i z[4], t[4];
    for (int i = 0; i < 4; i++)   /* z[i]'s 128-bit lanes: outputs i, i + 4, i + 8, i + 12 */
        z[i] = q8_load4x128(at + i * row_bytes, 4 * row_bytes, C - i <= 0 ? 0 : (C - i + 3) / 4);
    for (int i = 0; i < 4; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);       /* words 0, 1 of z[i], z[i + 1] per 128 bits */
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);   /* words 2, 3 */
    }
    for (int j = 0; j < 2; j++) {   /* lane 4 l + i of p[g]: word g of z[i]'s lane l, output i + 4 l */
        p[2 * j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
        p[2 * j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
    }
}

/* The panel's v (q8_panel) of q8_direct_panel's kinds from the 16 outputs' blocks at blk, blk + row_bytes, ...
 * (o < C), their stored bytes transposed as words: Q8_0's 32 as 8; the 16 nibble bytes of the others as 4, whose
 * low nibbles are weights 4g .. 4g + 3 and high nibbles weights 16 + 4g .. . A quarter of the shuffles
 * q8_transpose8 makes of the decoded bytes (1 thread, AMD EPYC Zen 4, 8 rows: SmolLM2 Q4_1 1536x576 0.092 -> 0.083
 * ms, its Q8_0 head 49152x576 4.65 -> 4.48 ms). */
NI_VNNI static inline __attribute__((always_inline)) void q8_panel_direct(const int kind, const uint8_t *blk,
                                                                         long row_bytes, int C, __m512i v[8]) {
    if (kind == NI_Q8_0) {
        q8_transpose16x4(blk + 2, row_bytes, C, v);
        q8_transpose16x4(blk + 18, row_bytes, C, v + 4);
        for (int g = 0; g < 8; g++) v[g] = _mm512_xor_si512(v[g], _mm512_set1_epi8((char)0x80));   /* q8_unsigned */
        return;
    }
    __m512i p[4];
    q8_transpose16x4(blk + q8_nibbles_at(kind), row_bytes, C, p);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; g++) {
        v[g] = _mm512_and_si512(p[g], low4);
        v[g + 4] = _mm512_and_si512(_mm512_srli_epi16(p[g], 4), low4);
    }
    if (kind == NI_IQ4_NL) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES));
        for (int g = 0; g < 8; g++)
            v[g] = _mm512_xor_si512(_mm512_shuffle_epi8(table, v[g]), _mm512_set1_epi8((char)0x80));
    }
}

/* Rows m0 .. m0 + R - 1 (R <= Q8_PANEL_ROWS) of the outputs o < C of the panels into y. */
NI_VNNI static inline __attribute__((always_inline)) void q8_panel_rows(const int kind, const q8_panel *panel,
                                                                       int chunks, int C, const ni_q8_rows *xq,
                                                                       int M, int m0, const int R, float *y,
                                                                       long ys) {
    const int with_min = q8_has_min(kind);
    const int offset = q8_offset(kind, 1);
    __m512 acc[Q8_PANEL_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const q8_panel *p = panel + c;
        __m512i v[8];
        for (int g = 0; g < 8; g++) v[g] = _mm512_load_si512(&p->v[g]);
        for (int r = 0; r < R; r++) {
            const long at = q8_at(M, m0 + r, c);
            const uint8_t *t = (const uint8_t *)xq->t + at * 32;
            __m512i half[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};   /* weights 0-15, 16-31 */
            for (int g = 0; g < 8; g++)
                half[g / 4] = _mm512_dpbusd_epi32(half[g / 4], v[g], _mm512_set1_epi32((int)read_u32(t + 4 * g)));
            __m512i isum;
            if (kind == NI_Q6_K) {   /* q6_isum, 16 lanes */
                const int32_t sumt_lo = xq->sumt_lo[at], sumt_hi = xq->sumt[at] - sumt_lo;
                const __m512i lo = _mm512_sub_epi32(half[0], _mm512_set1_epi32(32 * sumt_lo));
                const __m512i hi = _mm512_sub_epi32(half[1], _mm512_set1_epi32(32 * sumt_hi));
                isum = _mm512_add_epi32(_mm512_mullo_epi32(lo, _mm512_load_si512(&p->sc_lo)),
                                        _mm512_mullo_epi32(hi, _mm512_load_si512(&p->sc_hi)));
            } else {
                isum = _mm512_add_epi32(half[0], half[1]);
            }
            if (offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * xq->sumt[at]));
            const float d = xq->d[at];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(p->a, _mm512_set1_ps(d)), acc[r]);
            if (with_min) acc[r] = _mm512_fmadd_ps(p->b, _mm512_set1_ps(xq->dsumt[at]), acc[r]);
        }
    }
    const __mmask16 lanes = (__mmask16)((1u << C) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (long)r * ys, lanes, acc[r]);
}

/* The group's panels, made once, for every tile of Q8_PANEL_ROWS rows. */
NI_VNNI static void q8_group_panels(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M,
                                    int K, float *y, long ys, q8_panel *panel) {
    const int chunks = K / 32;
    FOR_KIND(kind, {
        q8_panel_half(KIND, w0, row_bytes, C, chunks, panel, 0, 1);
        q8_panel_half(KIND, w0 + 8 * row_bytes, row_bytes, C - 8, chunks, panel, 1, 1);
        for (int c = 0; q8_direct_panel(KIND) && c < chunks; c++)
            q8_panel_direct(KIND, w0 + block_bytes(KIND) * c, row_bytes, C, panel[c].v);
        for (int m = 0; m < M; m += Q8_PANEL_ROWS) {
            if (M - m >= Q8_PANEL_ROWS)
                q8_panel_rows(KIND, panel, chunks, C, xq, M, m, Q8_PANEL_ROWS, y + m * ys, ys);
            else
                q8_panel_rows(KIND, panel, chunks, C, xq, M, m, M - m, y + m * ys, ys);
        }
    })
}

/* How many vpmaddubsw pair sums of an unsigned kind's weights int16 holds exactly: each is at most 2 x 15 x 127,
 * 2 x 31 x 127 or 2 x 63 x 127 (4-, 5- and 6-bit weights, |t| <= 127), so 8 of the first (30,480), 4 of the
 * second (31,496), 2 of Q6_K's (32,004). */
static inline int q8_int16_sums(int kind) {
    return kind == NI_Q6_K ? 2 : kind == NI_Q5_0 || kind == NI_Q5_1 || kind == NI_Q5_K ? 4 : 8;
}

/* Rows m0 .. m0 + R - 1 (R <= Q8_PANEL_ROWS) of the outputs 8 h + l < C (l < 8) of the panels into y, on AVX2: an
 * unsigned kind (not q8_signed: vpmaddubsw's unsigned operand is the weight). Per row and chunk, 8 vpmaddubsw of
 * the panel's words by the row's 4 inputs broadcast, summed in int16 q8_int16_sums(kind) at a time, widened by
 * vpmaddwd: the chunk's exact isum in each output's lane; then q8_tile's epilogue, the same fp32 operations. */
NI_AVX2 static inline __attribute__((always_inline)) void q8_panel_rows_avx2(const int kind, const q8_panel *panel,
                                                                            int chunks, int C, const ni_q8_rows *xq,
                                                                            int M, int m0, const int R, float *y,
                                                                            long ys, int h) {
    const int with_min = q8_has_min(kind), offset = q8_offset(kind, 0), per = q8_int16_sums(kind);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[Q8_PANEL_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        const q8_panel *p = panel + c;
        __m256i v[8];
        for (int g = 0; g < 8; g++) v[g] = _mm256_load_si256((const __m256i *)&p->v[g] + h);
        const __m256 a = _mm256_load_ps((const float *)&p->a + 8 * h);
        for (int r = 0; r < R; r++) {
            const long at = q8_at(M, m0 + r, c);
            const uint8_t *t = (const uint8_t *)xq->t + at * 32;
            __m256i part[4];   /* int32 sums of weights 4 per k .. 4 per (k + 1) - 1 */
            for (int k = 0; k < 8 / per; k++) {
                __m256i pairs = _mm256_setzero_si256();
                for (int g = k * per; g < (k + 1) * per; g++) {
                    const __m256i inputs = _mm256_set1_epi32((int)read_u32(t + 4 * g));   /* 4, in each lane */
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(v[g], inputs));
                }
                part[k] = _mm256_madd_epi16(pairs, ones);
            }
            __m256i isum;
            if (kind == NI_Q6_K)   /* parts 0-1: weights 0-15, 2-3: 16-31 */
                isum = q6_isum(_mm256_add_epi32(part[0], part[1]), _mm256_add_epi32(part[2], part[3]),
                               _mm256_load_si256((const __m256i *)&p->sc_lo + h),
                               _mm256_load_si256((const __m256i *)&p->sc_hi + h), xq->sumt_lo[at], xq->sumt[at]);
            else
                isum = per == 4 ? _mm256_add_epi32(part[0], part[1]) : part[0];
            if (offset) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * xq->sumt[at]));
            const float d = xq->d[at];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(a, _mm256_set1_ps(d)), acc[r]);
            if (with_min)
                acc[r] = _mm256_fmadd_ps(_mm256_load_ps((const float *)&p->b + 8 * h),
                                         _mm256_set1_ps(xq->dsumt[at]), acc[r]);
        }
    }
    const int n = C - 8 * h < 8 ? C - 8 * h : 8;
    for (int r = 0; r < R; r++) {
        float out[8];
        _mm256_storeu_ps(out, acc[r]);
        for (int l = 0; l < n; l++) y[(long)r * ys + 8 * h + l] = out[l];
    }
}

/* An unsigned kind's group in AVX2 panels: both halves' made once, then each tile of rows reads them. */
NI_AVX2 static inline __attribute__((always_inline)) void q8_panels_avx2_of(const int kind, const uint8_t *w0,
                                                                           long row_bytes, int C,
                                                                           const ni_q8_rows *xq, int M, int K,
                                                                           float *y, long ys, q8_panel *panel) {
    const int chunks = K / 32;
    for (int h = 0; h < 2 && 8 * h < C; h++)
        q8_panel_half(kind, w0 + 8 * h * row_bytes, row_bytes, C - 8 * h, chunks, panel, h, 0);
    for (int m = 0; m < M; m += Q8_PANEL_ROWS)
        for (int h = 0; h < 2 && 8 * h < C; h++) {
            if (M - m >= Q8_PANEL_ROWS)
                q8_panel_rows_avx2(kind, panel, chunks, C, xq, M, m, Q8_PANEL_ROWS, y + m * ys, ys, h);
            else
                q8_panel_rows_avx2(kind, panel, chunks, C, xq, M, m, M - m, y + m * ys, ys, h);
        }
}

/* Whether AVX2 takes M rows of a kind in panels: the unsigned kinds from 9 rows, Q6_K from 8 (their tiles from
 * 8 outputs; 1 thread, AMD EPYC Zen 4 capped to AVX2, panels against tiles: 8 rows 0.92-0.97x on the 4-bit kinds,
 * 0.99-1.01x on the 5-bit ones, 1.15x Q6_K; 10 and 12 rows 0.95-1.06x; 16 rows 1.07-1.36x; 128 rows 1.23-1.63x). */
static inline int q8_avx2_panels(int kind, int M) {
    return !q8_signed(kind) && (M > Q8_TILE_ROWS || (kind == NI_Q6_K && M == Q8_TILE_ROWS));
}

/* The signed kinds (Q8_0, IQ4_NL: vpmaddubsw's unsigned operand is the weight) and fewer rows in q8_tile's tiles,
 * the rest in panels. */
NI_AVX2 static void q8_group_avx2(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M,
                                  int K, float *y, long ys, void *scratch) {
    if (!q8_avx2_panels(kind, M)) {
        q8_tiles(kind, w0, row_bytes, C, xq, M, K, y, ys, 0);
        return;
    }
    switch (kind) {
#define PANELS_OF(KIND) case KIND: q8_panels_avx2_of(KIND, w0, row_bytes, C, xq, M, K, y, ys, scratch); break;
    PANELS_OF(NI_Q4_0) PANELS_OF(NI_Q4_1) PANELS_OF(NI_Q5_0) PANELS_OF(NI_Q5_1) PANELS_OF(NI_Q4_K)
    PANELS_OF(NI_Q5_K) PANELS_OF(NI_Q6_K)
#undef PANELS_OF
    }
}

/* Up to Q8_FEW_ROWS rows in q8_tile's tiles of 8 outputs (a panel would cost more than its rows save), more in
 * panels. */
NI_VNNI static void q8_group_vnni(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M,
                                  int K, float *y, long ys, void *scratch) {
    if (M <= Q8_FEW_ROWS) q8_tiles(kind, w0, row_bytes, C, xq, M, K, y, ys, 1);
    else q8_group_panels(kind, w0, row_bytes, C, xq, M, K, y, ys, scratch);
}

static int ni_has_vnni(void) { return ni_has_avx512() && __builtin_cpu_supports("avx512vnni"); }
#endif

void ni_q8_group(int kind, const uint8_t *w0, long row_bytes, int C, const ni_q8_rows *xq, int M, int K, float *y,
              long ys, void *scratch) {
#if NI_X86
    if (ni_has_vnni()) {
        q8_group_vnni(kind, w0, row_bytes, C, xq, M, K, y, ys, scratch);
        return;
    }
    if (ni_has_avx2()) {
        q8_group_avx2(kind, w0, row_bytes, C, xq, M, K, y, ys, scratch);
        return;
    }
#elif NI_NEON
    if (ni_has_neon()) {
        ni_q8_group_neon(kind, w0, row_bytes, C, xq, M, K, y, ys, scratch);
        return;
    }
#endif
    q8_group_scalar(kind, w0, row_bytes, C, xq, M, K, y, ys, scratch);
}
