/*
 * dlop.formats._crc32: zlib's CRC-32 (the reflected polynomial 0xEDB88320 of
 * SPEC.md section 5) by carry-less multiplication, on x86-64 CPUs that have
 * PCLMULQDQ.
 *
 * crc32(data, crc=0) returns what zlib.crc32(data, crc) returns. The buffer
 * is folded 64 bytes at a time into four 128-bit remainders: each one's two
 * halves are multiplied by the residues of the powers of x that move them 512
 * bits on (k512 below) and added to the next 64 bytes. The four are then
 * folded into one (k128), its 128 bits reduced to 64 and 32 (k64), and the
 * last 32 bits of remainder found by Barrett reduction (P and MU). All constants are the bit-reflected
 * residues of the paper "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ Instruction" (Intel, 2009), shifted left by one as its reflected
 * form requires. Bytes past the last whole 16 go through a table, one at a
 * time. ``accelerated`` says whether this CPU takes the folding path; where it
 * is false dlop.formats.crc uses zlib instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define POLY 0xEDB88320u
#define GIL_FREE_BYTES 4096 /* larger buffers are folded without the GIL */

static uint32_t table[256];

static uint32_t bytewise(const uint8_t *p, size_t n, uint32_t c)
{
    while (n--)
        c = (c >> 8) ^ table[(c ^ *p++) & 0xFF];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_FOLDING 1
#include <immintrin.h>

#define FOLDING __attribute__((target("pclmul,sse2")))

/* x (128 bits) times the pair k = (lo, hi): x.lo * k.lo + x.hi * k.hi, plus y. */
FOLDING static inline __m128i fold(__m128i x, __m128i k, __m128i y)
{
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), y);
}

/* The register c (not inverted) after n bytes, n a multiple of 16 and at least 64. */
FOLDING static uint32_t folded(const uint8_t *p, size_t n, uint32_t c)
{
    const __m128i k512 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i k64 = _mm_set_epi64x(0, 0x163cd6124);
    const __m128i barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641); /* (P, MU) */
    const __m128i low32 = _mm_set_epi32(0, -1, 0, -1);
    const __m128i *q = (const __m128i *)p;
    __m128i a = _mm_xor_si128(_mm_loadu_si128(q), _mm_cvtsi32_si128((int)c));
    __m128i b = _mm_loadu_si128(q + 1);
    __m128i d = _mm_loadu_si128(q + 2);
    __m128i e = _mm_loadu_si128(q + 3);
    size_t left = n - 64;
    for (q += 4; left >= 64; q += 4, left -= 64) {
        a = fold(a, k512, _mm_loadu_si128(q));
        b = fold(b, k512, _mm_loadu_si128(q + 1));
        d = fold(d, k512, _mm_loadu_si128(q + 2));
        e = fold(e, k512, _mm_loadu_si128(q + 3));
    }
    a = fold(fold(fold(a, k128, b), k128, d), k128, e);
    for (; left >= 16; q++, left -= 16)
        a = fold(a, k128, _mm_loadu_si128(q));
    /* 128 bits to 64: the low half times x^64's residue, added to the high half */
    a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, k128, 0x10));
    /* 64 to 32 */
    a = _mm_xor_si128(_mm_srli_si128(a, 4),
                      _mm_clmulepi64_si128(_mm_and_si128(a, low32), k64, 0x00));
    /* Barrett: quotient by MU, times P, subtracted */
    __m128i t = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(a, low32), barrett, 0x10),
                              low32);
    a = _mm_xor_si128(a, _mm_clmulepi64_si128(t, barrett, 0x00));
    return (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(a, 4));
}

static int can_fold(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2");
}
#else
#define HAVE_FOLDING 0
#endif

static int accelerated;

static uint32_t crc_of(const uint8_t *p, size_t n, uint32_t crc)
{
    uint32_t c = ~crc;
#if HAVE_FOLDING
    if (accelerated && n >= 64) {
        size_t whole = n & ~(size_t)15;
        c = folded(p, whole, c);
        p += whole;
        n -= whole;
    }
#endif
    return ~bytewise(p, n, c);
}

static PyObject *crc32(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer view;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32", &view, &crc))
        return NULL;
    uint32_t out;
    if (view.len >= GIL_FREE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        out = crc_of(view.buf, (size_t)view.len, (uint32_t)crc);
        Py_END_ALLOW_THREADS
    } else {
        out = crc_of(view.buf, (size_t)view.len, (uint32_t)crc);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(out);
}

static PyMethodDef methods[] = {
    {"crc32", crc32, METH_VARARGS, "crc32(data, crc=0): zlib.crc32(data, crc), folded"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_crc32", "zlib's CRC-32 by carry-less multiplication.", -1, methods,
};

PyMODINIT_FUNC PyInit__crc32(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (POLY & (0u - (c & 1u)));
        table[i] = c;
    }
#if HAVE_FOLDING
    accelerated = can_fold();
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "accelerated", accelerated) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
