/* GGUF's quantized blocks for matmul.c: their layouts, and each 32-weight chunk decoded to exactly the fp32
 * values gguf's own dequantize gives, on the portable path, with AVX2 and with AVX-512 (the same values on each).
 *
 * A row of K weights is K / 32 chunks. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL blocks are one chunk each; Q4_K,
 * Q5_K and Q6_K super-blocks are 8 chunks (256 weights) sharing an fp16 scale (and min) with a small integer
 * scale (and min) per chunk (Q6_K: per 16 weights). Every value is computed as gguf computes it, in fp32:
 *   Q8_0 d q   Q4_0 d (q - 8)   Q5_0 d (q - 16)   IQ4_NL d table[q]        (one exact product)
 *   Q4_1, Q5_1  d q + m          (d q exact: one rounding, so fma and mul-then-add agree)
 *   Q4_K, Q5_K  (d sc) q - (dmin mn)   (d sc, dmin mn and (d sc) q exact: one rounding)
 *   Q6_K        (d sc) (q - 32)        (d sc exact, then one rounding)
 * with d, m, dmin the block's fp16 values widened exactly to fp32.
 */
#ifndef NANOINFER_QUANTS_H
#define NANOINFER_QUANTS_H

#include <stdint.h>
#include <string.h>

#include "kernels.h"

static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int is_k_quant(int kind) { return kind == NI_Q4_K || kind == NI_Q5_K || kind == NI_Q6_K; }

static inline int block_weights(int kind) { return is_k_quant(kind) ? 256 : 32; }

/* Bytes per block, -1 for a kind that is not a block format. */
static inline long block_bytes(int kind) {
    switch (kind) {
    case NI_Q4_0: case NI_IQ4_NL: return 18;   /* d, 16 bytes of nibbles */
    case NI_Q4_1: return 20;                   /* d, m, nibbles */
    case NI_Q5_0: return 22;                   /* d, 32 fifth bits, nibbles */
    case NI_Q5_1: return 24;                   /* d, m, fifth bits, nibbles */
    case NI_Q8_0: return 34;                   /* d, 32 int8 */
    case NI_Q4_K: return 144;                  /* d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles */
    case NI_Q5_K: return 176;                  /* as Q4_K, with 32 bytes of fifth bits before the nibbles */
    case NI_Q6_K: return 210;                  /* 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d */
    default: return -1;
    }
}

/* STMT with KIND a compile-time copy of the block kind `kind`, so the decoders inlined in it lose their switch (a
 * switch per chunk made a batch-1 Q4_1 matmul twice as slow). */
#define CASE_KIND(K_, ...) case K_: { const int KIND = K_; __VA_ARGS__; } break;
#define FOR_KIND(kind, ...)                                                                                          \
    switch (kind) {                                                                                                  \
    CASE_KIND(NI_Q8_0, __VA_ARGS__) CASE_KIND(NI_Q4_0, __VA_ARGS__) CASE_KIND(NI_Q4_1, __VA_ARGS__)                  \
    CASE_KIND(NI_Q5_0, __VA_ARGS__) CASE_KIND(NI_Q5_1, __VA_ARGS__) CASE_KIND(NI_IQ4_NL, __VA_ARGS__)                \
    CASE_KIND(NI_Q4_K, __VA_ARGS__) CASE_KIND(NI_Q5_K, __VA_ARGS__) CASE_KIND(NI_Q6_K, __VA_ARGS__)                  \
    }

/* The block holding chunk b of a row, and the chunk's place in it (0 for 32-weight blocks, 0..7 in a super-block). */
static inline const uint8_t *chunk_block(int kind, const uint8_t *row, int b, int *sub) {
    const int super = is_k_quant(kind);   /* shifts, not a division by a run-time 8 or 1 */
    *sub = super ? b & 7 : 0;
    return row + block_bytes(kind) * (super ? b >> 3 : b);
}

static inline float half_to_float(uint16_t h) {
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

static inline float read_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

static inline uint32_t read_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Chunk `sub`'s 6-bit scale and min in a Q4_K/Q5_K super-block's 12 packed bytes (gguf's Q4_K.get_scale_min). */
static inline void k_scale_min(const uint8_t *packed, int sub, int *scale, int *min) {
    if (sub < 4) {
        *scale = packed[sub] & 0x3F;
        *min = packed[4 + sub] & 0x3F;
    } else {
        *scale = (packed[4 + sub] & 0x0F) | ((packed[sub - 4] >> 2) & 0x30);
        *min = (packed[4 + sub] >> 4) | ((packed[sub] >> 2) & 0x30);
    }
}

/* A Q4_K/Q5_K chunk's d sc and dmin mn (exact products), from its super-block's header. */
static inline void k_chunk_scale(const uint8_t *blk, int sub, float d, float dmin, float *scale, float *min) {
    int sc, mn;
    k_scale_min(blk + 4, sub, &sc, &mn);
    *scale = d * (float)sc;
    *min = dmin * (float)mn;
}

/* Weight j of a 32-weight nibble chunk: byte j's low nibble for j < 16, byte j - 16's high nibble after. */
static inline int nibble(const uint8_t *nibbles, int j) { return j < 16 ? nibbles[j] & 0x0F : nibbles[j - 16] >> 4; }

/* Q6_K chunk `sub`: its 32 low nibbles start at ql + ql_at(sub) >> ql_shift(sub), its high pairs at
 * qh + 32 (sub / 4) >> 2 (sub % 4); weights 0..15 take scale 2 sub, 16..31 scale 2 sub + 1. */
static inline int q6_ql_at(int sub) { return 64 * (sub / 4) + 32 * (sub % 2); }
static inline int q6_ql_shift(int sub) { return 4 * ((sub / 2) % 2); }

/* ---- the portable path ------------------------------------------------------------------------------- */
static inline void decode_chunk_scalar(int kind, const uint8_t *row, int b, float w[32]) {
    int sub;
    const uint8_t *blk = chunk_block(kind, row, b, &sub);
    switch (kind) {
    case NI_Q8_0: {
        const float d = read_half(blk);
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)blk[2 + j];
        break;
    }
    case NI_Q4_0: case NI_IQ4_NL: {
        const float d = read_half(blk);
        for (int j = 0; j < 32; j++) {
            const int q = nibble(blk + 2, j);
            w[j] = d * (float)(kind == NI_Q4_0 ? q - 8 : IQ4_NL_VALUES[q]);
        }
        break;
    }
    case NI_Q4_1: {
        const float d = read_half(blk), m = read_half(blk + 2);
        for (int j = 0; j < 32; j++) w[j] = d * (float)nibble(blk + 4, j) + m;
        break;
    }
    case NI_Q5_0: case NI_Q5_1: {
        const int with_min = kind == NI_Q5_1;
        const float d = read_half(blk), m = with_min ? read_half(blk + 2) : 0.0f;
        const uint32_t fifth = read_u32(blk + 2 + 2 * with_min);
        const uint8_t *nibbles = blk + 6 + 2 * with_min;
        for (int j = 0; j < 32; j++) {
            const int q = nibble(nibbles, j) | (int)((fifth >> j) & 1) << 4;
            w[j] = with_min ? d * (float)q + m : d * (float)(q - 16);
        }
        break;
    }
    case NI_Q4_K: case NI_Q5_K: {
        float scale, min;
        k_chunk_scale(blk, sub, read_half(blk), read_half(blk + 2), &scale, &min);
        const int fifths = kind == NI_Q5_K;
        const uint8_t *nibbles = blk + 16 + 32 * fifths + 32 * (sub / 2);
        for (int j = 0; j < 32; j++) {
            int q = (nibbles[j] >> (4 * (sub % 2))) & 0x0F;
            if (fifths) q |= ((blk[16 + j] >> sub) & 1) << 4;
            w[j] = scale * (float)q - min;
        }
        break;
    }
    default: {   /* NI_Q6_K: callers admit only the kinds block_bytes knows */
        const float d = read_half(blk + 208);
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float lo_scale = d * (float)scales[2 * sub], hi_scale = d * (float)scales[2 * sub + 1];
        const uint8_t *ql = blk + q6_ql_at(sub), *qh = blk + 128 + 32 * (sub / 4);
        for (int j = 0; j < 32; j++) {
            const int q = ((ql[j] >> q6_ql_shift(sub)) & 0x0F) | ((qh[j] >> (2 * (sub % 4))) & 3) << 4;
            w[j] = (j < 16 ? lo_scale : hi_scale) * (float)(q - 32);
        }
        break;
    }
    }
}

#if NI_X86
NI_AVX2 static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

/* ---- AVX2: a chunk as four vectors of 8 --------------------------------------------------------------- */
/* 8 bytes at p widened to int32 lanes. */
NI_AVX2 static inline __m256i bytes8_avx2(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* A 16-byte nibble chunk's 32 values as 4 x 8 int32 (weights 8a .. 8a + 7 in q[a]). */
NI_AVX2 static inline void nibbles_avx2(const uint8_t *nibbles, __m256i q[4]) {
    const __m256i first = bytes8_avx2(nibbles), second = bytes8_avx2(nibbles + 8), mask = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_and_si256(first, mask);
    q[1] = _mm256_and_si256(second, mask);
    q[2] = _mm256_srli_epi32(first, 4);
    q[3] = _mm256_srli_epi32(second, 4);
}

/* A K-quant chunk's 32 quants as bytes, built 32 at a time (16-bit shifts; the masks drop what crosses in from
 * the neighbouring byte): Q4_K/Q5_K's q (0..31), Q6_K's q - 32 (int8). */
NI_AVX2 static inline __m256i k_quant_bytes_avx2(int kind, const uint8_t *blk, int sub) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (kind == NI_Q6_K) {
        const __m256i low = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + q6_ql_at(sub))),
                                                              _mm_cvtsi32_si128(q6_ql_shift(sub))), low4);
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (sub / 4))),
                                                               _mm_cvtsi32_si128(2 * (sub % 4))), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    }
    const int fifths = kind == NI_Q5_K;
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * fifths + 32 * (sub / 2))),
                                                  _mm_cvtsi32_si128(4 * (sub % 2))), low4);
    if (fifths)
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16)),
                                                                                    _mm_cvtsi32_si128(sub)),
                                                                  _mm256_set1_epi8(1)), 4));
    return q;
}

/* 32 bytes (unsigned, or `is_signed`) widened to 4 x 8 int32 (weights 8a .. 8a + 7 in out[a]). */
NI_AVX2 static inline void widen32_avx2(__m256i bytes, int is_signed, __m256i out[4]) {
    for (int a = 0; a < 4; a++) {
        const __m128i half = a < 2 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
        const __m128i eight = a % 2 ? _mm_srli_si128(half, 8) : half;
        out[a] = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    }
}

NI_AVX2 static inline void decode_avx2(int kind, const uint8_t *row, int b, __m256 w[4]) {
    int sub;
    const uint8_t *blk = chunk_block(kind, row, b, &sub);
    __m256i q[4];
    switch (kind) {
    case NI_Q8_0: {
        const __m256 d = _mm256_set1_ps(half_f16c(blk));
        for (int a = 0; a < 4; a++)
            w[a] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * a)))));
        break;
    }
    case NI_Q4_0: case NI_Q4_1: case NI_IQ4_NL: {
        const __m256 d = _mm256_set1_ps(half_f16c(blk));
        if (kind == NI_IQ4_NL) {   /* each nibble picks its table entry as a byte, then widens */
            const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_NL_VALUES);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + 2)), low = _mm_set1_epi8(0x0F);
            const __m128i values[2] = {_mm_shuffle_epi8(table, _mm_and_si128(bytes, low)),
                                       _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low))};
            for (int a = 0; a < 4; a++)
                w[a] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            a % 2 ? _mm_srli_si128(values[a / 2], 8) : values[a / 2])));
            break;
        }
        nibbles_avx2(blk + (kind == NI_Q4_1 ? 4 : 2), q);
        const __m256 m = _mm256_set1_ps(kind == NI_Q4_1 ? half_f16c(blk + 2) : 0.0f);
        for (int a = 0; a < 4; a++) {
            const __m256 qf = _mm256_cvtepi32_ps(q[a]);
            w[a] = kind == NI_Q4_1 ? _mm256_fmadd_ps(d, qf, m) : _mm256_mul_ps(d, _mm256_sub_ps(qf, _mm256_set1_ps(8.0f)));
        }
        break;
    }
    case NI_Q5_0: case NI_Q5_1: {
        const int with_min = kind == NI_Q5_1;
        const __m256 d = _mm256_set1_ps(half_f16c(blk)), m = _mm256_set1_ps(with_min ? half_f16c(blk + 2) : 0.0f);
        const __m256i fifth = _mm256_set1_epi32((int)read_u32(blk + 2 + 2 * with_min));
        nibbles_avx2(blk + 6 + 2 * with_min, q);
        for (int a = 0; a < 4; a++) {
            const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * a));
            const __m256i high = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(fifth, at), _mm256_set1_epi32(1)), 4);
            const __m256i qa = _mm256_or_si256(q[a], high);
            w[a] = with_min ? _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(qa), m)
                            : _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(qa, _mm256_set1_epi32(16))));
        }
        break;
    }
    case NI_Q4_K: case NI_Q5_K: {
        float scale, min;
        k_chunk_scale(blk, sub, half_f16c(blk), half_f16c(blk + 2), &scale, &min);
        const __m256 s = _mm256_set1_ps(scale), mn = _mm256_set1_ps(min);
        widen32_avx2(k_quant_bytes_avx2(kind, blk, sub), 0, q);
        for (int a = 0; a < 4; a++) w[a] = _mm256_sub_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(q[a])), mn);
        break;
    }
    default: {   /* NI_Q6_K: callers admit only the kinds block_bytes knows */
        const float d = half_f16c(blk + 208);
        const int8_t *scales = (const int8_t *)(blk + 192);
        const __m256 lo_scale = _mm256_set1_ps(d * (float)scales[2 * sub]);
        const __m256 hi_scale = _mm256_set1_ps(d * (float)scales[2 * sub + 1]);
        widen32_avx2(k_quant_bytes_avx2(kind, blk, sub), 1, q);
        for (int a = 0; a < 4; a++) w[a] = _mm256_mul_ps(a < 2 ? lo_scale : hi_scale, _mm256_cvtepi32_ps(q[a]));
        break;
    }
    }
}

/* ---- AVX-512: a chunk as two vectors of 16 ------------------------------------------------------------ */
/* 16 bytes at p widened to int32 lanes. */
NI_AVX512 static inline __m512i bytes16_512(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* A 4-bit chunk's 32 weights from its 16 possible values: vpermps reads the low 4 bits of each index, so the
 * low nibbles need no mask. */
NI_AVX512 static inline void pick16_512(__m512 values, __m512i bytes, __m512 w[2]) {
    w[0] = _mm512_permutexvar_ps(bytes, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
}

/* 5-bit indices into 32 values lo | hi: the low 4 bits of `low4`, and as bit 4 the bit of `fifths` whose number
 * `to_bit4` rotates there. (Picking through a mask register instead, kmov and a second permute share a port with
 * the other permutes: a batch-1 Q5_0 matmul took 51% longer than a Q4_0 one of the same shape; this way 26%.) */
NI_AVX512 static inline __m512 pick32_512(__m512 lo, __m512 hi, __m512i low4, __m512i fifths, __m512i to_bit4) {
    const __m512i index = _mm512_ternarylogic_epi32(low4, _mm512_rorv_epi32(fifths, to_bit4), _mm512_set1_epi32(0x0F),
                                                    0xE4);   /* c ? a : b, bitwise: a's low 4 bits, b's above */
    return _mm512_permutex2var_ps(lo, index, hi);
}

/* d and m (the two halves at the start of a Q4_1/Q5_1 block, or a K-quant's d and dmin), each in every lane of a
 * vector of 4: the exact conversions half_f16c makes. */
NI_AVX512 static inline __m128 two_halves(const uint8_t *blk) { return _mm_cvtph_ps(_mm_cvtsi32_si128((int)read_u32(blk))); }

/* The fp16 d and m (0 without one) of a row's first nb 32-weight blocks as fp32 pairs dm[2 b], dm[2 b + 1]: the
 * exact conversions half_f16c makes, 8 blocks per gather and conversion. Decoding a chunk then broadcasts its
 * pair from memory (a load) instead of converting and broadcasting in registers on the port its permutes need
 * (batch-1 matmul, 1 thread, ps per weight, noisy: Q4_1 66 -> 45, Q4_0 66 -> 44, Q5_0 77 -> 65, Q8_0 77 -> 65).
 * A block with only d converts it alone: the bytes after it, read as a half, may be subnormal (slow to convert).
 * dm holds 2 nb rounded up to 16 floats. */
NI_AVX512 static inline void block_halves512(int kind, const uint8_t *row, int nb, float *dm) {
    const int bytes = (int)block_bytes(kind);
    const __m256i keep = _mm256_set1_epi32(kind == NI_Q4_1 || kind == NI_Q5_1 ? -1 : 0xFFFF);
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bytes));
    /* gathered, not stored one by one and read back as a vector: that read waits for the stores (a stall per 8) */
    for (int b0 = 0; b0 < nb; b0 += 8) {
        const __m256i in_row = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb - b0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i halves = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(row + (long)bytes * b0),
                                                           at, in_row, 1);
        _mm512_storeu_ps(dm + 2 * b0, _mm512_cvtph_ps(_mm256_and_si256(halves, keep)));
    }
}

/* Chunk b (a 32-weight block) of a row, with its d and m from block_halves512 at dm[0], dm[1]. */
NI_AVX512 static inline __attribute__((always_inline)) void decode512(int kind, const uint8_t *row, int b,
                                                                     const float *dm, __m512 w[2]) {
    int sub;
    const uint8_t *blk = chunk_block(kind, row, b, &sub);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 d = _mm512_set1_ps(dm[0]), m = _mm512_set1_ps(dm[1]);
    switch (kind) {
    case NI_Q8_0: {
        w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
        break;
    }
    case NI_Q4_0: {
        pick16_512(_mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f))), bytes16_512(blk + 2), w);
        break;
    }
    case NI_IQ4_NL: {
        const __m512 table = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES)));
        pick16_512(_mm512_mul_ps(d, table), bytes16_512(blk + 2), w);
        break;
    }
    case NI_Q4_1: {
        pick16_512(_mm512_fmadd_ps(d, iota, m), bytes16_512(blk + 4), w);
        break;
    }
    case NI_Q5_0: case NI_Q5_1: {
        __m512 lo, hi;   /* the values of q = 0..15 and 16..31 */
        if (kind == NI_Q5_1) {
            lo = _mm512_fmadd_ps(d, iota, m);
            hi = _mm512_fmadd_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), m);
        } else {
            lo = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f)));
            hi = _mm512_mul_ps(d, iota);
        }
        const int with_min = kind == NI_Q5_1;
        const uint32_t fifth = read_u32(blk + 2 + 2 * with_min);
        const __m512i bytes = bytes16_512(blk + 6 + 2 * with_min);
        const __m512i fifths = _mm512_set1_epi32((int)fifth);   /* lane j: bit j, then bit 16 + j, to bit 4 */
        const __m512i to_bit4 = _mm512_setr_epi32(28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11);
        w[0] = pick32_512(lo, hi, bytes, fifths, to_bit4);
        w[1] = pick32_512(lo, hi, _mm512_srli_epi32(bytes, 4), fifths, _mm512_add_epi32(to_bit4, _mm512_set1_epi32(16)));
        break;
    }
    default:   /* the K-quants: callers decode their super-blocks with k_header512 and k_pair512 */
        break;
    }
}

/* A K-quant super-block's per-chunk factors, computed once for its 8 chunks: Q4_K/Q5_K's d sc and dmin mn per
 * chunk, Q6_K's d sc per 16 weights (the same exact products the portable path forms per chunk). */
typedef struct {
    float scale[16];
    float min[8];
} KHeader;

NI_AVX512 static inline __attribute__((always_inline)) void k_header512(int kind, const uint8_t *blk, KHeader *h) {
    if (kind == NI_Q6_K) {
        const __m512 d = _mm512_set1_ps(half_f16c(blk + 208));
        _mm512_storeu_ps(h->scale, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                        _mm_loadu_si128((const __m128i *)(blk + 192))))));
        return;
    }
    /* k_scale_min for the 8 chunks at once, 4 bytes per 32-bit operation (the masks drop the bits a shift moves
     * across bytes): scales of chunks 0-3 then 4-7 in the bytes of `scales`, mins likewise */
    const uint32_t low = read_u32(blk + 4), mid = read_u32(blk + 8), high = read_u32(blk + 12);
    const uint64_t scales = (low & 0x3F3F3F3Fu) |
                            (uint64_t)((high & 0x0F0F0F0Fu) | ((low >> 2) & 0x30303030u)) << 32;
    const uint64_t mins = (mid & 0x3F3F3F3Fu) |
                          (uint64_t)(((high >> 4) & 0x0F0F0F0Fu) | ((mid >> 2) & 0x30303030u)) << 32;
    const __m128 dm = two_halves(blk);
    _mm256_storeu_ps(h->scale, _mm256_mul_ps(_mm256_broadcastss_ps(dm),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales)))));
    _mm256_storeu_ps(h->min, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins)))));
}

/* Chunks 2p and 2p + 1 of a K-quant super-block (64 weights, 16 per vector in w[0..3]), given its header. Q4_K's
 * pair shares 32 bytes of nibbles (low: chunk 2p, high: 2p + 1), read once; vpermps reads the low 4 bits of each
 * index, so the low nibbles need no mask. */
NI_AVX512 static inline __attribute__((always_inline)) void k_pair512(int kind, const uint8_t *blk, int p,
                                                                     const KHeader *h, __m512 w[4]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (kind == NI_Q4_K) {
        const uint8_t *nibbles = blk + 16 + 32 * p;
        const __m512i q[2] = {bytes16_512(nibbles), bytes16_512(nibbles + 16)};
        for (int half = 0; half < 2; half++) {
            const int sub = 2 * p + half;
            const __m512 values = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(h->scale[sub]), iota),
                                                _mm512_set1_ps(h->min[sub]));
            for (int i = 0; i < 2; i++)
                w[2 * half + i] = _mm512_permutexvar_ps(half ? _mm512_srli_epi32(q[i], 4) : q[i], values);
        }
        return;
    }
    for (int half = 0; half < 2; half++) {
        const int sub = 2 * p + half;
        const __m256i q = k_quant_bytes_avx2(kind, blk, sub);
        const __m128i bytes[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        if (kind == NI_Q6_K) {
            for (int i = 0; i < 2; i++)
                w[2 * half + i] = _mm512_mul_ps(_mm512_set1_ps(h->scale[2 * sub + i]),
                                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes[i])));
            continue;
        }
        /* Q5_K: 5-bit indices into the 32 values lo | hi */
        const __m512 s = _mm512_set1_ps(h->scale[sub]), mn = _mm512_set1_ps(h->min[sub]);
        const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(s, iota), mn);
        const __m512 hi = _mm512_sub_ps(_mm512_mul_ps(s, _mm512_add_ps(iota, _mm512_set1_ps(16.0f))), mn);
        for (int i = 0; i < 2; i++) w[2 * half + i] = _mm512_permutex2var_ps(lo, _mm512_cvtepu8_epi32(bytes[i]), hi);
    }
}
#endif

#endif
