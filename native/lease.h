/*
 * lease.h -- the Lease type: a buffer exporter over [address, address+nbytes)
 * that keeps an owner alive and releases (munmap, close, on_release) exactly
 * once, when the lease and every view exported from it are gone.
 */
#ifndef SHMSHARE_LEASE_H
#define SHMSHARE_LEASE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject LeaseType;
extern long page_size_value; /* defined in shmshare_native.c, set at import */

#endif /* SHMSHARE_LEASE_H */
