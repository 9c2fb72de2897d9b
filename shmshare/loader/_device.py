"""``device="cuda:N"``: batches delivered in device memory, copied one batch ahead on a side stream.

Beyond torch's loader (its users call ``.to(device, non_blocking=True)`` on
each batch themselves). The main process copies each received batch's
arrays host-to-device on a stream of its own, as soon as the batch before
it is handed out, so the copy of batch k+1 overlaps the program's work on
batch k. Device memory comes from a caching allocator over
``CudaDeviceProvider``. The host batch (pinned where it lies, Note [Fenced
releases]) is held until an event after its copies has completed, and only
then dropped, so its blocks go back to the worker once the device has read
them. Each device array is made on the side stream (``stream=`` of the
``DeviceArray``: a DLPack consumer's stream waits for it, and
``__cuda_array_interface__`` synchronizes it first); torch gets tensors
through DLPack.

A device array dropped by the program gives its block back at the next
batch (its finalizer only queues it: it may run at any bytecode), used on
the legacy default stream as far as the allocator knows.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import numpy as np

from ..tensors import as_numpy

__all__ = ["DeviceCopier", "parse_device"]


def parse_device(device: Any) -> int | None:
    """Return the CUDA ordinal of ``device`` ("cuda", "cuda:1", 1, a torch.device), or None for
    the CPU (None, "cpu", "cpu:0", torch.device("cpu")): batches stay where workers made them."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        if device >= 0:
            return device
        raise ValueError(f"device ordinal must be >= 0, got {device!r}")
    text = str(device).strip()
    kind, _, index = text.partition(":")
    if kind == "cpu" and (not index or index.isdigit()):
        return None
    if kind == "cuda" and (not index or index.isdigit()):
        return int(index) if index else 0
    if kind in _TORCH_DEVICE_TYPES:
        raise ValueError(f"device={device!r}: the loader copies batches to CUDA devices only; "
                         "leave device unset and move each batch yourself (batch.to(device))")
    raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N', a device ordinal or a "
                     f"torch.device, got {device!r}")


# the other device types torch names (torch.device accepts them): refused with the fix
_TORCH_DEVICE_TYPES = frozenset({"mps", "xpu", "xla", "meta", "hpu", "ipu", "mtia", "privateuseone",
                                 "lazy", "vulkan", "mkldnn", "opengl", "opencl", "ideep", "hip",
                                 "ve", "fpga", "maia"})


class DeviceCopier:
    """One loader iterator's copies to device ``device``."""

    def __init__(self, device: int, use_torch: bool) -> None:
        from .. import cuda
        from ..cuda._deferred import release_later
        from ..memory import CachingAllocator

        self._cuda = cuda
        self._release_later = release_later  # imported here, not in a finalizer
        self.context = cuda.Context.primary(device)
        self.stream = cuda.Stream(self.context)
        self.provider = cuda.CudaDeviceProvider(device, context=self.context)
        self.alloc = CachingAllocator(self.provider, "expandable_segments:False")
        self.events = cuda.EventPool(self.context)
        self.use_torch = use_torch
        self.inflight: collections.deque[tuple[Any, list[Any]]] = collections.deque()
        self.dead: collections.deque[Any] = collections.deque()  # blocks of dropped arrays
        self.live = 0  # device arrays handed out and not yet dropped
        self.closed = False

    def copy(self, arrays: list[Any]) -> list[Any]:
        """Start copying `arrays` (numpy arrays or CPU tensors) to the device; return them there."""
        self.poll()
        out = []
        for a in arrays:
            host, _ = as_numpy(a)  # a tensor of a dtype numpy lacks (bfloat16) as same-size ints
            torch_dtype = None if isinstance(a, np.ndarray) else a.dtype
            if not host.flags.c_contiguous:
                host = np.ascontiguousarray(host)
            out.append(self._one(host, torch_dtype))
        event = self.events.get().record(self.stream)
        self.inflight.append((event, arrays))  # the host batch goes when its copies are done
        return out

    def _one(self, host: np.ndarray, torch_dtype: Any) -> Any:
        nbytes = host.nbytes
        block = self.alloc.malloc(max(nbytes, 1), stream=self.stream)
        if nbytes:
            self._cuda.copy_host_to_device(block.address, host, nbytes, stream=self.stream,
                                           context=self.context)
        dev = self.provider.array(block, host.shape, host.dtype, stream=self.stream)
        weakref.finalize(dev, self._dropped, block)  # holds us: the pool lives while arrays do
        self.live += 1
        if torch_dtype is None:
            return dev
        import torch

        t = torch.utils.dlpack.from_dlpack(dev)
        return t if t.dtype == torch_dtype else t.view(torch_dtype)

    def _dropped(self, block: Any) -> None:
        """A device array's finalizer (any bytecode): queue its block for the next copy, or, once
        closed, for the next drain of the deferred releases (Note [Deferred releases]). Never
        freed here: a collection inside a driver or allocator call of this thread would call
        back into it (a deadlock seen with the test's driver model)."""
        self.live -= 1
        self.dead.append(block)
        if self.closed:  # (checked after the append: a close() meanwhile has drained no more)
            self._release_later("a closed loader's device blocks", self._free_closed)

    def _free_closed(self) -> None:
        while self.dead:  # closed: nothing else uses this pool any more; each block freed once
            self._free(self.dead.popleft())
        if not self.live:
            self.alloc.empty_cache()

    def _free(self, block: Any) -> None:
        self.alloc.record_stream(block, self.provider.default_stream())
        self.alloc.free(block)

    def poll(self) -> None:
        """Drop host batches whose copies completed; free device blocks of dropped arrays."""
        while self.inflight and self.inflight[0][0].query():
            self.inflight.popleft()
        while self.dead:
            self._free(self.dead.popleft())

    def close(self) -> None:
        """Wait for the copies, give the host batches back; device arrays still held stay valid."""
        if self.closed:
            return
        self.closed = True
        self.stream.synchronize()
        self.inflight.clear()
        self.poll()
        self.events.close()
        if not self.live:
            self.alloc.empty_cache()
