"""A lender's pool: shared memory whose blocks are lent to other processes, and their books.

Note [Spare blocks]
    A block whose last lease and local view are gone is not handed back to
    the caching allocator at once: it is kept as a *spare* for the next
    request of its size (sizes rounded up to _SPARE_GRAIN; up to
    _SPARES_PER_SIZE of a size and ``spare_limit`` bytes in all).
    A producer sending batches of a few shapes -- the usual case -- then
    skips the allocator's malloc/free pair, a large share of a small
    message's cost (Note [Hot path] in ``channel/__init__.py``). Sizes that stop
    being asked for must not pin memory the allocator could reuse (a
    producer of ever-varying sizes would grow its pool): on a request, hit
    or miss, at most every _SPARE_IDLE ticks of the lender's clock, the
    spares of every size not asked for in the last _SPARE_IDLE ticks go back. The channel's clock
    counts sends, not requests, so that a batch of many arrays ages its
    sizes by one, not by its length. All spares go back before a request
    waits for room, on ``empty_cache()``, ``close()`` and when nothing more
    will be lent (``keep_spares = False``). They count as allocated in
    ``memory_stats()``.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import itertools
import operator
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .. import _fork, _native
from .._errors import SegmentError
from ..memory import CachingAllocator, InvariantError, ShmProvider, ShmSegment
from ..memory._policy import SMALL_BUFFER
from .segments import SegmentBook

__all__ = ["LendingPool", "Held", "Retirer", "SPARE_BYTES", "host_cause", "check_limit"]

SPARE_BYTES = 64 << 20  # at most this many bytes of spare blocks (and the lender's own bound), ...
_SPARES_PER_SIZE = 1024  # ... and at most this many of one size (Note [Spare blocks])
_SPARE_GRAIN = 512  # requests alike to this many bytes share spares (the allocator's smallest block)
_SPARE_IDLE = 64  # a size not asked for in this many ticks gives its spares back

# A foreign call: the GIL is released while it copies. One thread: a copy split over two was
# slower end to end at 64 MiB on 2 cores (23-24 against 27-28 messages/s, scripts/bench_mp.py),
# the other core being the consumer's.
_memmove = ctypes.memmove


class Held:
    """A pool block the lender holds: by a local view, by leases, as a spare, or several."""

    __slots__ = ("block", "seg", "local", "leases", "want", "spare", "free_to")

    def __init__(self, block: Any, seg: ShmSegment, local: bool, want: int) -> None:
        self.block = block  # the allocator's Block
        self.seg = seg  # the segment it lies in
        self.local = local  # an array from empty()/zeros() is alive here
        self.leases = 0  # arrays of it alive in borrowers
        self.want = want  # its size key: the bytes asked for, rounded to _SPARE_GRAIN
        self.spare = False  # kept for the next request of its size: nothing may point into it
        self.free_to: Any = None  # an Overflow when the block lies past the pool (Note [Past the pool])


class Retirer(Protocol):
    """Blocks a forked child may still map: kept out of the pool until the child is gone."""

    def busy(self) -> bool: ...  # anything marked or retired: else retire() is False, free_now() []
    def retire(self, address: int, block: Any) -> bool: ...  # kept back: not freed now
    def free_now(self) -> list[Any]: ...  # blocks whose children are gone


class LendingPool:
    """Shared memory lent to borrowers: the caching allocator over sealed memfds, the segments
    the borrower knows (:class:`SegmentBook`), and the blocks held -- by local views (arrays
    of ``empty()``), by leases, or as spares (Note [Spare blocks]).

    It holds no lock and waits for nothing: its lender calls it under its own lock, and
    passes in what only the lender can do (wait for room, take releases in).
    """

    def __init__(self, limit: int | None, backend: str, config: str | None, spare_limit: int) -> None:
        self.provider = ShmProvider(limit, backend)
        self.segments = SegmentBook()
        self.provider.listeners.append(self.segments.on_segment_event)
        self.alloc = CachingAllocator(self.provider, config)
        self.held: dict[int, Held] = {}  # block address -> held block (spares included)
        self.addrs: list[int] = []  # sorted addresses of held blocks
        self.local_done: collections.deque[Held] = collections.deque()  # local views that died
        self.spares: dict[int, list[Held]] = {}  # size key -> blocks kept for requests of it
        self.spare_bytes = 0
        self.spare_limit = spare_limit
        self.keep_spares = True  # False once nothing more will be lent (the borrower is gone)
        self.overflow: Any = None  # an Overflow past the pool (the channel's Note [Past the pool])
        self.retirer: Retirer | None = None  # blocks a forked child may map (multiprocessing's)
        self.leases: dict[int, Held] = {}  # lease id -> the block a borrower's array pins
        self.retired: set[Held] = set()  # leased when the borrower went: never reused, freed by close
        # Unique per process, like segment ids: a forked child sharing a socket with its parent
        # must never take a release of its parent's lease 1 for its own lease 1.
        self._lease_ids = itertools.count((os.getpid() << 32) + 1)
        self._asked: dict[int, int] = {}  # size key -> the clock when last asked for
        self._swept = 0  # the clock at the last sweep

    def find(self, start: int, span: int) -> Held | None:
        """The held block that `span` bytes from address `start` lie in, if any (not a spare)."""
        i = bisect.bisect_right(self.addrs, start) - 1
        if i < 0:
            return None
        held = self.held[self.addrs[i]]
        b = held.block
        # a spare has no view anywhere: memory "in" it came from a raw pointer, not from us
        return held if start + span <= b.address + b.size and not held.spare else None

    def spare(self, want: int, clock: int, drain: Callable[[], None] | None = None) -> Held | None:
        """Take a spare block for a request of `want` bytes, or None.

        With none at hand, `drain` (the lender's: take in the releases already
        queued) runs first: a block a borrower has just let go of is better
        than a fresh one, whose pages (and the borrower's mapping of them) cost
        far more than one syscall -- a producer of large arrays would otherwise
        grow its pool by a segment whenever a release is a moment late.
        """
        key = -(-want // _SPARE_GRAIN) * _SPARE_GRAIN
        self._asked[key] = clock
        if self.spare_bytes and clock - self._swept >= _SPARE_IDLE:
            self._sweep_spares(clock)  # hits too: a producer now served by spares of one size
            # must not keep those of sizes it stopped asking for (this one was just asked for)
        spares = self.spares.get(key)
        if not spares and drain is not None:
            drain()
            spares = self.spares.get(key)
        if not spares:
            return None
        held = spares.pop()
        if not spares:
            del self.spares[key]
        held.spare = False
        self.spare_bytes -= held.block.size
        return held

    def lend(self, held: Held) -> int:
        """Lease `held` to the borrower (an array of it goes out); the lease's id."""
        lease = next(self._lease_ids)
        self.leases[lease] = held
        held.leases += 1
        return lease

    def give_back(self, ids: Any) -> None:
        """The borrower's arrays of these leases died (a release), or they never went out."""
        leases = self.leases
        for lease in ids:
            held = leases.pop(lease, None)  # an unhashable id is a TypeError: the caller's to handle
            if held is not None:  # unknown ids (a confused peer) change nothing
                held.leases -= 1
                if not held.leases and not held.local:
                    self.maybe_free(held)

    def borrower_gone(self) -> None:
        """Nothing more will be lent: the spares go back, and every block leased is retired --
        the borrower may still read its arrays (its mapping keeps them), so they are never
        handed out again; :meth:`free_retired` frees them when nothing allocates any more."""
        self.keep_spares = False
        self.free_spares()
        self.retired.update(self.leases.values())
        self.leases.clear()

    def free_retired(self) -> None:
        """Closing: the retired blocks go back (or stay spared from nothing: keep_spares is off)."""
        for held in self.retired:
            held.leases = 0
            self.maybe_free(held)
        self.retired.clear()

    def take(self, nbytes: int, clock: int, malloc: Callable[[int], Any], local: bool,
             drain: Callable[[], None] | None = None) -> Held:
        """A block for `nbytes`: a spare of its size (see :meth:`spare`), else ``malloc(nbytes)``."""
        held = self.spare(nbytes, clock, drain)
        if held is None:
            return self.hold(malloc(nbytes), nbytes, local)
        held.local = local
        return held

    def copy_in(self, arr: np.ndarray, ptr: int, span: int, clock: int,
                malloc: Callable[[int], Any], drain: Callable[[], None] | None = None) -> Held:
        """Copy `arr` (not in the pool; its elements span `span` bytes from `ptr`) into a block
        taken as :meth:`take` does, in C order, every byte of every element."""
        want = arr.nbytes
        held = self.take(want, clock, malloc, False, drain)
        try:
            if span == want and arr.flags.c_contiguous:
                # every byte (padding of structured dtypes included: a field-wise copy would
                # leave the bytes of the block's last array there), with the GIL released
                _memmove(held.block.address, ptr, want)
            else:
                raw = _native.Lease(None, held.block.address, want)
                dst = np.ndarray(arr.shape, arr.dtype, raw)  # type: ignore[arg-type]  # numpy types Buffer from 3.12
                if arr.dtype.fields is not None or arr.dtype.subdtype is not None:
                    void = np.dtype((np.void, arr.dtype.itemsize))  # the padding too (above)
                    np.copyto(dst.view(void), arr.view(void), casting="no")
                else:
                    np.copyto(dst, arr, casting="no")
        except BaseException:
            self.maybe_free(held)
            raise
        return held

    def hold(self, block: Any, nbytes: int, local: bool) -> Held:
        """Book a block just allocated for a request of `nbytes`."""
        held = Held(block, self.segments.segment_of(block.address), local,
                    -(-nbytes // _SPARE_GRAIN) * _SPARE_GRAIN)
        if self.overflow is not None and self.overflow.owns(block.address):
            held.free_to = self.overflow
        bisect.insort(self.addrs, block.address)
        self.held[block.address] = held
        return held

    def drain_local(self) -> None:
        """Take in the blocks whose local views died (not while this process forks: Note [At fork])."""
        done = self.local_done
        if done and _fork.forking():
            return  # a child may map them: its parent handler marks them first
        while done:
            held = done.popleft()
            held.local = False
            self.maybe_free(held)

    def maybe_free(self, held: Held) -> None:
        """A block no view or lease may hold any more: a spare, retired, or freed."""
        if held.local or held.leases:
            return
        addr = held.block.address
        if self.held.get(addr) is not held:
            return
        retirer = self.retirer
        if retirer is None or not retirer.busy():  # the usual case, kept short: it runs per message
            self._spare_or_free(held)
            return
        if retirer.retire(addr, held.block):
            self._forget(addr)  # Note [Blocks a child inherits]: not reused while its child lives
            return
        self._spare_or_free(held)
        for block in retirer.free_now():
            self.free_block(block)

    def _spare_or_free(self, held: Held) -> None:
        size = held.block.size
        if self.spare_bytes + size <= self.spare_limit and self.keep_spares \
                and held.free_to is None:  # past the pool: back to the host at once
            spares = self.spares.get(held.want)
            if spares is None:
                spares = self.spares[held.want] = []
            elif len(spares) >= _SPARES_PER_SIZE:
                self.free_held(held)
                return
            spares.append(held)  # stays in held: no view of it is alive anywhere
            held.spare = True
            self.spare_bytes += size
            return
        self.free_held(held)

    def free_block(self, block: Any) -> None:
        """Give back a block no longer held (a retired one): to the overflow it came from, if any."""
        overflow = self.overflow
        (overflow if overflow is not None and overflow.owns(block.address) else self.alloc).free(block)

    def free_held(self, held: Held) -> None:
        """Give a held block back to the allocator (or the overflow it came from)."""
        self._forget(held.block.address)
        (held.free_to or self.alloc).free(held.block)

    def free_spares(self) -> None:
        """Give every spare block back to the allocator."""
        spares, self.spares, self.spare_bytes = self.spares, {}, 0
        self._asked.clear()
        for blocks in spares.values():
            for held in blocks:
                self.free_held(held)

    def check_invariants(self) -> None:
        """Check the books against each other and the allocator's (InvariantError naming one):
        held addresses sorted in ``addrs``; spares exactly the blocks flagged spare, none of
        them viewed or leased, their bytes ``spare_bytes``; every lease's block held, and each
        block's lease count the leases that name it; retired blocks held and never spare."""
        fail = _fail
        if self.addrs != sorted(self.held):
            fail("addrs is not the sorted addresses of the held blocks")
        for addr, held in self.held.items():
            if held.block.address != addr:
                fail(f"held block at {addr:#x} has address {held.block.address:#x}")
        spares = [h for hs in self.spares.values() for h in hs]
        if {id(h) for h in spares} != {id(h) for h in self.held.values() if h.spare} \
                or len(spares) != len({id(h) for h in spares}):
            fail("the spare lists are not exactly the held blocks flagged spare")
        if any(h.local or h.leases for h in spares):
            fail("a spare block has a local view or a lease")
        if sum(h.block.size for h in spares) != self.spare_bytes:
            fail(f"spare_bytes is {self.spare_bytes}, the spares hold "
                 f"{sum(h.block.size for h in spares)}")
        counts: dict[int, int] = {}
        for held in self.leases.values():
            if self.held.get(held.block.address) is not held:
                fail(f"a lease names the block at {held.block.address:#x}, which is not held")
            counts[id(held)] = counts.get(id(held), 0) + 1
        for held in self.held.values():
            if held not in self.retired and held.leases != counts.get(id(held), 0):
                fail(f"the block at {held.block.address:#x} counts {held.leases} leases, "
                     f"{counts.get(id(held), 0)} name it")
        if any(h.spare or self.held.get(h.block.address) is not h for h in self.retired):
            fail("a retired block is spare, or not held")
        self.alloc.check_invariants()

    def _forget(self, addr: int) -> None:
        del self.held[addr]
        del self.addrs[bisect.bisect_left(self.addrs, addr)]

    def _sweep_spares(self, now: int) -> None:
        """Give back the spares of sizes not asked for in the last _SPARE_IDLE ticks."""
        self._swept = now
        asked = self._asked
        for key in [k for k in self.spares if now - asked.get(k, -_SPARE_IDLE - 1) > _SPARE_IDLE]:
            for held in self.spares.pop(key):
                self.spare_bytes -= held.block.size
                self.free_held(held)
        for key in [k for k, t in asked.items() if now - t > _SPARE_IDLE]:
            del asked[key]  # asked for again later: stamped again then


def check_limit(limit: object, setting: str = "limit") -> None:
    """Refuse a pool limit that is not an int of bytes, or below the pool's smallest segment."""
    try:
        n = operator.index(limit)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{setting} must be an int of bytes (e.g. 256 << 20), got {limit!r}") from None
    if n <= 0 or isinstance(limit, bool):
        raise ValueError(f"{setting} must be a positive number of bytes (e.g. 256 << 20), got {limit!r}")
    if n < SMALL_BUFFER:
        raise ValueError(f"{setting}={limit!r} bytes is less than the pool's smallest segment "
                         f"({SMALL_BUFFER} bytes, 2 MiB): no array would ever fit. Pass "
                         f"{setting}={SMALL_BUFFER} or more (an array over 1 MiB takes "
                         "a segment of 20 MiB)")


def _fail(what: str) -> None:
    raise InvariantError(f"LendingPool: {what}")


def host_cause(exc: BaseException) -> SegmentError | None:
    """Return the host's error (a full /dev/shm, a cgroup limit) behind a pool OOM, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SegmentError):
            return seen
        seen = seen.__cause__
    return None
