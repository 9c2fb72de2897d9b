"""A bookkeeping model of one CUDA device behind the driver API, to run shmshare.cuda's Python on CPU.

THIS IS NOT A GPU and proves nothing about one. It answers the driver calls
that shmshare.cuda makes from a small in-Python model (contexts per thread,
streams whose work completes when a test says so, device memory as
bytearrays, virtual ranges, chunks, POSIX fds carrying a chunk's identity),
so that the Python around the calls (bookkeeping, chunking, all-or-nothing
paths, the IPC header and its fds, error mapping) runs and is checked here.

Where cuda-python is installed, every call is also handed to the real
binding first. Without libcuda the binding can only fail for that reason,
*after* converting its arguments: any other exception means shmshare passed
an argument that cuda-python does not accept, and the call fails the test.
Types then come from the real binding too (``CUdeviceptr``, structs, enums).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import os
import threading
import time
import types
from typing import Any

GRANULARITY = 2 << 20
_CONTEXT = 0xC0C0  # the one primary context
_CONTEXT_FREE = {"cuInit", "cuStreamGetCtx", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuDevicePrimaryCtxGetState",
                 "cuPointerGetAttribute", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                 "cuDevicePrimaryCtxRelease", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGetAttribute",
                 "cuDeviceTotalMem", "cuDeviceGetUuid", "cuDeviceGetName", "cuMemGetAllocationGranularity"}


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713


def _standins() -> types.SimpleNamespace:
    """Stand-ins for the enums and structs of cuda-python, where it is not installed."""
    def ns(**kw: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(**kw)

    class Prop:
        def __init__(self) -> None:
            self.type, self.requestedHandleTypes = 0, 0
            self.location = ns(type=0, id=0)

    class Desc:
        def __init__(self) -> None:
            self.flags, self.location = 0, ns(type=0, id=0)

    return ns(
        CUresult=CUresult, CUmemAllocationProp=Prop, CUmemAccessDesc=Desc,
        CUmemAllocationType=ns(CU_MEM_ALLOCATION_TYPE_PINNED=1),
        CUmemLocationType=ns(CU_MEM_LOCATION_TYPE_DEVICE=1),
        CUmemAccess_flags=ns(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3),
        CUmemAllocationHandleType=ns(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1),
        CUmemAllocationGranularity_flags=ns(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0),
        CUdevice_attribute=ns(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102,
                              CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=103),
    )


class DriverModel:
    """Answer driver calls from a model of one device (see the module docstring)."""

    def __init__(self, real: Any = None, capacity: int = 1 << 32) -> None:
        self.real = real  # cuda.bindings.driver, for signature checks and types; None for stand-ins
        self.types = real if real is not None else _standins()
        self.capacity = capacity
        self.granularity = GRANULARITY  # cuMemGetAllocationGranularity; tests may shrink it for many cheap chunks
        self.used = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.retains = 0
        self._tls = threading.local()
        self._ids = itertools.count(0x1000)
        self._va = itertools.count(0x7000_0000_0000, 1 << 36)  # one 64 GiB slot per reservation
        self.streams: dict[int, list[int]] = {0: [0, 0], 1: [0, 0], 2: [0, 0]}  # handle -> [enqueued, done]
        self.events: dict[int, tuple[int, int] | None] = {}  # handle -> (stream, target) once recorded
        self.waits: dict[int, tuple[int, int]] = {}  # stream -> (host word address, value) it waits for
        self.phys: dict[int, int] = {}  # physical allocation -> bytes
        self.data: dict[int, bytearray] = {}  # physical allocation -> contents, once touched
        self.handles: dict[int, int] = {}  # generic allocation handle -> physical allocation
        self.reservations: dict[int, int] = {}  # start -> size
        self.mappings: dict[int, tuple[int, int]] = {}  # start -> (size, physical allocation)
        self.mallocs: dict[int, int] = {}  # cuMemAlloc address -> physical allocation
        self.host: dict[int, Any] = {}  # cuMemHostAlloc address -> ctypes buffer
        self.registered: dict[int, int] = {}  # cuMemHostRegister start -> bytes
        self.exported: list[int] = []  # fds handed out by cuMemExportToShareableHandle
        self._checked: set[tuple[Any, ...]] = set()  # call shapes the real binding accepted

    # --- plumbing ------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            return getattr(self.types, name)
        impl = getattr(type(self), "_" + name, None)
        if impl is None:
            raise AttributeError(f"the driver model has no {name}")

        def call(*args: Any) -> Any:
            self.calls.append((name, args))
            self._check_signature(name, args)
            if name not in _CONTEXT_FREE and getattr(self._tls, "ctx", 0) != _CONTEXT:
                return self._err(CUresult.CUDA_ERROR_INVALID_CONTEXT)
            return impl(self, *args)

        return call

    def _check_signature(self, name: str, args: tuple[Any, ...]) -> None:
        shape = (name, *(type(a) for a in args))
        if self.real is None or shape in self._checked:
            return
        try:
            getattr(self.real, name)(*args)
        except Exception as exc:
            if type(exc).__name__ == "DynamicLibNotFoundError":
                self._checked.add(shape)  # arguments converted; only the library was missing
                return
            raise AssertionError(f"cuda-python rejects {name}{args!r}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError(f"{name} ran on a real driver: the model must not be used where libcuda exists")

    def _ok(self, *values: Any) -> tuple[Any, ...]:
        return (self.types.CUresult(0), *values)

    def _err(self, code: int) -> tuple[Any, ...]:
        return (self.types.CUresult(int(code)), None)

    def _wrap(self, kind: str, value: int) -> Any:
        return getattr(self.real, kind)(value) if self.real is not None else value

    # --- test controls ----------------------------------------------------------------------

    def hold(self, stream: int) -> None:
        """Enqueue work on ``stream`` that completes only at ``finish``."""
        self.streams[int(stream)][0] += 1

    def finish(self, stream: int) -> None:
        """Complete the work enqueued on ``stream``."""
        entry = self.streams[int(stream)]
        entry[1] = entry[0]

    def _advance(self, stream: int, block: bool = False) -> None:
        """Complete a stream's work once the host word it waits on is written (poll when ``block``)."""
        wait = self.waits.get(stream)
        deadline = time.monotonic() + 120
        while wait is not None:
            if ctypes.c_uint32.from_address(wait[0]).value >= wait[1]:
                del self.waits[stream]
                self.finish(stream)
                return
            if not block or time.monotonic() > deadline:
                assert not block, f"stream {stream} never stopped waiting"
                return
            time.sleep(0.001)

    def read(self, address: int, nbytes: int) -> bytes:
        """Return device bytes (through mappings), for assertions."""
        return bytes(self._gather(address, nbytes))

    def live(self) -> dict[str, int]:
        """Return counts of what is still allocated, for leak assertions."""
        return {"mallocs": len(self.mallocs), "host": len(self.host), "registered": len(self.registered),
                "reservations": len(self.reservations), "mappings": len(self.mappings),
                "handles": len(self.handles), "phys": len(self.phys)}

    # --- init, devices, contexts ---------------------------------------------------------------

    def _cuInit(self, flags: int) -> Any:
        return self._ok()[:1]

    def _cuDeviceGetCount(self) -> Any:
        return self._ok(1)

    def _cuDeviceGet(self, ordinal: int) -> Any:
        if ordinal != 0:
            return self._err(CUresult.CUDA_ERROR_INVALID_DEVICE)
        return self._ok(self._wrap("CUdevice", ordinal))

    def _cuDevicePrimaryCtxRetain(self, dev: Any) -> Any:
        self.retains += 1
        return self._ok(self._wrap("CUcontext", _CONTEXT))

    def _cuDevicePrimaryCtxRelease(self, dev: Any) -> Any:
        assert self.retains > 0, "primary context released more often than retained"
        self.retains -= 1
        return self._ok()[:1]

    def _cuCtxGetCurrent(self) -> Any:
        return self._ok(self._wrap("CUcontext", getattr(self._tls, "ctx", 0)))

    def _cuCtxSetCurrent(self, ctx: Any) -> Any:
        self._tls.ctx = int(ctx)
        return self._ok()[:1]

    def _cuCtxPushCurrent(self, ctx: Any) -> Any:
        stack = self._tls.__dict__.setdefault("stack", [])
        stack.append(getattr(self._tls, "ctx", 0))
        self._tls.ctx = int(ctx)
        return self._ok()[:1]

    def _cuCtxPopCurrent(self) -> Any:
        stack = self._tls.__dict__.setdefault("stack", [])
        old = getattr(self._tls, "ctx", 0)
        self._tls.ctx = stack.pop() if stack else 0
        return self._ok(self._wrap("CUcontext", old))

    def _cuDevicePrimaryCtxGetState(self, dev: Any) -> Any:
        return self._ok(0, 1 if self.retains else 0)

    def _cuStreamGetCtx(self, stream: Any) -> Any:
        return self._ok(self._wrap("CUcontext", _CONTEXT))

    def _cuStreamIsCapturing(self, stream: Any) -> Any:
        return self._ok(self.types.CUstreamCaptureStatus(0))

    def _cuPointerGetAttribute(self, attribute: Any, ptr: Any) -> Any:
        return self._ok(0)

    def _cuCtxSynchronize(self) -> Any:
        for stream in list(self.waits):
            self._advance(stream, block=True)
        for entry in self.streams.values():
            entry[1] = entry[0]
        return self._ok()[:1]

    def _cuDeviceGetAttribute(self, attribute: Any, dev: Any) -> Any:
        return self._ok(1)

    def _cuDeviceTotalMem(self, dev: Any) -> Any:
        return self._ok(self.capacity)

    def _cuMemGetInfo(self) -> Any:
        return self._ok(self.capacity - self.used, self.capacity)

    def _cuDeviceGetUuid(self, dev: Any) -> Any:
        uuid = self.real.CUuuid() if self.real is not None else types.SimpleNamespace(bytes=b"\0" * 16)
        return self._ok(uuid)

    def _cuDeviceGetName(self, length: int, dev: Any) -> Any:
        return self._ok(b"driver model\0")

    # --- streams and events ------------------------------------------------------------------

    def _cuStreamCreate(self, flags: int) -> Any:
        handle = next(self._ids)
        self.streams[handle] = [0, 0]
        return self._ok(self._wrap("CUstream", handle))

    def _cuStreamDestroy(self, stream: Any) -> Any:
        assert self.streams.pop(int(stream), None) is not None, f"destroy of unknown stream {stream}"
        return self._ok()[:1]

    def _cuStreamSynchronize(self, stream: Any) -> Any:
        self._advance(int(stream), block=True)
        self.finish(int(stream))
        return self._ok()[:1]

    def _cuStreamQuery(self, stream: Any) -> Any:
        self._advance(int(stream))
        enqueued, done = self.streams[int(stream)]
        return self._ok()[:1] if done >= enqueued else self._err(CUresult.CUDA_ERROR_NOT_READY)[:1]

    def _cuEventCreate(self, flags: int) -> Any:
        handle = next(self._ids)
        self.events[handle] = None
        return self._ok(self._wrap("CUevent", handle))

    def _cuEventDestroy(self, event: Any) -> Any:
        assert int(event) in self.events, f"destroy of unknown event {event}"
        del self.events[int(event)]
        return self._ok()[:1]

    def _cuEventRecord(self, event: Any, stream: Any) -> Any:
        assert int(event) in self.events and int(stream) in self.streams, "record with unknown objects"
        self.events[int(event)] = (int(stream), self.streams[int(stream)][0])
        return self._ok()[:1]

    def _cuEventQuery(self, event: Any) -> Any:
        recorded = self.events[int(event)]
        if recorded is not None:
            self._advance(recorded[0])
        if recorded is None or self.streams[recorded[0]][1] >= recorded[1]:
            return self._ok()[:1]
        return self._err(CUresult.CUDA_ERROR_NOT_READY)[:1]

    def _cuEventSynchronize(self, event: Any) -> Any:
        recorded = self.events[int(event)]
        if recorded is not None:
            self._advance(recorded[0], block=True)
            self.finish(recorded[0])
        return self._ok()[:1]

    def _cuStreamWaitValue32(self, stream: Any, address: Any, value: int, flags: int) -> Any:
        assert int(stream) not in self.waits and flags == 0, "one GEQ wait per stream in this model"
        self.waits[int(stream)] = (int(address), value)
        self.hold(int(stream))
        return self._ok()[:1]

    def _cuMemHostGetDevicePointer(self, address: int, flags: int) -> Any:
        assert int(address) in self.host, "device pointer of memory cuMemHostAlloc did not give"
        return self._ok(self._wrap("CUdeviceptr", int(address)))  # unified addressing: the same address

    def _cuStreamWaitEvent(self, stream: Any, event: Any, flags: int) -> Any:
        assert int(stream) in self.streams and int(event) in self.events
        return self._ok()[:1]

    # --- host memory -------------------------------------------------------------------------------

    def _cuMemHostAlloc(self, nbytes: int, flags: int) -> Any:
        buffer = ctypes.create_string_buffer(nbytes)
        self.host[ctypes.addressof(buffer)] = buffer
        return self._ok(ctypes.addressof(buffer))

    def _cuMemFreeHost(self, address: int) -> Any:
        assert self.host.pop(int(address), None) is not None, f"cuMemFreeHost of unknown 0x{int(address):x}"
        return self._ok()[:1]

    def _cuMemHostRegister(self, address: int, nbytes: int, flags: int) -> Any:
        for start, size in self.registered.items():
            if start < address + nbytes and address < start + size:
                return self._err(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)[:1]
        self.registered[int(address)] = nbytes
        return self._ok()[:1]

    def _cuMemHostUnregister(self, address: int) -> Any:
        if self.registered.pop(int(address), None) is None:
            return self._err(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)[:1]
        return self._ok()[:1]

    # --- device memory -------------------------------------------------------------------------------

    def _new_phys(self, nbytes: int) -> int | None:
        if self.used + nbytes > self.capacity:
            return None
        self.used += nbytes
        pid = next(self._ids)
        self.phys[pid] = nbytes
        return pid

    def _drop_phys_if_unused(self, pid: int) -> None:
        if pid in self.handles.values() or any(p == pid for _, p in self.mappings.values()):
            return
        if pid in self.mallocs.values():
            return
        self.used -= self.phys.pop(pid)
        self.data.pop(pid, None)

    def _cuMemAlloc(self, nbytes: int) -> Any:
        pid = self._new_phys(nbytes)
        if pid is None:
            return self._err(CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        address = next(self._va)
        self.mallocs[address] = pid
        return self._ok(self._wrap("CUdeviceptr", address))

    def _cuMemFree(self, address: Any) -> Any:
        pid = self.mallocs.pop(int(address), None)
        assert pid is not None, f"cuMemFree of unknown 0x{int(address):x}"
        self._drop_phys_if_unused(pid)
        return self._ok()[:1]

    def _cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> Any:
        assert int(prop.type) == 1 and int(prop.location.type) == 1, "granularity of a non-device prop"
        return self._ok(self.granularity)

    def _cuMemAddressReserve(self, size: int, alignment: int, address: Any, flags: int) -> Any:
        assert size % self.granularity == 0 and size <= 1 << 36, f"reserve of {size} bytes"
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
        assert size % self.granularity == 0, f"cuMemCreate of {size} bytes, not whole granules"
        pid = self._new_phys(size)
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
        start, pid = int(address), self.handles[int(handle)]
        assert offset == 0 and size == self.phys[pid], "cuMemMap must map a whole allocation here"
        assert any(r <= start and start + size <= r + s for r, s in self.reservations.items()), \
            "map outside a reservation"
        assert not any(m < start + size and start < m + s for m, (s, _) in self.mappings.items()), "map over a mapping"
        self.mappings[start] = (size, pid)
        return self._ok()[:1]

    def _cuMemUnmap(self, address: Any, size: int) -> Any:
        entry = self.mappings.get(int(address))
        if entry is None or entry[0] != size:  # the driver cannot unmap part of a mapping
            return self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1]
        del self.mappings[int(address)]
        self._drop_phys_if_unused(entry[1])
        return self._ok()[:1]

    def _cuMemSetAccess(self, address: Any, size: int, descs: Any, count: int) -> Any:
        assert len(descs) == count == 1 and int(descs[0].flags) == 3, "access must be read-write for one device"
        self._segments(int(address), size)  # the whole range must be mapped
        return self._ok()[:1]

    def _cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: int) -> Any:
        fd = os.memfd_create("driver-model-chunk", os.MFD_CLOEXEC)
        os.write(fd, self.handles[int(handle)].to_bytes(8, "little"))
        self.exported.append(fd)
        return self._ok(fd)

    def _cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> Any:
        pid = int.from_bytes(os.pread(int(fd), 8, 0), "little")
        assert pid in self.phys, "import of a chunk that no longer exists"
        handle = next(self._ids)
        self.handles[handle] = pid
        return self._ok(self._wrap("CUmemGenericAllocationHandle", handle))

    # --- copies ----------------------------------------------------------------------------------------

    def _segments(self, address: int, nbytes: int) -> list[tuple[bytearray, int, int]]:
        """Return (contents, offset, length) pieces covering a device range, or fail."""
        pieces, cursor, end = [], address, address + nbytes
        while cursor < end:
            for start, pid in self.mallocs.items():
                if start <= cursor < start + self.phys[pid]:
                    break
            else:
                found = [(s, p) for s, (size, p) in self.mappings.items() if s <= cursor < s + size]
                assert found, f"device address 0x{cursor:x} is not mapped"
                start, pid = found[0]
            data = self.data.get(pid)
            if data is None:
                data = self.data[pid] = bytearray(self.phys[pid])
            length = min(end, start + len(data)) - cursor
            pieces.append((data, cursor - start, length))
            cursor += length
        return pieces

    def _gather(self, address: int, nbytes: int) -> bytearray:
        out = bytearray()
        for data, offset, length in self._segments(address, nbytes):
            out += data[offset:offset + length]
        return out

    def _scatter(self, address: int, payload: bytes) -> None:
        done = 0
        for data, offset, length in self._segments(address, len(payload)):
            data[offset:offset + length] = payload[done:done + length]
            done += length

    def _cuMemcpyHtoD(self, dst: Any, src: int, nbytes: int) -> Any:
        self._scatter(int(dst), ctypes.string_at(int(src), nbytes))
        return self._ok()[:1]

    def _cuMemcpyHtoDAsync(self, dst: Any, src: int, nbytes: int, stream: Any) -> Any:
        assert int(stream) in self.streams
        return self._cuMemcpyHtoD(dst, src, nbytes)

    def _cuMemcpyDtoH(self, dst: int, src: Any, nbytes: int) -> Any:
        ctypes.memmove(int(dst), bytes(self._gather(int(src), nbytes)), nbytes)
        return self._ok()[:1]

    def _cuMemcpyDtoHAsync(self, dst: int, src: Any, nbytes: int, stream: Any) -> Any:
        assert int(stream) in self.streams
        return self._cuMemcpyDtoH(dst, src, nbytes)

    def _cuMemsetD8(self, dst: Any, value: int, nbytes: int) -> Any:
        self._scatter(int(dst), bytes([value]) * nbytes)
        return self._ok()[:1]

    def _cuMemsetD8Async(self, dst: Any, value: int, nbytes: int, stream: Any) -> Any:
        assert int(stream) in self.streams
        return self._cuMemsetD8(dst, value, nbytes)
