/* Copies a transfer's ranges between two blocks of this process's memory with streaming
 * (non-temporal) stores, without the GIL.
 *
 * A transfer's destination is another process's KV cache: nothing on this core reads it
 * again, so ordinary stores only pay to read each destination line into the cache first and
 * then evict this core's own working set. Streaming stores write whole lines to memory
 * instead. Rules: every range is validated before the first byte moves (a bad list moves
 * nothing); ranges that overlap their source, and calls too small to spill this core's cache,
 * use memmove; the stores are fenced before the call returns, so the bytes are visible to
 * any other core once it has. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_copy_kernels.h"
#include "_int_args.h"

static void copy_all(const copy_range *ranges, Py_ssize_t count, uint64_t total) {
#ifdef STREAM_X86
    if (total >= STREAM_MIN_CALL_BYTES) {
        for (Py_ssize_t k = 0; k < count; k++)
            stream_or_move(&ranges[k]);
        copy_fence();
        return;
    }
#else
    (void)total;
#endif
    for (Py_ssize_t k = 0; k < count; k++)
        memmove((void *)(uintptr_t)ranges[k].dst, (const void *)(uintptr_t)ranges[k].src, ranges[k].size);
}

static int read_base(PyObject *item, const char *what, uint64_t *out) {
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int address, got %.80s", what, Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(item);
    /* 0 is allowed: a batch of absolute addresses comes with both bases 0. */
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected an address in [0, 2**64), got %R", what, item);
        return -1;
    }
    *out = value;
    return 0;
}

static PyObject *copy_ranges(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "copy_ranges(dst_base, dst_offsets, src_base, src_offsets, sizes): expected 5 arguments, got %zd",
                     nargs);
        return NULL;
    }
    uint64_t dst_base, src_base;
    if (read_base(args[0], "dst_base", &dst_base) < 0 || read_base(args[2], "src_base", &src_base) < 0)
        return NULL;
    static const char *const names[3] = {"dst_offsets", "src_offsets", "sizes"};
    PyObject *seqs[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    copy_range *ranges = NULL;
    for (int s = 0; s < 3; s++) {
        seqs[s] = PySequence_Fast(args[s == 0 ? 1 : (s == 1 ? 3 : 4)], names[s]);
        if (seqs[s] == NULL)
            goto done;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seqs[2]);
    if (PySequence_Fast_GET_SIZE(seqs[0]) != count || PySequence_Fast_GET_SIZE(seqs[1]) != count) {
        PyErr_Format(PyExc_ValueError, "copy_ranges: dst_offsets, src_offsets and sizes differ in length (%zd, %zd, %zd)",
                     PySequence_Fast_GET_SIZE(seqs[0]), PySequence_Fast_GET_SIZE(seqs[1]), count);
        goto done;
    }
    ranges = PyMem_New(copy_range, (size_t)(count ? count : 1));
    if (ranges == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t dst_off, src_off, size;
        if (read_u64(PySequence_Fast_GET_ITEM(seqs[0], k), names[0], k, &dst_off) < 0 ||
            read_u64(PySequence_Fast_GET_ITEM(seqs[1], k), names[1], k, &src_off) < 0 ||
            read_u64(PySequence_Fast_GET_ITEM(seqs[2], k), names[2], k, &size) < 0)
            goto done;
        /* Wrapping past the end of the address space would copy to the wrong place. */
        if (dst_off > UINT64_MAX - dst_base || src_off > UINT64_MAX - src_base ||
            size > UINT64_MAX - (dst_base + dst_off) || size > UINT64_MAX - (src_base + src_off) ||
            size > UINT64_MAX - total || dst_base + dst_off + size > (uint64_t)UINTPTR_MAX ||
            src_base + src_off + size > (uint64_t)UINTPTR_MAX) {
            PyErr_Format(PyExc_ValueError, "copy_ranges: range %zd runs past the end of the address space", k);
            goto done;
        }
        ranges[k].dst = dst_base + dst_off;
        ranges[k].src = src_base + src_off;
        ranges[k].size = size;
        total += size;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_all(ranges, count, total);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ranges);
    for (int s = 0; s < 3; s++)
        Py_XDECREF(seqs[s]);
    return result;
}

static PyObject *streaming(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
#ifdef STREAM_X86
    return PyUnicode_FromString(have_avx2 ? "avx2" : "sse2");
#else
    Py_RETURN_NONE;
#endif
}

/* For tests: run the SSE2 loop on a machine that has AVX2 (False), or go back (True). */
static PyObject *use_avx2(PyObject *module, PyObject *flag) {
    (void)module;
    int wanted = PyObject_IsTrue(flag);
    if (wanted < 0)
        return NULL;
#ifdef STREAM_X86
    int before = have_avx2;
    have_avx2 = wanted && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(before);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"copy_ranges", (PyCFunction)(void (*)(void))copy_ranges, METH_FASTCALL,
     "copy_ranges(dst_base, dst_offsets, src_base, src_offsets, sizes)\n\n"
     "Copy sizes[k] bytes from src_base + src_offsets[k] to dst_base + dst_offsets[k] for every k,\n"
     "without the GIL. The addresses must be mapped and writable where written: the caller checks."},
    {"streaming", streaming, METH_NOARGS,
     "The streaming stores in use (\"avx2\" or \"sse2\"), or None where this build has none."},
    {"_use_avx2", use_avx2, METH_O,
     "_use_avx2(flag) -> the previous setting. For tests: False runs the SSE2 loop."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_stream_copy",
    "Copies with streaming stores for ranges whose destination this core will not read again.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__stream_copy(void) {
    copy_kernels_init();
    return PyModule_Create(&module_def);
}
