/*
 * strhash.h -- a hash of byte strings that every process computes alike (see strhash.c).
 */
#ifndef SHMSHARE_STRHASH_H
#define SHMSHARE_STRHASH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *py_hash_bytes(PyObject *mod, PyObject *arg);
PyObject *py_hash_spans(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_find_key(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);

#endif /* SHMSHARE_STRHASH_H */
