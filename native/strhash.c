/*
 * strhash.c -- the keys' hash of shared mappings (Note [One copy of the dataset] in
 * shmshare/loader/_frozen.py): FNV-1a over the bytes, then splitmix64's finalizer to spread
 * it. Unlike Python's hash() it is the same in every process, so a mapping packed in one is
 * looked up in another. hash_spans hashes every key of a packed sequence in one call.
 */
#include "strhash.h"

#include <stdint.h>
#include <string.h>

static int64_t strhash(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    h ^= (uint64_t)n;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
    h ^= h >> 31;
    return (int64_t)h;
}

/* hash_bytes(buffer) -> int: the hash of a bytes-like object, as a signed 64-bit int. */
PyObject *py_hash_bytes(PyObject *mod, PyObject *arg) {
    (void)mod;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    int64_t h = strhash((const unsigned char *)view.buf, view.len);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong((long long)h);
}

/* hash_spans(data, offsets, out): out[i] = the hash of data[offsets[i]:offsets[i+1]], for
 * int64 offsets (n + 1 of them, ascending, within data) and a writable int64 out of n. */
PyObject *py_hash_spans(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "hash_spans(data, offsets, out)");
    Py_buffer data, offs, out;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &offs, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &out, PyBUF_SIMPLE | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&offs);
        PyBuffer_Release(&data);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = out.len / 8;
    const int64_t *o = (const int64_t *)offs.buf;
    if (out.len % 8 || offs.len != (n + 1) * 8 || (uintptr_t)offs.buf % 8 || (uintptr_t)out.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "hash_spans: offsets must be n + 1 aligned int64s and out n");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] < 0 || o[i] > o[i + 1] || o[i + 1] > data.len) {
            PyErr_Format(PyExc_ValueError, "hash_spans: span %zd [%lld, %lld) is outside the %zd bytes",
                         i, (long long)o[i], (long long)o[i + 1], data.len);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        ((int64_t *)out.buf)[i] = strhash((const unsigned char *)data.buf + o[i], o[i + 1] - o[i]);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&data);
    return result;
}

/* find_key(key, hashes, order, offsets, data) -> i or -1: the index of the key whose bytes
 * equal `key`'s in a packed mapping: `hashes` (sorted int64) are its keys' hashes, `order[j]`
 * the key whose hash is hashes[j], and key i is data[offsets[i]:offsets[i+1]]. Every index
 * read is checked against the buffers: a bad mapping gives ValueError, never a wild read. */
PyObject *py_find_key(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "find_key(key, hashes, order, offsets, data)");
    Py_buffer b[5];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 5; got++)
        if (PyObject_GetBuffer(args[got], &b[got], PyBUF_SIMPLE) < 0) goto done;
    const unsigned char *key = b[0].buf;
    const int64_t *hashes = b[1].buf, *order = b[2].buf, *offs = b[3].buf;
    Py_ssize_t n = b[1].len / 8, nkeys = b[3].len / 8 - 1;
    if (b[2].len != b[1].len || nkeys < 0 || (uintptr_t)hashes % 8 || (uintptr_t)order % 8 ||
        (uintptr_t)offs % 8) {
        PyErr_SetString(PyExc_ValueError, "find_key: hashes, order and offsets must be aligned int64s");
        goto done;
    }
    int64_t h = strhash(key, b[0].len);
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {  /* the first j with hashes[j] >= h */
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (hashes[mid] < h) lo = mid + 1; else hi = mid;
    }
    long long found = -1;
    for (Py_ssize_t j = lo; j < n && hashes[j] == h; j++) {
        int64_t i = order[j];
        if (i < 0 || i >= nkeys || offs[i] < 0 || offs[i] > offs[i + 1] || offs[i + 1] > b[4].len) {
            PyErr_SetString(PyExc_ValueError, "find_key: the mapping's order or offsets are out of range");
            goto done;
        }
        if (offs[i + 1] - offs[i] == b[0].len &&
            memcmp((const unsigned char *)b[4].buf + offs[i], key, (size_t)b[0].len) == 0) {
            found = i;
            break;
        }
    }
    result = PyLong_FromLongLong(found);
done:
    while (got-- > 0) PyBuffer_Release(&b[got]);
    return result;
}
