/*
 * ring.h -- the Ring type: one end of a connection's two single-producer
 * single-consumer rings in shared memory (see ring.c).
 */
#ifndef SHMSHARE_RING_H
#define SHMSHARE_RING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

extern PyTypeObject RingType;

/* Bytes of shared memory both directions of `count` slots of `slot` bytes take (whole pages). */
size_t ss_ring_bytes(uint32_t count, uint32_t slot);

#endif /* SHMSHARE_RING_H */
