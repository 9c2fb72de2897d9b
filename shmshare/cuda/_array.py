"""DeviceArray: device memory described for CuPy, torch and numba without a copy.

A :class:`DeviceArray` is a view: an address, a shape, a dtype, strides and
the object that keeps the memory alive (a pool block, an imported buffer).
It speaks the two standard protocols:

- ``__cuda_array_interface__`` (version 3): ``torch.as_tensor(a, device="cuda")``,
  ``cupy.asarray(a)``, ``numba.cuda.as_cuda_array(a)``;
- DLPack (``__dlpack__`` / ``__dlpack_device__``): ``torch.from_dlpack(a)``,
  ``cupy.from_dlpack(a)``; see Note [DLPack with ctypes].

When the array was produced on a stream (``stream=``), a consumer that
passes its own stream to ``__dlpack__`` gets an event recorded on the
producer's stream and waited on by its own (``cuStreamWaitEvent``), as the
DLPack stream rules ask. ``__cuda_array_interface__`` could only carry the
stream for the consumer to wait on, and consumers may ignore it (v3 makes
it optional; numba can be told to), so the producer's stream is
synchronized on the host before the interface is returned, and the
interface names no stream: the data is ready on any stream.

The consumer's stream is also told to the owner when it can take it
(``owner.record_stream``: imported device memory), so that the memory is
not unmapped before the consumer's work on it is done (Note [Imported
memory is unmapped deferred]).

A read-only array is exported through DLPack only as a versioned (1.x)
capsule with the read-only flag (the consumer must pass
``max_version >= (1, 0)``): the unversioned capsule cannot say read-only,
and its consumer would take the memory as writable.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ._context import Context, EventPool, Stream, pool_of, stream_handle
from ._dlpack import CUDA, VERSION, make_capsule
from ._driver import call

__all__ = ["DeviceArray"]

_pools: dict[int, EventPool] = {}  # context handle -> event pool used for DLPack stream hand-offs
_pools_lock = threading.Lock()


class DeviceArray:
    """Describe ``shape`` x ``dtype`` of device memory at ``address``.

    Parameters
    ----------
    address : int
        Device address of element 0.
    shape : int or tuple of int
    dtype : numpy dtype or anything ``numpy.dtype`` takes
    device : int
        Device ordinal the memory lives on.
    strides : tuple of int, optional
        In bytes; None for C order.
    owner : object, optional
        Kept alive as long as this array and every DLPack consumer of it.
    stream : stream object or int handle, optional
        The stream the data was produced on; None when it is ready.
    readonly : bool
        Reported to ``__cuda_array_interface__`` consumers.
    """

    def __init__(self, address: int, shape: Any, dtype: Any = np.uint8, *, device: int = 0,
                 strides: tuple[int, ...] | None = None, owner: Any = None, stream: Any = None,
                 readonly: bool = False) -> None:
        if isinstance(address, bool) or not isinstance(address, int) or address < 0:
            raise ValueError(f"address must be a non-negative int, got {address!r}")
        self.shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        if any(n < 0 for n in self.shape):
            raise ValueError(f"shape must not have negative sizes, got {self.shape}")
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        if strides is not None and len(strides) != len(self.shape):
            raise ValueError(f"strides {strides} do not match shape {self.shape}")
        self.address = address  # device address of element 0
        self.device = device
        self.strides = None if strides is None else tuple(int(s) for s in strides)
        self.owner = owner
        self.stream = None if stream is None else stream_handle(stream)
        self._stream_object = stream if isinstance(stream, Stream) else None  # kept open while the array lives
        self.readonly = readonly

    @property
    def nbytes(self) -> int:
        """Return the bytes spanned by the elements (C order size)."""
        return self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Return the CUDA Array Interface (version 3) description."""
        interface: dict[str, Any] = {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.address, self.readonly),
            "version": 3,
            "strides": self.strides,
            "descr": [("", self.dtype.str)],
        }
        if self.stream is not None:  # consumers may ignore a stream: the data is made ready here
            producer = Context.of_stream(self.stream, Context.primary(self.device))
            with producer.active():
                call("cuStreamSynchronize", self.stream)
        return interface

    def __dlpack_device__(self) -> tuple[int, int]:
        """Return (kDLCUDA, device ordinal)."""
        return (CUDA, self.device)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """Return a ``"dltensor"`` capsule over the memory, ready on the consumer's ``stream``.

        ``stream`` is the consumer's: None or 1 for the legacy default
        stream, 2 for the per-thread one, another handle, or -1 for "do not
        synchronize". A writable array gives an unversioned (DLPack 0.8)
        capsule, which every consumer takes; a read-only one gives a
        versioned capsule with the read-only flag, and needs ``max_version``
        of at least (1, 0).
        """
        if copy:
            raise BufferError("DeviceArray exports its memory without copying; copy=True is not supported")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        if stream == 0:
            raise ValueError("stream=0 is ambiguous for DLPack on CUDA; pass 1 for the legacy default stream")
        versioned = False
        if self.readonly:
            if max_version is None or int(max_version[0]) < VERSION[0]:
                raise BufferError(f"this DeviceArray is read-only, and the consumer asked for a DLPack "
                                  f"{'0.8' if max_version is None else tuple(max_version)} capsule, which cannot "
                                  "say read-only (it would be taken as writable); consume it with a DLPack 1.x "
                                  "consumer (max_version=(1, 0)), or make the array writable")
            versioned = True
        consumer = 1 if stream is None else stream
        if self.stream is not None and stream != -1:
            self._wait_on(consumer)
        if stream != -1:
            record = getattr(self.owner, "record_stream", None)
            if callable(record):
                record(0 if consumer in (1, 2) else consumer)
        return make_capsule(self.address, self.shape, self.dtype, self.strides, CUDA, self.device, self,
                            versioned=versioned, readonly=self.readonly)

    def __repr__(self) -> str:
        return f"<DeviceArray {self.dtype} {self.shape} at 0x{self.address:x} on device {self.device}>"

    def _wait_on(self, consumer: Any) -> None:
        """Make the consumer's stream wait for the producer's: an event of the producer's context."""
        device = Context.primary(self.device)
        producer = Context.of_stream(self.stream, device)
        event = pool_of(_pools, producer, _pools_lock).get().record(self.stream)
        try:
            event.wait_on(stream_handle(consumer), Context.of_stream(consumer, device))
        finally:
            event.release()  # the wait is enqueued; re-recording the event later does not affect it
