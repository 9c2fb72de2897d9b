"""A value as one object's bytes: where each array goes, how it is written, and the views back.

Note [An object's layout]
    An object is one run of bytes: every array of the value, C order, each
    starting on a 64-byte boundary, in the order the value's walk meets
    them. The meta (``tensors.encode``) says where: segment 1 and an offset
    from the object's first byte, so the bytes can sit anywhere (a block of
    the daemon's pool, or a memfd of their own) without the meta changing.
    Empty arrays take no bytes (segment 0).

Note [Writing a large object]
    A put of an object of ``LARGE`` bytes or more writes the arrays into a
    fresh memfd with ``pwrite``, never through a mapping: tmpfs allocates
    each page as the write fills it, so the bytes are copied once and no
    page is zeroed first or faulted in, and the writer never has a writable
    mapping -- the memfd is sealed ``F_SEAL_WRITE`` before it leaves the
    process. ``posix_fallocate`` then fills the holes the padding left, so
    a getter's read can never allocate (Note [Trust no fd]). Large writes
    go on two threads: ``pwrite`` releases the GIL.

Note [Shared memory and the memory cgroup]
    A page of shared memory is charged to the memory cgroup of the process
    that first allocates it (``pwrite`` into a hole, ``posix_fallocate``),
    and stays charged there for as long as any fd or mapping keeps it: a
    putter's object is charged to the putter's cgroup while the daemon
    holds it, even after the putter exits; the daemon's pool, and the
    memfds it makes for small objects, to the daemon's. Past the limit the
    kernel does not fail the write: it OOM-kills a process of the cgroup. So
    every reservation of pages here first asks the segment layer's check
    (``_cgroup.memory_limit``, Note [Checking memory before reserving] in
    ``_segcalls``) and refuses with an error that names the limit and the
    fix: ``SegmentError(ENOMEM)`` in a client, ``StoreFull`` from the daemon.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import threading
from typing import Any

import numpy as np

from .. import _cgroup, _native, _segcalls, tensors
from .._errors import SegmentError, making_fds
from ._protocol import ALIGN, MAX_META, StoreError

__all__ = ["Plan", "write_memfd", "new_memfd", "reserve", "allocate_pages", "cgroup_refusal",
           "check_cgroup", "build", "one_array_meta", "torch_dtype_problem"]

_WRITE_MAX = 1 << 30  # bytes per pwrite call (Linux writes at most 0x7ffff000 at once)
_TWO_THREADS = 64 << 20  # objects from this size are written on two threads
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # every memfd of the store, from birth
_CLIENT_FIX = ("The pages of the objects this process put stay charged to its cgroup while the "
               "store holds them: delete some (Store.delete), put less, or raise the cgroup's "
               "limit (docker run --memory; memory.max, or memory.limit_in_bytes on cgroup v1)")


class Plan:
    """Where each array of `value` goes in its object (Note [An object's layout])."""

    __slots__ = ("arrays", "size", "torch", "meta")

    def __init__(self, value: Any) -> None:
        self.arrays: list[tuple[np.ndarray, int]] = []  # (array, offset in the object)
        self.size = 0  # bytes of the object
        self.torch = False  # holds torch tensors (a getter maps them copy-on-write)
        self.meta = tensors.encode(value, self._place)
        if len(self.meta) > MAX_META:
            raise ValueError(f"the value's description is {len(self.meta)} bytes (its arrays' "
                             f"descriptors and plain values); the store takes at most {MAX_META}: "
                             "put fewer arrays or less plain data per object")

    def _place(self, obj: Any) -> Any:
        arr, tdt = tensors.as_numpy(obj)
        dt = arr.dtype
        tensors.check_shareable(dt)
        if tdt is not None:
            self.torch = True
        shape = arr.shape
        strides = tensors.c_strides(dt.itemsize, shape)
        tbytes = (tdt or "").encode()
        if arr.nbytes == 0:
            return tensors.pack_desc(0, 0, 0, tensors.desc_dtype_bytes(dt), shape, strides, tbytes)
        offset = -(-self.size // ALIGN) * ALIGN
        self.arrays.append((arr, offset))
        self.size = offset + arr.nbytes
        return tensors.pack_desc(1, 0, offset, tensors.desc_dtype_bytes(dt), shape, strides, tbytes)

    def copy_into(self, address: int) -> None:
        """Copy every array to `address` + its offset (a mapping of the object's bytes)."""
        Plan.copy_some(self.arrays, address)

    @staticmethod
    def copy_some(arrays: list[tuple[np.ndarray, int]], address: int) -> None:
        """Copy each (array, offset) of `arrays` to `address` + offset."""
        for arr, offset in arrays:
            raw = _native.Lease(None, address + offset, arr.nbytes)
            dst = np.ndarray(arr.shape, arr.dtype, buffer=raw)  # type: ignore[arg-type]
            _copy(dst, arr)


def one_array_meta(shape: tuple[int, ...], dtype: np.dtype, torch_dtype: str | None,
                   has_bytes: bool) -> bytes:
    """The meta of an object that is one C-order array at offset 0 (``create``)."""
    ext = tensors.pack_desc(1 if has_bytes else 0, 0, 0, tensors.desc_dtype_bytes(dtype), shape,
                            tensors.c_strides(dtype.itemsize, shape), (torch_dtype or "").encode())
    return tensors.encode(ext, _no_arrays)


def _no_arrays(obj: Any) -> Any:
    raise TypeError("no array here")


# What a tensor of each torch dtype is as numpy (tensors.as_numpy), known without importing
# torch -- the daemon never does: (item size, numpy's own dtype, or None where numpy has none
# and the tensor comes as the same-size integer). A meta that says torch dtype X over another
# numpy dtype would make every getter's as_torch fail, or view the bits as another shape.
_TORCH_DTYPES: dict[str, tuple[int, str | None]] = {
    "bool": (1, "?"), "uint8": (1, "u1"), "int8": (1, "i1"), "int16": (2, "i2"),
    "uint16": (2, "u2"), "int32": (4, "i4"), "uint32": (4, "u4"), "int64": (8, "i8"),
    "uint64": (8, "u8"), "float16": (2, "f2"), "float32": (4, "f4"), "float64": (8, "f8"),
    "complex64": (8, "c8"), "complex128": (16, "c16"),
    "bfloat16": (2, None), "complex32": (4, None), "bits16": (2, None),
    **{n: (1, None) for n in (
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "bits8", "bits1x8", "bits2x4", "bits4x2",
        *(f"{u}int{b}" for u in ("", "u") for b in range(1, 8)))},
}
_AS_INT = {1: "u1", 2: "i2", 4: "i4", 8: "i8"}  # as_numpy's view of a dtype numpy lacks


def torch_dtype_problem(dt: np.dtype, torch_dtype: str) -> str | None:
    """Why an array of numpy dtype `dt` cannot be a tensor of `torch_dtype`; None if it can."""
    known = _TORCH_DTYPES.get(torch_dtype)
    if known is None:
        return (f"an array's torch dtype {torch_dtype!r} (over numpy {dt.str!r}) is not a torch "
                "dtype the store knows (a newer torch's dtype needs a newer shmshare)")
    size, own = known
    fits = [np.dtype("=" + x) for x in (own, _AS_INT.get(size)) if x is not None]
    if any(dt == f for f in fits):
        return None
    return (f"an array's torch dtype {torch_dtype!r} does not match its numpy dtype {dt.str!r}: "
            f"a {torch_dtype} tensor is numpy {' or '.join(repr(f.str) for f in fits)}, so no "
            "getter could rebuild it")


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    if src.dtype.fields is not None or src.dtype.subdtype is not None:
        void = np.dtype((np.void, src.dtype.itemsize))  # whole items, padding included
        np.copyto(dst.view(void), src.view(void), casting="no")
    else:
        np.copyto(dst, src, casting="no")


def new_memfd(size: int, what: str) -> int:
    """A memfd of `size` bytes, sealed against shrinking and growing; the caller owns it."""
    fd = making_fds("memfd_create", os.memfd_create,
                    f"shmshare_{os.getpid()}_{secrets.token_hex(4)}",
                    os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        raise SegmentError(exc.errno, f"cannot make a {size}-byte memfd for {what}: "
                           f"{exc.strerror}") from exc
    return fd


def cgroup_refusal(nbytes: int, what: str, who: str, fix: str) -> str | None:
    """Why `who`'s memory cgroup cannot take `nbytes` more of shared memory for `what` now, or
    None if it can (Note [Shared memory and the memory cgroup])."""
    lim = _cgroup.memory_limit(nbytes=nbytes)
    if lim is None or lim.fits(nbytes):
        return None
    cache = f", {lim.reclaimable} of them reclaimable page cache" if lim.reclaimable else ""
    return (f"cannot reserve {nbytes} bytes of shared memory for {what}: the memory cgroup "
            f"{lim.path} (v{lim.version}, {lim.directory}) of {who} has a limit of {lim.limit} "
            f"bytes and {lim.usage} bytes in use{cache}, {lim.slack} bytes kept as headroom; "
            f"writing past the limit would get {who} OOM-killed, so it was not tried. {fix}")


def reserve(fd: int, size: int, what: str) -> None:
    """Give every page of a fresh memfd its memory now, if this process's memory cgroup can
    take them (SegmentError ENOMEM if not): ENOSPC here, never SIGBUS or an OOM kill later."""
    check_cgroup(size, what)
    allocate_pages(fd, size, what)


def allocate_pages(fd: int, size: int, what: str) -> None:
    """posix_fallocate the memfd's pages (the caller checked the memory cgroup)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise SegmentError(exc.errno, f"cannot reserve {size} bytes of shared memory for {what}: "
                           f"{exc.strerror} (the host's memory, or the memory cgroup's limit, is "
                           "used up: free some, or put less)") from exc


def check_cgroup(size: int, what: str) -> None:
    """SegmentError(ENOMEM) unless this process's memory cgroup, and the host, can take `size`
    more bytes (past the host's, the OOM killer may pick any process)."""
    pages = -(-size // _native.PAGE_SIZE) * _native.PAGE_SIZE
    refused = cgroup_refusal(pages, what, "this process", _CLIENT_FIX)
    if refused is not None:
        raise SegmentError(errno.ENOMEM, refused)
    _segcalls.check_host(pages, f"memfd of {what}")


def write_memfd(plan: Plan, name: str) -> int:
    """Write the plan's arrays into a new memfd sealed against writes (Note [Writing a large
    object]); return the fd (the caller owns it)."""
    what = f"object {name!r}"
    check_cgroup(plan.size, what)  # each pwrite allocates the pages it fills
    fd = new_memfd(plan.size, what)
    try:
        jobs = [(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr), off)
                for arr, off in plan.arrays]
        failed: list[BaseException] = []
        if plan.size >= _TWO_THREADS:
            half = plan.size // 2
            first = [(a, o) for a, o in jobs if o < half]
            rest = [(a, o) for a, o in jobs if o >= half]
            if not rest and len(first) == 1:  # one big array: its two halves
                a, o = first[0]
                flat = a.reshape(-1).view(np.uint8)
                cut = (half // _native.PAGE_SIZE) * _native.PAGE_SIZE
                first, rest = [(flat[:cut], o)], [(flat[cut:], o + cut)]
            t = threading.Thread(target=_write_all, args=(fd, rest, failed), daemon=True)
            t.start()
            _write_all(fd, first, failed)
            t.join()
        else:
            _write_all(fd, jobs, failed)
        if failed:
            raise failed[0]
        allocate_pages(fd, plan.size, what)  # the padding's holes: checked with the rest
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, SegmentError):
            raise
        raise SegmentError(exc.errno, f"cannot write {plan.size} bytes into the memfd of {what}: "
                           f"{exc.strerror}") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, jobs: list[tuple[np.ndarray, int]], failed: list[BaseException]) -> None:
    try:
        for arr, offset in jobs:
            mv = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy types Buffer from 3.12
            done, n = 0, len(mv)
            while done < n:
                done += os.pwrite(fd, mv[done:done + _WRITE_MAX], offset + done)
    except BaseException as exc:  # noqa: BLE001 - raised again by write_memfd, on its thread
        failed.append(exc)


def build(meta: bytes, address: int, size: int, root: Any, readonly: bool, on_release: Any,
          torch_copy: bool, track: Any = None) -> Any:
    """The value `meta` describes, as views of `size` bytes at `address` (kept alive by `root`).

    One lease covers the object: `on_release` runs once every view is gone.
    Torch tensors share the mapping unless `torch_copy` (then each is a
    private copy: torch has no read-only tensors). `track(lease)` is told of the lease.
    """
    lease = _native.Lease(root, address, size, readonly, on_release)
    if track is not None:
        track(lease)  # a view of a pool block: a forked child copies it

    def view(seg: int, block: int, offset: int, lay: tensors.Layout) -> Any:
        dt = lay.dtype
        if dt.hasobject:
            raise StoreError(f"an array of dtype {dt} in an object: refused")
        if seg == 0:
            if 0 not in lay.shape and (dt.itemsize or dt.kind in "SU"):
                raise StoreError(f"an empty array's descriptor has shape {lay.shape}")
            arr = np.empty(lay.shape, dt)
            if lay.torch_dtype is None or not tensors.torch_imported():
                arr.flags.writeable = False  # as every array a get gives
        else:
            start = offset + lay.lo
            if seg != 1 or start < 0 or start + lay.nbytes > size:
                raise StoreError(f"an array of {lay.nbytes} bytes at offset {start} lies outside "
                                 f"its object of {size} bytes")
            if lay.dense:
                arr = np.ndarray(lay.shape, dt, buffer=lease, offset=offset)  # type: ignore[arg-type]
            else:
                arr = np.ndarray(lay.shape, dt, buffer=lease, offset=offset,  # type: ignore[arg-type]
                                 strides=lay.strides)
            if not readonly and (lay.torch_dtype is None or not tensors.torch_imported()):
                arr.flags.writeable = False  # a copy-on-write mapping: numpy arrays stay read-only
        if lay.torch_dtype is None or not tensors.torch_imported():
            return arr  # Note [Tensors to a process without torch]
        problem = torch_dtype_problem(dt, lay.torch_dtype)  # the daemon checked it: ours too
        if problem is not None:
            raise StoreError(f"the store sent a malformed object: {problem}")
        return tensors.as_torch(arr.copy() if torch_copy else arr, lay.torch_dtype)

    try:
        return tensors.decode(meta, view)
    except ValueError as exc:
        raise StoreError(f"the store sent a malformed object: {exc}") from exc
