/*
 * shmshare_native.h -- the OS primitives that the Python standard library lacks.
 *
 * The rule every primitive keeps (after mimalloc's prim.h):
 *   - it returns 0 on success or a positive errno value on failure; it never
 *     sets errno for the caller to read and never raises;
 *   - outputs go through pointer arguments, which are never NULL;
 *   - it holds no state and takes no policy decision: sizes, alignment and
 *     flags come from the caller, which is Python code that knows why.
 * The Python wrappers in shmshare_native.c turn a non-zero result into an
 * OSError subclass whose message names the system call, its arguments and
 * strerror(errno).
 */
#ifndef SHMSHARE_NATIVE_H
#define SHMSHARE_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Reserve `nbytes` of address space: PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|
 * MAP_NORESERVE. No memory is committed. */
int ss_reserve(size_t nbytes, void **out_address);

/* Map `nbytes` of `fd` at `offset` with MAP_SHARED|MAP_FIXED over
 * [address, address+nbytes), which must lie in a range from ss_reserve. */
int ss_map_fd(void *address, size_t nbytes, int fd, off_t offset, int writable);

/* Map `nbytes` of `fd` at `offset` wherever the kernel chooses.
 * shared: MAP_SHARED, else MAP_PRIVATE (copy-on-write); populate: MAP_POPULATE. */
int ss_mmap(size_t nbytes, int fd, off_t offset, int writable, int shared,
            int populate, void **out_address);

/* Turn [address, address+nbytes) back into a PROT_NONE reservation (the
 * address range stays ours), or release it to the kernel when `release`. */
int ss_unmap(void *address, size_t nbytes, int release);

/* fallocate(FALLOC_FL_PUNCH_HOLE|FALLOC_FL_KEEP_SIZE): free the pages of
 * [offset, offset+nbytes) of `fd` while the file keeps its size. */
int ss_punch_hole(int fd, off_t offset, size_t nbytes);

/* madvise(2) on a raw range. */
int ss_madvise(void *address, size_t nbytes, int advice);

/* Fault in every page of [address, address+nbytes) on `threads` threads by
 * touching one byte per page (a write that keeps the byte when `writable`,
 * else a read). `page_size` is the stride. */
int ss_prefault(void *address, size_t nbytes, size_t page_size, int threads,
                int writable);

#endif /* SHMSHARE_NATIVE_H */
