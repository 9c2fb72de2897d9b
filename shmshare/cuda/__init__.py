"""CUDA for shmshare: pinned-host and device pools, registered segments, device memory over fds.

Everything here uses the driver API of cuda-python (``cuda.bindings.driver``),
imported on first use (Note [Lazy driver] in ``_driver.py``): importing this
package never needs CUDA, and :func:`available` / :func:`why_unavailable`
say whether it can be used and why not.

- :class:`Context`, :class:`Stream`, :class:`EventPool`, :class:`Event`:
  thin owners of driver objects (``_context.py``).
- :class:`CudaHostProvider`: page-locked memory (``cuMemHostAlloc``, or the
  register path) for :class:`~shmshare.memory.CachingHostAllocator`;
  :func:`host_allocator` is the process-wide pinned pool (``_pinned.py``).
- :func:`register_segment` / :func:`unregister_segment`: page-lock a shm
  segment's mapping once so copies run straight from it (``_register.py``).
- :class:`CudaDeviceProvider`: device memory for
  :class:`~shmshare.memory.CachingAllocator`, classic and expandable
  (``_device.py``, ``_vmm.py``).
- :class:`DeviceArray`: device memory as ``__cuda_array_interface__`` and
  DLPack (``_array.py``, ``_dlpack.py``).
- :func:`send_device_memory` / :func:`recv_device_memory`: device memory to
  another process as fds in ``SCM_RIGHTS`` (``_ipc.py``).
- :func:`finish_releases` / :func:`pending_releases`: releases that
  finalizers and DLPack deleters queued instead of waiting for the GPU
  (``_deferred.py``, Note [Deferred releases]).

Layer: beside ``memory`` (it may import ``memory``, ``wire``, ``segment``
and ``_native``; nothing below imports it). Design notes: ``docs/cuda.md``.
"""

from __future__ import annotations

from ._array import DeviceArray
from ._context import Context, Event, EventPool, Stream, stream_handle
from ._copy import address_of, copy_device_to_host, copy_host_to_device, memset_device
from ._deferred import finish_releases
from ._deferred import pending as pending_releases
from ._device import CudaDeviceProvider
from ._driver import (
    CudaError,
    CudaOutOfMemory,
    CudaUnavailable,
    available,
    why_unavailable,
)
from ._ipc import ImportedDeviceMemory, recv_device_memory, send_device_memory
from ._pinned import CudaHostProvider, host_allocator
from ._register import Registration, register_segment, registered, unregister_segment
from ._vmm import VirtualRange

__all__ = [
    "Context",
    "CudaDeviceProvider",
    "CudaError",
    "CudaHostProvider",
    "CudaOutOfMemory",
    "CudaUnavailable",
    "DeviceArray",
    "Event",
    "EventPool",
    "ImportedDeviceMemory",
    "Registration",
    "Stream",
    "VirtualRange",
    "address_of",
    "available",
    "copy_device_to_host",
    "copy_host_to_device",
    "finish_releases",
    "host_allocator",
    "memset_device",
    "pending_releases",
    "recv_device_memory",
    "register_segment",
    "registered",
    "send_device_memory",
    "stream_handle",
    "unregister_segment",
    "why_unavailable",
]
