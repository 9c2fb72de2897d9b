"""ShmProvider: memfd (or POSIX shm) segments for the caching allocator.

Every record holds a :class:`~shmshare.Segment`, the only owner of its fd
and mapping. Classic segments are ``Segment.create`` (sealed memfds, pages
reserved with ``posix_fallocate``). Expandable segments are
``Segment.reserve``: one memfd behind a reserved address range, grown and
mapped piece by piece with ``map_range``; ``unmap_range(punch=True)`` gives
a range's memory back to the host while the address range and the fd stay
(Note [Expandable shm segments]).

Note [Streams of the shm provider]
    Here a stream would be a consumer process and an event its release of a
    block. Releases arrive in any order, and the allocator's stream-ordered
    event queues would then hold every block freed after one that a peer
    keeps for a long time (head-of-line blocking). So the channel counts the
    leases of each block itself and hands the block to ``free`` only when
    the last lease and the last local view are gone; for the allocator every
    shm event is complete at once.

Note [Expandable shm segments]
    The memfd is sealed ``F_SEAL_SHRINK`` only: it may grow, never shrink,
    so no peer can truncate it under a reader. A peer that received the fd
    maps the ranges it is told about into its own reservation; a hole
    punched here reads as zeros there, and is never handed out to the peer
    again before being re-announced.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from .._errors import SegmentError
from .._lifetime import Closeable
from ..segment import DEFAULT_FLAGS, Segment, shm_free_bytes
from ._provider import ProviderOutOfMemory

__all__ = ["ShmProvider", "ShmSegment"]

_ids = itertools.count(1)
_OOM_ERRNOS = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
LOCAL_STREAM = "local"  # the provider's own process


def _new_id() -> int:
    # unique across fork: a child's segments never collide with its parent's on a shared connection
    return (os.getpid() << 32) | next(_ids)


@dataclass(eq=False)
class ShmSegment(Closeable):
    """A segment the provider made: its id and the :class:`Segment` that owns fd and mapping."""

    id: int  # unique across processes of this host
    segment: Segment  # the only owner of the fd and of the mapping
    mapped: dict[int, int] = field(default_factory=dict)  # expandable: offset -> nbytes mapped
    keep_pages: bool = False  # a peer may still read it: unmap here, never punch holes

    @property
    def address(self) -> int:
        """First byte in this process (of the reservation, for expandable segments)."""
        return self.segment.address

    @property
    def size(self) -> int:
        """Bytes of address range (reserved, for expandable segments)."""
        return self.segment.size

    @property
    def fd(self) -> int:
        """The memfd, owned by `segment`; -1 once closed (or forgotten in a forked child)."""
        fd = self.segment.fd
        return -1 if fd is None else fd

    @property
    def expandable(self) -> bool:
        """Whether this is a reserved range mapped piece by piece."""
        return self.segment.expandable

    def close(self) -> None:
        """Close the segment: its fd now, its mapping once no view holds it. Idempotent.

        ``Segment.close`` forgets before it acts, so a second call (``__del__``,
        maybe much later from the garbage collector) touches no address range
        or fd number that by then belongs to someone else.
        """
        seg = getattr(self, "segment", None)  # a half-built record has none
        if seg is not None:
            seg.close()


class ShmProvider:
    """Give the allocator shared memory that can be sent to other processes.

    Parameters
    ----------
    limit : int, optional
        Bytes of memory (classic segments plus mapped expandable pages) the
        provider backs at most; past it ``allocate``/``map`` signal OOM, which
        is how a channel's pool gets back-pressure.
    backend : {"memfd", "posix"}
        For classic segments; expandable segments are always memfds.
    """

    name = "shm"

    def __init__(self, limit: int | None = None, backend: str = "memfd") -> None:
        if limit is not None and limit <= 0:
            raise ValueError(f"limit must be a positive number of bytes or None, got {limit}")
        if backend not in ("memfd", "posix"):
            raise ValueError(f"backend must be 'memfd' or 'posix', got {backend!r}")
        self.limit = limit
        self.backend = backend
        self.used = 0  # bytes backed now
        self.segments: dict[int, ShmSegment] = {}  # id -> segment
        self.listeners: list[Callable[[str, ShmSegment, int, int], None]] = []
        self._lock = threading.Lock()

    # -- classic segments -----------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, object]:
        """Create a sealed segment of `nbytes`; return (address, ShmSegment)."""
        self._charge(nbytes, "allocate")
        try:
            seg = Segment.create(nbytes, DEFAULT_FLAGS, backend=self.backend)
        except SegmentError as exc:
            self._refund(nbytes)
            if exc.errno in _OOM_ERRNOS:
                raise ProviderOutOfMemory(f"shm: cannot create a {nbytes}-byte segment: {exc}") from exc
            raise
        rec = ShmSegment(_new_id(), seg)
        self.segments[rec.id] = rec
        self._notify("segment_alloc", rec, 0, nbytes)
        return rec.address, rec

    def free(self, handle: object) -> None:
        """Close a classic segment; peers that mapped it keep their pages."""
        rec = self._record(handle)
        self._notify("segment_free", rec, 0, rec.size)
        del self.segments[rec.id]
        rec.close()
        self._refund(rec.size)

    # -- expandable segments --------------------------------------------------

    def reserve(self, nbytes: int) -> tuple[int, object]:
        """Reserve `nbytes` of address space backed by a fresh growable memfd (0 bytes yet)."""
        seg = Segment.reserve(nbytes)
        rec = ShmSegment(_new_id(), seg)
        self.segments[rec.id] = rec
        self._notify("segment_reserve", rec, 0, nbytes)
        return rec.address, rec

    def map(self, handle: object, offset: int, nbytes: int) -> None:
        """Grow the memfd if needed, reserve the pages, map them at address+offset."""
        rec = self._record(handle)
        self._charge(nbytes, "map")
        try:
            rec.segment.map_range(offset, nbytes)  # all or nothing
        except BaseException as exc:
            self._refund(nbytes)
            if isinstance(exc, OSError) and exc.errno in _OOM_ERRNOS:
                raise ProviderOutOfMemory(f"shm: cannot map {nbytes} bytes at offset {offset} of an "
                                          f"expandable segment: {exc}") from exc
            raise
        rec.mapped[offset] = nbytes
        self._notify("segment_map", rec, offset, nbytes)

    def unmap(self, handle: object, offset: int, nbytes: int) -> None:
        """Unmap a range (the addresses stay reserved) and punch its pages out of the memfd."""
        rec = self._record(handle)
        self._notify("segment_unmap", rec, offset, nbytes)
        rec.segment.unmap_range(offset, nbytes, punch=not rec.keep_pages)
        _forget_range(rec.mapped, offset, nbytes)
        self._refund(nbytes)

    def release(self, handle: object) -> None:
        """Give the address range back and close the memfd."""
        rec = self._record(handle)
        self._notify("segment_free", rec, 0, rec.size)
        del self.segments[rec.id]
        self._refund(sum(rec.mapped.values()))
        rec.close()

    # -- capacity, streams, events ---------------------------------------------

    def capacity(self) -> int | None:
        """Return the byte limit, or None when unlimited."""
        return self.limit

    def free_bytes(self) -> int | None:
        """Return the bytes that could still be backed: under the limit, and on the host."""
        host = shm_free_bytes()[0] if self.backend == "posix" else _available_memory()
        if self.limit is None:
            return host
        return max(0, min(self.limit - self.used, host))

    def default_stream(self) -> Hashable:
        """Return the provider's own process as a stream."""
        return LOCAL_STREAM

    def record_event(self, stream: Hashable) -> object:
        """Return a completed event (leases are counted by the channel, see the module note)."""
        return None

    def event_done(self, event: object) -> bool:
        """Return True: shm events complete at once."""
        return True

    def synchronize(self, stream: Hashable | None = None) -> None:
        """Return at once: nothing runs asynchronously on shared memory."""

    def after_fork_in_child(self, keep: set[int]) -> list[ShmSegment]:
        """In a forked child: forget every segment's fd; unmap all but the ids in `keep`.

        The segments in `keep` stay mapped (arrays the child inherited point
        into them) and are returned: the caller keeps them alive and never
        reuses them. The provider is empty afterwards (Note [Segments in a
        forked child] in ``segment``).
        """
        kept = []
        for rec in self.segments.values():
            rec.segment._forget_after_fork()
            if rec.id in keep:
                kept.append(rec)
            else:
                rec.close()  # unmaps: nothing of the child's points into it
        self.segments.clear()
        self.used = 0
        return kept

    def close(self) -> None:
        """Close every segment still open (the allocator normally frees them first)."""
        for rec in list(self.segments.values()):
            rec.close()
        self.segments.clear()
        self.used = 0

    # -- internals --------------------------------------------------------------

    def _charge(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                raise ProviderOutOfMemory(
                    f"shm: {what} of {nbytes} bytes would pass the pool limit of {self.limit} "
                    f"bytes ({self.used} in use)")
            self.used += nbytes

    def _refund(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes

    def _record(self, handle: object) -> ShmSegment:
        if not isinstance(handle, ShmSegment) or handle.id not in self.segments:
            raise ValueError(f"{handle!r} is not a live segment of this provider")
        return handle

    def _notify(self, kind: str, rec: ShmSegment, offset: int, nbytes: int) -> None:
        for fn in self.listeners:
            fn(kind, rec, offset, nbytes)


def _forget_range(mapped: dict[int, int], offset: int, nbytes: int) -> None:
    """Remove [offset, offset+nbytes) from a map of mapped ranges, splitting where needed."""
    end = offset + nbytes
    for start, size in list(mapped.items()):
        stop = start + size
        if stop <= offset or start >= end:
            continue
        del mapped[start]
        if start < offset:
            mapped[start] = offset - start
        if stop > end:
            mapped[end] = stop - end


def _available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
