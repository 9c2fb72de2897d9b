"""A bookkeeping model of CUDA devices behind the driver API, to run shmshare.cuda's Python on CPU.

THIS IS NOT A GPU and proves nothing about one. It answers the driver calls
that shmshare.cuda makes from a small in-Python model (devices with their
primary contexts, a context stack per thread, streams whose work runs in
stream order, device memory as bytearrays, virtual ranges, chunks, POSIX fds
carrying a chunk's identity), so that the Python around the calls
(bookkeeping, chunking, all-or-nothing paths, the IPC header and its fds,
error mapping, ordering) runs and is checked here.

The model is meant to be at least as strict as the driver: where the driver
refuses a call, the model refuses it with the same ``CUresult``; where the
driver would misbehave silently (a race between streams, a DMA into memory
no longer pinned, an unregister after munmap), the model raises
AssertionError. tests/cuda/test_driver_model*.py show each rule.

Where cuda-python is installed, every call is also handed to the real
binding first. Without libcuda the binding can only fail for that reason,
*after* converting its arguments: any other exception means shmshare passed
an argument that cuda-python does not accept, and the call fails the test.
Types then come from the real binding too (``CUdeviceptr``, structs, enums).

Test controls: ``DriverModel(real, capacity=, devices=)``; ``hold(stream)`` /
``finish(stream)`` (a long kernel; 0, 1, 2 name the current context's default
streams), ``settle()`` (complete everything), ``pending(stream)``,
``read(address, n)`` (what has landed, forcing nothing), ``capturing()``,
``live()``, ``stale_registrations()``, ``adopt_after_fork()``; settable
``granularity`` (MINIMUM), ``recommended_granularity``, ``capacity``,
``attributes`` (cuDeviceGetAttribute by name or value, 1 otherwise); books
to assert on: ``calls``, ``violations``, ``devices``, ``contexts``,
``streams``, ``events``, ``registered``, ``host``, ``mallocs``, ``mappings``,
``handles``, ``reservations``, ``phys``, ``used``, ``retains``.

The class is spread over three files only to keep each short: this one has
the plumbing, the test controls, devices and contexts;
driver_model_streams.py streams, events, the execution engine and capture
(Note [Stream order in the model]); driver_model_memory.py memory and
copies. All state lives here, in ``DriverModel.__init__``.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import os
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from .driver_model_memory import MemoryMixin, Phys, _covering
from .driver_model_streams import (
    UNSAFE_DURING_CAPTURE,
    CaptureMode,
    CaptureStatus,
    CUresult,
    Event,
    Refused,
    Stream,
    StreamsMixin,
)

__all__ = ["GRANULARITY", "CUresult", "DriverModel", "Phys"]

GRANULARITY = 2 << 20
CONTEXT_BASE = 0xC0C0  # device d's primary context is CONTEXT_BASE + d
_CONTEXT_FREE = {"cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                 "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxGetState", "cuCtxGetCurrent",
                 "cuCtxSetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuDeviceGetAttribute",
                 "cuDeviceTotalMem", "cuDeviceGetUuid", "cuDeviceGetName", "cuMemGetAllocationGranularity",
                 "cuStreamGetCtx", "cuPointerGetAttribute", "cuThreadExchangeStreamCaptureMode"}
# Calls whose only output is the CUresult: a refusal returns (code,), others (code, None).
_NO_OUTPUT = {"cuInit", "cuDevicePrimaryCtxRelease", "cuCtxSetCurrent", "cuCtxPushCurrent", "cuCtxSynchronize",
              "cuStreamDestroy", "cuStreamSynchronize", "cuStreamQuery", "cuStreamWaitValue32",
              "cuStreamWaitEvent", "cuStreamBeginCapture", "cuGraphDestroy", "cuEventDestroy", "cuEventRecord",
              "cuEventQuery", "cuEventSynchronize", "cuMemFreeHost", "cuMemHostRegister", "cuMemHostUnregister",
              "cuMemFree", "cuMemAddressFree", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
              "cuMemcpyHtoD", "cuMemcpyHtoDAsync", "cuMemcpyDtoH", "cuMemcpyDtoHAsync", "cuMemsetD8",
              "cuMemsetD8Async"}


@dataclass(eq=False)
class Device:
    """One device of the model."""

    ordinal: int
    context: int  # its primary context's handle
    capacity: int  # bytes of device memory
    used: int = 0  # bytes of it allocated
    retains: int = 0  # cuDevicePrimaryCtxRetain minus cuDevicePrimaryCtxRelease
    ever_retained: bool = False
    uuid: bytes = field(default=bytes(16))


@dataclass(eq=False)
class Context:
    """A primary context and its default streams."""

    handle: int
    device: int
    legacy: Stream  # the legacy default stream (handles 0 and CU_STREAM_LEGACY)
    per_thread: Stream  # CU_STREAM_PER_THREAD (one per context here, not one per thread)


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
        CUstreamCaptureStatus=CaptureStatus, CUstreamCaptureMode=CaptureMode,
        CUmemAllocationType=ns(CU_MEM_ALLOCATION_TYPE_PINNED=1),
        CUmemLocationType=ns(CU_MEM_LOCATION_TYPE_DEVICE=1),
        CUmemAccess_flags=ns(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3),
        CUmemAllocationHandleType=ns(CU_MEM_HANDLE_TYPE_NONE=0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1),
        CUmemAllocationGranularity_flags=ns(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0,
                                            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1),
        CUdevice_attribute=enum.IntEnum("CUdevice_attribute", {  # an enum: attributes are looked up by name
            "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 102,
            "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": 103,
            "CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED": 113}),
        CUpointer_attribute=ns(CU_POINTER_ATTRIBUTE_CONTEXT=1, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9),
        CUstream_flags=ns(CU_STREAM_DEFAULT=0, CU_STREAM_NON_BLOCKING=1),
        CUevent_flags=ns(CU_EVENT_DEFAULT=0, CU_EVENT_BLOCKING_SYNC=1, CU_EVENT_DISABLE_TIMING=2,
                         CU_EVENT_INTERPROCESS=4),
        CU_STREAM_LEGACY=1, CU_STREAM_PER_THREAD=2,
        CU_MEMHOSTALLOC_PORTABLE=1, CU_MEMHOSTALLOC_DEVICEMAP=2, CU_MEMHOSTALLOC_WRITECOMBINED=4,
        CU_MEMHOSTREGISTER_PORTABLE=1, CU_MEMHOSTREGISTER_DEVICEMAP=2, CU_MEMHOSTREGISTER_IOMEMORY=4,
        CU_MEMHOSTREGISTER_READ_ONLY=8,
    )


class DriverModel(StreamsMixin, MemoryMixin):
    """Answer driver calls from a model of ``devices`` devices (see the module docstring).

    Parameters
    ----------
    real : module or None
        cuda.bindings.driver, for signature checks and types; None for stand-ins.
    capacity : int
        Bytes of memory of each device.
    devices : int
        How many devices there are.
    """

    def __init__(self, real: Any = None, capacity: int = 1 << 32, devices: int = 1) -> None:
        self.real = real
        self.types = real if real is not None else _standins()
        self.pid = os.getpid()  # a forked child may not use CUDA
        self.granularity = GRANULARITY  # MINIMUM; tests may shrink it for many cheap chunks
        self.recommended_granularity = GRANULARITY  # RECOMMENDED
        self.attributes: dict[int | str, int] = {}  # cuDeviceGetAttribute by int value or name; default 1
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.violations: list[str] = []  # races found (also raised as AssertionError where found)
        self._lock = threading.Lock()  # one call at a time (released while a wait polls)
        self._tls = threading.local()
        self._ids = itertools.count(0x1000)
        self._seq = itertools.count()
        self._va = itertools.count(0x7000_0000_0000, 1 << 36)  # one 64 GiB slot per reservation
        self._keep: list[Any] = []  # ctypes buffers behind the real binding's CUuuid and CUipcEventHandle
        self.devices = [Device(d, CONTEXT_BASE + d, capacity, uuid=bytes([d]) * 16) for d in range(devices)]
        self.contexts = {d.context: Context(d.context, d.ordinal, Stream(0, d.context, True, legacy=True),
                                            Stream(2, d.context, True)) for d in self.devices}
        self.streams: dict[int, Stream] = {}  # cuStreamCreate'd, not yet destroyed
        self.events: dict[int, Event] = {}
        self.graphs: dict[int, list[Any]] = {}  # cuStreamEndCapture's graphs -> captured operations
        self._queues: set[Stream] = set()  # streams with pending work, destroyed ones included
        self.phys: dict[int, Phys] = {}  # physical allocation id -> allocation
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
            if os.getpid() != self.pid:  # CUDA does not survive fork()
                return self._refusal(name, CUresult.CUDA_ERROR_NOT_INITIALIZED)
            self.calls.append((name, args))
            self._check_signature(name, args)
            with self._lock:
                try:
                    self._progress()  # a host word may have been written since the last call
                    if name not in _CONTEXT_FREE:
                        self._check_current()
                    if name in UNSAFE_DURING_CAPTURE:
                        self._refuse_if_capturing(name)
                    return impl(self, *args)
                except Refused as refused:
                    return self._refusal(name, refused.code)

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

    def _refusal(self, name: str, code: int) -> tuple[Any, ...]:
        out = self._err(code)
        return out[:1] if name in _NO_OUTPUT else out

    def _wrap(self, kind: str, value: int) -> Any:
        return getattr(self.real, kind)(value) if self.real is not None else value

    def _stack(self) -> list[int]:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _current(self) -> int:
        stack = self._stack()
        return stack[-1] if stack else 0

    def _check_current(self) -> None:
        """Refuse a call that needs a context when none is current, or the current one was released."""
        context = self.contexts.get(self._current())
        if context is None:
            raise Refused(CUresult.CUDA_ERROR_INVALID_CONTEXT)
        if not self.devices[context.device].retains:  # its last release reset it
            raise Refused(CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)

    def _attribute(self, value: int, name: str) -> int:
        return self.attributes.get(name, self.attributes.get(value, 1))

    # --- test controls ----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes of memory of device 0; setting it sets every device's."""
        return self.devices[0].capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        for device in self.devices:
            device.capacity = value

    @property
    def used(self) -> int:
        """Bytes of device memory allocated, over all devices."""
        return sum(d.used for d in self.devices)

    @property
    def retains(self) -> int:
        """Primary context retains not yet released, over all devices."""
        return sum(d.retains for d in self.devices)

    def _control_stream(self, stream: int) -> Stream:
        number = int(stream)
        if number in (0, 1, 2):
            context = self.contexts.get(self._current(), self.contexts[CONTEXT_BASE])
            return context.legacy if number != 2 else context.per_thread
        return self.streams[number]

    def hold(self, stream: int) -> None:
        """Enqueue on ``stream`` a long kernel, which runs until ``finish`` (or a synchronous wait).

        0, 1 and 2 name the current context's default streams (device 0's when none is current).
        """
        with self._lock:
            self._enqueue(self._control_stream(stream), "hold (a long kernel)", held=True)

    def finish(self, stream: int) -> None:
        """End the long kernels held on ``stream``, and run what can run."""
        with self._lock:
            for op in self._control_stream(stream).queue:
                op.held = False
            self._progress()

    def settle(self) -> None:
        """Complete all work of every context, as a cuCtxSynchronize on each would."""
        with self._lock:
            self._force([op for s in list(self._queues) for op in s.queue], "settle()")

    def pending(self, stream: int) -> list[str]:
        """Return the labels of the operations not yet executed on ``stream``."""
        with self._lock:
            self._progress()
            return [op.label for op in self._control_stream(stream).queue]

    def capturing(self) -> list[int]:
        """Return the handles of the streams capturing now."""
        return [s.handle for s in self.streams.values() if s.capture is not None]

    def adopt_after_fork(self) -> None:
        """Serve this (forked) process from now on, as if it had initialized CUDA itself.

        For tests whose forked child plays another process; a real driver would
        not survive the fork (every call from a child otherwise returns
        CUDA_ERROR_NOT_INITIALIZED).
        """
        self.pid = os.getpid()
        self._lock = threading.Lock()

    def read(self, address: int, nbytes: int) -> bytes:
        """Return the device bytes that have landed (through mappings), forcing nothing."""
        with self._lock:
            self._progress()
            return self._gather(self._segments(address, nbytes))

    def stale_registrations(self) -> list[tuple[int, int]]:
        """Return the registered ranges no longer (wholly) mapped: munmapped while pinned, a stale DMA target."""
        return [(start, size) for start, size in self.registered.items() if _covering(start, size) is None]

    def live(self) -> dict[str, int]:
        """Return counts of what is still allocated, for leak assertions."""
        return {"mallocs": len(self.mallocs), "host": len(self.host), "registered": len(self.registered),
                "reservations": len(self.reservations), "mappings": len(self.mappings),
                "handles": len(self.handles), "phys": len(self.phys)}

    # --- init, devices, contexts ---------------------------------------------------------------

    def _cuInit(self, flags: int) -> Any:
        return self._ok()[:1]

    def _cuDeviceGetCount(self) -> Any:
        return self._ok(len(self.devices))

    def _cuDeviceGet(self, ordinal: int) -> Any:
        return self._ok(self._wrap("CUdevice", self._device_arg(ordinal)))

    def _cuDevicePrimaryCtxRetain(self, dev: Any) -> Any:
        device = self.devices[self._device_arg(dev)]
        device.retains += 1
        device.ever_retained = True
        return self._ok(self._wrap("CUcontext", device.context))

    def _cuDevicePrimaryCtxRelease(self, dev: Any) -> Any:
        device = self.devices[self._device_arg(dev)]
        assert device.retains > 0, "primary context released more often than retained"
        device.retains -= 1
        return self._ok()[:1]

    def _cuDevicePrimaryCtxGetState(self, dev: Any) -> Any:
        device = self.devices[self._device_arg(dev)]
        return self._ok(0, int(device.retains > 0))

    def _context_arg(self, ctx: Any) -> int:
        handle = int(ctx)
        if handle not in self.contexts:
            raise Refused(CUresult.CUDA_ERROR_INVALID_CONTEXT)
        return handle

    def _cuCtxGetCurrent(self) -> Any:
        return self._ok(self._wrap("CUcontext", self._current()))

    def _cuCtxSetCurrent(self, ctx: Any) -> Any:
        stack = self._stack()
        if int(ctx) == 0:  # unbind: pop the top, if any
            if stack:
                stack.pop()
            return self._ok()[:1]
        handle = self._context_arg(ctx)
        if stack:
            stack[-1] = handle
        else:
            stack.append(handle)
        return self._ok()[:1]

    def _cuCtxPushCurrent(self, ctx: Any) -> Any:
        self._stack().append(self._context_arg(ctx))
        return self._ok()[:1]

    def _cuCtxPopCurrent(self) -> Any:
        stack = self._stack()
        if not stack:
            return self._err(CUresult.CUDA_ERROR_INVALID_CONTEXT)
        return self._ok(self._wrap("CUcontext", stack.pop()))

    def _cuCtxGetDevice(self) -> Any:
        return self._ok(self._wrap("CUdevice", self.contexts[self._current()].device))

    def _cuDeviceGetAttribute(self, attribute: Any, dev: Any) -> Any:
        self._device_arg(dev)
        return self._ok(self._attribute(int(attribute), getattr(attribute, "name", "")))

    def _cuDeviceTotalMem(self, dev: Any) -> Any:
        return self._ok(self.devices[self._device_arg(dev)].capacity)

    def _cuDeviceGetUuid(self, dev: Any) -> Any:
        raw = self.devices[self._device_arg(dev)].uuid
        if self.real is None:
            return self._ok(types.SimpleNamespace(bytes=raw))
        buffer = ctypes.create_string_buffer(raw, 16)
        self._keep.append(buffer)  # the CUuuid points into it
        return self._ok(self.real.CUuuid(ctypes.addressof(buffer)))

    def _cuDeviceGetName(self, length: int, dev: Any) -> Any:
        self._device_arg(dev)
        return self._ok(b"driver model\0")
