/*
 * shmshare._native.Ring -- one end of a connection's pair of single-producer
 * single-consumer rings in shared memory (Note [Rings] in shmshare/_ring.py).
 *
 * The shared memory holds two directions; each is
 *
 *     offset   0  u64 tail        written by its producer
 *     offset  64  u32 cons_sleep  set by its consumer before it sleeps; the producer takes it
 *     offset 128  u64 head        written by its consumer
 *     offset 256  count slots of slot bytes: u32 length, then the frame
 *
 * The other end is another process that may be hostile and may write any of
 * these words at any moment. So each end keeps its own index privately and
 * never reads it back; the peer's index is loaded once per call, checked
 * against the private one (never more than `count` apart), and a slot's
 * length is loaded once and checked before the bytes are copied out. A
 * failed check is reported as -2 ("the peer broke the ring"), never acted on.
 * The geometry (count, slot) is the caller's, never read from the memory.
 *
 * Ordering: indices are published with release stores and read with acquire
 * loads. Sleeping is Dekker's handshake: the sleeper stores its flag, fences
 * (seq_cst) and looks at the ring again; the other side publishes, fences
 * and takes the flag with an exchange, so one of the two always sees the
 * other, and a sleeper is woken once per time it armed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ring.h"

#define RING_HEADER 256
#define OFF_TAIL 0
#define OFF_CONS_SLEEP 64
#define OFF_HEAD 128

typedef struct {
    PyObject_HEAD
    char *base;       /* the whole mapping, owned: unmapped when the object dies */
    size_t maplen;
    char *out;        /* the direction this end produces into */
    char *in;         /* the direction this end consumes */
    uint64_t tail;    /* private: the next index this end writes */
    uint64_t head;    /* private: the next index this end reads */
    uint32_t count;
    uint32_t slot;
    int closed;       /* close() was called: every call raises; unmapped once no spin() runs */
    int spinners;     /* spin() calls running without the GIL */
    pid_t pid;        /* the process whose threads `spinners` counts (a fork's child has none) */
} RingObject;

static inline uint64_t *word64(char *dir, size_t off) { return (uint64_t *)(dir + off); }
static inline uint32_t *word32(char *dir, size_t off) { return (uint32_t *)(dir + off); }

size_t ss_ring_bytes(uint32_t count, uint32_t slot) {
    size_t dir = RING_HEADER + (size_t)count * slot;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (2 * dir + page - 1) / page * page;
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "count", "slot", "first", NULL};
    int fd, first;
    unsigned int count, slot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iIIp", kwlist, &fd, &count, &slot, &first))
        return -1;
    if (self->base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Ring: already initialized");
        return -1;
    }
    if (count < 2 || count > (1u << 20) || (count & (count - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "Ring: count must be a power of two in 2..2**20, got %u", count);
        return -1;
    }
    if (slot < 16 || slot > (1u << 20) || slot % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "Ring: slot must be a multiple of 8 in 16..2**20, got %u", slot);
        return -1;
    }
    size_t len = ss_ring_bytes(count, slot);
    void *p;
    Py_BEGIN_ALLOW_THREADS
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    Py_END_ALLOW_THREADS
    if (p == MAP_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, "mmap (a connection's rings)");
        return -1;
    }
    size_t dir = RING_HEADER + (size_t)count * slot;
    self->base = p;
    self->maplen = len;
    self->out = first ? (char *)p : (char *)p + dir;
    self->in = first ? (char *)p + dir : (char *)p;
    self->count = count;
    self->slot = slot;
    self->tail = 0;
    self->head = 0;
    self->pid = getpid();
    return 0;
}

static void unmap_if_idle(RingObject *self) {
    if (self->base != NULL && (self->spinners == 0 || self->pid != getpid())) {
        munmap(self->base, self->maplen);
        self->base = NULL;
    }
}

/* close(): every later call raises ValueError; the mapping goes now, or when the last spin()
 * running without the GIL returns (every other call runs under the GIL, so none is inside). */
static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    __atomic_store_n(&self->closed, 1, __ATOMIC_RELAXED);
    unmap_if_idle(self);
    Py_RETURN_NONE;
}

static void Ring_dealloc(RingObject *self) {
    if (self->base != NULL) munmap(self->base, self->maplen);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_ready(RingObject *self) {
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "this connection's rings are closed");
        return -1;
    }
    if (self->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "Ring: not initialized");
        return -1;
    }
    return 0;
}

/* push(frame) -> 1 pushed; 3 pushed and the consumer was asleep (wake it); 0 full; -2 the peer
 * broke the ring (its head is not within count of our tail). */
static PyObject *Ring_push(RingObject *self, PyObject *arg) {
    if (check_ready(self) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len > (Py_ssize_t)self->slot - 4) {
        Py_ssize_t n = view.len;
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "Ring.push: a frame of %zd bytes does not fit a slot of %u",
                            n, self->slot - 4);
    }
    uint64_t head = __atomic_load_n(word64(self->out, OFF_HEAD), __ATOMIC_ACQUIRE);
    uint64_t used = self->tail - head;
    if (used > self->count) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(-2);
    }
    if (used == self->count) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(0);
    }
    char *slot = self->out + RING_HEADER + (size_t)(self->tail & (self->count - 1)) * self->slot;
    uint32_t n = (uint32_t)view.len;
    memcpy(slot, &n, 4);
    memcpy(slot + 4, view.buf, view.len);
    PyBuffer_Release(&view);
    self->tail += 1;
    __atomic_store_n(word64(self->out, OFF_TAIL), self->tail, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint32_t *sleep = word32(self->out, OFF_CONS_SLEEP);
    if (__atomic_load_n(sleep, __ATOMIC_RELAXED) != 0 && __atomic_exchange_n(sleep, 0, __ATOMIC_SEQ_CST) != 0)
        return PyLong_FromLong(3);
    return PyLong_FromLong(1);
}

/* pop_into(buffer) -> -1 empty; -2 the peer broke the ring; else n, the frame's length, copied to
 * the buffer's start. */
static PyObject *Ring_pop_into(RingObject *self, PyObject *arg) {
    if (check_ready(self) < 0) return NULL;
    uint64_t tail = __atomic_load_n(word64(self->in, OFF_TAIL), __ATOMIC_ACQUIRE);
    uint64_t avail = tail - self->head;
    if (avail == 0) return PyLong_FromLong(-1);
    if (avail > self->count) return PyLong_FromLong(-2);
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0) return NULL;
    if (view.len < (Py_ssize_t)self->slot) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "Ring.pop_into: the buffer holds %zd bytes, less than a slot (%u)",
                            view.len, self->slot);
    }
    const char *slot = self->in + RING_HEADER + (size_t)(self->head & (self->count - 1)) * self->slot;
    uint32_t n;
    memcpy(&n, slot, 4);  /* once: the peer may change it while we look */
    if (n > self->slot - 4) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(-2);
    }
    memcpy(view.buf, slot + 4, n);
    PyBuffer_Release(&view);
    self->head += 1;
    __atomic_store_n(word64(self->in, OFF_HEAD), self->head, __ATOMIC_RELEASE);
    return PyLong_FromLong((long)n);
}

/* Whether the incoming ring has a frame (or is broken: pop_into says which). */
static inline int in_ready(RingObject *self) {
    return __atomic_load_n(word64(self->in, OFF_TAIL), __ATOMIC_ACQUIRE) != self->head;
}

static PyObject *Ring_readable(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(self) < 0) return NULL;
    return PyBool_FromLong(in_ready(self));
}

/* arm() -> readable: say this end is going to sleep, then look again (Dekker's handshake). */
static PyObject *Ring_arm(RingObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_ready(self) < 0) return NULL;
    __atomic_store_n(word32(self->in, OFF_CONS_SLEEP), 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyBool_FromLong(in_ready(self));
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* spin(ns) -> readable: look at the incoming ring for up to `ns` nanoseconds, GIL released. */
static PyObject *Ring_spin(RingObject *self, PyObject *arg) {
    if (check_ready(self) < 0) return NULL;
    long long ns = PyLong_AsLongLong(arg);
    if (ns == -1 && PyErr_Occurred()) return NULL;
    if (in_ready(self)) Py_RETURN_TRUE;
    if (ns <= 0) Py_RETURN_FALSE;
    int ready = 0;
    self->spinners++;
    Py_BEGIN_ALLOW_THREADS
    uint64_t end = now_ns() + (uint64_t)ns;
    for (unsigned i = 1;; i++) {
        if (in_ready(self)) { ready = 1; break; }
        cpu_relax();
        if ((i & 63) == 0 && (now_ns() >= end || __atomic_load_n(&self->closed, __ATOMIC_RELAXED))) break;
    }
    Py_END_ALLOW_THREADS
    self->spinners--;
    if (self->closed) {
        unmap_if_idle(self);
        PyErr_SetString(PyExc_ValueError, "this connection's rings were closed while it waited");
        return NULL;
    }
    return PyBool_FromLong(ready);
}

static PyObject *Ring_get_count(RingObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLong(self->count);
}

static PyObject *Ring_get_slot(RingObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLong(self->slot);
}

/* Frames pushed that the peer has not taken; -1 when its head is out of bounds (it broke the ring). */
static PyObject *Ring_get_pending(RingObject *self, void *Py_UNUSED(closure)) {
    if (check_ready(self) < 0) return NULL;
    uint64_t head = __atomic_load_n(word64(self->out, OFF_HEAD), __ATOMIC_ACQUIRE);
    uint64_t used = self->tail - head;
    return PyLong_FromLongLong(used > self->count ? -1 : (long long)used);
}

static PyObject *Ring_bytes(PyObject *Py_UNUSED(cls), PyObject *args) {
    unsigned int count, slot;
    if (!PyArg_ParseTuple(args, "II", &count, &slot)) return NULL;
    return PyLong_FromSize_t(ss_ring_bytes(count, slot));
}

static PyMethodDef Ring_methods[] = {
    {"push", (PyCFunction)Ring_push, METH_O,
     "push(frame) -> 1 pushed, 3 pushed and the consumer must be woken, 0 full, -2 the peer broke the ring"},
    {"pop_into", (PyCFunction)Ring_pop_into, METH_O,
     "pop_into(buffer) -> -1 empty, -2 the peer broke the ring, else the frame's length"},
    {"readable", (PyCFunction)Ring_readable, METH_NOARGS, "readable() -> whether a frame waits"},
    {"arm", (PyCFunction)Ring_arm, METH_NOARGS, "arm() -> readable: this end is about to sleep"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS,
     "close(): unmap (now, or when a spin() running returns); every later call raises ValueError"},
    {"spin", (PyCFunction)Ring_spin, METH_O, "spin(ns) -> readable: look for up to ns, GIL released"},
    {"nbytes", (PyCFunction)Ring_bytes, METH_VARARGS | METH_STATIC,
     "nbytes(count, slot) -> bytes of shared memory both directions take (whole pages)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"count", (getter)Ring_get_count, NULL, "slots per direction", NULL},
    {"slot", (getter)Ring_get_slot, NULL, "bytes per slot (a frame takes 4 of them for its length)", NULL},
    {"pending", (getter)Ring_get_pending, NULL, "frames this end pushed that the peer has not taken (-1: the peer broke the ring)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmshare._native.Ring",
    .tp_doc = "Ring(fd, count, slot, first)\n\nOne end of a connection's two SPSC rings, mapped from fd.",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};
