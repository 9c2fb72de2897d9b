/*
 * counts.h -- atomically counted words of shared memory, and Unref (see counts.c).
 */
#ifndef SHMSHARE_COUNTS_H
#define SHMSHARE_COUNTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

extern PyTypeObject UnrefType;

PyObject *py_add64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *py_load64(PyObject *mod, PyObject *arg);
PyObject *py_store64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);

/* Register the fork handler that tells Unrefs made before a fork (0, or an errno). */
int ss_counts_init(void);

#endif /* SHMSHARE_COUNTS_H */
