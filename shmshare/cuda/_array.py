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
DLPack stream rules ask; the ``__cuda_array_interface__`` carries the
stream instead, for the consumer to wait on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._context import Context, EventPool, stream_handle
from ._dlpack import CUDA, make_capsule

__all__ = ["DeviceArray"]

_pools: dict[int, EventPool] = {}  # context handle -> event pool used for DLPack stream hand-offs


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
        if self.stream is not None:  # v3 forbids 0 as ambiguous: the legacy default stream is 1
            interface["stream"] = self.stream or 1
        return interface

    def __dlpack_device__(self) -> tuple[int, int]:
        """Return (kDLCUDA, device ordinal)."""
        return (CUDA, self.device)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        """Return a ``"dltensor"`` capsule over the memory, ready on the consumer's ``stream``.

        ``stream`` is the consumer's: None or 1 for the legacy default
        stream, 2 for the per-thread one, another handle, or -1 for "do not
        synchronize". ``max_version`` is accepted and an unversioned
        (DLPack 0.8) capsule returned, which consumers take.
        """
        if copy:
            raise BufferError("DeviceArray exports its memory without copying; copy=True is not supported")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        if stream == 0:
            raise ValueError("stream=0 is ambiguous for DLPack on CUDA; pass 1 for the legacy default stream")
        if self.stream is not None and stream != -1:
            self._wait_on(1 if stream is None else stream)
        return make_capsule(self.address, self.shape, self.dtype, self.strides, CUDA, self.device, self)

    def __repr__(self) -> str:
        return f"<DeviceArray {self.dtype} {self.shape} at 0x{self.address:x} on device {self.device}>"

    def _wait_on(self, consumer: Any) -> None:
        context = Context.primary(self.device)
        pool = _pools.get(context.handle)
        if pool is None:
            pool = _pools[context.handle] = EventPool(context)
        event = pool.get().record(self.stream)
        event.wait_on(stream_handle(consumer))
        event.release()  # the wait is enqueued; re-recording the event later does not affect it
