"""The blocks a sender holds: by local views, by leases, or as spares.

Note [Spare blocks]
    A block whose last lease and local view are gone is not handed back to
    the caching allocator at once: it is kept as a *spare* for the next
    request of its size (sizes rounded up to _SPARE_GRAIN; up to
    _SPARES_PER_SIZE of a size and min(limit/8, SPARE_BYTES) bytes in all).
    A producer sending batches of a few shapes -- the usual case -- then
    skips the allocator's malloc/free pair, a large share of a small
    message's cost (Note [Hot path] in ``__init__.py``). Sizes that stop
    being asked for must not pin memory the allocator could reuse (a
    producer of ever-varying sizes would grow its pool): on a miss, at most
    every _SPARE_IDLE sends, the spares of every size not asked for in the
    last _SPARE_IDLE sends go back. The clock counts sends, not requests, so
    that a batch of many arrays ages its sizes by one, not by its length.
    All spares go back before a request waits for room, on ``empty_cache()``,
    ``close()`` and peer death. They count as allocated in ``memory_stats()``
    and as ``spare_bytes`` in ``statistics()``.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import PoolExhausted, SegmentError
from ..memory import CachingAllocator, ShmSegment
from ._announce import SegmentBook

__all__ = ["BlockBook", "SPARE_BYTES", "SenderStatistics", "ViewDied", "exhausted", "host_cause"]

SPARE_BYTES = 64 << 20  # at most this many bytes of spare blocks (and limit/8), ...
_SPARES_PER_SIZE = 1024  # ... and at most this many of one size (Note [Spare blocks])
_SPARE_GRAIN = 512  # requests alike to this many bytes share spares (the allocator's smallest block)
_SPARE_IDLE = 64  # a size not asked for in this many sends gives its spares back


class _Held:
    """A pool block the sender holds: by a local view, by leases, as a spare, or several."""

    __slots__ = ("block", "seg", "local", "leases", "want", "spare", "free_to")

    def __init__(self, block: Any, seg: ShmSegment, local: bool, want: int) -> None:
        self.block = block  # the allocator's Block
        self.seg = seg  # the segment it lies in
        self.local = local  # an array from empty()/zeros() is alive here
        self.leases = 0  # arrays of it alive in the receiver
        self.want = want  # its size key: the bytes asked for, rounded to _SPARE_GRAIN
        self.spare = False  # kept for the next request of its size: nothing may point into it
        self.free_to: Any = None  # an Overflow when the block lies past the pool (Note [Past the pool])


class BlockBook:
    """The sender's books of held blocks, and its spares (a mixin of :class:`Sender`).

    It keeps ``_held`` (block address -> :class:`_Held`) with ``_addrs``
    sorted for :meth:`_find`, and the spares of Note [Spare blocks]. The
    sender provides ``_malloc``, ``_ann``, ``_drain``, ``_alloc``,
    ``_leases``, ``_peer_dead`` and ``_sent``; everything here runs under its lock.
    """

    _held: dict[int, _Held]
    _addrs: list[int]
    _overflow: Any = None  # the sender's Overflow, if it may go past its pool
    _local_done: collections.deque[_Held]  # blocks whose local views died (ViewDied queues them)
    _spares: dict[int, list[_Held]]
    _leases: dict[int, _Held]
    _peer_dead: bool
    _sent: int  # batches sent so far: the clock of Note [Spare blocks]
    _alloc: CachingAllocator
    _ann: SegmentBook

    if TYPE_CHECKING:  # the sender's, declared here for the type checker only

        def _malloc(self, nbytes: int, deadline: float | None) -> Any: ...
        def _drain(self) -> None: ...

    def _new_book(self, spare_limit: int) -> None:
        self._held = {}  # block address -> held block (spares included)
        self._addrs = []  # sorted addresses of held blocks
        self._spares = {}  # size key -> blocks kept for requests of it
        self._spare_bytes = 0
        self._spare_limit = spare_limit
        self._asked: dict[int, int] = {}  # size key -> the send count when last asked for
        self._swept = 0  # the send count at the last sweep

    def _find(self, start: int, span: int) -> _Held | None:
        i = bisect.bisect_right(self._addrs, start) - 1
        if i < 0:
            return None
        held = self._held[self._addrs[i]]
        b = held.block
        # a spare has no view anywhere: memory "in" it came from a raw pointer, not from us
        return held if start + span <= b.address + b.size and not held.spare else None

    def _spare(self, want: int) -> _Held | None:
        """Take a spare block for a request of `want` bytes, or None.

        With none at hand, take in the releases already queued first: a
        block the receiver has just let go of is better than a fresh one,
        whose pages (and the receiver's mapping of them) cost far more than
        one syscall -- a producer of large arrays would otherwise grow its
        pool by a segment whenever a release is a moment late.
        """
        key = -(-want // _SPARE_GRAIN) * _SPARE_GRAIN
        now = self._asked[key] = self._sent  # the clock: sends, so a batch of many sizes counts once
        spares = self._spares.get(key)
        if not spares and self._leases and not self._peer_dead:
            self._drain()
            spares = self._spares.get(key)
        if not spares:
            if self._spare_bytes and now - self._swept >= _SPARE_IDLE:
                self._sweep_spares(now)
            return None
        held = spares.pop()
        if not spares:
            del self._spares[key]
        held.spare = False
        self._spare_bytes -= held.block.size
        return held

    def _sweep_spares(self, now: int) -> None:
        """Give back the spares of sizes not asked for in the last _SPARE_IDLE sends."""
        self._swept = now
        asked = self._asked
        for key in [k for k in self._spares if now - asked.get(k, -_SPARE_IDLE - 1) > _SPARE_IDLE]:
            for held in self._spares.pop(key):
                self._spare_bytes -= held.block.size
                self._free_held(held)
        for key in [k for k, t in asked.items() if now - t > _SPARE_IDLE]:
            del asked[key]  # asked for again later: stamped again then

    def _new_held(self, nbytes: int, deadline: float | None, local: bool) -> _Held:
        block = self._malloc(nbytes, deadline)
        held = _Held(block, self._ann.segment_of(block.address), local,
                     -(-nbytes // _SPARE_GRAIN) * _SPARE_GRAIN)
        if self._overflow is not None and self._overflow.owns(block.address):
            held.free_to = self._overflow
        bisect.insort(self._addrs, block.address)
        self._held[block.address] = held
        return held

    def _drain_local(self) -> None:
        """Take in the blocks whose local views died."""
        done = self._local_done
        while done:
            held = done.popleft()
            held.local = False
            self._maybe_free(held)

    def _maybe_free(self, held: _Held) -> None:
        if held.local or held.leases:
            return
        addr = held.block.address
        if self._held.get(addr) is not held:
            return
        size = held.block.size
        if self._spare_bytes + size <= self._spare_limit and not self._peer_dead \
                and held.free_to is None:  # past the pool: back to the host at once
            spares = self._spares.get(held.want)
            if spares is None:
                spares = self._spares[held.want] = []
            if len(spares) < _SPARES_PER_SIZE:
                spares.append(held)  # stays in _held: no view of it is alive anywhere
                held.spare = True
                self._spare_bytes += size
                return
        self._free_held(held)

    def _free_held(self, held: _Held) -> None:
        addr = held.block.address
        del self._held[addr]
        del self._addrs[bisect.bisect_left(self._addrs, addr)]
        (held.free_to or self._alloc).free(held.block)

    def _free_spares(self) -> None:
        """Give every spare block back to the allocator."""
        spares, self._spares, self._spare_bytes = self._spares, {}, 0
        self._asked.clear()
        for blocks in spares.values():
            for held in blocks:
                self._free_held(held)


@dataclass(frozen=True)
class SenderStatistics:
    """What a sender holds now (see ``Sender.statistics()``)."""

    messages_sent: int
    arrays_copied: int  # arrays copied into the pool by send()
    arrays_in_place: int  # arrays sent straight from the pool (empty()/zeros())
    leases_out: int  # arrays the receiver still holds
    bytes_leased: int  # pool bytes those arrays pin
    segments_announced: int  # segments whose fd crossed the socket
    reserved_bytes: int  # shared memory the pool holds
    allocated_bytes: int  # of which in use (spare blocks included)
    spare_bytes: int  # blocks kept for the next request of their size (_blocks.py)
    retired_bytes: int = 0  # blocks a receiver that went may still map: never reused, freed by close()


class ViewDied:
    """on_release of a local array (``empty()``): Note [Callbacks from the garbage collector]."""

    __slots__ = ("done", "sender", "held")

    def __init__(self, done: collections.deque[_Held], sender: Any, held: _Held) -> None:
        # Strong: a sender lives as long as an array from its empty() does (the array's Lease
        # owns the allocator; this keeps the sender too, so that a close() can find its books).
        self.done, self.sender, self.held = done, sender, held

    def __call__(self) -> None:
        self.done.append(self.held)
        if self.sender._reap:
            self.sender._reap_closed()  # closed: nobody else will take it in


def exhausted(nbytes: int, limit: int, leases: dict[int, _Held], held: dict[int, _Held],
              host: Exception | None, setting: str = "limit=") -> PoolExhausted:
    """The error of a pool that stayed full past a wait: what holds it, and what to do."""
    pinned = sum(h.block.size for h in set(leases.values()))
    local = sum(h.block.size for h in held.values() if h.local)
    if host is not None:
        return PoolExhausted(
            f"no shared memory for {nbytes} bytes within the timeout: {host}. Meanwhile the "
            f"receiver holds {pinned} bytes of this pool in {len(leases)} arrays, and "
            f"{local} bytes are in local arrays from empty()")
    return PoolExhausted(
        f"no room for {nbytes} bytes in the sender's pool (limit {limit} bytes) within "
        f"the timeout: the receiver still holds {pinned} bytes in {len(leases)} arrays, "
        f"and {local} bytes are in local arrays from empty(). Drop received arrays sooner, "
        f"raise {setting}, or send with a longer timeout")


def host_cause(exc: BaseException) -> SegmentError | None:
    """Return the host's error (a full /dev/shm, a cgroup limit) behind a pool OOM, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SegmentError):
            return seen
        seen = seen.__cause__
    return None
