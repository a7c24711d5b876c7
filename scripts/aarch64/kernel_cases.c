/* The kernel cases of tests/kernel_cases.py, run by the C kernels alone (no Python): for scripts/test-aarch64.sh,
 * which builds this with the kernels for aarch64 and runs it under qemu.
 *
 * Reads one case a line on stdin, "kernel p1 p2 ...", the parameters in ORDER of scripts/aarch64/cases.py; makes
 * the inputs from the same splitmix64 draws as tests/kernel_cases.py; writes case i's output bytes to DIR/i.bin.
 * Usage: kernel_cases DIR [CAP] (CAP: the instruction-set cap, ni_simd_cap; default the widest).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

int ni_simd_cap = 2;

#define GREEDY_RHO 1e-5
#define GREEDY_CAP 64
#define GREEDY_CHUNK 64

typedef struct {
    uint64_t seed, used;
} stream;

static uint64_t draw(stream *s) {
    uint64_t z = s->seed + ++s->used * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float *floats(stream *s, long n, float scale) {
    float *v = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (long i = 0; i < n; i++) v[i] = ((float)(draw(s) >> 40) * 0x1p-23f - 1.0f) * scale;
    return v;
}

static double *doubles(stream *s, long n, double plus) {
    double *v = malloc(sizeof(double) * (size_t)n);
    for (long i = 0; i < n; i++) v[i] = (double)(draw(s) >> 11) * 0x1p-53 + plus;
    return v;
}

/* A matrix of `rows` x K weights of `kind`: random bytes, then each block's fp16 fields made finite. */
static unsigned char *packed(stream *s, int kind, int rows, int K) {
    if (kind == NI_F32) return (unsigned char *)floats(s, (long)rows * K, 1.0f);
    long size = 0, halves[2] = {0, 0}, count = 1, weights = 32;
    switch (kind) {
    case NI_Q4_0: case NI_IQ4_NL: size = 18; break;
    case NI_Q8_0: size = 34; break;
    case NI_Q5_0: size = 22; break;
    case NI_Q4_1: size = 20; count = 2; halves[1] = 2; break;
    case NI_Q5_1: size = 24; count = 2; halves[1] = 2; break;
    case NI_Q4_K: size = 144; count = 2; halves[1] = 2; weights = 256; break;
    case NI_Q5_K: size = 176; count = 2; halves[1] = 2; weights = 256; break;
    case NI_Q6_K: size = 210; halves[0] = 208; weights = 256; break;
    }
    const long blocks = (long)rows * K / weights;
    unsigned char *data = malloc((size_t)(blocks * size));
    for (long i = 0; i < blocks * size; i++) data[i] = (unsigned char)(draw(s) & 255);
    for (long b = 0; b < blocks; b++)
        for (int f = 0; f < count; f++) {
            const uint64_t z = draw(s);
            const unsigned h = (unsigned)((z & 1) << 15 | (10 + (z >> 1 & 7)) << 10 | (z >> 4 & 1023));
            data[b * size + halves[f]] = (unsigned char)(h & 255);
            data[b * size + halves[f] + 1] = (unsigned char)(h >> 8);
        }
    return data;
}

static void put(FILE *f, const void *data, size_t bytes) { fwrite(data, 1, bytes, f); }

/* Case `name` with parameters p into f; 0 on success. */
static int run(const char *name, const long *p, FILE *f) {
    if (!strcmp(name, "matmul")) {   /* kind tier M K N bias threads seed */
        const int kind = (int)p[0], M = (int)p[2], K = (int)p[3], N = (int)p[4];
        stream s = {(uint64_t)p[7], 0};
        unsigned char *w = packed(&s, kind, N, K);
        float *x = floats(&s, (long)M * K, 1.0f), *bias = p[5] ? floats(&s, N, 1.0f) : NULL;
        float *y = calloc((size_t)M * N, sizeof(float));
        const int status = (p[1] ? ni_matmul_q8 : ni_matmul)(x, K, M, K, w, kind, N, bias, y, N, (int)p[6]);
        put(f, y, sizeof(float) * (size_t)M * N);
        free(w), free(x), free(bias), free(y);
        return status;
    }
    if (!strcmp(name, "attention")) {   /* B H Hkv Tq Tk D window threads seed */
        const int B = (int)p[0], H = (int)p[1], Hkv = (int)p[2], Tq = (int)p[3], Tk = (int)p[4], D = (int)p[5];
        stream s = {(uint64_t)p[8], 0};
        float *q = floats(&s, (long)B * H * Tq * D, 1.0f), *k = floats(&s, (long)B * Hkv * Tk * D, 1.0f);
        float *v = floats(&s, (long)B * Hkv * Tk * D, 1.0f), *out = calloc((size_t)B * H * Tq * D, sizeof(float));
        int *counts = malloc(sizeof(int) * (size_t)B * Tq);
        for (int b = 0; b < B; b++)
            for (int i = 0; i < Tq; i++) counts[b * Tq + i] = Tk - Tq + i + 1;
        const ni_strides qs = {(long)H * Tq * D, (long)Tq * D, D}, ks = {(long)Hkv * Tk * D, (long)Tk * D, D};
        const ni_key_spans seen = {counts, NULL, 0, 0, (int)p[6]};
        ni_attention(q, &qs, k, &ks, v, &ks, out, &qs, &seen, B, H, Hkv, Tq, D, 0.125f, (int)p[7]);
        put(f, out, sizeof(float) * (size_t)B * H * Tq * D);
        free(q), free(k), free(v), free(out), free(counts);
        return 0;
    }
    if (!strcmp(name, "rmsnorm") || !strcmp(name, "layernorm")) {   /* rows D threads seed */
        const int rows = (int)p[0], D = (int)p[1];
        stream s = {(uint64_t)p[3], 0};
        float *x = floats(&s, (long)rows * D, 4.0f), *w = floats(&s, D, 1.0f), *b = floats(&s, D, 1.0f);
        float *y = calloc((size_t)rows * D, sizeof(float));
        if (name[0] == 'r') ni_rmsnorm(x, D, w, y, D, rows, D, 1e-5f, (int)p[2]);
        else ni_layernorm(x, D, w, b, y, D, rows, D, 1e-5f, (int)p[2]);
        put(f, y, sizeof(float) * (size_t)rows * D);
        free(x), free(w), free(b), free(y);
        return 0;
    }
    if (!strcmp(name, "rope")) {   /* B T heads D threads seed */
        const int B = (int)p[0], T = (int)p[1], heads = (int)p[2], D = (int)p[3];
        stream s = {(uint64_t)p[5], 0};
        float *x = floats(&s, (long)B * T * heads * D, 1.0f), *c = floats(&s, (long)B * T * D / 2, 1.0f);
        float *sn = floats(&s, (long)B * T * D / 2, 1.0f);
        const ni_strides xs = {(long)T * heads * D, D, (long)heads * D};
        ni_rope(x, &xs, c, sn, B, T, heads, D, (int)p[4]);
        put(f, x, sizeof(float) * (size_t)B * T * heads * D);
        free(x), free(c), free(sn);
        return 0;
    }
    if (!strcmp(name, "activation")) {   /* mlp rows hidden threads scale seed */
        const int mlp = (int)p[0], hidden = (int)p[2];
        const long rows = p[1], width = mlp == NI_SWIGLU || mlp == NI_GEGLU ? 2L * hidden : hidden;
        stream s = {(uint64_t)p[5], 0};
        float *u = floats(&s, rows * width, (float)p[4]), *y = calloc((size_t)(rows * hidden), sizeof(float));
        ni_activation(mlp, u, y, rows, hidden, (int)p[3]);
        put(f, y, sizeof(float) * (size_t)(rows * hidden));
        free(u), free(y);
        return 0;
    }
    if (!strcmp(name, "draw")) {   /* f32 rows n threads scale seed */
        const long rows = p[1], n = p[2];
        stream s = {(uint64_t)p[5], 0};
        float *scores = floats(&s, rows * n, (float)p[4]);
        double *wide = malloc(sizeof(double) * (size_t)(rows * n));
        for (long i = 0; i < rows * n; i++) wide[i] = scores[i];
        double *temperature = doubles(&s, rows, 0.25), *u = doubles(&s, rows, 0.0);
        long *out = calloc((size_t)rows, sizeof(long));
        const int status = ni_draw_rows(p[0] ? (const void *)scores : wide, (int)p[0], n, rows, n, temperature, u,
                                        out, (int)p[3]);
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)rows);
        for (long r = 0; r < rows; r++) ids[r] = out[r];
        put(f, ids, sizeof(int64_t) * (size_t)rows);
        free(scores), free(wide), free(temperature), free(u), free(out), free(ids);
        return status;
    }
    if (!strcmp(name, "weights")) {   /* n scale seed */
        const long n = p[0];
        stream s = {(uint64_t)p[2], 0};
        float *scores = floats(&s, n, (float)p[1]);
        double *wide = malloc(sizeof(double) * (size_t)n), *w = malloc(sizeof(double) * (size_t)n);
        double *temperature = doubles(&s, 1, 0.25), best = -INFINITY;
        for (long j = 0; j < n; j++) {
            wide[j] = j % 7 == 3 ? -INFINITY : scores[j];
            best = wide[j] > best ? wide[j] : best;
        }
        ni_draw_weights(wide, n, best, temperature[0], w);
        put(f, w, sizeof(double) * (size_t)n);
        free(scores), free(wide), free(w), free(temperature);
        return 0;
    }
    if (!strcmp(name, "row_best")) {   /* rows n threads seed */
        const long rows = p[0], n = p[1];
        stream s = {(uint64_t)p[3], 0};
        float *scores = floats(&s, rows * n, 1.0f), *best = calloc((size_t)rows, sizeof(float));
        long *index = calloc((size_t)rows, sizeof(long));
        ni_row_best(scores, n, rows, n, best, index, (int)p[2]);
        int64_t *ids = malloc(sizeof(int64_t) * (size_t)rows);
        for (long r = 0; r < rows; r++) ids[r] = index[r];
        put(f, best, sizeof(float) * (size_t)rows);
        put(f, ids, sizeof(int64_t) * (size_t)rows);
        free(scores), free(best), free(index), free(ids);
        return 0;
    }
    if (!strcmp(name, "greedy")) {   /* blocks K R threads valid seed */
        const int blocks = (int)p[0], K = (int)p[1], R = (int)p[2], threads = (int)p[3];
        const int nc = (K + GREEDY_CHUNK - 1) / GREEDY_CHUNK;
        stream s = {(uint64_t)p[5], 0};
        float *w = floats(&s, 16L * blocks * K, 1.0f), *x = floats(&s, (long)R * K, 1.0f);
        signed char *wq = calloc((size_t)blocks * nc * 1024, 1);
        float *tab = calloc((size_t)blocks * nc * 48, sizeof(float)), *chunk_max = malloc(sizeof(float) * 3 * nc);
        ni_greedy_shadow(w, K, blocks, K, nc, GREEDY_RHO, wq, tab, threads);
        for (int field = 0; field < 3; field++)   /* (3, nc): each field's largest over blocks and outputs */
            for (int k = 0; k < nc; k++) {
                float top = -INFINITY;
                for (int b = 0; b < blocks; b++)
                    for (int j = 0; j < 16; j++) {
                        const float t = tab[((long)b * nc + k) * 48 + 16 * field + j];
                        top = t > top ? t : top;
                    }
                chunk_max[field * nc + k] = top;
            }
        int *cand = calloc((size_t)R * GREEDY_CAP, sizeof(int)), *counts = calloc((size_t)R, sizeof(int));
        ni_greedy_candidates(x, K, R, K, nc, wq, tab, chunk_max, blocks, (int)p[4], GREEDY_RHO, GREEDY_CAP, cand,
                             counts, NI_DOTS_AMX, threads);
        put(f, wq, (size_t)blocks * nc * 1024);
        put(f, tab, sizeof(float) * (size_t)blocks * nc * 48);
        put(f, counts, sizeof(int) * (size_t)R);
        for (int r = 0; r < R; r++)
            if (counts[r] > 0) put(f, cand + (long)r * GREEDY_CAP, sizeof(int) * (size_t)counts[r]);
        free(w), free(x), free(wq), free(tab), free(chunk_max), free(cand), free(counts);
        return 0;
    }
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [CAP] < cases\n", argv[0]);
        return 2;
    }
    if (argc > 2) ni_simd_cap = atoi(argv[2]);
    char line[512], name[32], path[4096];
    for (int i = 0; fgets(line, sizeof line, stdin); i++) {
        long p[16];
        int used = 0, n = 0;
        const char *at = line;
        if (sscanf(at, "%31s%n", name, &used) != 1) continue;
        at += used;
        while (n < 16 && sscanf(at, "%ld%n", &p[n], &used) == 1) at += used, n++;
        snprintf(path, sizeof path, "%s/%d.bin", argv[1], i);
        FILE *f = fopen(path, "wb");
        if (!f || run(name, p, f)) {
            fprintf(stderr, "kernel_cases: case %d (%s) failed\n", i, name);
            return 1;
        }
        fclose(f);
    }
    return 0;
}
