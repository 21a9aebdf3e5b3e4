/* Buffer-protocol arguments of the curation kernels (_langid.c, _minhash.c, _textstats.c). */
#ifndef MARIN_KERNEL_BUFFERS_H
#define MARIN_KERNEL_BUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A C-contiguous view of `obj` with items of `itemsize` bytes (writable if asked); on failure a
 * ValueError or the buffer protocol's own error is set, nothing is held, and -1 is returned. */
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected items of %zd bytes, got %zd", name, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#endif
