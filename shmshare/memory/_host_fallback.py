"""A host provider with no driver behind it, so the pinned-host pool runs on CPU.

:class:`HostFallbackProvider` gives the :class:`CachingHostAllocator` plain,
page-aligned anonymous memory (never page-locked) and the streams and events
of :class:`SimulatedDevice`: an event recorded on a stream with no pending
work is done at once; one recorded after ``stream.enqueue()`` is done when a
test calls ``stream.run()``. With it every policy of the pool (size classes,
event-delayed reuse, the background thread, the reserve segment, statistics)
is tested without CUDA; ``shmshare.cuda.CudaHostProvider`` is the same
interface over the driver.

:class:`AnonymousMemory` is also what the CUDA provider's register path
allocates before page-locking it.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Hashable
from dataclasses import dataclass

from ._policy import format_size
from ._provider import ProviderOutOfMemory
from ._simulated import SimulatedEvent, SimulatedStream

__all__ = ["AnonymousMemory", "HostFallbackProvider", "HostFallbackStats"]


class AnonymousMemory:
    """Own one private anonymous mapping: page aligned, zero filled, unmapped on ``close()``.

    Parameters
    ----------
    nbytes : int
        Bytes to map, > 0 (the mapping is rounded up to whole pages).
    """

    __slots__ = ("address", "size", "length", "_map")

    def __init__(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self._map: mmap.mmap | None = None
        try:
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise ProviderOutOfMemory(f"host: mmap of {format_size(nbytes)} of anonymous memory "
                                      f"failed: {exc.strerror}") from exc
        self.size = nbytes  # bytes asked for
        self.length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # bytes mapped: whole pages
        self.address = _address_of(self._map)  # first byte, page aligned

    def close(self) -> None:
        """Unmap the memory. Idempotent; the caller guarantees nobody uses it any more."""
        m, self._map = getattr(self, "_map", None), None
        if m is not None:
            m.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - half-built object or interpreter shutdown: nothing mapped to free
            pass

    def __repr__(self) -> str:
        state = "closed" if self._map is None else f"0x{self.address:x}"
        return f"<AnonymousMemory {format_size(self.size)} {state}>"


class HostFallbackProvider:
    """Give the host pool plain memory, and streams whose work completes when a test says so.

    Parameters
    ----------
    limit : int, optional
        Bytes it backs at most; past it ``allocate`` raises
        ``ProviderOutOfMemory``, as a failed ``cuMemHostAlloc`` would.

    Notes
    -----
    Streams are :class:`~shmshare.memory.SimulatedStream` objects from
    :meth:`new_stream` (stream 0 is :meth:`default_stream`); record an event
    on anything else and ``ValueError`` says so. The provider is thread safe,
    since the pool's background thread queries events.
    """

    name = "host fallback"

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ValueError(f"limit must be a positive number of bytes or None, got {limit!r}")
        self.limit = limit
        self.used = 0  # bytes backed now
        self._live: dict[int, AnonymousMemory] = {}  # address -> memory
        self._streams = [SimulatedStream(0)]
        self._counts = {"allocations": 0, "frees": 0, "events": 0, "ooms": 0}
        self._lock = threading.Lock()

    # --- memory ----------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, AnonymousMemory]:
        """Map ``nbytes`` of anonymous memory; return (address, handle)."""
        with self._lock:
            if self.limit is not None and self.used + nbytes > self.limit:
                self._counts["ooms"] += 1
                raise ProviderOutOfMemory(
                    f"host fallback: allocating {format_size(nbytes)} would pass the limit of "
                    f"{format_size(self.limit)} ({format_size(self.used)} in use)")
            self.used += nbytes
        try:
            memory = AnonymousMemory(nbytes)
        except BaseException:
            with self._lock:
                self.used -= nbytes
            raise
        with self._lock:
            self._live[memory.address] = memory
            self._counts["allocations"] += 1
        return memory.address, memory

    def free(self, handle: object) -> None:
        """Unmap memory from ``allocate``."""
        with self._lock:
            if not isinstance(handle, AnonymousMemory) or self._live.get(handle.address) is not handle:
                raise ValueError(f"free of {handle!r}, which is not live memory of this provider")
            del self._live[handle.address]
            self.used -= handle.size
            self._counts["frees"] += 1
        handle.close()

    # --- streams and events --------------------------------------------------------------

    def new_stream(self) -> SimulatedStream:
        """Return a new stream with no pending work."""
        with self._lock:
            stream = SimulatedStream(len(self._streams))
            self._streams.append(stream)
            return stream

    def default_stream(self) -> SimulatedStream:
        """Return stream 0."""
        return self._streams[0]

    def record_event(self, stream: Hashable) -> SimulatedEvent:
        """Return an event done when the work enqueued on ``stream`` so far is."""
        if not isinstance(stream, SimulatedStream) or stream not in self._streams:
            raise ValueError(f"record_event on {stream!r}, which is not a stream of this provider "
                             "(use new_stream() or default_stream())")
        with self._lock:
            self._counts["events"] += 1
        return SimulatedEvent(stream, stream.enqueued)

    def event_done(self, event: object) -> bool:
        """Return whether the work before ``event`` has completed."""
        if not isinstance(event, SimulatedEvent):
            raise ValueError(f"event_done on {event!r}, which is not an event of this provider")
        return event.done

    # --- inspection ----------------------------------------------------------------------

    def statistics(self) -> HostFallbackStats:
        """Return counts of calls, and what is held now."""
        with self._lock:
            return HostFallbackStats(live=len(self._live), used=self.used, **self._counts)

    def close(self) -> None:
        """Unmap whatever is still live (the pool normally frees it all first). Idempotent."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
            self.used = 0
        for memory in live:
            memory.close()

    def __repr__(self) -> str:
        return f"<HostFallbackProvider {format_size(self.used)} in {len(self._live)} mappings>"


@dataclass(frozen=True, slots=True)
class HostFallbackStats:
    """Count the calls a :class:`HostFallbackProvider` has served."""

    allocations: int  # successful allocate calls
    frees: int
    events: int  # events recorded
    ooms: int  # allocate calls refused for the limit
    live: int  # mappings held now
    used: int  # bytes held now


def _address_of(m: mmap.mmap) -> int:
    """Return the first address of a writable mmap without keeping a buffer export alive."""
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # drop the export at once, or m.close() would raise BufferError
