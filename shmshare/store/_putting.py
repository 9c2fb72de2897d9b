"""A client's puts and creates: where an object's bytes are written, and by whom.

Note [Warm memory]
    An object of ``LARGE`` bytes or more goes, by default, into the
    daemon's pool (the ``LendingPool`` small objects live in), as Ray's
    objects go into its arena: the client asks for *room* (a block,
    pending until named), copies the bytes into it through a read-write
    mapping of the block's segment that it keeps -- the segment's fd
    crosses once per client, as a getter's read-only one does -- and then
    puts, which names the block. A freed block's pages stay in the pool,
    populated and mapped in every client that used them, so the next put
    is a copy into memory already there and the next get of a recycled
    block takes no fault. Objects of 256 MiB or more are copied on up to 4
    threads. The pool keeps free room warm up to ``--limit`` (without one,
    a quarter of the host's memory, at most 8 GiB) and gives it back once
    it has been empty for 0.5 s (Note [Eviction]).

    What it guarantees is Ray's: getters map the pool ``PROT_READ``, so a
    get's views cannot write it; a process that puts maps it read-write and
    is trusted not to write objects it did not put, as every process of one
    uid can through ``/proc/<pid>/fd`` anyway. Where the kernel must enforce
    it, ``put(..., immutable=True)`` and ``create(..., immutable=True)``
    take the object's own memfd, sealed ``F_SEAL_WRITE`` (Note [Writing a
    large object] in ``_packing``): nobody can change it, it costs a fresh
    allocation per put and a fault per page per getter, and it is the path
    a warm put falls back to when the pool has no room for it under
    ``--limit`` (a 1-10 MiB object takes a 20 MiB segment of the pool), or
    the daemon's memory cgroup none.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native
from .._errors import FdLimitError, ProtocolError
from .._fd import Fd
from ._flusher import Queued
from ._inherited import track_view
from ._packing import Plan, new_memfd, reserve, write_memfd
from ._protocol import LARGE, StoreError, StoreFull

if TYPE_CHECKING:
    from ._client import Store

__all__ = ["put", "create", "stage", "copy_plan", "THREADS_FROM"]

THREADS_FROM = 256 << 20  # bytes from which a warm put copies on several threads
_MAX_THREADS = 4


def put(store: Store, name: str, plan: Plan, replace: bool, immutable: bool) -> None:
    """Store `plan`'s value under `name`: warm (the pool), sealed (its own memfd), or staged."""
    header = {"k": "put", "n": name, "m": plan.meta, "s": plan.size, "t": plan.torch,
              "r": replace}
    if plan.size >= LARGE and not immutable:
        try:
            _put_warm(store, name, plan, header)
            return
        except StoreFull:
            pass  # no room in the pool for it: its own memfd, which the daemon charges by page
    if plan.size and (immutable or plan.size >= LARGE):
        fd = write_memfd(plan, name)
        try:
            store._call(header, [fd])
        finally:
            os.close(fd)
        return
    with store._lock:
        stage(store, plan)
        header["st"] = plan.size
        store._call_locked(header, [])


def _put_warm(store: Store, name: str, plan: Plan, header: dict[str, Any]) -> None:
    with store._lock:
        h, fds = store._call_locked({"k": "room", "n": name, "s": plan.size,
                                     "r": header["r"]}, [])
        oid = h["o"]
        store._putting += 1  # a close() meanwhile keeps the connection (and so the room)
    try:
        try:
            with store._lock:
                root = _writable(store, h, fds, plan.size)  # held: kept mapped while we copy
            copy_plan(plan, root.address + h["off"])
        except BaseException:
            store._abandon(oid)  # its block goes back with the next request
            raise
        header["o"] = oid
        store._call(header)  # not sent (closed meanwhile): _unsent abandons the room
    finally:
        with store._lock:
            store._putting -= 1
        store._waker.poke()


def stage(store: Store, plan: Plan) -> None:
    """Copy a small object's bytes into the client's staging memfd (under its lock)."""
    if store._staging is None:
        fd = new_memfd(LARGE, "the store client's staging memfd")
        try:
            reserve(fd, LARGE, "the store client's staging memfd")
            address = _native.mmap(LARGE, fd, 0, writable=True, shared=True)
            try:
                store._call_locked({"k": "stage", "s": LARGE}, [fd])
            except BaseException:
                _native.unmap(address, LARGE, release=True)
                raise
        except BaseException:
            os.close(fd)
            raise
        store._staging = (fd, address)
    plan.copy_into(store._staging[1])


def create(store: Store, name: str, header: dict[str, Any], shape: tuple[int, ...],
           dtype: np.dtype, immutable: bool) -> np.ndarray:
    """Make object `name` of one array to fill in place; the array (Store.create's)."""
    size = header["s"]
    if size >= LARGE and not immutable:
        try:
            return _create_warm(store, name, header, shape, dtype)
        except StoreFull:
            pass  # no room in the pool for it: its own memfd, as an immutable one
    if size >= LARGE or (immutable and size):
        fd = new_memfd(size, f"object {name!r}")
        try:
            reserve(fd, size, f"object {name!r}")
            address = _native.mmap(size, fd, 0, writable=True, shared=True)
            try:
                h, _ = store._call(header, [fd])
            except BaseException:
                _native.unmap(address, size, release=True)
                raise
        finally:
            os.close(fd)
        oid = h["o"]
        lease = _native.Lease(None, address, size, False, Queued(store, store._unmapped, oid),
                              unmap=True)
        arr = np.ndarray(shape, dtype, buffer=lease)  # type: ignore[arg-type]
        store._creating[name] = (oid, weakref.ref(arr))
        return arr
    h, _ = store._call(header)
    arr = np.empty(shape, dtype)
    store._creating[name] = (h["o"], arr)
    return arr


def _create_warm(store: Store, name: str, header: dict[str, Any], shape: tuple[int, ...],
                 dtype: np.dtype) -> np.ndarray:
    """A warm create: the array is a writable view of the pool block, and holds a reference of
    this client's, as a get's views do, until it is gone (else the daemon could reuse it)."""
    size = header["s"]
    with store._lock:
        try:
            h, fds = store._call_locked({**header, "w": True}, [])
        except FdLimitError:  # created, its fd lost (its reference given back): unmade
            with contextlib.suppress(StoreError):
                store._call_locked({"k": "del", "n": name}, [])
            raise
        oid = h["o"]
        store._out += 1
        done = Queued(store, store._released, oid)
        try:
            root = _writable(store, h, fds, size)
        except BaseException:
            done()  # the reference goes; the unsealed object is aborted when we disconnect
            raise
    lease = _native.Lease(root, root.address + h["off"], size, False, done)
    track_view(lease)  # a forked child copies it (Note [Views across fork])
    arr = np.ndarray(shape, dtype, buffer=lease)  # type: ignore[arg-type]
    store._creating[name] = (oid, weakref.ref(arr))
    return arr


def _writable(store: Store, h: dict[Any, Any], fds: list[Fd], size: int) -> _native.Lease:
    """The segment to write a room's `size` bytes in, at ``h["off"]``: mapped read-write, kept."""
    seg, off = h.get("i"), h.get("off")
    if type(seg) is not int or type(off) is not int:
        for f in fds:
            f.close()
        raise ProtocolError(f"the store gave room at segment {seg!r}, offset {off!r}")
    root = store._wsegs.get(seg)
    if root is None:
        nbytes = h.get("n")
        if len(fds) != 1 or type(nbytes) is not int or nbytes <= 0:
            for f in fds:
                f.close()
            store._wforget.append(seg)
            raise ProtocolError("the store gave room in a segment without its fd")
        try:
            root = store._wsegs.map(seg, fds.pop(), nbytes, writable=True)
        except BaseException:
            store._wforget.append(seg)  # sent, not mapped: the daemon sends it again
            raise
    for f in fds:
        f.close()
    if not 0 <= off <= off + size <= root.nbytes:
        raise ProtocolError(f"the store gave room for {size} bytes at offset {off} of a "
                            f"{root.nbytes}-byte segment")
    return root


def copy_plan(plan: Plan, address: int) -> None:
    """Copy the plan's arrays to `address`: on several threads from THREADS_FROM bytes (the
    copy runs with the GIL released), else on this one."""
    threads = min(_MAX_THREADS, os.cpu_count() or 1) if plan.size >= THREADS_FROM else 1
    if threads < 2:
        plan.copy_into(address)
        return
    spans: list[tuple[int, int, int]] = []  # (destination, source, bytes) of contiguous arrays
    rest: list[tuple[np.ndarray, int]] = []
    for arr, offset in plan.arrays:
        if arr.flags.c_contiguous:
            spans.append((address + offset, arr.ctypes.data, arr.nbytes))
        else:
            rest.append((arr, offset))
    share = -(-sum(n for _, _, n in spans) // threads)
    jobs: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    k, room = 0, share
    for dst, src, n in spans:
        while n:
            take = min(n, room)
            jobs[k].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if not room and k + 1 < threads:
                k, room = k + 1, share
    failed: list[BaseException] = []

    def run(job: list[tuple[int, int, int]]) -> None:
        try:
            for dst, src, n in job:
                ctypes.memmove(dst, src, n)
        except BaseException as exc:  # noqa: BLE001 - raised again below, on the caller's thread
            failed.append(exc)

    helpers = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs[1:] if j]
    for t in helpers:
        t.start()
    run(jobs[0])
    if rest:
        Plan.copy_some(rest, address)
    for t in helpers:
        t.join()
    if failed:
        raise failed[0]
