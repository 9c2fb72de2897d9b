"""A device that exists only in bookkeeping, so every pool policy runs on CPU.

:class:`SimulatedDevice` is a provider (Note [Providers]) with a capacity,
fake page-aligned addresses, expandable reservations, and streams whose work
completes only when a test says so. With it a test can provoke every step
of the retry chain and every event ordering, deterministically, without a
GPU; it checks each call against the provider rules and raises
:class:`SimulatedDeviceError` when the allocator breaks one.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

from .._errors import ShmshareError
from ._policy import format_size
from ._provider import ProviderOutOfMemory

__all__ = ["SimulatedDevice", "SimulatedDeviceError", "SimulatedEvent", "SimulatedStats", "SimulatedStream"]

_GRANULARITY = 2 << 20  # like CUDA's allocation granularity
_BASE = 0x7F00_0000_0000  # where fake addresses start
_SPACE = 1 << 46  # fake address space, far more than any test reserves
_GUARD = _GRANULARITY  # gap left after every range, so that no two ranges touch
_LOG_ENTRIES = 4096


class SimulatedDevice:
    """Simulate a device with ``capacity`` bytes, streams and events.

    Parameters
    ----------
    capacity : int
        Bytes of memory; allocations and mapped pages count against it,
        rounded up to the 2 MiB granularity; reservations do not.

    Notes
    -----
    ``log`` keeps the latest calls as tuples (``("allocate", handle,
    nbytes)``, ``("map", handle, offset, nbytes)``, ``("synchronize",
    stream_id)``, ``("oom", "allocate", nbytes)`` for a refused call...) for
    tests that check the order of operations.
    """

    name = "simulated device"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._used = 0  # bytes backed now
        self._space = _AddressSpace(_BASE, _SPACE)
        self._handles = itertools.count(1)
        self._allocations: dict[int, tuple[int, int]] = {}  # handle -> (address, charged bytes)
        self._reservations: dict[int, _Reservation] = {}
        self._streams = [SimulatedStream(0)]
        self._counts = dict.fromkeys(SimulatedStats.__dataclass_fields__, 0)
        self.log: deque[tuple[object, ...]] = deque(maxlen=_LOG_ENTRIES)  # latest calls, oldest first

    # --- streams and events -------------------------------------------------------

    def new_stream(self) -> SimulatedStream:
        """Return a new stream with no pending work."""
        stream = SimulatedStream(len(self._streams))
        self._streams.append(stream)
        return stream

    def default_stream(self) -> SimulatedStream:
        """Return stream 0."""
        return self._streams[0]

    def record_event(self, stream: object) -> SimulatedEvent:
        """Return an event that completes with the work enqueued on ``stream`` so far."""
        if not isinstance(stream, SimulatedStream) or stream not in self._streams:
            raise SimulatedDeviceError(f"record_event on {stream!r}, not a stream of this device")
        self._counts["events"] += 1
        return SimulatedEvent(stream, stream.enqueued)

    def event_done(self, event: object) -> bool:
        """Return whether the work before ``event`` has completed."""
        if not isinstance(event, SimulatedEvent):
            raise SimulatedDeviceError(f"event_done on {event!r}, not an event of this device")
        return event.done

    def synchronize(self, stream: object = None) -> None:
        """Complete the pending work of ``stream``, or of every stream when None."""
        self._counts["synchronizes"] += 1
        if stream is None:
            self.log.append(("synchronize", None))
            for s in self._streams:
                s.run()
        elif isinstance(stream, SimulatedStream) and stream in self._streams:
            self.log.append(("synchronize", stream.id))
            stream.run()
        else:
            raise SimulatedDeviceError(f"synchronize on {stream!r}, not a stream of this device")

    # --- capacity -----------------------------------------------------------------

    def capacity(self) -> int:
        """Return the device's capacity in bytes."""
        return self._capacity

    def free_bytes(self) -> int:
        """Return the bytes not backed now."""
        return self._capacity - self._used

    @property
    def used(self) -> int:
        """Return the bytes backed now (allocations and mapped pages)."""
        return self._used

    def statistics(self) -> SimulatedStats:
        """Return counts of calls and what is held now."""
        return SimulatedStats(**self._counts)

    # --- classic segments -----------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """Back ``nbytes`` with memory; raise ``ProviderOutOfMemory`` past the capacity."""
        charged = _round_up(max(nbytes, 1), _GRANULARITY)
        self._charge(charged, "allocate")
        address = self._space.take(charged)
        if address is None:
            self._used -= charged
            raise ProviderOutOfMemory(f"simulated device: no address space for {format_size(nbytes)}")
        handle = next(self._handles)
        self._allocations[handle] = (address, charged)
        self._counts["allocations"] += 1
        self.log.append(("allocate", handle, nbytes))
        return address, handle

    def free(self, handle: object) -> None:
        """Give back a segment from ``allocate``."""
        entry = self._allocations.pop(handle, None)  # type: ignore[call-overload]
        if entry is None:
            raise SimulatedDeviceError(f"free of unknown or freed handle {handle!r}")
        address, charged = entry
        self._space.give(address, charged)
        self._used -= charged
        self._counts["frees"] += 1
        self.log.append(("free", handle))

    # --- expandable segments ----------------------------------------------------------

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """Reserve ``nbytes`` (a multiple of 2 MiB) of address space."""
        if nbytes <= 0 or nbytes % _GRANULARITY:
            raise SimulatedDeviceError(f"reserve of {nbytes} bytes, not a positive multiple of 2 MiB")
        address = self._space.take(nbytes)
        if address is None:
            raise ProviderOutOfMemory(f"simulated device: no address space for {format_size(nbytes)}")
        handle = next(self._handles)
        self._reservations[handle] = _Reservation(address, nbytes)
        self._counts["reserves"] += 1
        self.log.append(("reserve", handle, nbytes))
        return address, handle

    def map(self, handle: object, offset: int, nbytes: int) -> None:
        """Back an unmapped, aligned range of a reservation; all or nothing."""
        pages = self._pages(handle, offset, nbytes, "map")
        if any(pages.reservation.mapped[p] for p in pages.range):
            raise SimulatedDeviceError(f"map of an already mapped range {pages}")
        self._charge(nbytes, "map")
        pages.reservation.mapped[pages.range.start:pages.range.stop] = b"\x01" * len(pages.range)
        self._counts["maps"] += 1
        self.log.append(("map", handle, offset, nbytes))

    def unmap(self, handle: object, offset: int, nbytes: int) -> None:
        """Give back the memory of a mapped, aligned range of a reservation."""
        pages = self._pages(handle, offset, nbytes, "unmap")
        if not all(pages.reservation.mapped[p] for p in pages.range):
            raise SimulatedDeviceError(f"unmap of a range that is not wholly mapped {pages}")
        pages.reservation.mapped[pages.range.start:pages.range.stop] = bytes(len(pages.range))
        self._used -= nbytes
        self._counts["unmaps"] += 1
        self.log.append(("unmap", handle, offset, nbytes))

    def release(self, handle: object) -> None:
        """Give back a reservation whose pages are all unmapped."""
        reservation = self._reservations.get(handle)  # type: ignore[call-overload]
        if reservation is None:
            raise SimulatedDeviceError(f"release of unknown or released handle {handle!r}")
        if any(reservation.mapped):
            raise SimulatedDeviceError(f"release of reservation {handle!r} with pages still mapped")
        del self._reservations[handle]  # type: ignore[arg-type]
        self._space.give(reservation.address, reservation.size)
        self._counts["releases"] += 1
        self.log.append(("release", handle))

    def __repr__(self) -> str:
        return (f"<SimulatedDevice {format_size(self._used)} of {format_size(self._capacity)} used, "
                f"{len(self._streams)} streams>")

    # --- private helpers ----------------------------------------------------------------

    def _charge(self, nbytes: int, what: str) -> None:
        if self._used + nbytes > self._capacity:
            self._counts["ooms"] += 1
            self.log.append(("oom", what, nbytes))
            raise ProviderOutOfMemory(
                f"simulated device: {what} of {format_size(nbytes)} failed: "
                f"{format_size(self._used)} of {format_size(self._capacity)} in use"
            )
        self._used += nbytes

    def _pages(self, handle: object, offset: int, nbytes: int, what: str) -> _PageRange:
        reservation = self._reservations.get(handle)  # type: ignore[call-overload]
        if reservation is None:
            raise SimulatedDeviceError(f"{what} on unknown or released handle {handle!r}")
        if offset % _GRANULARITY or nbytes <= 0 or nbytes % _GRANULARITY or offset + nbytes > reservation.size:
            raise SimulatedDeviceError(
                f"{what} of [{offset:#x}, +{nbytes:#x}) is unaligned or outside a {reservation.size}-byte reservation"
            )
        return _PageRange(reservation, range(offset // _GRANULARITY, (offset + nbytes) // _GRANULARITY))


class SimulatedStream:
    """Queue work that completes only when ``run`` (or ``synchronize``) says so."""

    __slots__ = ("id", "enqueued", "completed")

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id  # index on its device; 0 is the default stream
        self.enqueued = 0  # work items ever enqueued
        self.completed = 0  # work items completed, in order

    def enqueue(self, n: int = 1) -> None:
        """Add ``n`` pending work items."""
        if n < 0:
            raise ValueError(f"enqueue: n must be >= 0, got {n}")
        self.enqueued += n

    def run(self, n: int | None = None) -> int:
        """Complete ``n`` pending items, all of them when None; return how many completed."""
        count = self.pending if n is None else min(n, self.pending)
        self.completed += count
        return count

    @property
    def pending(self) -> int:
        """Return the number of work items not completed yet."""
        return self.enqueued - self.completed

    def __repr__(self) -> str:
        return f"<SimulatedStream {self.id}: {self.pending} pending>"


@dataclass(frozen=True, slots=True)
class SimulatedEvent:
    """Mark a point in a stream: done when the work enqueued before it completes."""

    stream: SimulatedStream  # the stream it was recorded on
    target: int  # the stream's enqueued count when recorded

    @property
    def done(self) -> bool:
        """Return whether the stream has completed the work before the event."""
        return self.stream.completed >= self.target


@dataclass(frozen=True, slots=True)
class SimulatedStats:
    """Count the provider calls a :class:`SimulatedDevice` has served."""

    allocations: int = 0  # successful allocate calls
    frees: int = 0
    reserves: int = 0
    maps: int = 0  # successful map calls
    unmaps: int = 0
    releases: int = 0
    events: int = 0  # events recorded
    synchronizes: int = 0
    ooms: int = 0  # allocate/map calls refused for capacity


class SimulatedDeviceError(ShmshareError, RuntimeError):
    """Report a call that breaks the provider rules (double free, unaligned map...)."""


@dataclass
class _Reservation:
    address: int
    size: int

    def __post_init__(self) -> None:
        self.mapped = bytearray(self.size // _GRANULARITY)  # 1 per mapped 2 MiB page


@dataclass
class _PageRange:
    reservation: _Reservation
    range: range


class _AddressSpace:
    """Hand out non-overlapping, aligned fake address ranges, first fit, reused after return.

    Each range is followed by an unused guard gap: ranges never touch, so an
    allocator that runs off the end of one cannot land in the next unnoticed,
    and visualizers do not draw two segments as one.
    """

    def __init__(self, base: int, size: int) -> None:
        self._free: list[tuple[int, int]] = [(base, size)]  # (address, size), sorted, coalesced

    def take(self, nbytes: int) -> int | None:
        nbytes += _GUARD
        for i, (address, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (address + nbytes, size - nbytes)
                return address
        return None

    def give(self, address: int, nbytes: int) -> None:
        nbytes += _GUARD
        i = bisect.bisect_left(self._free, (address, 0))
        self._free.insert(i, (address, nbytes))
        if i + 1 < len(self._free) and address + nbytes == self._free[i + 1][0]:
            self._free[i] = (address, nbytes + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == address:
            prev_address, prev_size = self._free[i - 1]
            self._free[i - 1] = (prev_address, prev_size + self._free.pop(i)[1])


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


SimulatedDeviceError.__module__ = "shmshare.memory"  # tracebacks name the public module
