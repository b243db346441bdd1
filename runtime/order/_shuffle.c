/*
 * dlop.runtime.order._shuffle: part of a numpy shuffle, without the GIL.
 *
 * shuffle_from(bitgen, data, first, draw) runs the swaps numpy's
 * Generator.shuffle makes on a 1-D int64 array, from the last place down to
 * place ``first`` (first = 1: the whole shuffle) and stops there. bitgen is the
 * bit generator's "BitGenerator" capsule (numpy's public C interface to bit
 * generators); data is a writable, contiguous buffer of native int64.
 *
 * Why: numpy's Fisher-Yates walks from the end, and places first .. n-1 are
 * settled once it has passed them. Which samples the first ``first`` places of
 * an order hold (as a set) is known after n - first swaps, not n - 1: a resume
 * that must know what an earlier world read computes only that much.
 *
 * The swaps must be numpy's own, draw for draw: place i swaps with a j drawn
 * uniformly from [0, i] from the bit generator's 32-bit draws (i below
 * 2^32 - 1), by one of the two ways numpy has drawn it: ``draw`` 0, the
 * draw masked to the bits of i and drawn again while above i (numpy 1.26 to 2.4's
 * shuffle); 1, Lemire's multiply-and-reject. runtime.order.partial checks
 * which one equals numpy's shuffle on first use, and shuffles with numpy
 * instead if neither does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* numpy/random/bitgen.h: the interface every numpy bit generator exposes. */
typedef struct {
    void *state;
    uint64_t (*next_uint64)(void *st);
    uint32_t (*next_uint32)(void *st);
    double (*next_double)(void *st);
    uint64_t (*next_raw)(void *st);
} bitgen_t;

/* A number drawn uniformly from [0, bound] (bound < 2^32 - 1), masked. */
static inline uint32_t masked(bitgen_t *gen, uint32_t bound)
{
    uint32_t mask = bound;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    uint32_t value;
    while ((value = gen->next_uint32(gen->state) & mask) > bound)
        ;
    return value;
}

/* A number drawn uniformly from [0, bound] (bound < 2^32 - 1), by Lemire's method. */
static inline uint32_t lemire(bitgen_t *gen, uint32_t bound)
{
    const uint32_t span = bound + 1;
    uint64_t m = (uint64_t)gen->next_uint32(gen->state) * span;
    uint32_t low = (uint32_t)m;
    if (low < span) {
        const uint32_t reject = (UINT32_MAX - bound) % span;
        while (low < reject) {
            m = (uint64_t)gen->next_uint32(gen->state) * span;
            low = (uint32_t)m;
        }
    }
    return (uint32_t)(m >> 32);
}

/* Whether a buffer's format is a signed 64-bit integer in this machine's byte order. */
static int native_int64(const Py_buffer *view)
{
    const char *f = view->format;
    if (f == NULL || view->itemsize != (Py_ssize_t)sizeof(int64_t))
        return 0;
    if (*f == '@' || *f == '=' ||
#if PY_LITTLE_ENDIAN
        *f == '<'
#else
        *f == '>' || *f == '!'
#endif
    )
        f++;
    return (f[0] == 'q' || f[0] == 'l') && f[1] == '\0';
}

static PyObject *shuffle_from(PyObject *self, PyObject *args)
{
    PyObject *capsule, *data;
    Py_buffer view;
    Py_ssize_t first;
    int draw;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOni", &capsule, &data, &first, &draw))
        return NULL;
    bitgen_t *gen = PyCapsule_GetPointer(capsule, "BitGenerator");
    if (gen == NULL)
        return NULL;
    if (PyObject_GetBuffer(data, &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (!native_int64(&view)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "shuffle_from: data is not a buffer of int64");
        return NULL;
    }
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(int64_t);
    if ((uint64_t)n >= (uint64_t)UINT32_MAX) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "shuffle_from: more than 2^32 - 2 places");
        return NULL;
    }
    if (first < 1)
        first = 1;
    int64_t *places = view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = n - 1; i >= first; i--) {
        uint32_t j = draw ? lemire(gen, (uint32_t)i) : masked(gen, (uint32_t)i);
        int64_t held = places[j];
        places[j] = places[i];
        places[i] = held;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"shuffle_from", shuffle_from, METH_VARARGS,
     "shuffle_from(bitgen_capsule, data, first, draw): numpy Generator.shuffle's swaps of "
     "the int64 buffer data, from its last place down to place first, each place's partner "
     "drawn masked (draw 0) or by Lemire's method (1); the GIL is released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlop.runtime.order._shuffle",
    "Part of a numpy shuffle (see runtime/order/_shuffle.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shuffle(void)
{
    return PyModule_Create(&module);
}
