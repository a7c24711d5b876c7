/* The Python module `nanoinfer._kernels`: thin entry points taking raw data pointers (ints) and sizes.
 *
 * The Python side (nanoinfer/kernels/__init__.py) checks dtypes, shapes and contiguity and passes
 * `tensor.data_ptr()`, so this file never needs torch's headers and builds with any C compiler in seconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"
#include "neon.h"
#include "parallel.h"

int ni_simd_cap = 2;

static PyObject *cap_simd(PyObject *self, PyObject *args) {
    int cap, previous = ni_simd_cap;
    if (!PyArg_ParseTuple(args, "i", &cap)) return NULL;
    ni_simd_cap = cap;
    return PyLong_FromLong(previous);
}

static PyObject *attention(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, out, counts, tables;
    ni_strides qs, ks, vs, os;
    int B, H, Hkv, Tq, D, threads, width, shift, window;
    float scale;
    if (!PyArg_ParseTuple(args, "K(lll)K(lll)K(lll)K(lll)(KKiii)iiiiifi", &q, &qs.b, &qs.h, &qs.t, &k, &ks.b,
                          &ks.h, &ks.t, &v, &vs.b, &vs.h, &vs.t, &out, &os.b, &os.h, &os.t, &counts, &tables, &width,
                          &shift, &window, &B, &H, &Hkv, &Tq, &D, &scale, &threads))
        return NULL;
    const ni_key_spans seen = {(const int *)counts, (const int *)tables, width, shift, window};
    Py_BEGIN_ALLOW_THREADS
    ni_attention((const float *)q, &qs, (const float *)k, &ks, (const float *)v, &vs, (float *)out, &os, &seen, B,
                 H, Hkv, Tq, D, scale, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *matmul(PyObject *self, PyObject *args) {
    unsigned long long x, w, bias, y;
    long xs, ys;
    int M, K, kind, N, threads, activations, status;
    if (!PyArg_ParseTuple(args, "KliiKiiKKlii", &x, &xs, &M, &K, &w, &kind, &N, &bias, &y, &ys, &threads,
                          &activations))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = (activations == NI_ACTIVATIONS_INT8 ? ni_matmul_q8 : ni_matmul)(
        (const float *)x, xs, M, K, (const unsigned char *)w, kind, N, (const float *)bias, (float *)y, ys, threads);
    Py_END_ALLOW_THREADS
    if (status == -2) return PyErr_NoMemory();
    if (status) return PyErr_Format(PyExc_ValueError, "matmul: unsupported weight kind %d with K=%d", kind, K);
    Py_RETURN_NONE;
}

static PyObject *dequantize_rows(PyObject *self, PyObject *args) {
    unsigned long long w, ids, out;
    int kind, K, count;
    if (!PyArg_ParseTuple(args, "KiiKiK", &w, &kind, &K, &ids, &count, &out)) return NULL;
    if (ni_dequantize_rows((const unsigned char *)w, kind, K, (const long *)ids, count, (float *)out))
        return PyErr_Format(PyExc_ValueError, "dequantize_rows: unsupported weight kind %d with K=%d", kind, K);
    Py_RETURN_NONE;
}

static PyObject *rope(PyObject *self, PyObject *args) {
    unsigned long long x, cos, sin;
    ni_strides xs;
    int B, T, heads, D, threads;
    if (!PyArg_ParseTuple(args, "K(lll)KKiiiii", &x, &xs.b, &xs.h, &xs.t, &cos, &sin, &B, &T, &heads, &D, &threads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_rope((float *)x, &xs, (const float *)cos, (const float *)sin, B, T, heads, D, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rmsnorm(PyObject *self, PyObject *args) {
    unsigned long long x, w, y;
    long xs, ys;
    int rows, D, threads;
    float eps;
    if (!PyArg_ParseTuple(args, "KlKKliifi", &x, &xs, &w, &y, &ys, &rows, &D, &eps, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_rmsnorm((const float *)x, xs, (const float *)w, (float *)y, ys, rows, D, eps, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *layernorm(PyObject *self, PyObject *args) {
    unsigned long long x, w, b, y;
    long xs, ys;
    int rows, D, threads;
    float eps;
    if (!PyArg_ParseTuple(args, "KlKKKliifi", &x, &xs, &w, &b, &y, &ys, &rows, &D, &eps, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_layernorm((const float *)x, xs, (const float *)w, (const float *)b, (float *)y, ys, rows, D, eps, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *activation(PyObject *self, PyObject *args) {
    unsigned long long u, y;
    long rows;
    int mlp, hidden, threads;
    if (!PyArg_ParseTuple(args, "iKKlii", &mlp, &u, &y, &rows, &hidden, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_activation(mlp, (const float *)u, (float *)y, rows, hidden, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *blocks(PyObject *self, PyObject *args) {
    unsigned long long layers, x, kv, slots, counts, tables, cos, sin, local_cos, local_sin;
    ni_dims dims;
    ni_kv_strides kvs;
    int L, B, T, threads, status, width, shift, window;
    if (!PyArg_ParseTuple(args, "Ki(iiiiiiiiiiff)KiiK(lllll)K(KKiii)KKKKi", &layers, &L, &dims.n_embd, &dims.n_head,
                          &dims.n_kv_head, &dims.head_dim, &dims.ffn_hidden, &dims.mlp, &dims.layernorm,
                          &dims.qk_norm, &dims.post_norms, &dims.activations, &dims.eps, &dims.attn_scale, &x, &B, &T, &kv, &kvs.layer,
                          &kvs.kv, &kvs.b, &kvs.h, &kvs.t, &slots, &counts, &tables, &width, &shift, &window, &cos,
                          &sin, &local_cos, &local_sin, &threads))
        return NULL;
    const ni_key_spans seen = {(const int *)counts, (const int *)tables, width, shift, window};
    Py_BEGIN_ALLOW_THREADS
    status = ni_blocks((const ni_layer *)layers, L, &dims, (float *)x, B, T, (float *)kv, &kvs, (const long *)slots,
                       &seen, (const float *)cos, (const float *)sin, (const float *)local_cos,
                       (const float *)local_sin, threads);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_Format(PyExc_MemoryError, "blocks: out of memory or an unsupported weight kind");
    Py_RETURN_NONE;
}

static PyObject *draw_rows(PyObject *self, PyObject *args) {
    unsigned long long scores, temperature, u, out;
    long stride, rows, n;
    int f32, threads, status;
    if (!PyArg_ParseTuple(args, "KilllKKKi", &scores, &f32, &stride, &rows, &n, &temperature, &u, &out, &threads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    status = ni_draw_rows((const void *)scores, f32, stride, rows, n, (const double *)temperature, (const double *)u,
                          (long *)out, threads);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *draw_weights(PyObject *self, PyObject *args) {
    unsigned long long s, w;
    long n;
    double best, temperature;
    if (!PyArg_ParseTuple(args, "KlddK", &s, &n, &best, &temperature, &w)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_draw_weights((const double *)s, n, best, temperature, (double *)w);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *row_best(PyObject *self, PyObject *args) {
    unsigned long long scores, best, index;
    long stride, rows, n;
    int threads;
    if (!PyArg_ParseTuple(args, "KlllKKi", &scores, &stride, &rows, &n, &best, &index, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_row_best((const float *)scores, stride, rows, n, (float *)best, (long *)index, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *greedy_shadow(PyObject *self, PyObject *args) {
    unsigned long long w, wq, tab;
    long ws;
    int blocks, K, nc, threads;
    double rho;
    if (!PyArg_ParseTuple(args, "KliiidKKi", &w, &ws, &blocks, &K, &nc, &rho, &wq, &tab, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_greedy_shadow((const float *)w, ws, blocks, K, nc, rho, (signed char *)wq, (float *)tab, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *greedy_candidates(PyObject *self, PyObject *args) {
    unsigned long long x, wq, tab, chunk_max, cand, counts;
    long xs;
    int R, K, nc, blocks, valid, cap, most, threads;
    double rho;
    if (!PyArg_ParseTuple(args, "KliiiKKKiidiKKii", &x, &xs, &R, &K, &nc, &wq, &tab, &chunk_max, &blocks, &valid,
                          &rho, &cap, &cand, &counts, &most, &threads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    ni_greedy_candidates((const float *)x, xs, R, K, nc, (const signed char *)wq, (const float *)tab,
                                  (const float *)chunk_max, blocks, valid, rho, cap, (int *)cand, (int *)counts, most,
                                  threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *greedy_dots(PyObject *self, PyObject *args) {
    int most;
    if (!PyArg_ParseTuple(args, "i", &most)) return NULL;
    return PyLong_FromLong(ni_greedy_dots(most));
}

static PyObject *simd(PyObject *self, PyObject *args) {
#if NI_X86
    return PyUnicode_FromString(ni_has_avx512() ? "avx2+fma, avx512 for matmul"
                                : ni_has_avx2() ? "avx2+fma" : "scalar");
#elif NI_NEON
    return PyUnicode_FromString(!ni_has_neon() ? "scalar" : ni_has_dotprod() ? "neon+dotprod" : "neon");
#else
    return PyUnicode_FromString("scalar");
#endif
}

static PyMethodDef methods[] = {
    {"attention", attention, METH_VARARGS, "fixed-order attention over key prefixes (see attention.c)"},
    {"matmul", matmul, METH_VARARGS, "fixed-order x W^T with fp32 or GGUF-packed W, fp32 or int8 activations (see matmul.c, matmul_q8.c)"},
    {"dequantize_rows", dequantize_rows, METH_VARARGS, "selected rows of a packed matrix as fp32"},
    {"rope", rope, METH_VARARGS, "RoPE in place on (batch, token, head, dim) views (see rope.c)"},
    {"rmsnorm", rmsnorm, METH_VARARGS, "RMSNorm of each row in a fixed order (see norm.c)"},
    {"layernorm", layernorm, METH_VARARGS, "LayerNorm of each row in a fixed order (see norm.c)"},
    {"activation", activation, METH_VARARGS, "the MLP's activation of each row (see elementwise.c)"},
    {"blocks", blocks, METH_VARARGS, "every transformer block of a forward pass, cache writes included (see block.c)"},
    {"draw_rows", draw_rows, METH_VARARGS, "the sampler's inverse-CDF draw of one token per row (see sample.c)"},
    {"draw_weights", draw_weights, METH_VARARGS, "the draw's weights exp((s - best) / T) of one row (sample.c)"},
    {"row_best", row_best, METH_VARARGS, "each row's largest score and its first index, as amax and argmax (sample.c)"},
    {"greedy_shadow", greedy_shadow, METH_VARARGS, "a head's int8 shadow and bound tables (see greedy_head.c)"},
    {"greedy_candidates", greedy_candidates, METH_VARARGS, "each row's argmax candidates, rigorously (greedy_head.c)"},
    {"greedy_dots", greedy_dots, METH_VARARGS, "the greedy head's fastest integer-dot path here, at most the one given"},
    {"cap_simd", cap_simd, METH_VARARGS, "limit the instruction set (2 AVX-512, 1 AVX2, 0 none); returns the old cap"},
    {"simd", simd, METH_NOARGS, "the instruction set the kernels dispatch to on this CPU"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "nanoinfer's CPU kernels", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "THREADS", ni_threads_backend()) < 0) Py_CLEAR(m);
    return m;
}
