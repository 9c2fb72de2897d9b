/*
 * counts.c -- words of shared memory counted atomically: the store's fast gets (Note [Gets
 * without a round trip] in shmshare/store/_index.py): add64, load64, store64, and Unref, the
 * release of a fast get's views.
 */
#include "counts.h"

#include <pthread.h>

/* add64(address, delta) -> the new value: an atomic, sequentially consistent add to the
 * 8-byte word at `address` (a full barrier: the store's fast gets, Note [Gets without a round
 * trip] in store/_index.py). The caller owns the address: a word of a mapping it keeps. */
PyObject *py_add64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "add64(address, delta)");
    unsigned long long address = PyLong_AsUnsignedLongLong(args[0]);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    long long delta = PyLong_AsLongLong(args[1]);
    if (delta == -1 && PyErr_Occurred()) return NULL;
    if (address % 8 != 0) return PyErr_Format(PyExc_ValueError, "add64: address not 8-byte aligned");
    uint64_t got = __atomic_add_fetch((uint64_t *)(uintptr_t)address, (uint64_t)delta,
                                      __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong((unsigned long long)got);
}

/* load64(address) -> the 8-byte word at `address`, loaded sequentially consistent (a
 * read-only mapping is fine: no write is made). */
PyObject *py_load64(PyObject *mod, PyObject *arg) {
    (void)mod;
    unsigned long long address = PyLong_AsUnsignedLongLong(arg);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (address % 8 != 0) return PyErr_Format(PyExc_ValueError, "load64: address not 8-byte aligned");
    uint64_t got = __atomic_load_n((uint64_t *)(uintptr_t)address, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong((unsigned long long)got);
}

/* store64(address, value): an 8-byte word stored sequentially consistent. */
PyObject *py_store64(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "store64(address, value)");
    unsigned long long address = PyLong_AsUnsignedLongLong(args[0]);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    unsigned long long value = PyLong_AsUnsignedLongLong(args[1]);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (address % 8 != 0) return PyErr_Format(PyExc_ValueError, "store64: address not 8-byte aligned");
    __atomic_store_n((uint64_t *)(uintptr_t)address, (uint64_t)value, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* Unref(address, keep1, keep2): a callable that subtracts 1 from the 8-byte word at `address`
 * (seq_cst), and holds keep1 and keep2 -- the mapping the word lies in, and whatever must outlive
 * the count -- for as long as it lives. Not tracked by the garbage collector, on purpose: a
 * collection never clears what it holds, so the word stays mapped for every call (a fast get's
 * views' on_release: Note [Gets without a round trip] in store/_index.py). Neither kept object
 * may refer back to the Unref. In a forked child it does nothing (fork_epoch). */
typedef struct {
    PyObject_HEAD
    uint64_t *word;
    PyObject *keep1, *keep2;
    uint64_t epoch;  /* fork_epoch when made: in a forked child the word is the parent's */
} UnrefObject;

/* Incremented in every forked child (pthread_atfork), before any Python code runs there: an
 * Unref made before the fork does nothing in the child -- its word is its parent's count. */
static volatile uint64_t fork_epoch = 0;

static void unref_in_child(void) { fork_epoch++; }

int ss_counts_init(void) { return pthread_atfork(NULL, NULL, unref_in_child); }

static PyObject *unref_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    unsigned long long address;
    PyObject *keep1, *keep2;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)
        return PyErr_Format(PyExc_TypeError, "Unref takes no keyword arguments");
    if (!PyArg_ParseTuple(args, "KOO:Unref", &address, &keep1, &keep2)) return NULL;
    if (address % 8 != 0) return PyErr_Format(PyExc_ValueError, "Unref: address not 8-byte aligned");
    UnrefObject *self = (UnrefObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->word = (uint64_t *)(uintptr_t)address;
    self->keep1 = Py_NewRef(keep1);
    self->keep2 = Py_NewRef(keep2);
    self->epoch = fork_epoch;
    return (PyObject *)self;
}

static void unref_dealloc(UnrefObject *self) {
    Py_CLEAR(self->keep1);
    Py_CLEAR(self->keep2);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *unref_call(UnrefObject *self, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    if (self->epoch == fork_epoch) __atomic_sub_fetch(self->word, 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

PyTypeObject UnrefType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmshare._native.Unref",
    .tp_basicsize = sizeof(UnrefObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = unref_new,
    .tp_dealloc = (destructor)unref_dealloc,
    .tp_call = (ternaryfunc)unref_call,
    .tp_doc = "Unref(address, keep1, keep2): calling it subtracts 1 from the word at address",
};
