/*
 * lease.c -- the Lease buffer type of shmshare._native (see lease.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "lease.h"

/* ------------------------------------------------------------------------ */
/* Lease                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *owner;        /* kept alive as long as the lease lives */
    PyObject *on_release;   /* called once when the lease and its exports are gone */
    void *address;          /* first byte exported */
    Py_ssize_t nbytes;      /* bytes exported */
    Py_ssize_t exports;     /* live Py_buffer exports */
    int readonly;           /* refuse writable exports */
    int released;           /* on_release already called */
    int unmap;              /* munmap [address, address+nbytes) on release */
    int fd;                 /* closed on release, or -1 */
    PyObject *weakreflist;  /* so that owners can watch leases */
} LeaseObject;

static int Lease_init(LeaseObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"owner", "address", "nbytes", "readonly", "on_release", "unmap", "fd",
                             NULL};
    PyObject *owner, *on_release = Py_None;
    unsigned long long address;
    Py_ssize_t nbytes;
    int readonly = 0, unmap = 0, fd = -1;
    if (self->owner != NULL || self->exports != 0) {
        PyErr_SetString(PyExc_RuntimeError, "Lease is already initialized");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKn|pOpi:Lease", kwlist, &owner, &address, &nbytes,
                                     &readonly, &on_release, &unmap, &fd))
        return -1;
    if (unmap && (nbytes <= 0 || address % (unsigned long long)page_size_value != 0)) {
        PyErr_SetString(PyExc_ValueError, "Lease: unmap=True needs a page-aligned address and nbytes > 0");
        return -1;
    }
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "Lease: nbytes must be >= 0, got %zd", nbytes);
        return -1;
    }
    if (address == 0 && nbytes > 0) {
        PyErr_SetString(PyExc_ValueError, "Lease: address 0 with nbytes > 0");
        return -1;
    }
    if (on_release != Py_None && !PyCallable_Check(on_release)) {
        PyErr_SetString(PyExc_TypeError, "Lease: on_release must be callable or None");
        return -1;
    }
    Py_INCREF(owner);
    self->owner = owner;
    Py_INCREF(on_release);
    self->on_release = on_release;
    self->address = (void *)(uintptr_t)address;
    self->nbytes = nbytes;
    self->readonly = readonly;
    self->unmap = unmap;
    self->fd = fd;
    return 0;
}

/* Release once: munmap and close in C (no Python object that a garbage
 * collector could have cleared first), then call on_release. */
static void Lease_fire(LeaseObject *self) {
    if (self->released) return;
    self->released = 1;
    if (self->owner == NULL) return; /* never initialized: it owns nothing */
    if (self->unmap) munmap(self->address, (size_t)self->nbytes); /* EINVAL only: nothing to do */
    if (self->fd >= 0) {
        int fd = self->fd;
        self->fd = -1;
        close(fd);
    }
    PyObject *cb = self->on_release;
    if (cb == NULL || cb == Py_None) return;
    Py_INCREF(cb);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb); /* the callback must not clobber a pending error */
    PyObject *res = PyObject_CallNoArgs(cb);
    if (res == NULL)
        PyErr_WriteUnraisable(cb);
    else
        Py_DECREF(res);
    PyErr_Restore(type, value, tb);
    Py_DECREF(cb);
}

/* PEP 442 finalizer. For cyclic garbage the collector runs every finalizer of
 * the cycle before clearing anything, so a memoryview of this lease may still
 * be read by another object's __del__: while exports are alive, wait; the
 * callback then runs from tp_clear or tp_dealloc, once the exports are gone. */
static void Lease_finalize(LeaseObject *self) {
    if (self->exports == 0) Lease_fire(self);
}

static int Lease_traverse(LeaseObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->owner);
    Py_VISIT(self->on_release);
    return 0;
}

static int Lease_clear(LeaseObject *self) {
    if (self->exports > 0) return 0; /* a view still points into the memory: keep its owner */
    Lease_fire(self);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->on_release);
    return 0;
}

static void Lease_dealloc(LeaseObject *self) {
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) return; /* resurrected */
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    Lease_clear(self); /* no export can be alive here: each holds a reference */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Lease_getbuffer(LeaseObject *self, Py_buffer *view, int flags) {
    if (self->owner == NULL) {
        PyErr_SetString(PyExc_ValueError, "Lease is not initialized");
        view->obj = NULL;
        return -1;
    }
    if (self->readonly && (flags & PyBUF_WRITABLE)) {
        PyErr_SetString(PyExc_BufferError,
                        "this Lease is read-only; receive with writable=True for a writable view");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->address, self->nbytes, self->readonly,
                          flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void Lease_releasebuffer(LeaseObject *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

static PyBufferProcs Lease_as_buffer = {
    (getbufferproc)Lease_getbuffer,
    (releasebufferproc)Lease_releasebuffer,
};

static PyObject *Lease_get_address(LeaseObject *self, void *c) {
    (void)c;
    return PyLong_FromVoidPtr(self->address);
}
static PyObject *Lease_get_nbytes(LeaseObject *self, void *c) {
    (void)c;
    return PyLong_FromSsize_t(self->nbytes);
}
static PyObject *Lease_get_readonly(LeaseObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->readonly);
}
static PyObject *Lease_get_exports(LeaseObject *self, void *c) {
    (void)c;
    return PyLong_FromSsize_t(self->exports);
}
static PyObject *Lease_get_owner(LeaseObject *self, void *c) {
    (void)c;
    PyObject *o = self->owner ? self->owner : Py_None;
    Py_INCREF(o);
    return o;
}

static PyGetSetDef Lease_getset[] = {
    {"address", (getter)Lease_get_address, NULL, "First byte exported, as an int.", NULL},
    {"nbytes", (getter)Lease_get_nbytes, NULL, "Number of bytes exported.", NULL},
    {"readonly", (getter)Lease_get_readonly, NULL, "Whether exports are read-only.", NULL},
    {"exports", (getter)Lease_get_exports, NULL, "Number of live buffer exports.", NULL},
    {"owner", (getter)Lease_get_owner, NULL, "The object this lease keeps alive.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *Lease_repr(LeaseObject *self) {
    return PyUnicode_FromFormat("<shmshare._native.Lease address=%p nbytes=%zd%s exports=%zd>",
                                self->address, self->nbytes, self->readonly ? " readonly" : "",
                                self->exports);
}

PyDoc_STRVAR(Lease_doc,
"Lease(owner, address, nbytes, readonly=False, on_release=None, unmap=False, fd=-1)\n--\n\n"
"Export [address, address+nbytes) through the buffer protocol while keeping\n"
"`owner` alive. When the lease and every buffer exported from it (memoryview,\n"
"numpy array, torch tensor) are gone, exactly once: the range is munmap'ed if\n"
"`unmap`, `fd` is closed if >= 0 (the lease owns it), and `on_release()` is called.\n"
"The caller guarantees the range stays mapped while `owner` lives.");

PyTypeObject LeaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmshare._native.Lease",
    .tp_basicsize = sizeof(LeaseObject),
    .tp_dealloc = (destructor)Lease_dealloc,
    .tp_repr = (reprfunc)Lease_repr,
    .tp_as_buffer = &Lease_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Lease_doc,
    .tp_traverse = (traverseproc)Lease_traverse,
    .tp_clear = (inquiry)Lease_clear,
    .tp_weaklistoffset = offsetof(LeaseObject, weakreflist),
    .tp_getset = Lease_getset,
    .tp_init = (initproc)Lease_init,
    .tp_new = PyType_GenericNew,
    .tp_finalize = (destructor)Lease_finalize,
};
