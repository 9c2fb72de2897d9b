"""CudaDeviceProvider: device memory, streams and events for the caching allocator core.

Note [CUDA device provider]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
This is the provider of Note [Providers] (``memory/_provider.py``) over the
driver, so :class:`~shmshare.memory.CachingAllocator` becomes PyTorch's CUDA
caching allocator with the policy already proven on ``SimulatedDevice``.

- Classic segments: ``cuMemAlloc`` / ``cuMemFree`` (which, like
  ``cudaFree``, waits for work still using the memory).
- Expandable segments: ``cuMemAddressReserve`` for the reservation, and
  chunks of the allocation granularity created, mapped, given access,
  unmapped and released as the core maps and unmaps pages (Note [Device
  chunks] in ``_vmm.py``). The core synchronizes the segment's stream
  before every unmap, because ``cuMemUnmap`` does not wait.
- With ``ipc=True`` every segment, classic ones too, is made of chunks
  created shareable as POSIX fds, so any block can be sent to another
  process (``send_device_memory``); freeing such a classic segment
  synchronizes the context first, since unmapping does not wait as
  ``cuMemFree`` does.
- Streams are ``Stream`` objects; the default stream is the legacy default
  stream (handle 0). Any stream a caller brings works as an int handle
  (``torch.cuda.current_stream().cuda_stream``, ``cupy`` streams' ``.ptr``):
  ``Stream`` hashes and compares equal to its handle. Events come from the
  context's event pool.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..memory._policy import format_size
from ._array import DeviceArray
from ._context import Context, Event, EventPool, Stream, stream_handle
from ._deferred import drain
from ._driver import CudaError, CudaOutOfMemory, call
from ._vmm import VirtualRange, allocation_granularity

__all__ = ["CudaDeviceProvider"]

_SMALL_PAGE = 2 << 20  # the core's page size for small pools; chunks must divide it


class CudaDeviceProvider:
    """Give the caching allocator device memory, streams and events (Note [CUDA device provider]).

    Parameters
    ----------
    device : int
        Device ordinal.
    ipc : bool
        Make every segment of shareable chunks, so blocks can go to other
        processes by fd. Needs virtual memory management and POSIX fd handles.
    context : Context, optional
        The device's primary context when None.
    """

    name = "cuda device"

    def __init__(self, device: int = 0, *, ipc: bool = False, context: Context | None = None) -> None:
        self.context = context or Context.primary(device)
        self.device = self.context.device
        self.ipc = bool(ipc)
        if self.ipc:
            self._require("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "virtual memory management")
            self._require("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "POSIX fd handles")
        self.events = EventPool(self.context)
        self._default = Stream.wrap(0, self.context)
        self._capacity = self.context.total_memory()
        self._chunk: int | None = None  # allocation granularity, asked on first use
        self._ranges: dict[int, VirtualRange] = {}  # address -> every live virtual range
        self._addresses: list[int] = []  # sorted keys of _ranges, for range_of()
        self._classic: dict[int, int] = {}  # address -> bytes of each cuMemAlloc segment

    # --- classic segments ------------------------------------------------------------------

    def allocate(self, nbytes: int) -> tuple[int, object]:
        """Back ``nbytes`` with device memory; return (address, handle)."""
        _check_positive(nbytes, "allocate")
        drain()
        if self.ipc:
            chunk = self.chunk_size
            self._check_free(nbytes, "allocate")
            vrange = self._new_range(-(-nbytes // chunk) * chunk)
            try:
                vrange.map(0, vrange.size)
            except BaseException:
                self._drop_range(vrange)
                vrange.release()
                raise
            return vrange.address, vrange
        with self.context.active():
            address = int(call("cuMemAlloc", nbytes))
        self._classic[address] = nbytes
        return address, _ClassicHandle(address)

    def free(self, handle: object) -> None:
        """Give back a segment from ``allocate``, after the work using it."""
        if isinstance(handle, _ClassicHandle) and handle.address in self._classic:
            with self.context.active():
                call("cuMemFree", handle.address)  # waits for work using it, as cudaFree does
            del self._classic[handle.address]
            return
        vrange = self._range(handle, "free")
        self.context.synchronize()  # unlike cuMemFree, cuMemUnmap does not wait
        vrange.close()  # a failed unmap keeps the range in the books (and mapped), for close() to retry
        self._drop_range(vrange)

    # --- expandable segments ---------------------------------------------------------------------

    def reserve(self, nbytes: int) -> tuple[int, object]:
        """Reserve ``nbytes`` of device address space; return (address, handle)."""
        _check_positive(nbytes, "reserve")
        vrange = self._new_range(nbytes)
        return vrange.address, vrange

    def map(self, handle: object, offset: int, nbytes: int) -> None:
        """Back a chunk-aligned, unmapped range of a reservation; all or nothing."""
        vrange = self._range(handle, "map")
        drain()
        self._check_free(nbytes, "map")
        vrange.map(offset, nbytes)

    def unmap(self, handle: object, offset: int, nbytes: int) -> None:
        """Unmap a mapped range (the core synchronized the segment's stream first)."""
        self._range(handle, "unmap").unmap(offset, nbytes)

    def release(self, handle: object) -> None:
        """Give back a reservation whose pages are all unmapped."""
        vrange = self._range(handle, "release")
        vrange.release()
        self._drop_range(vrange)

    # --- capacity, streams, events ----------------------------------------------------------------

    def capacity(self) -> int:
        """Return the device's memory in bytes."""
        return self._capacity

    def free_bytes(self) -> int:
        """Return the device memory the driver reports free now."""
        return self.context.memory_info()[0]

    def default_stream(self) -> Stream:
        """Return the legacy default stream (handle 0), the same object every time."""
        return self._default

    def new_stream(self, *, non_blocking: bool = True) -> Stream:
        """Create a stream in this provider's context (close it when done)."""
        return Stream(self.context, non_blocking=non_blocking)

    def record_event(self, stream: Hashable) -> Event:
        """Return a pooled event recorded on ``stream`` (any stream object or int handle of this device)."""
        owner = Context.of_stream(stream, self.context)
        if owner.handle != self.context.handle:
            raise ValueError(f"stream {stream!r} belongs to device {owner.device}, and this allocator's memory "
                             f"is on device {self.device}: use a stream of device {self.device}")
        return self.events.get().record(stream)

    def event_done(self, event: object) -> bool:
        """Return whether ``event`` completed, without blocking."""
        if not isinstance(event, Event):
            raise ValueError(f"event_done on {event!r}, which is not an event of this provider")
        return event.query()

    def synchronize(self, stream: Hashable | None = None) -> None:
        """Wait for ``stream``'s work, or the whole context's when None."""
        if stream is None:
            self.context.synchronize()
            return
        with self.context.active():
            call("cuStreamSynchronize", stream_handle(stream))

    # --- blocks as arrays, lookup ---------------------------------------------------------------------

    @property
    def chunk_size(self) -> int:
        """Return the allocation granularity of virtual-memory chunks (asked once)."""
        if self._chunk is None:
            chunk = allocation_granularity(self.context, self.ipc, _SMALL_PAGE)
            if _SMALL_PAGE % chunk:
                raise CudaError(f"device {self.device}: allocation granularity {chunk} does not divide "
                                "2 MiB, so expandable segments cannot be mapped page by page here")
            self._chunk = chunk
        return self._chunk

    def array(self, block: Any, shape: Any, dtype: Any = np.uint8, *, stream: Any = None) -> DeviceArray:
        """Return a :class:`DeviceArray` over a block (or an address) of this provider's device.

        The array does not own the block: free it only after the array's
        last user (torch, CuPy) is done with it.
        """
        address = getattr(block, "address", block)
        return DeviceArray(int(address), shape, dtype, device=self.device, stream=stream, owner=block)

    def range_of(self, address: int) -> tuple[VirtualRange, int] | None:
        """Return (virtual range, offset) holding ``address``, or None (e.g. ``cuMemAlloc`` memory)."""
        i = bisect.bisect_right(self._addresses, address) - 1
        if i < 0:
            return None
        vrange = self._ranges[self._addresses[i]]
        offset = address - vrange.address
        return (vrange, offset) if offset < vrange.size else None

    def close(self) -> None:
        """Free every segment still held and the pooled events (the allocator freed them first). Idempotent."""
        if self._classic or self._ranges:
            self.context.synchronize()
        error: Exception | None = None
        with self.context.active():
            for address in list(self._classic):
                try:
                    call("cuMemFree", address)
                except Exception as exc:  # noqa: BLE001 - raised below, once every segment was tried
                    error = error or exc
                    continue
                del self._classic[address]
        for vrange in list(self._ranges.values()):
            try:
                vrange.close()  # a failed unmap keeps the range in the books: close() again retries
            except Exception as exc:  # noqa: BLE001 - raised below, once every segment was tried
                error = error or exc
                continue
            self._drop_range(vrange)
        self.events.close()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        kind = "ipc" if self.ipc else "local"
        return f"<CudaDeviceProvider device {self.device} {kind}, {len(self._classic) + len(self._ranges)} segments>"

    # --- private --------------------------------------------------------------------------------------

    def _require(self, attribute: str, what: str) -> None:
        if not self.context.attribute(attribute):
            raise CudaError(f"device {self.device} does not support {what} ({attribute} is 0); "
                            "use ipc=False")

    def _check_free(self, nbytes: int, what: str) -> None:
        """Fail at once when the driver reports too little free memory.

        Chunks are created one by one, so a hopeless request (the retry
        chain's "twice the device") would otherwise create and map thousands
        of chunks before the first one fails, then unmap them all.
        """
        free = self.free_bytes()
        if nbytes > free:
            raise CudaOutOfMemory(f"{what} of {format_size(nbytes)} on device {self.device}: the driver "
                                  f"reports {format_size(free)} free (cuMemGetInfo)", call="cuMemGetInfo")

    def _new_range(self, nbytes: int) -> VirtualRange:
        vrange = VirtualRange(self.context, nbytes, self.chunk_size, shareable=self.ipc)
        self._ranges[vrange.address] = vrange
        bisect.insort(self._addresses, vrange.address)
        return vrange

    def _drop_range(self, vrange: VirtualRange) -> None:
        if self._ranges.pop(vrange.address, None) is not None:
            self._addresses.remove(vrange.address)

    def _range(self, handle: object, what: str) -> VirtualRange:
        if not isinstance(handle, VirtualRange) or self._ranges.get(handle.address) is not handle:
            raise ValueError(f"{what} of {handle!r}, which is not a live segment of this provider")
        return handle


class _ClassicHandle:
    """The handle of a ``cuMemAlloc`` segment: its address."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address

    def __repr__(self) -> str:
        return f"<cuMemAlloc 0x{self.address:x}>"


def _check_positive(nbytes: Any, what: str) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"{what}: nbytes must be a positive int, got {nbytes!r}")
