/*
 * shmshare._native -- OS primitives the stdlib lacks, the Lease buffer type and the Ring type.
 *
 * The primitives (ss_*) follow the rule in shmshare_native.h: return 0 or an
 * errno, never raise. The Python wrappers below validate arguments (ValueError
 * naming the argument), release the GIL around system calls that may block or
 * take long, and raise OSError subclasses whose message names the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shmshare_native.h"
#include "lease.h"
#include "ring.h"
#include "counts.h"
#include "strhash.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* ------------------------------------------------------------------------ */
/* primitives                                                                */
/* ------------------------------------------------------------------------ */

int ss_reserve(size_t nbytes, void **out_address) {
    void *p = mmap(NULL, nbytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return errno;
    *out_address = p;
    return 0;
}

int ss_map_fd(void *address, size_t nbytes, int fd, off_t offset, int writable) {
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    void *p = mmap(address, nbytes, prot, MAP_SHARED | MAP_FIXED, fd, offset);
    if (p == MAP_FAILED) return errno;
    return 0;
}

int ss_mmap(size_t nbytes, int fd, off_t offset, int writable, int shared,
            int populate, void **out_address) {
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    int flags = (shared ? MAP_SHARED : MAP_PRIVATE) | (populate ? MAP_POPULATE : 0);
    void *p = mmap(NULL, nbytes, prot, flags, fd, offset);
    if (p == MAP_FAILED) return errno;
    *out_address = p;
    return 0;
}

int ss_unmap(void *address, size_t nbytes, int release) {
    if (release) return munmap(address, nbytes) == 0 ? 0 : errno;
    /* Replacing the range with a fresh PROT_NONE anonymous mapping drops the
     * file pages in one step and keeps the address range reserved, so no
     * other mmap can land in the middle of an expandable segment. */
    void *p = mmap(address, nbytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return p == MAP_FAILED ? errno : 0;
}

int ss_punch_hole(int fd, off_t offset, size_t nbytes) {
    int rc;
    do {
        rc = fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset,
                       (off_t)nbytes);
    } while (rc != 0 && errno == EINTR);
    return rc == 0 ? 0 : errno;
}

int ss_madvise(void *address, size_t nbytes, int advice) {
    return madvise(address, nbytes, advice) == 0 ? 0 : errno;
}

static int populate_supported; /* MADV_POPULATE_READ works here (set at import) */

typedef struct {
    char *start;      /* first byte of this thread's share */
    size_t nbytes;    /* length of the share, a multiple of page_size or the tail */
    size_t page_size; /* touch stride */
    int writable;     /* write-touch (keeps the byte) instead of read-touch */
    int result;       /* 0 or errno from madvise */
} prefault_job;

static void *prefault_worker(void *arg) {
    prefault_job *job = (prefault_job *)arg;
    job->result = 0;
    if (job->nbytes == 0) return NULL;
    /* MADV_POPULATE_* (Linux 5.14) faults the range in without touching it
     * from user space, and fails with an errno (EFAULT, EINVAL, ENOMEM) where a
     * touch would crash: a read-only or PROT_NONE range. Only kernels without
     * it (probed once at import) are touched by hand. */
    if (populate_supported) {
        int advice = job->writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
        if (madvise(job->start, job->nbytes, advice) != 0) job->result = errno;
        return NULL;
    }
    for (size_t off = 0; off < job->nbytes; off += job->page_size) {
        char *p = job->start + off;
        if (job->writable)
            __atomic_fetch_add(p, 0, __ATOMIC_RELAXED); /* write fault, same value */
        else
            (void)*(volatile char *)p;
    }
    return NULL;
}

int ss_prefault(void *address, size_t nbytes, size_t page_size, int threads,
                int writable) {
    enum { MAX_THREADS = 64 };
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    size_t pages = (nbytes + page_size - 1) / page_size;
    if ((size_t)threads > pages) threads = pages ? (int)pages : 1;
    size_t per = (pages + threads - 1) / threads * page_size;

    prefault_job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 0; i < threads; i++) {
        size_t begin = (size_t)i * per;
        jobs[i].start = (char *)address + begin;
        jobs[i].nbytes = begin >= nbytes ? 0 : (nbytes - begin < per ? nbytes - begin : per);
        jobs[i].page_size = page_size;
        jobs[i].writable = writable;
        jobs[i].result = 0;
    }
    /* Thread 0's share runs on the calling thread. */
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, prefault_worker, &jobs[i]) == 0;
    prefault_worker(&jobs[0]);
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            prefault_worker(&jobs[i]); /* could not start a thread: do it here */
    }
    for (int i = 0; i < threads; i++)
        if (jobs[i].result) return jobs[i].result;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Python wrappers                                                           */
/* ------------------------------------------------------------------------ */

long page_size_value; /* sysconf(_SC_PAGESIZE), set at import */

/* Raise OSError(err, "<call> failed: <strerror> (<detail>)"); OSError's
 * constructor picks the errno's subclass (FileNotFoundError, ...). */
static PyObject *raise_errno(int err, const char *call, const char *detail) {
    PyObject *msg = PyUnicode_FromFormat("%s failed: %s (%s)", call, strerror(err), detail);
    if (msg == NULL) return NULL;
    PyObject *args = Py_BuildValue("(iO)", err, msg);
    Py_DECREF(msg);
    if (args == NULL) return NULL;
    PyErr_SetObject(PyExc_OSError, args);
    Py_DECREF(args);
    return NULL;
}

static int check_aligned(unsigned long long address, Py_ssize_t nbytes, const char *what) {
    if (nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "%s: nbytes must be > 0, got %zd", what, nbytes);
        return -1;
    }
    if (address % (unsigned long long)page_size_value != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: address %p is not a multiple of the page size (%ld)",
                     what, (void *)(uintptr_t)address, page_size_value);
        return -1;
    }
    return 0;
}

static PyObject *py_reserve(PyObject *mod, PyObject *args) {
    Py_ssize_t nbytes;
    (void)mod;
    if (!PyArg_ParseTuple(args, "n:reserve", &nbytes)) return NULL;
    if (nbytes <= 0) return PyErr_Format(PyExc_ValueError, "reserve: nbytes must be > 0, got %zd", nbytes);
    void *p = NULL;
    int err = ss_reserve((size_t)nbytes, &p);
    if (err) {
        char detail[96];
        snprintf(detail, sizeof detail, "PROT_NONE reservation of %zd bytes", nbytes);
        return raise_errno(err, "mmap", detail);
    }
    return PyLong_FromVoidPtr(p);
}

static PyObject *py_map_fd(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"address", "nbytes", "fd", "offset", "writable", NULL};
    unsigned long long address;
    Py_ssize_t nbytes;
    int fd, writable = 1;
    long long offset = 0;
    (void)mod;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Kni|Lp:map_fd", kwlist, &address, &nbytes,
                                     &fd, &offset, &writable))
        return NULL;
    if (check_aligned(address, nbytes, "map_fd") < 0) return NULL;
    if (offset < 0 || offset % page_size_value != 0)
        return PyErr_Format(PyExc_ValueError, "map_fd: offset %lld must be >= 0 and page aligned", offset);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ss_map_fd((void *)(uintptr_t)address, (size_t)nbytes, fd, (off_t)offset, writable);
    Py_END_ALLOW_THREADS
    if (err) {
        char detail[128];
        snprintf(detail, sizeof detail, "MAP_SHARED|MAP_FIXED, fd %d, offset %lld, %zd bytes", fd,
                 offset, nbytes);
        return raise_errno(err, "mmap", detail);
    }
    Py_RETURN_NONE;
}

static PyObject *py_mmap(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nbytes", "fd", "offset", "writable", "shared", "populate", NULL};
    Py_ssize_t nbytes;
    int fd, writable = 1, shared = 1, populate = 0;
    long long offset = 0;
    (void)mod;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ni|Lppp:mmap", kwlist, &nbytes, &fd, &offset,
                                     &writable, &shared, &populate))
        return NULL;
    if (nbytes <= 0) return PyErr_Format(PyExc_ValueError, "mmap: nbytes must be > 0, got %zd", nbytes);
    if (offset < 0 || offset % page_size_value != 0)
        return PyErr_Format(PyExc_ValueError, "mmap: offset %lld must be >= 0 and page aligned", offset);
    void *p = NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ss_mmap((size_t)nbytes, fd, (off_t)offset, writable, shared, populate, &p);
    Py_END_ALLOW_THREADS
    if (err) {
        char detail[128];
        snprintf(detail, sizeof detail, "%s%s, fd %d, offset %lld, %zd bytes",
                 shared ? "MAP_SHARED" : "MAP_PRIVATE", writable ? ", writable" : ", read-only",
                 fd, offset, nbytes);
        return raise_errno(err, "mmap", detail);
    }
    return PyLong_FromVoidPtr(p);
}

static PyObject *py_unmap(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"address", "nbytes", "release", NULL};
    unsigned long long address;
    Py_ssize_t nbytes;
    int release = 0;
    (void)mod;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Kn|p:unmap", kwlist, &address, &nbytes, &release))
        return NULL;
    if (check_aligned(address, nbytes, "unmap") < 0) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ss_unmap((void *)(uintptr_t)address, (size_t)nbytes, release);
    Py_END_ALLOW_THREADS
    if (err) {
        char detail[96];
        snprintf(detail, sizeof detail, "0x%llx, %zd bytes", address, nbytes);
        return raise_errno(err, release ? "munmap" : "mmap(PROT_NONE, MAP_FIXED)", detail);
    }
    Py_RETURN_NONE;
}

static PyObject *py_punch_hole(PyObject *mod, PyObject *args) {
    int fd;
    long long offset;
    Py_ssize_t nbytes;
    (void)mod;
    if (!PyArg_ParseTuple(args, "iLn:punch_hole", &fd, &offset, &nbytes)) return NULL;
    if (offset < 0 || nbytes <= 0)
        return PyErr_Format(PyExc_ValueError, "punch_hole: offset (%lld) must be >= 0 and nbytes (%zd) > 0",
                            offset, nbytes);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ss_punch_hole(fd, (off_t)offset, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    if (err) {
        char detail[128];
        snprintf(detail, sizeof detail, "FALLOC_FL_PUNCH_HOLE|KEEP_SIZE, fd %d, offset %lld, %zd bytes",
                 fd, offset, nbytes);
        return raise_errno(err, "fallocate", detail);
    }
    Py_RETURN_NONE;
}

static PyObject *py_madvise(PyObject *mod, PyObject *args) {
    unsigned long long address;
    Py_ssize_t nbytes;
    int advice;
    (void)mod;
    if (!PyArg_ParseTuple(args, "Kni:madvise", &address, &nbytes, &advice)) return NULL;
    if (check_aligned(address, nbytes, "madvise") < 0) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ss_madvise((void *)(uintptr_t)address, (size_t)nbytes, advice);
    Py_END_ALLOW_THREADS
    if (err) {
        char detail[96];
        snprintf(detail, sizeof detail, "0x%llx, %zd bytes, advice %d", address, nbytes, advice);
        return raise_errno(err, "madvise", detail);
    }
    Py_RETURN_NONE;
}

static PyObject *py_prefault(PyObject *mod, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"address", "nbytes", "threads", "writable", NULL};
    unsigned long long address;
    Py_ssize_t nbytes;
    int threads = 1, writable = 0;
    (void)mod;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Kn|ip:prefault", kwlist, &address, &nbytes,
                                     &threads, &writable))
        return NULL;
    if (check_aligned(address, nbytes, "prefault") < 0) return NULL;
    if (threads < 1 || threads > 64)
        return PyErr_Format(PyExc_ValueError, "prefault: threads must be 1..64, got %d", threads);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = ss_prefault((void *)(uintptr_t)address, (size_t)nbytes, (size_t)page_size_value, threads,
                      writable);
    Py_END_ALLOW_THREADS
    if (err) {
        char detail[96];
        snprintf(detail, sizeof detail, "MADV_POPULATE_%s, 0x%llx, %zd bytes",
                 writable ? "WRITE" : "READ", address, nbytes);
        return raise_errno(err, "madvise", detail);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* buffers (not an OS primitive: the channel's hot path, Note [Hot path] in  */
/* shmshare/channel/__init__.py)                                             */
/* ------------------------------------------------------------------------ */

/* shape_bytes(shape, itemsize) -> (shape, nbytes) or None: the bytes of an
 * empty(shape) of items of `itemsize` bytes when the shape is the usual kind --
 * an exact int, or a tuple of at most 64 exact ints, each >= 0 -- and the
 * bytes fit a Py_ssize_t; None for anything else (a bool, an np.int64, a list,
 * a negative dimension, an overflow), which the caller's Python path takes,
 * refuses or explains (shmshare/_empty_args.py). An int shape comes back as a
 * 1-tuple; a tuple, as itself. */
static PyObject *py_shape_bytes(PyObject *mod, PyObject *args) {
    PyObject *shape;
    Py_ssize_t itemsize;
    (void)mod;
    if (!PyArg_ParseTuple(args, "On:shape_bytes", &shape, &itemsize)) return NULL;
    if (itemsize < 0) Py_RETURN_NONE;
    int one = PyLong_CheckExact(shape);
    if (!one && !PyTuple_CheckExact(shape)) Py_RETURN_NONE;
    Py_ssize_t ndim = one ? 1 : PyTuple_GET_SIZE(shape);
    if (ndim > 64) Py_RETURN_NONE;
    size_t total = (size_t)itemsize; /* of the dimensions not 0: numpy refuses an overflow there */
    int big = 0, empty = 0;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        PyObject *item = one ? shape : PyTuple_GET_ITEM(shape, i);
        if (!PyLong_CheckExact(item)) Py_RETURN_NONE;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || v < 0) {
            if (PyErr_Occurred()) PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (v == 0)
            empty = 1;
        else if (__builtin_mul_overflow(total, (size_t)v, &total))
            big = 1;
    }
    if (big || total > (size_t)PY_SSIZE_T_MAX) Py_RETURN_NONE;
    if (empty) total = 0;
    if (one) return Py_BuildValue("((O)n)", shape, (Py_ssize_t)total);
    return Py_BuildValue("(On)", shape, (Py_ssize_t)total);
}

/* extent(obj) -> (address, lo, span): the address of element [0, ..., 0] of
 * a buffer-protocol object (a numpy array of any strides), and the bytes its
 * elements cover relative to that address: [address + lo, address + lo + span).
 * An empty buffer spans (0, 0). In Python this costs a dict
 * (__array_interface__) and a loop; here, one buffer request. */
static PyObject *py_extent(PyObject *mod, PyObject *obj) {
    (void)mod;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_STRIDES) < 0) return NULL;
    Py_ssize_t lo = 0, hi = 0, span = view.itemsize, step;
    int overflow = 0;
    for (int i = 0; i < view.ndim; i++) {
        Py_ssize_t n = view.shape[i], stride = view.strides[i];
        if (n == 0) {
            lo = hi = span = 0;
            overflow = 0;
            break;
        }
        /* strides from as_strided() can be anything: never let the sums wrap */
        overflow |= __builtin_mul_overflow(n - 1, stride, &step);
        overflow |= stride < 0 ? __builtin_add_overflow(lo, step, &lo)
                               : __builtin_add_overflow(hi, step, &hi);
    }
    if (span && !overflow) {
        overflow |= __builtin_sub_overflow(hi, lo, &step);
        overflow |= __builtin_add_overflow(span, step, &span);
    }
    unsigned long long address = (unsigned long long)(uintptr_t)view.buf;
    int ndim = view.ndim;
    PyBuffer_Release(&view);
    if (overflow)
        return PyErr_Format(PyExc_OverflowError,
                            "extent: the elements of this %d-dimensional buffer span more bytes "
                            "than an address can (strides from as_strided?)", ndim);
    return Py_BuildValue("(Knn)", address, lo, span);
}

/* ------------------------------------------------------------------------ */
/* module                                                                    */
/* ------------------------------------------------------------------------ */

/* cas64(buffer, index, expected, desired) -> the value found.
 *
 * One atomic compare-and-swap of the index-th 8-byte word of a writable
 * buffer (shared memory that other processes CAS too): the word becomes
 * `desired` only if it held `expected`; the value found is returned either
 * way, so the swap happened iff it equals `expected`. Sequentially
 * consistent. The buffer must be 8-byte aligned and the index in range. */
static PyObject *py_cas64(PyObject *mod, PyObject *args) {
    PyObject *obj;
    Py_ssize_t index;
    unsigned long long expected, desired;
    (void)mod;
    if (!PyArg_ParseTuple(args, "OnKK:cas64", &obj, &index, &expected, &desired)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if ((uintptr_t)view.buf % 8 != 0) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "cas64: the buffer is not 8-byte aligned");
    }
    if (index < 0 || index >= view.len / 8) {
        Py_ssize_t words = view.len / 8;
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_IndexError, "cas64: word %zd is outside the buffer's %zd words",
                            index, words);
    }
    uint64_t *word = (uint64_t *)view.buf + index;
    uint64_t found = (uint64_t)expected;
    __atomic_compare_exchange_n(word, &found, (uint64_t)desired, 0, __ATOMIC_SEQ_CST,
                                __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)found);
}

static PyMethodDef native_methods[] = {
    {"add64", (PyCFunction)(void (*)(void))py_add64, METH_FASTCALL,
     "add64(address, delta) -> new value\n\nAtomically add to the 8-byte word at address (seq_cst)."},
    {"load64", py_load64, METH_O,
     "load64(address) -> value\n\nLoad the 8-byte word at address (seq_cst)."},
    {"store64", (PyCFunction)(void (*)(void))py_store64, METH_FASTCALL,
     "store64(address, value)\n\nStore the 8-byte word at address (seq_cst)."},
    {"hash_bytes", py_hash_bytes, METH_O,
     "hash_bytes(buffer) -> int\n\nA 64-bit hash of the bytes, the same in every process (signed)."},
    {"hash_spans", (PyCFunction)(void (*)(void))py_hash_spans, METH_FASTCALL,
     "hash_spans(data, offsets, out)\n\nout[i] = hash_bytes(data[offsets[i]:offsets[i+1]]) (int64 buffers)."},
    {"find_key", (PyCFunction)(void (*)(void))py_find_key, METH_FASTCALL,
     "find_key(key, hashes, order, offsets, data) -> index or -1\n\nLook a key's bytes up in a packed mapping."},
    {"reserve", py_reserve, METH_VARARGS,
     "reserve(nbytes) -> address\n\nReserve address space: PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE."},
    {"map_fd", (PyCFunction)(void (*)(void))py_map_fd, METH_VARARGS | METH_KEYWORDS,
     "map_fd(address, nbytes, fd, offset=0, writable=True)\n\nMap fd with MAP_SHARED|MAP_FIXED into a reserved range."},
    {"mmap", (PyCFunction)(void (*)(void))py_mmap, METH_VARARGS | METH_KEYWORDS,
     "mmap(nbytes, fd, offset=0, writable=True, shared=True, populate=False) -> address\n\n"
     "Map fd where the kernel chooses (MAP_SHARED, or MAP_PRIVATE copy-on-write)."},
    {"unmap", (PyCFunction)(void (*)(void))py_unmap, METH_VARARGS | METH_KEYWORDS,
     "unmap(address, nbytes, release=False)\n\nTurn a range back into a PROT_NONE reservation, or munmap it when release."},
    {"punch_hole", py_punch_hole, METH_VARARGS,
     "punch_hole(fd, offset, nbytes)\n\nfallocate(PUNCH_HOLE|KEEP_SIZE): give the pages back, keep the size."},
    {"madvise", py_madvise, METH_VARARGS, "madvise(address, nbytes, advice)"},
    {"prefault", (PyCFunction)(void (*)(void))py_prefault, METH_VARARGS | METH_KEYWORDS,
     "prefault(address, nbytes, threads=1, writable=False)\n\n"
     "Fault every page in on `threads` threads with the GIL released (a write that keeps\n"
     "the byte when writable, else a read)."},
    {"shape_bytes", py_shape_bytes, METH_VARARGS,
     "shape_bytes(shape, itemsize) -> (shape, nbytes) or None\n\n"
     "The bytes of an empty(shape) when the shape is an exact int or a tuple of at most 64\n"
     "exact ints >= 0 whose bytes fit a Py_ssize_t; None for anything else."},
    {"extent", py_extent, METH_O,
     "extent(obj) -> (address, lo, span)\n\n"
     "Where element 0 of a strided buffer lies, and the bytes its elements cover:\n"
     "[address + lo, address + lo + span). An empty buffer gives lo = span = 0."},
    {"cas64", py_cas64, METH_VARARGS,
     "cas64(buffer, index, expected, desired) -> found\n\n"
     "Atomically set the index-th 8-byte word of a writable buffer to `desired` if it holds\n"
     "`expected`; return the value found (the swap happened iff it equals `expected`)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmshare._native",
    .m_doc = "OS primitives the stdlib lacks (see native/shmshare_native.h) and the Lease buffer type.",
    .m_size = -1,
    .m_methods = native_methods,
};

static void probe_populate(void) {
    void *p = mmap(NULL, (size_t)page_size_value, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    populate_supported = madvise(p, (size_t)page_size_value, MADV_POPULATE_READ) == 0;
    munmap(p, (size_t)page_size_value);
}

PyMODINIT_FUNC PyInit__native(void) {
    page_size_value = sysconf(_SC_PAGESIZE);
    if (ss_counts_init() != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    probe_populate();
    if (PyType_Ready(&LeaseType) < 0 || PyType_Ready(&RingType) < 0 ||
        PyType_Ready(&UnrefType) < 0) return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Lease", (PyObject *)&LeaseType) < 0 ||
        PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddObjectRef(m, "Unref", (PyObject *)&UnrefType) < 0 ||
        PyModule_AddIntConstant(m, "PAGE_SIZE", page_size_value) < 0 ||
        PyModule_AddIntConstant(m, "MADV_NORMAL", MADV_NORMAL) < 0 ||
        PyModule_AddIntConstant(m, "MADV_SEQUENTIAL", MADV_SEQUENTIAL) < 0 ||
        PyModule_AddIntConstant(m, "MADV_WILLNEED", MADV_WILLNEED) < 0 ||
        PyModule_AddIntConstant(m, "MADV_DONTNEED", MADV_DONTNEED) < 0 ||
        PyModule_AddIntConstant(m, "MADV_REMOVE", MADV_REMOVE) < 0 ||
        PyModule_AddIntConstant(m, "MADV_HUGEPAGE", MADV_HUGEPAGE) < 0 ||
        PyModule_AddIntConstant(m, "MADV_POPULATE_READ", MADV_POPULATE_READ) < 0 ||
        PyModule_AddIntConstant(m, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
