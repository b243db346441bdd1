/*
 * dlop.compiler._kernels: the featurizer's framing gather and spectrum-to-filterbank step,
 * without the GIL.
 *
 * power_filterbank(spec, rows, bins, out, n_filters, lo, hi, start, weights, magnitude)
 * turns rows of a complex64 spectrum into filterbank rows in one pass:
 *
 *     out[r, f] = sum over b in [lo[f], hi[f]) of weights[start[f] + b - lo[f]] * p(r, b)
 *
 * where p(r, b) = re^2 + im^2 of spec[r, b] (or its square root when magnitude
 * is true). spec is the address of rows * bins complex64 values (C order), out
 * of rows * n_filters float32; lo and hi are int32 arrays and start an int64
 * array of n_filters entries; weights holds each filter's weights over its
 * bins. features.py builds all of them from tensors it made and checked.
 *
 * Every row is computed alone with the same operations in the same order
 * (rows are taken BLOCK at a time, the last block padded with zero rows, and
 * each lane of a block is one row): a row's result never depends on which
 * rows are computed with it, so an archive's bytes do not depend on how its
 * inputs were grouped. Sums run in float32 over the filter's bins (two
 * running sums, see filter_sum); the build disables contraction into fused
 * multiply-adds, and the SSE2 path and the portable one do the same
 * operations in the same order, so every build rounds alike.
 *
 * pcm16_rows(src, step, rows, frame, window, out, out_step) writes
 *
 *     out[r * out_step + j] = (float)src[r * step + j] * window[j]
 *
 * for r < rows and j < frame: the framing gather's windowed copy of int16
 * rows (16-bit PCM; the window carries its 1/32768) that overlap in the clip,
 * step being the hop. Each product is one float32 multiply of exact operands,
 * rounded once, as torch.mul rounds it; torch's own mixed int16-by-float32
 * multiply takes twice as long.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#define BLOCK 8 /* rows per block, a multiple of 4: one lane each */

static inline float bin_power(const float *c, int magnitude)
{
    float p = c[0] * c[0] + c[1] * c[1];
    return magnitude ? sqrtf(p) : p;
}

/* power[b * BLOCK + k] = p(row[k], b) for the block's BLOCK rows (zero rows pad it). */
static void block_power(const float *const *row, Py_ssize_t bins, int magnitude, float *power)
{
    Py_ssize_t b = 0;
#if defined(__SSE2__)
    /* Four bins of every row at a time, transposed in registers: the same products
     * and sums as bin_power, so every bin rounds alike on either path. */
    for (; b + 4 <= bins; b += 4) {
        for (int g = 0; g < BLOCK; g += 4) {
            __m128 p[4];
            for (int k = 0; k < 4; k++) {
                const float *c = row[g + k] + 2 * b;
                __m128 lo = _mm_loadu_ps(c);     /* re0 im0 re1 im1 */
                __m128 hi = _mm_loadu_ps(c + 4); /* re2 im2 re3 im3 */
                __m128 re = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
                __m128 im = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
                __m128 v = _mm_add_ps(_mm_mul_ps(re, re), _mm_mul_ps(im, im));
                p[k] = magnitude ? _mm_sqrt_ps(v) : v;
            }
            _MM_TRANSPOSE4_PS(p[0], p[1], p[2], p[3]);
            for (int j = 0; j < 4; j++)
                _mm_storeu_ps(power + (b + j) * BLOCK + g, p[j]);
        }
    }
#endif
    for (; b < bins; b++)
        for (int k = 0; k < BLOCK; k++)
            power[b * BLOCK + k] = bin_power(row[k] + 2 * b, magnitude);
}

/* acc[k] = the filter's weights w[j] times power[(lo + j) * BLOCK + k] over j < hi - lo,
 * summed as two running sums, one over the even steps and one over the odd, added
 * at the end: two independent chains of additions per lane. */
static inline void filter_sum(const float *w, int32_t lo, int32_t hi, const float *power,
                              float *acc)
{
    const float *p = power + (Py_ssize_t)lo * BLOCK;
    int32_t n = hi - lo, j = 0;
#if defined(__SSE2__)
    __m128 e0 = _mm_setzero_ps(), e1 = _mm_setzero_ps();
    __m128 o0 = _mm_setzero_ps(), o1 = _mm_setzero_ps();
    for (; j + 2 <= n; j += 2) {
        const float *pe = p + (Py_ssize_t)j * BLOCK;
        __m128 we = _mm_set1_ps(w[j]), wo = _mm_set1_ps(w[j + 1]);
        e0 = _mm_add_ps(e0, _mm_mul_ps(we, _mm_loadu_ps(pe)));
        e1 = _mm_add_ps(e1, _mm_mul_ps(we, _mm_loadu_ps(pe + 4)));
        o0 = _mm_add_ps(o0, _mm_mul_ps(wo, _mm_loadu_ps(pe + BLOCK)));
        o1 = _mm_add_ps(o1, _mm_mul_ps(wo, _mm_loadu_ps(pe + BLOCK + 4)));
    }
    if (j < n) {
        const float *pe = p + (Py_ssize_t)j * BLOCK;
        __m128 we = _mm_set1_ps(w[j]);
        e0 = _mm_add_ps(e0, _mm_mul_ps(we, _mm_loadu_ps(pe)));
        e1 = _mm_add_ps(e1, _mm_mul_ps(we, _mm_loadu_ps(pe + 4)));
    }
    _mm_storeu_ps(acc, _mm_add_ps(e0, o0));
    _mm_storeu_ps(acc + 4, _mm_add_ps(e1, o1));
#else
    float even[BLOCK] = {0}, odd[BLOCK] = {0};
    for (; j + 2 <= n; j += 2)
        for (int k = 0; k < BLOCK; k++) {
            even[k] += w[j] * p[(Py_ssize_t)j * BLOCK + k];
            odd[k] += w[j + 1] * p[(Py_ssize_t)(j + 1) * BLOCK + k];
        }
    if (j < n)
        for (int k = 0; k < BLOCK; k++)
            even[k] += w[j] * p[(Py_ssize_t)j * BLOCK + k];
    for (int k = 0; k < BLOCK; k++)
        acc[k] = even[k] + odd[k];
#endif
}

static void filterbank_rows(const float *spec, Py_ssize_t rows, Py_ssize_t bins, float *out,
                            Py_ssize_t n_filters, const int32_t *lo, const int32_t *hi,
                            const int64_t *start, const float *weights, int magnitude,
                            float *power /* bins * BLOCK */, const float *zeros /* 2 * bins */)
{
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += BLOCK) {
        Py_ssize_t n = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        const float *row[BLOCK];
        for (Py_ssize_t k = 0; k < BLOCK; k++)
            row[k] = k < n ? spec + 2 * (r0 + k) * bins : zeros;
        block_power(row, bins, magnitude, power);
        for (Py_ssize_t f = 0; f < n_filters; f++) {
            float acc[BLOCK];
            filter_sum(weights + start[f], lo[f], hi[f], power, acc);
            for (Py_ssize_t k = 0; k < n; k++)
                out[(r0 + k) * n_filters + f] = acc[k];
        }
    }
}

static int address(PyObject *obj, void **out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *out = (void *)(uintptr_t)v;
    return 1;
}

static PyObject *power_filterbank(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *spec_o, *out_o, *lo_o, *hi_o, *start_o, *weights_o;
    Py_ssize_t rows, bins, n_filters;
    int magnitude;
    if (!PyArg_ParseTuple(args, "OnnOnOOOOp", &spec_o, &rows, &bins, &out_o, &n_filters, &lo_o,
                          &hi_o, &start_o, &weights_o, &magnitude))
        return NULL;
    void *spec, *out, *lo, *hi, *start, *weights;
    if (!address(spec_o, &spec) || !address(out_o, &out) || !address(lo_o, &lo) ||
        !address(hi_o, &hi) || !address(start_o, &start) || !address(weights_o, &weights))
        return NULL;
    if (rows < 0 || bins < 0 || n_filters < 0) {
        PyErr_SetString(PyExc_ValueError, "negative size");
        return NULL;
    }
    if (rows == 0)
        Py_RETURN_NONE;
    size_t width = (size_t)(bins ? bins : 1);
    float *power = malloc(sizeof(float) * BLOCK * width);
    float *zeros = calloc(2 * width, sizeof(float));
    if (power == NULL || zeros == NULL) {
        free(power);
        free(zeros);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    filterbank_rows((const float *)spec, rows, bins, (float *)out, n_filters,
                    (const int32_t *)lo, (const int32_t *)hi, (const int64_t *)start,
                    (const float *)weights, magnitude, power, zeros);
    Py_END_ALLOW_THREADS
    free(power);
    free(zeros);
    Py_RETURN_NONE;
}

static void windowed_i16(const int16_t *src, Py_ssize_t step, Py_ssize_t rows,
                         Py_ssize_t frame, const float *w, float *out, Py_ssize_t out_step)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        const int16_t *s = src + r * step;
        float *o = out + r * out_step;
        for (Py_ssize_t j = 0; j < frame; j++)
            o[j] = (float)s[j] * w[j];
    }
}

static PyObject *pcm16_rows(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *src_o, *w_o, *out_o;
    Py_ssize_t step, rows, frame, out_step;
    if (!PyArg_ParseTuple(args, "OnnnOOn", &src_o, &step, &rows, &frame, &w_o, &out_o,
                          &out_step))
        return NULL;
    void *src, *w, *out;
    if (!address(src_o, &src) || !address(w_o, &w) || !address(out_o, &out))
        return NULL;
    if (step < 0 || rows < 0 || frame < 0 || out_step < frame) {
        PyErr_SetString(PyExc_ValueError, "negative size, or output rows that overlap");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    windowed_i16((const int16_t *)src, step, rows, frame, (const float *)w, (float *)out,
                 out_step);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"power_filterbank", power_filterbank, METH_VARARGS,
     "power_filterbank(spec, rows, bins, out, n_filters, lo, hi, start, weights, magnitude): "
     "filterbank rows of |spec|^2 (or |spec|), row by row"},
    {"pcm16_rows", pcm16_rows, METH_VARARGS,
     "pcm16_rows(src, step, rows, frame, window, out, out_step): "
     "out rows = int16 source rows times a float32 window"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "The featurizer's compiled framing gather and spectrum-to-filterbank step.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
