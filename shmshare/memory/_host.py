"""The pinned-host caching pool: PyTorch's ``CachingHostAllocatorImpl`` over any host provider.

Note [Caching host allocator]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Page-locked host memory is what makes host-to-device copies asynchronous,
and getting it is slow (``cuMemHostAlloc`` takes a global driver lock and
pins every page), so it is cached. The policy is PyTorch's
(``aten/src/ATen/core/CachingHostAllocator.h``, seed notes
"CUDACachingHostAllocator"):

- Sizes are rounded up to a power of two; each power has its own free list
  (LIFO, so the warmest block goes out first). Blocks are never split or
  merged: the rounding bounds the waste at half a block.
- ``record_event(ptr, stream)`` only notes that ``stream`` used the block.
  Events are recorded at ``free``, one per stream, because a pinned buffer
  is typically used many times between allocation and free and an event per
  use would cost more than one per free.
- A freed block with events goes to one FIFO queue; it returns to its free
  list once all its events are done. ``process_events`` drains the queue
  from the oldest event and stops at the first not done. It runs at every
  ``allocate``, unless ``pinned_use_background_threads`` is set: then a
  thread runs it every ``background_interval`` seconds (0.1), and an
  ``allocate`` that finds its free list empty first drains just the events
  of its own size.
- ``empty_cache`` drains the events, then gives every free block back to the
  provider.
- ``pinned_reserve_segment_size_mb``: on first use, one segment of that size
  is taken from the provider and requests are carved from it (each rounded
  to 4 KiB) before the provider is asked again; see Note [Reserve segment].
- When the provider is out of memory, the cache is emptied and the request
  tried once more (PyTorch fails at once); then ``OutOfMemoryError``.

The provider (:class:`HostProvider`) is called outside the pool's lock for
memory (its calls can take milliseconds) and under it for events (cheap
queries), so ``free`` and cache hits never wait behind a slow allocation.

Note [Reserve segment]
    Carving is a bump pointer: carved space is never returned to the
    reserve. PyTorch drops carved blocks on ``empty_cache`` (their memory is
    then lost until exit); shmshare keeps them cached instead, since giving
    them back would free nothing. ``close()`` returns the reserve segment
    itself to the provider once no carved block is in use.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from .. import _native, _registry
from ._config import AllocatorConfig, get_config, parse_config
from ._exceptions import OutOfMemoryError
from ._host_block import HostBlock, HostProvider, ReserveSegment
from ._host_invariants import check_host_invariants
from ._host_stats import HostStats
from ._policy import format_size
from ._provider import ProviderOutOfMemory
from ._report import report_host_allocator

__all__ = ["CachingHostAllocator", "HostBlock", "HostProvider"]

MAX_REQUEST = 1 << 62  # beyond this, rounding to a power of two overflows 64-bit sizes
BACKGROUND_INTERVAL = 0.1  # seconds between two background process_events runs


class CachingHostAllocator:
    """Cache page-locked host memory in power-of-two blocks (see Note [Caching host allocator]).

    Parameters
    ----------
    provider : HostProvider
        Where memory and events come from: ``shmshare.cuda.CudaHostProvider``,
        or :class:`~shmshare.memory.HostFallbackProvider` without CUDA.
    config : str, AllocatorConfig or None
        Settings (``pinned_use_background_threads``,
        ``pinned_reserve_segment_size_mb``); a string is parsed onto the
        process-wide settings, None uses those as they are now.
    background_interval : float
        Seconds between two runs of the background thread, when it is on.
    """

    def __init__(self, provider: HostProvider, config: str | AllocatorConfig | None = None, *,
                 background_interval: float = BACKGROUND_INTERVAL) -> None:
        if not isinstance(provider, HostProvider):
            raise TypeError(f"provider must have allocate/free/record_event/event_done, "
                            f"got {type(provider).__name__}")
        if isinstance(config, str):
            config = parse_config(config, get_config(), source="CachingHostAllocator(config=...)")
        elif config is None:
            config = get_config()
        elif not isinstance(config, AllocatorConfig):
            raise TypeError(f"config must be a str, an AllocatorConfig or None, got {type(config).__name__}")
        if not background_interval > 0:
            raise ValueError(f"background_interval must be > 0 seconds, got {background_interval!r}")
        self.provider = provider
        self.config = config
        self.background_interval = background_interval
        self.stats = HostStats()
        self._lock = threading.RLock()  # re-entrant: a dying array's lease may free a block under it
        self._blocks: dict[int, HostBlock] = {}  # address -> every block the pool owns
        self._free: dict[int, list[HostBlock]] = {}  # log2(size) -> free blocks, LIFO
        self._events: deque[tuple[object, HostBlock]] = deque()  # oldest first
        self._reserve: ReserveSegment | None = None
        self._reserve_tried = False
        self._reserve_lock = threading.Lock()  # one thread creates the reserve segment
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._background_error: BaseException | None = None
        self._closed = False
        _registry.register("pools", self, report_host_allocator)  # Note [Reporters]: weakly, once

    # --- allocation -------------------------------------------------------------------

    def allocate(self, nbytes: int) -> HostBlock:
        """Return a block of at least ``nbytes`` bytes (``nbytes`` rounded up to a power of two).

        Raises
        ------
        OutOfMemoryError
            When the provider has no memory even after the cache was emptied.
        """
        nbytes = _check_nbytes(nbytes)
        if self._closed:
            raise ValueError("allocate() on a closed CachingHostAllocator")
        self._raise_background_error()
        if nbytes == 0:  # PyTorch returns a null pointer; a block of size 0 is its twin
            empty = HostBlock(self, 0, 0, None, False)
            empty.allocated = True
            return empty
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            background = self.config.pinned_use_background_threads
            if not background:
                self._process_events()
            block = self._take_free(size, nbytes)
            if block is None and background:
                self._process_events_for_size(size)
                block = self._take_free(size, nbytes)
                self._start_background_thread()
            if block is not None:
                return block
        return self._allocate_new(size, nbytes)

    def free(self, block: HostBlock) -> None:
        """Give ``block`` back; it is reused once the events of the streams that used it are done."""
        if not isinstance(block, HostBlock) or block.owner is not self:
            raise ValueError(f"free() of {block!r}, which this allocator did not allocate")
        if block.size == 0:
            return
        with self._lock:
            if not block.allocated or self._blocks.get(block.address) is not block:
                raise ValueError(f"free() of {block!r}, which is not allocated (double free?)")
            if block.streams:
                self._insert_events(block)
            else:
                block.allocated = False
                block.requested_size = 0
                self._make_free(block)

    def record_event(self, ptr: HostBlock | int, stream: Hashable) -> bool:
        """Note that ``stream`` uses the block at ``ptr``; ``free`` records the event.

        Returns False when ``ptr`` is not the address of a block of this pool
        (as PyTorch does for a tensor that is not pinned-pool memory).
        """
        with self._lock:
            if isinstance(ptr, HostBlock):
                block = ptr if ptr.owner is self and self._blocks.get(ptr.address) is ptr else None
            elif isinstance(ptr, int) and not isinstance(ptr, bool):
                block = self._blocks.get(ptr)
            else:
                raise TypeError(f"record_event: ptr must be a HostBlock or an address, got {ptr!r}")
            if block is None:
                return False
            if not block.allocated:
                raise ValueError(f"record_event() on {block!r}, which is not allocated")
            block.streams.add(stream)
            return True

    def empty(self, shape: Any, dtype: Any = np.uint8) -> np.ndarray:
        """Return an uninitialized array in a pool block; the block is freed when the array dies."""
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = dt.itemsize * int(np.prod(shp, dtype=np.int64))
        if nbytes == 0:
            return np.empty(shp, dt)
        block = self.allocate(nbytes)
        lease = _native.Lease(self, block.address, nbytes,
                              on_release=functools.partial(_free_quietly, weakref.ref(self), block))
        # numpy's stubs name a few buffer types, not every object with the buffer protocol
        return np.ndarray(shp, dtype=dt, buffer=lease)  # type: ignore[arg-type]

    def block_of(self, address: int) -> HostBlock | None:
        """Return the block that starts at ``address``, or None."""
        with self._lock:
            return self._blocks.get(address)

    # --- events and cache -------------------------------------------------------------

    def process_events(self) -> None:
        """Return to their free lists the freed blocks whose events have all completed."""
        self._raise_background_error()
        with self._lock:
            self._process_events()

    def empty_cache(self) -> None:
        """Drain completed events, then give every free block back to the provider.

        Blocks carved from the reserve segment stay cached (Note [Reserve segment]).
        """
        with self._lock:
            self._process_events()
            victims: list[HostBlock] = []
            # A snapshot: an array dying here (the lock is re-entrant for it) may add a block.
            for index, blocks in list(self._free.items()):
                keep: list[HostBlock] = []
                for b in blocks:
                    (keep if b.carved else victims).append(b)
                self._free[index] = keep
            for block in victims:
                self._forget(block)
        for block in victims:
            self._provider_free(block.handle)

    def close(self) -> None:
        """Stop the background thread, empty the cache and give the reserve segment back.

        Idempotent. Blocks still in use return to the cache when freed; a
        later ``empty_cache()`` (or ``close()``) gives them back too.
        """
        self._closed = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(10 * self.background_interval + 5)
        self.empty_cache()
        with self._lock:
            reserve = self._reserve
            carved = [b for b in self._blocks.values() if b.carved]
            if reserve is None or any(b.allocated or b.event_count for b in carved):
                return
            for block in carved:
                self._forget(block)
            self._free = {i: [b for b in bl if not b.carved] for i, bl in self._free.items()}
            self._reserve = None
        self._provider_free(reserve.handle)

    def __enter__(self) -> CachingHostAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()  # the thread holds only a weak reference; let it end

    # --- statistics and checks ----------------------------------------------------------

    def host_memory_stats(self) -> dict[str, int]:
        """Return the statistics flattened like ``torch.cuda.host_memory_stats()``."""
        with self._lock:
            return self.stats.flat()

    def reset_peak_stats(self) -> None:
        """Set every peak statistic to its current value."""
        with self._lock:
            self.stats.reset_peak()

    def reset_accumulated_stats(self) -> None:
        """Zero the allocated/freed totals, the call counters and the timings."""
        with self._lock:
            self.stats.reset_accumulated()

    def check_invariants(self) -> None:
        """Check the pool's books; raise ``InvariantError`` naming what is wrong."""
        with self._lock:
            check_host_invariants(self)

    def __repr__(self) -> str:
        s = self.stats
        return (f"<CachingHostAllocator {s.allocated.current} blocks in use, "
                f"{format_size(s.reserved_bytes.current)} reserved, over {self.provider!r}>")

    # --- private: free lists and events --------------------------------------------------

    def _take_free(self, size: int, nbytes: int) -> HostBlock | None:
        blocks = self._free.get(size.bit_length() - 1)
        if not blocks:
            return None
        block = blocks.pop()
        block.allocated = True
        block.requested_size = nbytes
        self.stats.allocated.increase(1)
        self.stats.allocated_bytes.increase(size)
        return block

    def _make_free(self, block: HostBlock) -> None:
        self._free.setdefault(block.size.bit_length() - 1, []).append(block)
        self.stats.allocated.decrease(1)
        self.stats.allocated_bytes.decrease(block.size)

    def _insert_events(self, block: HostBlock) -> None:
        """Record one event per stream that used ``block``; on any failure change nothing."""
        events = [self.provider.record_event(stream) for stream in block.streams]
        block.allocated = False
        block.requested_size = 0
        block.streams = set()
        block.event_count += len(events)
        self._events.extend((event, block) for event in events)

    def _process_events(self) -> None:
        done, queue = self.provider.event_done, self._events
        while queue:
            event, block = queue[0]
            if not done(event):
                return  # oldest first: later events are very likely not done either
            queue.popleft()
            self._event_completed(block)

    def _process_events_for_size(self, size: int) -> None:
        """Query only events of ``size`` blocks, until one block becomes free."""
        kept: deque[tuple[object, HostBlock]] = deque()
        done, found = self.provider.event_done, False
        try:
            while self._events:
                event, block = item = self._events[0]
                if found or block.size != size or not done(event):
                    kept.append(item)
                    self._events.popleft()
                else:
                    self._events.popleft()
                    found = self._event_completed(block)
        finally:  # a query that raised must not lose the events not looked at yet
            kept.extend(self._events)
            self._events = kept

    def _event_completed(self, block: HostBlock) -> bool:
        block.event_count -= 1
        if block.event_count:
            return False
        self._make_free(block)
        return True

    # --- private: memory ------------------------------------------------------------------

    def _allocate_new(self, size: int, nbytes: int) -> HostBlock:
        address, handle, carved = self._get_memory(size)
        block = HostBlock(self, address, size, handle, carved)
        block.allocated = True
        block.requested_size = nbytes
        with self._lock:
            self._blocks[address] = block
            stats = self.stats
            stats.segment.increase(1)
            stats.reserved_bytes.increase(size)
            stats.allocated.increase(1)
            stats.allocated_bytes.increase(size)
        return block

    def _get_memory(self, size: int) -> tuple[int, object, bool]:
        reserve = self._reserve_segment()
        if reserve is not None:
            with self._lock:
                address = reserve.carve(size)
            if address is not None:
                return address, reserve.handle, True
        try:
            return (*self._provider_allocate(size), False)
        except ProviderOutOfMemory:
            self.empty_cache()  # cached blocks of other sizes may be what the provider lacks
        try:
            return (*self._provider_allocate(size), False)
        except ProviderOutOfMemory as exc:
            with self._lock:
                held = self.stats.reserved_bytes.current
            raise OutOfMemoryError(
                f"pinned host pool out of memory: tried to allocate {format_size(size)}; the pool "
                f"holds {format_size(held)}, none of it free; {exc}", requested=size, size=size,
                allocated=self.stats.allocated_bytes.current, reserved=held) from exc

    def _reserve_segment(self) -> ReserveSegment | None:
        nbytes = self.config.pinned_reserve_segment_size
        if not nbytes or self._reserve_tried:
            return self._reserve
        with self._reserve_lock:
            if not self._reserve_tried:
                try:
                    address, handle = self._provider_allocate(nbytes)  # not a pool block: no segment stat
                except ProviderOutOfMemory as exc:
                    raise OutOfMemoryError(
                        f"pinned host pool: cannot allocate its reserve segment of {format_size(nbytes)} "
                        f"(pinned_reserve_segment_size_mb); lower the setting: {exc}",
                        requested=nbytes, size=nbytes) from exc
                self._reserve = ReserveSegment(address, nbytes, handle)
                self._reserve_tried = True
        return self._reserve

    def _provider_allocate(self, size: int) -> tuple[int, object]:
        start = time.perf_counter_ns()
        address, handle = self.provider.allocate(size)
        micros = (time.perf_counter_ns() - start) // 1000
        with self._lock:
            self.stats.num_host_alloc += 1
            self.stats.host_alloc_time.increase(micros)
        return address, handle

    def _provider_free(self, handle: object) -> None:
        start = time.perf_counter_ns()
        self.provider.free(handle)
        micros = (time.perf_counter_ns() - start) // 1000
        with self._lock:
            self.stats.num_host_free += 1
            self.stats.host_free_time.increase(micros)

    def _forget(self, block: HostBlock) -> None:
        del self._blocks[block.address]
        self.stats.segment.decrease(1)
        self.stats.reserved_bytes.decrease(block.size)

    # --- private: background thread ----------------------------------------------------------

    def _start_background_thread(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=_background_loop, args=(weakref.ref(self), self._stop, self.background_interval),
                name="shmshare-host-pool-events", daemon=True)
            self._thread.start()

    def _raise_background_error(self) -> None:
        error, self._background_error = self._background_error, None
        if error is not None:
            raise error


def _background_loop(ref: weakref.ref[CachingHostAllocator], stop: threading.Event, interval: float) -> None:
    """Run ``process_events`` every ``interval`` s until stopped or the pool is collected."""
    while not stop.wait(interval):
        allocator = ref()
        if allocator is None:
            return
        try:
            with allocator._lock:
                allocator._process_events()
        except BaseException as exc:  # noqa: BLE001 - a driver error: raised by the next allocate
            allocator._background_error = exc
            allocator._thread = None
            return
        del allocator  # hold no strong reference while sleeping


def _free_quietly(ref: weakref.ref[CachingHostAllocator], block: HostBlock) -> None:
    """Free ``block`` when its array dies (the lease's ``on_release``), if the pool still exists."""
    allocator = ref()
    if allocator is not None and block.allocated:
        allocator.free(block)


def _check_nbytes(nbytes: Any) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if not 0 <= nbytes <= MAX_REQUEST:
        raise ValueError(f"nbytes must be between 0 and 2**62, got {nbytes}")
    return int(nbytes)


