"""The seam between the caching allocator core and whatever gives it memory.

Note [Providers]
~~~~~~~~~~~~~~~~
:class:`~shmshare.memory.CachingAllocator` never touches memory. It asks a
*provider* for whole segments and keeps the books (blocks, best fit,
split/merge, events, retries, statistics). As in RMM, the provider is a
*resource*; the allocator is the pool on top. Three providers exist or are
planned: :class:`~shmshare.memory.SimulatedDevice` (tests, no GPU),
``ShmProvider`` (memfd segments) and a CUDA provider.

The methods, and the rule each keeps:

Memory, classic segments (every provider)

``allocate(nbytes) -> (address, handle)``
    Back ``nbytes`` bytes (a multiple of 512; in practice of 2 MiB) with
    memory at ``address``, an ``int``. The range must not overlap any live
    segment or reservation of the same provider; it should be page aligned.
    ``handle`` is opaque to the core, which stores it and passes it back to
    ``free`` exactly once.
``free(handle)``
    Give a segment back. The core calls it only when no block of the
    segment is allocated or waiting for events. Like ``cudaFree`` it may
    wait for work still running on the segment's memory.

Memory, expandable segments (providers that support them; see
:class:`ExpandableProvider` and Note [Expandable segments])

``reserve(nbytes) -> (address, handle)``
    Reserve ``nbytes`` of address space, backed by nothing, counted against
    nothing. ``nbytes`` is a multiple of the page size the core uses for
    that pool (2 MiB for small pools, ``large_segment_size_mb`` for large
    ones, 20 MiB by default), and so is every offset below.
``map(handle, offset, nbytes)``
    Back ``[address + offset, address + offset + nbytes)`` with memory. The
    range is inside the reservation and wholly unmapped. All or nothing: on
    failure nothing of the range is mapped.
``unmap(handle, offset, nbytes)``
    Give the memory of a mapped, page-aligned range back while keeping the
    addresses reserved. The core has called ``synchronize(stream)`` for the
    segment's stream first, because (unlike ``cudaFree``) ``cuMemUnmap``
    does not wait for in-flight work.
``release(handle)``
    Give the address space back. Every page is unmapped by then.

Out of memory

``allocate``, ``reserve`` and ``map`` signal that the memory is not there
by raising :class:`ProviderOutOfMemory`, and only that way; the call must
then have changed nothing. The core answers with its retry chain (free
memory callbacks, garbage collection, ``use_on_oom`` pools, releasing
oversize blocks, releasing everything after synchronizing) and finally
raises :class:`~shmshare.memory.OutOfMemoryError`. Any other exception
propagates to the caller of ``malloc`` unchanged, as a non-OOM CUDA error
does in PyTorch.

Capacity

``capacity() -> int | None``
    Total bytes the provider can back, or ``None`` when unknown. Used in
    the OOM message, by ``garbage_collection_threshold`` (off when None),
    and to size expandable reservations (capacity x 1.125; 64 GiB when
    None; never less than the request).
``free_bytes() -> int | None``
    Bytes the provider could still back now, or ``None``. Used in the OOM
    message and its trace entry.

Streams and events

A *stream* is any hashable object, compared with ``==``; the core never
creates one, and orders them by first sight. ``default_stream()`` returns
the stream of every ``malloc`` not given one, the same object on every call.
A block is allocated on one stream; ``record_stream(block, other)`` says it
is also used on ``other``. For CUDA a stream is a ``CUstream``; for the shm
provider a consumer process (a block *lent* to a peer is a block in use on
another stream), and its own process is the default stream.

``record_event(stream) -> event``
    Mark "everything enqueued on ``stream`` so far". The event is opaque.
``event_done(event) -> bool``
    Never blocks. True once the work before the event has completed, and
    then forever. The core queries each stream's events in the order they
    were recorded and stops at the first that is not done, so a provider
    whose events complete out of order is still correct, only slower to
    give blocks back. The shm provider's event is the peer's release
    message for the block; ``event_done`` may read pending messages.
``synchronize(stream=None)``
    Wait until the work enqueued on ``stream`` (every stream when None) has
    completed. Called only on slow paths: before unmapping pages, and when
    releasing everything (retry step 4, ``empty_cache``), once per stream
    with pending events. A provider that cannot wait for everything (a peer
    may hold a lease for ever) may return early; events not done afterwards
    simply stay queued and their blocks stay pending.

``default_stream``, ``record_event``, ``event_done`` and ``synchronize``
are called with the allocator's lock held, and must not call back into it.

Optional: a ``name`` attribute (``str``) used in messages ("simulated
device", "shm"); the class name otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable

from .._errors import ShmshareError

__all__ = ["ExpandableProvider", "Provider", "ProviderOutOfMemory"]


class ProviderOutOfMemory(ShmshareError, MemoryError):
    """Signal from a provider that it cannot back the memory asked for.

    Raised by ``allocate``, ``reserve`` and ``map``; the allocator catches it
    and runs its retry chain. Put the system call and the size in the
    message: it is chained to the ``OutOfMemoryError`` a caller finally sees.
    """


@runtime_checkable
class Provider(Protocol):
    """Give the allocator classic segments, streams and events (see Note [Providers])."""

    def allocate(self, nbytes: int) -> tuple[int, object]:
        """Back ``nbytes`` bytes with memory; return (address, handle)."""
        ...

    def free(self, handle: object) -> None:
        """Give back a segment from ``allocate``."""
        ...

    def capacity(self) -> int | None:
        """Return the bytes the provider can back in total, or None."""
        ...

    def free_bytes(self) -> int | None:
        """Return the bytes the provider could back now, or None."""
        ...

    def default_stream(self) -> Hashable:
        """Return the stream of allocations not given one."""
        ...

    def record_event(self, stream: Hashable) -> object:
        """Return an event that completes when the work enqueued on ``stream`` so far does."""
        ...

    def event_done(self, event: object) -> bool:
        """Return whether ``event`` has completed, without blocking."""
        ...

    def synchronize(self, stream: Hashable | None = None) -> None:
        """Wait for the work enqueued on ``stream`` (every stream when None)."""
        ...


@runtime_checkable
class ExpandableProvider(Provider, Protocol):
    """Add reserve/map/unmap/release for expandable segments (see Note [Providers])."""

    def reserve(self, nbytes: int) -> tuple[int, object]:
        """Reserve ``nbytes`` of address space; return (address, handle)."""
        ...

    def map(self, handle: object, offset: int, nbytes: int) -> None:
        """Back a page-aligned, unmapped range of a reservation with memory."""
        ...

    def unmap(self, handle: object, offset: int, nbytes: int) -> None:
        """Give back the memory of a page-aligned, mapped range of a reservation."""
        ...

    def release(self, handle: object) -> None:
        """Give back a reservation whose pages are all unmapped."""
        ...


# Tracebacks and reprs name the public module these are exported from, not this private one.
for _cls in (ProviderOutOfMemory,):
    _cls.__module__ = "shmshare.memory"
del _cls
