"""Helpers of the tests that call the driver model directly (test_driver_model*.py)."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .driver_model import DriverModel

MiB = 1 << 20
INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED, INVALID_DEVICE, INVALID_CONTEXT = 1, 2, 3, 101, 201
INVALID_HANDLE, ILLEGAL_STATE, NOT_READY, CONTEXT_IS_DESTROYED = 400, 401, 600, 709
ALREADY_REGISTERED, NOT_PERMITTED, NOT_SUPPORTED = 712, 800, 801
CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED, CAPTURE_IMPLICIT = 900, 901, 906
NON_BLOCKING = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def code(out: tuple[Any, ...]) -> int:
    """Return the CUresult of a call's outputs as an int."""
    return int(out[0])


def ok(out: tuple[Any, ...]) -> Any:
    """Assert success; return the call's one output (or the tuple of several, None for none)."""
    assert code(out) == 0, out
    values = out[1:]
    return None if not values else values[0] if len(values) == 1 else values


def enter(model: DriverModel, device: int = 0) -> Any:
    """Retain ``device``'s primary context and push it; return it."""
    ctx = ok(model.cuDevicePrimaryCtxRetain(ok(model.cuDeviceGet(device))))
    ok(model.cuCtxPushCurrent(ctx))
    return ctx


def stream(model: DriverModel, flags: int = 0) -> Any:
    return ok(model.cuStreamCreate(flags))


def device_buffer(model: DriverModel, nbytes: int = 4096) -> Any:
    return ok(model.cuMemAlloc(nbytes))


def pinned(model: DriverModel, nbytes: int = 4096) -> int:
    """Return cuMemHostAlloc'd (page-locked) memory, zeroed."""
    return int(ok(model.cuMemHostAlloc(nbytes, 0)))


def pageable(nbytes: int = 4096, fill: int = 0) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(bytes([fill]) * nbytes, nbytes)


def fill(address: int, value: int, nbytes: int = 4096) -> None:
    ctypes.memset(address, value, nbytes)


@contextmanager
def mapping(nbytes: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> Iterator[int]:
    """Map ``nbytes`` of anonymous memory with ``prot``; yield its address; unmap it after."""
    address = map_anonymous(nbytes, prot)
    try:
        yield address
    finally:
        unmap(address, nbytes)


def map_anonymous(nbytes: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> int:
    address = _libc.mmap(None, nbytes, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    return int(address)


def unmap(address: int, nbytes: int) -> None:
    assert _libc.munmap(address, nbytes) == 0, ctypes.get_errno()


def begin_global_capture(model: DriverModel, stream: Any) -> None:
    """Start a GLOBAL-mode capture on a shmshare Stream (its context made current)."""
    stream.context.make_current()
    (err,) = model.cuStreamBeginCapture(stream.handle, model.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    assert int(err) == 0


def end_capture(model: DriverModel, stream: Any) -> int:
    """End the capture on a shmshare Stream; return the CUresult (901: it was invalidated)."""
    stream.context.make_current()
    return int(model.cuStreamEndCapture(stream.handle)[0])
