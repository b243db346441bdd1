/*
 * dlop.compiler._kernels: the featurizer's spectrum-to-filterbank step, without the GIL.
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
 * inputs were grouped. Sums run in float32 over the filter's bins in order;
 * the build disables contraction into fused multiply-adds so that every
 * compiler path rounds alike.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 8 /* rows per block: one lane each */

static void filterbank_rows(const float *spec, Py_ssize_t rows, Py_ssize_t bins, float *out,
                            Py_ssize_t n_filters, const int32_t *lo, const int32_t *hi,
                            const int64_t *start, const float *weights, int magnitude,
                            float *power /* bins * BLOCK */)
{
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += BLOCK) {
        Py_ssize_t n = rows - r0 < BLOCK ? rows - r0 : BLOCK;
        /* power[b * BLOCK + k]: bin b of row r0 + k; zero for the padding rows */
        for (Py_ssize_t k = 0; k < BLOCK; k++) {
            if (k >= n) {
                for (Py_ssize_t b = 0; b < bins; b++)
                    power[b * BLOCK + k] = 0.0f;
                continue;
            }
            const float *row = spec + 2 * (r0 + k) * bins;
            for (Py_ssize_t b = 0; b < bins; b++) {
                float re = row[2 * b], im = row[2 * b + 1];
                float p = re * re + im * im;
                power[b * BLOCK + k] = magnitude ? sqrtf(p) : p;
            }
        }
        for (Py_ssize_t f = 0; f < n_filters; f++) {
            float acc[BLOCK];
            for (int k = 0; k < BLOCK; k++)
                acc[k] = 0.0f;
            const float *w = weights + start[f] - lo[f];
            for (int32_t b = lo[f]; b < hi[f]; b++) {
                const float wb = w[b];
                const float *pb = power + (Py_ssize_t)b * BLOCK;
                for (int k = 0; k < BLOCK; k++)
                    acc[k] += wb * pb[k];
            }
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
    float *power = malloc(sizeof(float) * BLOCK * (size_t)(bins ? bins : 1));
    if (power == NULL)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    filterbank_rows((const float *)spec, rows, bins, (float *)out, n_filters,
                    (const int32_t *)lo, (const int32_t *)hi, (const int64_t *)start,
                    (const float *)weights, magnitude, power);
    Py_END_ALLOW_THREADS
    free(power);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"power_filterbank", power_filterbank, METH_VARARGS,
     "power_filterbank(spec, rows, bins, out, n_filters, lo, hi, start, weights, magnitude): "
     "filterbank rows of |spec|^2 (or |spec|), row by row"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "The featurizer's compiled spectrum-to-filterbank step.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
