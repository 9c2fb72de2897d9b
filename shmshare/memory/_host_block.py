"""Blocks of the pinned-host pool, the provider interface, and the reserve segment."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .. import _native

if TYPE_CHECKING:
    from ._host import CachingHostAllocator

__all__ = ["RESERVE_ALIGNMENT", "HostBlock", "HostProvider", "ReserveSegment"]

RESERVE_ALIGNMENT = 4096  # carved blocks start on 4 KiB boundaries, as in PyTorch


@runtime_checkable
class HostProvider(Protocol):
    """Give the host pool memory, and events on the streams that use it.

    ``allocate(nbytes) -> (address, handle)`` backs ``nbytes`` with host
    memory (page-locked, for CUDA) and raises ``ProviderOutOfMemory`` when
    there is none; ``free(handle)`` gives it back. ``record_event(stream)``
    returns an event that is done when the work enqueued on ``stream`` so far
    is; ``event_done(event)`` says so without blocking, and stays True. The
    event calls may come from the pool's background thread.
    """

    def allocate(self, nbytes: int) -> tuple[int, object]:
        """Back ``nbytes`` bytes with host memory; return (address, handle)."""
        ...

    def free(self, handle: object) -> None:
        """Give back memory from ``allocate``."""
        ...

    def record_event(self, stream: Hashable) -> object:
        """Return an event that completes with the work enqueued on ``stream`` so far."""
        ...

    def event_done(self, event: object) -> bool:
        """Return whether ``event`` has completed, without blocking."""
        ...


class HostBlock:
    """Describe one block of the host pool: where, how big, and who used it.

    Callers read ``address``, ``size`` (a power of two) and
    ``requested_size``; the rest is the pool's bookkeeping. After ``free``
    the pool reuses the object for the next request of its size.
    """

    __slots__ = ("owner", "address", "size", "requested_size", "handle", "carved", "allocated",
                 "streams", "event_count", "__weakref__")

    def __init__(self, owner: CachingHostAllocator, address: int, size: int, handle: object,
                 carved: bool) -> None:
        self.owner = owner  # the pool the block belongs to
        self.address = address  # first byte
        self.size = size  # bytes, a power of two (0 for a zero-byte request)
        self.requested_size = 0  # bytes the caller asked for (0 while free)
        self.handle = handle  # the provider's handle (the reserve segment's, when carved)
        self.carved = carved  # cut from the reserve segment, never given back alone
        self.allocated = False  # in a caller's hands
        self.streams: set[Hashable] = set()  # streams that used it since allocate
        self.event_count = 0  # events still to complete before the block is free

    def view(self) -> memoryview:
        """Return a writable memoryview of the block (valid until the block is freed)."""
        if not self.allocated:
            raise ValueError(f"view() of {self!r}, which is not allocated")
        if self.size == 0:
            return memoryview(bytearray())
        return memoryview(_native.Lease(self, self.address, self.requested_size))

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "pending" if self.event_count else "free"
        return f"<HostBlock {state} 0x{self.address:x}+{self.size}>"


class ReserveSegment:
    """Carve 4 KiB-aligned pieces from one provider allocation with a bump pointer."""

    __slots__ = ("address", "size", "handle", "used")

    def __init__(self, address: int, size: int, handle: object) -> None:
        self.address = address  # first byte
        self.size = size  # bytes
        self.handle = handle  # the provider's handle of the whole segment
        self.used = 0  # bytes carved so far, from the start

    def carve(self, size: int) -> int | None:
        """Return the address of ``size`` fresh bytes, or None when the segment is used up."""
        rounded = -(-size // RESERVE_ALIGNMENT) * RESERVE_ALIGNMENT
        if self.used + rounded > self.size:
            return None
        address = self.address + self.used
        self.used += rounded
        return address

    def owns(self, address: int) -> bool:
        """Return whether ``address`` lies in the segment."""
        return self.address <= address < self.address + self.size


