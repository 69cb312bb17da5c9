/* Reading Python ints as the native modules' 64-bit values (_stream_copy.c, _copy_assist.c).
 * Rules: include after Python.h; a refusal names the argument and its index, and sets the
 * exception (TypeError for a non-int, ValueError outside [0, 2**64)). */
#ifndef MORIIO_INT_ARGS_H
#define MORIIO_INT_ARGS_H
#include <stdint.h>

/* A non-negative int that fits 64 bits; names the argument and the range on failure. */
static int read_u64(PyObject *item, const char *what, Py_ssize_t index, uint64_t *out) {
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s[%zd]: expected an int, got %.80s", what, index, Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(item);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s[%zd]: expected an int in [0, 2**64), got %R", what, index, item);
        return -1;
    }
    *out = value;
    return 0;
}
#endif
