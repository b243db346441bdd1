/*
 * dlop.runtime._copy: byte-run copies for the batch gathers, without the GIL.
 *
 * copy_runs(dst, src, nbytes, count, streaming) copies nbytes[i] bytes from
 * src[i] to dst[i] for i < count. dst, src and nbytes are the addresses of
 * int64 arrays of that length (numpy arrays' .ctypes.data); runtime.gather
 * builds them from offsets that dlop.formats validated and from buffers the
 * process allocated, and guarantees the runs do not overlap.
 *
 * copy_rows(dst, bases, nums, num_tables, shards, rows, count, row_bytes,
 * streaming) gathers rows of a fixed-size field held in several tables (one per
 * shard): row rows[i] of table shards[i] (nums[k] rows of row_bytes at
 * bases[k]) to dst + i * row_bytes, the whole batch in one call whatever the
 * number of shards it touches. shards may be 0: every row from table 0. Every
 * table and row number is checked before anything is copied.
 *
 * With streaming true, runs are written with non-temporal stores on x86-64:
 * they go around the cache, so writing a batch buffer that has left the cache
 * does not first read every line of it back (read-for-ownership), a third less
 * memory traffic for a gather. On the build machine a gather into three
 * rotating batch buffers runs at 0.7-0.8x of one into a single reused buffer
 * with ordinary stores, and at 1.0-1.07x with streaming stores. A buffer that
 * is refilled while still cached (one reused slot) is better written through
 * the cache: streaming is the caller's choice. Elsewhere it falls back to
 * memcpy.
 *
 * Sources are memory-mapped shard files. A file that shrinks under its mapping
 * (truncated by something other than dlop) makes a read past its new end fault
 * with SIGBUS, which would kill the process. While a copy runs, its thread
 * catches that fault (a SIGBUS handler, chained to the one installed before,
 * and a per-thread jump buffer): the call stops and raises MappingFault instead,
 * its ``address`` the faulting address. A SIGBUS outside a copy goes to the
 * previous handler, or ends the process as it would have.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DLOP_STREAMING 1
#include <immintrin.h>
#else
#define DLOP_STREAMING 0
#endif

/* Below this a run is copied through the cache: aligning and fencing cost more. */
#define STREAM_MIN_BYTES 256
/*
 * Streaming copies ask for the source this far ahead, running on into the next
 * run's first bytes near the end of a run. The hardware prefetcher stops at
 * each 4 KiB page and cannot guess where the next (randomly drawn) row
 * starts; on the build machine this made streaming row gathers 14-17% faster.
 */
#define PREFETCH_BYTES 4096
/* Rows copied through the cache ask for the row this many ahead. */
#define PREFETCH_ROWS 64

#if DLOP_STREAMING
typedef void (*body_fn)(char *dst, const char *src, size_t nbytes, const char *next);

static inline void prefetch_ahead(const char *src, size_t i, size_t nbytes, const char *next)
{
    size_t at = i + PREFETCH_BYTES;
    if (at < nbytes)
        _mm_prefetch(src + at, _MM_HINT_T0);
    else if (next != NULL)
        _mm_prefetch(next + (at - nbytes), _MM_HINT_T0);
}

/* nbytes is a multiple of 64 and dst is 64-byte aligned; next is the source of
 * the run copied after this one, or NULL. */
static void body_sse2(char *dst, const char *src, size_t nbytes, const char *next)
{
    for (size_t i = 0; i < nbytes; i += 64) {
        prefetch_ahead(src, i, nbytes, next);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}

__attribute__((target("avx512f"))) static void body_avx512(char *dst, const char *src,
                                                             size_t nbytes, const char *next)
{
    for (size_t i = 0; i < nbytes; i += 64) {
        prefetch_ahead(src, i, nbytes, next);
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
    }
}

static body_fn stream_body = body_sse2;

static void copy_streaming(char *dst, const char *src, size_t nbytes, const char *next)
{
    size_t head = (size_t)(-(uintptr_t)dst) & 63;
    if (head > nbytes)
        head = nbytes;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    nbytes -= head;
    size_t body = nbytes & ~(size_t)63;
    stream_body(dst, src, body, next);
    memcpy(dst + body, src + body, nbytes - body);
}
#endif

static void copy_one(char *dst, const char *src, size_t nbytes, const char *next, int streaming)
{
#if DLOP_STREAMING
    if (streaming && nbytes >= STREAM_MIN_BYTES) {
        copy_streaming(dst, src, nbytes, next);
        return;
    }
#else
    (void)streaming;
    (void)next;
#endif
    memcpy(dst, src, nbytes);
}

static PyObject *MappingFault;
static _Thread_local sigjmp_buf *copy_jump; /* set while this thread copies */
static _Thread_local void *fault_address;
static struct sigaction previous_bus;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    if (copy_jump != NULL) {
        fault_address = info->si_addr;
        siglongjmp(*copy_jump, 1);
    }
    if (previous_bus.sa_flags & SA_SIGINFO) {
        if (previous_bus.sa_sigaction != NULL) {
            previous_bus.sa_sigaction(sig, info, context);
            return;
        }
    } else if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
        previous_bus.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL); /* as if no handler had been there: the fault ends the process */
    raise(sig);
}

/* Installs on_sigbus unless it is the handler now (another library may have set its
 * own since: that one becomes the previous handler). Called with the GIL held. */
static int catch_bus_faults(void)
{
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)
        return 0;
    struct sigaction mine;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_sigbus;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&mine.sa_mask);
    if (sigaction(SIGBUS, &mine, &previous_bus) != 0)
        return -1;
    return 0;
}

/* Raises MappingFault, its ``address`` the faulting address (which file it was in is
 * for the caller to tell, from the mappings it holds). */
static PyObject *fault_error(void)
{
    PyObject *message = PyUnicode_FromFormat(
        "a read from a mapped file faulted at address %p (SIGBUS): the file "
        "shrank under its mapping while a batch was copied from it",
        fault_address);
    if (message == NULL)
        return NULL;
    PyObject *error = PyObject_CallOneArg(MappingFault, message);
    Py_DECREF(message);
    if (error == NULL)
        return NULL;
    PyObject *address = PyLong_FromVoidPtr(fault_address);
    if (address == NULL || PyObject_SetAttrString(error, "address", address) < 0) {
        Py_XDECREF(address);
        Py_DECREF(error);
        return NULL;
    }
    Py_DECREF(address);
    PyErr_SetObject(MappingFault, error);
    Py_DECREF(error);
    return NULL;
}

static PyObject *copy_runs(PyObject *self, PyObject *args)
{
    unsigned long long dst_addr, src_addr, nbytes_addr;
    Py_ssize_t count;
    int streaming;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKnp:copy_runs", &dst_addr, &src_addr, &nbytes_addr, &count,
                          &streaming))
        return NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "copy_runs: count must be 0 or more, got %zd", count);
        return NULL;
    }
    const int64_t *dst = (const int64_t *)(uintptr_t)dst_addr;
    const int64_t *src = (const int64_t *)(uintptr_t)src_addr;
    const int64_t *nbytes = (const int64_t *)(uintptr_t)nbytes_addr;
    if (catch_bus_faults() != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int faulted = 0;
    Py_BEGIN_ALLOW_THREADS
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1) == 0) {
        copy_jump = &jump;
        for (Py_ssize_t i = 0; i < count; i++)
            copy_one((char *)(uintptr_t)dst[i], (const char *)(uintptr_t)src[i],
                     (size_t)nbytes[i], i + 1 < count ? (const char *)(uintptr_t)src[i + 1] : NULL,
                     streaming);
    } else {
        faulted = 1;
    }
    copy_jump = NULL;
#if DLOP_STREAMING
    if (streaming)
        _mm_sfence(); /* the streamed stores are visible before the batch is handed on */
#endif
    Py_END_ALLOW_THREADS
    if (faulted)
        return fault_error();
    Py_RETURN_NONE;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    unsigned long long dst_addr, bases_addr, nums_addr, shards_addr, rows_addr;
    Py_ssize_t num_tables, count, row_bytes;
    int streaming;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKnKKnnp:copy_rows", &dst_addr, &bases_addr, &nums_addr,
                          &num_tables, &shards_addr, &rows_addr, &count, &row_bytes, &streaming))
        return NULL;
    if (count < 0 || row_bytes < 0 || num_tables < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_rows: count and row_bytes must be 0 or more, num_tables 1 or more");
        return NULL;
    }
    const int64_t *bases = (const int64_t *)(uintptr_t)bases_addr;
    const int64_t *nums = (const int64_t *)(uintptr_t)nums_addr;
    const int64_t *shards = (const int64_t *)(uintptr_t)shards_addr; /* NULL: all table 0 */
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_addr;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t k = shards != NULL ? shards[i] : 0;
        if (k < 0 || k >= num_tables) {
            PyErr_Format(PyExc_IndexError, "table %lld out of range 0..%zd (position %zd)",
                         (long long)k, num_tables - 1, i);
            return NULL;
        }
        if (rows[i] < 0 || rows[i] >= nums[k]) {
            PyErr_Format(PyExc_IndexError, "row %lld out of range 0..%lld of table %lld (position %zd)",
                         (long long)rows[i], (long long)nums[k] - 1, (long long)k, i);
            return NULL;
        }
    }
    char *dst = (char *)(uintptr_t)dst_addr;
    size_t row = (size_t)row_bytes;
#define ROW_SOURCE(i) \
    ((const char *)(uintptr_t)bases[shards != NULL ? shards[i] : 0] + (size_t)rows[i] * row)
    if (catch_bus_faults() != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int faulted = 0;
    int by_cache = !streaming || row < STREAM_MIN_BYTES;
    Py_BEGIN_ALLOW_THREADS
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1) == 0) {
        copy_jump = &jump;
        if (by_cache) {
            /* Small rows drawn at random wait on memory, not on copying: ask for the
             * rows a few ahead, and copy the common sizes without a call. */
            for (Py_ssize_t i = 0; i < count; i++) {
                if (i + PREFETCH_ROWS < count)
                    __builtin_prefetch(ROW_SOURCE(i + PREFETCH_ROWS));
                char *to = dst + (size_t)i * row;
                const char *from = ROW_SOURCE(i);
                switch (row) {
                case 1: memcpy(to, from, 1); break;
                case 2: memcpy(to, from, 2); break;
                case 4: memcpy(to, from, 4); break;
                case 8: memcpy(to, from, 8); break;
                case 16: memcpy(to, from, 16); break;
                default: memcpy(to, from, row);
                }
            }
        } else {
            for (Py_ssize_t i = 0; i < count; i++)
                copy_one(dst + (size_t)i * row, ROW_SOURCE(i), row,
                         i + 1 < count ? ROW_SOURCE(i + 1) : NULL, streaming);
        }
    } else {
        faulted = 1;
    }
    copy_jump = NULL;
#undef ROW_SOURCE
#if DLOP_STREAMING
    if (streaming)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    if (faulted)
        return fault_error();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(dst, src, nbytes, count, streaming): memcpy(dst[i], src[i], nbytes[i]) for "
     "i < count, from the addresses of three int64 arrays; the GIL is released."},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, bases, nums, num_tables, shards, rows, count, row_bytes, streaming): row "
     "rows[i] of table shards[i] (table 0 when shards is 0) to dst + i * row_bytes for "
     "i < count, from the addresses of int64 arrays; every table and row number is checked "
     "first; the GIL is released while copying."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlop.runtime._copy",
    "Byte-run copies for the batch gathers (see runtime/_copy.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    const char *kind = "none";
#if DLOP_STREAMING
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        stream_body = body_avx512;
        kind = "avx512";
    } else {
        kind = "sse2";
    }
#endif
    if (PyModule_AddStringConstant(m, "STREAMING", kind) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    MappingFault = PyErr_NewExceptionWithDoc(
        "dlop.runtime._copy.MappingFault",
        "A copy read past the end of a file that shrank under its mapping (SIGBUS).",
        PyExc_OSError, NULL);
    if (MappingFault == NULL || PyModule_AddObjectRef(m, "MappingFault", MappingFault) < 0) {
        Py_XDECREF(MappingFault);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
