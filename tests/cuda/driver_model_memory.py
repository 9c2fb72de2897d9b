"""The driver model's memory: pinned host memory, registration, device memory, VMM chunks, copies.

See driver_model.py for what the model is (NOT a GPU) and
driver_model_streams.py for the order in which copies and memsets land.
Registration is checked against the process's mappings (/proc/self/maps)
as the driver checks it against the page tables: page alignment, overlap,
write permission.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

from .driver_model_streams import CUresult, Op, Refused, Stream

PAGE = os.sysconf("SC_PAGE_SIZE")
HOSTALLOC_FLAGS = 1 | 2 | 4  # PORTABLE | DEVICEMAP | WRITECOMBINED
HOSTREGISTER_FLAGS = 1 | 2 | 4 | 8  # PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY
HOSTREGISTER_READ_ONLY = 8
READ_ONLY_HOST_REGISTER_SUPPORTED = 113  # CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
POINTER_CONTEXT, POINTER_DEVICE_ORDINAL = 1, 9  # CU_POINTER_ATTRIBUTE_*


@dataclass(eq=False)
class Phys:
    """One physical allocation (cuMemAlloc or cuMemCreate)."""

    size: int
    device: int  # the ordinal it is accounted to
    handle_types: int = 0  # CUmemAllocationProp.requestedHandleTypes at cuMemCreate
    data: bytearray | None = field(default=None, repr=False)  # contents, once touched


def process_mappings() -> list[tuple[int, int, str]]:
    """Return (start, end, permissions) of every mapping of this process."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            out.append((start, end, perms))
    return out


def _covering(address: int, nbytes: int) -> list[tuple[int, int, str]] | None:
    """Return the mappings covering [address, address + nbytes), or None if a byte is unmapped."""
    cursor, end, found = address, address + nbytes, []
    for start, stop, perms in process_mappings():
        if start <= cursor < stop:
            found.append((start, stop, perms))
            cursor = stop
            if cursor >= end:
                return found
    return None


class MemoryMixin:
    """Memory calls of the driver model (a mixin of DriverModel only to keep files short)."""

    # --- host memory -------------------------------------------------------------------------------

    def _pinned(self, address: int, nbytes: int) -> bool:
        """Return whether [address, address + nbytes) is page-locked (cuMemHostAlloc or registered)."""
        for start, buffer in self.host.items():
            if start <= address and address + nbytes <= start + ctypes.sizeof(buffer):
                return True
        return any(start <= address and address + nbytes <= start + size for start, size in self.registered.items())

    def _cuMemHostAlloc(self, nbytes: int, flags: int) -> Any:
        if int(flags) & ~HOSTALLOC_FLAGS:
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)
        buffer = ctypes.create_string_buffer(nbytes)
        self.host[ctypes.addressof(buffer)] = buffer
        return self._ok(ctypes.addressof(buffer))

    def _cuMemFreeHost(self, address: int) -> Any:
        assert self.host.pop(int(address), None) is not None, f"cuMemFreeHost of unknown 0x{int(address):x}"
        return self._ok()[:1]

    def _cuMemHostGetDevicePointer(self, address: int, flags: int) -> Any:
        assert self._pinned(int(address), 1), "device pointer of memory that is not page-locked"
        return self._ok(self._wrap("CUdeviceptr", int(address)))  # unified addressing: the same address

    def _cuMemHostRegister(self, address: int, nbytes: int, flags: int) -> Any:
        address, flags = int(address), int(flags)
        if flags & ~HOSTREGISTER_FLAGS or address % PAGE or nbytes % PAGE or nbytes <= 0:
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]
        pinned = [*self.registered.items(), *((a, ctypes.sizeof(b)) for a, b in self.host.items())]
        if any(start < address + nbytes and address < start + size for start, size in pinned):
            return self._err(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)[:1]
        if flags & HOSTREGISTER_READ_ONLY and not self._attribute(READ_ONLY_HOST_REGISTER_SUPPORTED,
                                                                   "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED"):
            return self._err(CUresult.CUDA_ERROR_NOT_SUPPORTED)[:1]
        covering = _covering(address, nbytes)
        if covering is None:
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]
        if not flags & HOSTREGISTER_READ_ONLY and any("w" not in perms for _, _, perms in covering):
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]  # the driver pins pages for writing
        self.registered[address] = nbytes
        return self._ok()[:1]

    def _cuMemHostUnregister(self, address: int) -> Any:
        size = self.registered.get(int(address))
        if size is None:
            return self._err(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)[:1]
        if _covering(int(address), size) is None:
            raise AssertionError("unregister of memory already unmapped: a mapping was munmapped while still "
                                 f"registered (0x{int(address):x}+{size}); the driver could still DMA into it")
        del self.registered[int(address)]
        return self._ok()[:1]

    # --- device memory ---------------------------------------------------------------------------------

    def _new_phys(self, nbytes: int, device: int, handle_types: int = 0) -> int | None:
        dev = self.devices[device]
        if dev.used + nbytes > dev.capacity:
            return None
        dev.used += nbytes
        pid = next(self._ids)
        self.phys[pid] = Phys(nbytes, device, handle_types)
        return pid

    def _drop_phys_if_unused(self, pid: int) -> None:
        if pid in self.handles.values() or any(p == pid for _, p in self.mappings.values()):
            return
        if pid in self.mallocs.values():
            return
        phys = self.phys.pop(pid)
        self.devices[phys.device].used -= phys.size

    def _device_arg(self, ordinal: Any) -> int:
        number = int(ordinal)
        if not 0 <= number < len(self.devices):
            raise Refused(CUresult.CUDA_ERROR_INVALID_DEVICE)
        return number

    def _cuMemAlloc(self, nbytes: int) -> Any:
        pid = self._new_phys(nbytes, self.contexts[self._current()].device)
        if pid is None:
            return self._err(CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        address = next(self._va)
        self.mallocs[address] = pid
        return self._ok(self._wrap("CUdeviceptr", address))

    def _cuMemFree(self, address: Any) -> Any:
        pid = self.mallocs.get(int(address))
        assert pid is not None, f"cuMemFree of unknown 0x{int(address):x}"
        self._force(self._pending_on(int(address), self.phys[pid].size), "cuMemFree")  # waits, as cudaFree does
        del self.mallocs[int(address)]
        self._drop_phys_if_unused(pid)
        return self._ok()[:1]

    def _cuMemGetInfo(self) -> Any:
        dev = self.devices[self.contexts[self._current()].device]
        return self._ok(dev.capacity - dev.used, dev.capacity)

    def _cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> Any:
        assert int(prop.type) == 1 and int(prop.location.type) == 1, "granularity of a non-device prop"
        self._device_arg(prop.location.id)
        return self._ok(self.recommended_granularity if int(option) == GRANULARITY_RECOMMENDED else self.granularity)

    def _whole_granules(self, size: int) -> None:
        if size <= 0 or size % self.granularity:
            raise Refused(CUresult.CUDA_ERROR_INVALID_VALUE)  # not a multiple of the MINIMUM granularity

    def _cuMemAddressReserve(self, size: int, alignment: int, address: Any, flags: int) -> Any:
        self._whole_granules(size)
        assert size <= 1 << 36, f"reserve of {size} bytes: more than a slot of this model"
        start = next(self._va)
        self.reservations[start] = size
        return self._ok(self._wrap("CUdeviceptr", start))

    def _cuMemAddressFree(self, address: Any, size: int) -> Any:
        start = int(address)
        assert self.reservations.get(start) == size, f"address free of 0x{start:x}+{size}, not a reservation"
        assert not any(start <= m < start + size for m in self.mappings), "address free with chunks mapped"
        del self.reservations[start]
        return self._ok()[:1]

    def _cuMemCreate(self, size: int, prop: Any, flags: int) -> Any:
        self._whole_granules(size)
        pid = self._new_phys(size, self._device_arg(prop.location.id), int(prop.requestedHandleTypes))
        if pid is None:
            return self._err(CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        handle = next(self._ids)
        self.handles[handle] = pid
        return self._ok(self._wrap("CUmemGenericAllocationHandle", handle))

    def _cuMemRelease(self, handle: Any) -> Any:
        pid = self.handles.pop(int(handle), None)
        assert pid is not None, f"cuMemRelease of unknown handle {handle}"
        self._drop_phys_if_unused(pid)
        return self._ok()[:1]

    def _cuMemMap(self, address: Any, size: int, offset: int, handle: Any, flags: int) -> Any:
        self._whole_granules(size)
        start, pid = int(address), self.handles[int(handle)]
        assert offset == 0 and size == self.phys[pid].size, "cuMemMap must map a whole allocation here"
        assert any(r <= start and start + size <= r + s for r, s in self.reservations.items()), \
            "map outside a reservation"
        assert not any(m < start + size and start < m + s for m, (s, _) in self.mappings.items()), "map over a mapping"
        self.mappings[start] = (size, pid)
        return self._ok()[:1]

    def _cuMemUnmap(self, address: Any, size: int) -> Any:
        entry = self.mappings.get(int(address))
        if entry is None or entry[0] != size:  # the driver cannot unmap part of a mapping
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]
        pending = self._pending_on(int(address), size)
        if pending:  # cuMemUnmap does not wait: on a GPU that work faults, or reads what comes next
            raise AssertionError(
                f"cuMemUnmap of 0x{int(address):x}+{size} while {pending[0].label} on stream "
                f"{self._name(pending[0].stream)} is pending on it: wait for that work first (an event "
                "recorded on its stream, or a synchronize of its context)")
        del self.mappings[int(address)]
        self._drop_phys_if_unused(entry[1])
        return self._ok()[:1]

    def _cuMemSetAccess(self, address: Any, size: int, descs: Any, count: int) -> Any:
        assert len(descs) == count == 1 and int(descs[0].flags) == 3, "access must be read-write for one device"
        self._device_arg(descs[0].location.id)
        self._segments(int(address), size)  # the whole range must be mapped
        return self._ok()[:1]

    def _cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: int) -> Any:
        pid = self.handles[int(handle)]
        if int(kind) != POSIX_FD or not self.phys[pid].handle_types & POSIX_FD:
            return self._err(CUresult.CUDA_ERROR_NOT_PERMITTED)  # not requested at cuMemCreate
        fd = os.memfd_create("driver-model-chunk", os.MFD_CLOEXEC)
        os.write(fd, pid.to_bytes(8, "little"))
        self.exported.append(fd)
        return self._ok(fd)

    def _cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> Any:
        pid = int.from_bytes(os.pread(int(fd), 8, 0), "little")
        assert pid in self.phys, "import of a chunk that no longer exists"
        handle = next(self._ids)
        self.handles[handle] = pid
        return self._ok(self._wrap("CUmemGenericAllocationHandle", handle))

    def _owner(self, address: int) -> int | None:
        """Return the physical allocation holding device ``address``, or None."""
        for start, pid in self.mallocs.items():
            if start <= address < start + self.phys[pid].size:
                return pid
        for start, (size, pid) in self.mappings.items():
            if start <= address < start + size:
                return pid
        return None

    def _cuPointerGetAttribute(self, attribute: Any, ptr: Any) -> Any:
        pid = self._owner(int(ptr))
        if pid is None or int(attribute) not in (POINTER_CONTEXT, POINTER_DEVICE_ORDINAL):
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)
        device = self.phys[pid].device
        if int(attribute) == POINTER_DEVICE_ORDINAL:
            return self._ok(device)
        return self._ok(self._wrap("CUcontext", self.devices[device].context))

    # --- copies: stream-ordered (Note [Stream order in the model]) --------------------------------------

    def _segments(self, address: int, nbytes: int) -> list[tuple[int, int, int]]:
        """Return (physical allocation, offset, length) pieces covering a device range, or fail."""
        pieces, cursor, end = [], address, address + nbytes
        while cursor < end:
            for start, pid in self.mallocs.items():
                if start <= cursor < start + self.phys[pid].size:
                    break
            else:
                found = [(s, p) for s, (size, p) in self.mappings.items() if s <= cursor < s + size]
                assert found, f"device address 0x{cursor:x} is not mapped"
                start, pid = found[0]
            length = min(end, start + self.phys[pid].size) - cursor
            pieces.append((pid, cursor - start, length))
            cursor += length
        return pieces

    def _contents(self, pid: int) -> bytearray:
        phys = self.phys[pid]
        if phys.data is None:
            phys.data = bytearray(phys.size)
        return phys.data

    def _gather(self, pieces: list[tuple[int, int, int]]) -> bytes:
        return b"".join(bytes(self._contents(pid)[offset:offset + length]) for pid, offset, length in pieces)

    def _scatter(self, pieces: list[tuple[int, int, int]], payload: bytes) -> None:
        done = 0
        for pid, offset, length in pieces:
            self._contents(pid)[offset:offset + length] = payload[done:done + length]
            done += length

    def _still_pinned(self, label: str, address: int, nbytes: int) -> None:
        """Fail a DMA whose host memory stopped being page-locked (or mapped) before it ran."""
        if not self._pinned(address, nbytes) or _covering(address, nbytes) is None:
            raise AssertionError(f"{label} ran after its host memory 0x{address:x}+{nbytes} was unpinned or "
                                 "unmapped: a DMA to a stale target")

    def _host_to_device(self, stream: Stream, label: str, dst: int, src: int, nbytes: int) -> Op:
        pieces = self._segments(dst, nbytes)
        writes = frozenset(pid for pid, _, _ in pieces)
        if self._pinned(src, nbytes):  # the DMA reads the host memory when it runs
            def effect() -> None:
                self._still_pinned(label, src, nbytes)
                self._scatter(pieces, ctypes.string_at(src, nbytes))
        else:  # pageable: the driver stages a copy at the call
            staged = ctypes.string_at(src, nbytes)

            def effect() -> None:
                self._scatter(pieces, staged)
        return self._enqueue(stream, label, effect=effect, writes=writes, span=(dst, nbytes))

    def _device_to_host(self, stream: Stream, label: str, dst: int, src: int, nbytes: int) -> Op:
        pieces = self._segments(src, nbytes)
        pinned = self._pinned(dst, nbytes)

        def effect() -> None:
            if pinned:
                self._still_pinned(label, dst, nbytes)
            ctypes.memmove(dst, self._gather(pieces), nbytes)
        op = self._enqueue(stream, label, effect=effect, reads=frozenset(pid for pid, _, _ in pieces),
                           span=(src, nbytes))
        if not pinned:  # into pageable memory the copy is synchronous
            self._force([op], label)
        return op

    def _memset(self, stream: Stream, label: str, dst: int, value: int, nbytes: int) -> Op:
        pieces = self._segments(dst, nbytes)
        return self._enqueue(stream, label, effect=lambda: self._scatter(pieces, bytes([value]) * nbytes),
                             writes=frozenset(pid for pid, _, _ in pieces), span=(dst, nbytes))

    def _legacy(self) -> Stream:
        return self.contexts[self._current()].legacy

    def _cuMemcpyHtoD(self, dst: Any, src: int, nbytes: int) -> Any:
        op = self._host_to_device(self._legacy(), "cuMemcpyHtoD", int(dst), int(src), nbytes)
        if self._pinned(int(src), nbytes):  # from pinned memory: synchronous; pageable: staged, may land later
            self._force([op], "cuMemcpyHtoD")
        return self._ok()[:1]

    def _cuMemcpyHtoDAsync(self, dst: Any, src: int, nbytes: int, stream: Any) -> Any:
        self._host_to_device(self._stream(stream), "cuMemcpyHtoDAsync", int(dst), int(src), nbytes)
        return self._ok()[:1]

    def _cuMemcpyDtoH(self, dst: int, src: Any, nbytes: int) -> Any:
        op = self._device_to_host(self._legacy(), "cuMemcpyDtoH", int(dst), int(src), nbytes)
        self._force([op], "cuMemcpyDtoH")
        return self._ok()[:1]

    def _cuMemcpyDtoHAsync(self, dst: int, src: Any, nbytes: int, stream: Any) -> Any:
        target = self._stream(stream)
        if not self._pinned(int(dst), nbytes):
            self._refuse_capturing_stream(target)  # a synchronous copy cannot be captured
        self._device_to_host(target, "cuMemcpyDtoHAsync", int(dst), int(src), nbytes)
        return self._ok()[:1]

    def _cuMemsetD8(self, dst: Any, value: int, nbytes: int) -> Any:
        self._memset(self._legacy(), "cuMemsetD8", int(dst), value, nbytes)
        return self._ok()[:1]

    def _cuMemsetD8Async(self, dst: Any, value: int, nbytes: int, stream: Any) -> Any:
        self._memset(self._stream(stream), "cuMemsetD8Async", int(dst), value, nbytes)
        return self._ok()[:1]
