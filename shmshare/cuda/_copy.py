"""Copies and fills between host and device memory, for tests, benchmarks and users.

The host side of an asynchronous copy must be page-locked (a pinned pool
block, or a registered segment) for the copy to overlap with other work;
from pageable memory the driver stages the data and the call returns only
once the source can be reused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._context import DEFAULT_STREAMS, Context, stream_handle
from ._driver import call, driver

__all__ = ["address_of", "copy_device_to_host", "copy_host_to_device", "memset_device"]


def copy_host_to_device(dst: Any, src: Any, nbytes: int, *, stream: Any = None,
                        context: Context | None = None) -> None:
    """Copy ``nbytes`` from host ``src`` to device ``dst``; asynchronous on ``stream`` when given."""
    _check_nbytes(nbytes)
    _check_host(src, nbytes, "src", writable=False)
    with _context_for(context, stream, address_of(dst)).active():
        if stream is None:
            call("cuMemcpyHtoD", address_of(dst), address_of(src), nbytes)
        else:
            call("cuMemcpyHtoDAsync", address_of(dst), address_of(src), nbytes, stream_handle(stream))


def copy_device_to_host(dst: Any, src: Any, nbytes: int, *, stream: Any = None,
                        context: Context | None = None) -> None:
    """Copy ``nbytes`` from device ``src`` to host ``dst``; asynchronous on ``stream`` when given."""
    _check_nbytes(nbytes)
    _check_host(dst, nbytes, "dst", writable=True)
    with _context_for(context, stream, address_of(src)).active():
        if stream is None:
            call("cuMemcpyDtoH", address_of(dst), address_of(src), nbytes)
        else:
            call("cuMemcpyDtoHAsync", address_of(dst), address_of(src), nbytes, stream_handle(stream))


def memset_device(dst: Any, value: int, nbytes: int, *, stream: Any = None,
                  context: Context | None = None) -> None:
    """Set ``nbytes`` of device memory at ``dst`` to the byte ``value``."""
    _check_nbytes(nbytes)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"value must be a byte (0..255), got {value!r}")
    with _context_for(context, stream, address_of(dst)).active():
        if stream is None:
            call("cuMemsetD8", address_of(dst), value, nbytes)
        else:
            call("cuMemsetD8Async", address_of(dst), value, nbytes, stream_handle(stream))


def address_of(obj: Any) -> int:
    """Return the address of an int, a block (``.address``), a numpy array or a DeviceArray."""
    if isinstance(obj, bool):
        raise TypeError("an address cannot be a bool")
    if isinstance(obj, int):
        return obj
    if isinstance(obj, np.ndarray):
        return int(obj.__array_interface__["data"][0])
    address = getattr(obj, "address", None)
    if isinstance(address, int):
        return address
    raise TypeError(f"cannot take the address of {type(obj).__name__}: pass an int, a block, "
                    "a numpy array or a DeviceArray")


def _context_for(context: Context | None, stream: Any, device_address: int) -> Context:
    """The context a copy runs in: the one given, the stream's, or the device memory's."""
    if context is not None:
        return context
    if stream is not None and stream_handle(stream) not in DEFAULT_STREAMS:
        return Context.of_stream(stream)
    attribute = driver().CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return Context.primary(int(call("cuPointerGetAttribute", attribute, device_address)))


def _check_host(arr: Any, nbytes: int, name: str, writable: bool) -> None:
    """Refuse a numpy host buffer that the copy would overrun, skip over or write read-only."""
    if not isinstance(arr, np.ndarray):
        return  # an address or a block: the caller vouches for its size
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous: a copy moves one flat range of bytes")
    if nbytes > arr.nbytes:
        raise ValueError(f"{name} holds {arr.nbytes} bytes, {nbytes} were asked to be copied")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only; the device-to-host copy would write into it")


def _check_nbytes(nbytes: Any) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
