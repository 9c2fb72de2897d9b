"""Helpers of the GPU tests: a stream held busy on demand, the child that sends device memory,
torch's CUDA warmed up before a leak check, and whether host memory is page-locked."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np
import pytest

from shmshare import cuda, wire
from shmshare.cuda import _driver
from shmshare.testing import pattern

_PORTABLE_DEVICEMAP = 1 | 2  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
WATCHDOG = 60.0  # s: a stream is never held longer, so a failing test cannot hang a synchronize


class BusyStream:
    """A real stream that waits (``cuStreamWaitValue32``) on a pinned word until ``release()``.

    Work and events enqueued on it after construction do not complete until
    the host writes the word, which makes "this block is still in use on
    another stream" deterministic on a real GPU. A watchdog writes it after
    ``WATCHDOG`` seconds in any case: every wait on the stream is bounded.
    """

    def __init__(self, context: cuda.Context) -> None:
        self.stream = cuda.Stream(context)
        context.make_current()
        self._word = int(_driver.call("cuMemHostAlloc", 4, _PORTABLE_DEVICEMAP))
        ctypes.c_uint32.from_address(self._word).value = 0
        device_word = _driver.call("cuMemHostGetDevicePointer", self._word, 0)
        try:
            _driver.call("cuStreamWaitValue32", self.stream.handle, device_word, 1, _WAIT_GEQ)
        except cuda.CudaError as exc:
            self.close()
            pytest.skip(f"stream memory operations are not usable here: {exc}")
        self.held = True
        self._watchdog = threading.Timer(WATCHDOG, self._write)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _write(self) -> None:
        if self._word:
            ctypes.c_uint32.from_address(self._word).value = 1

    @property
    def handle(self) -> int:
        return self.stream.handle

    def release(self) -> None:
        """Let the stream run, and wait for it."""
        if self._word:
            self._write()
            self.stream.synchronize()
        self.held = False

    def close(self) -> None:
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.cancel()
        self.release()
        self.stream.close()
        word, self._word = self._word, 0
        if word:
            _driver.call("cuMemFreeHost", word)


def read_device(address: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    cuda.copy_device_to_host(out, address, nbytes)
    return out


def send_pattern_then_exit(conn: wire.Connection, nbytes: int, seed: int, config: str) -> None:
    """Child (spawned): fill device memory on a stream, send it by fd, wait for the ack, exit at once.

    The copy is queued on a non-blocking stream and not waited for here:
    ``send_device_memory(stream=)`` must order the send after it.
    """
    from shmshare.memory import CachingAllocator

    provider = cuda.CudaDeviceProvider(ipc=True)
    allocator = CachingAllocator(provider, config)
    stream = cuda.Stream(provider.context)
    block = allocator.malloc(nbytes, stream=stream)
    data = pattern(seed, nbytes, np.uint8)
    cuda.copy_host_to_device(block.address, data, nbytes, stream=stream)
    cuda.send_device_memory(conn, provider, block, nbytes, stream=stream, meta={"seed": seed}, timeout=60)
    reply: Any = conn.recv(timeout=120)[0]
    os._exit(0 if reply == {"imported": True} else 3)  # no cleanup: the receiver must not need us


def torch_with_cuda() -> Any:
    """Return torch when it is installed with a usable CUDA, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def warm_torch() -> None:
    """Open what torch's CUDA keeps for the whole process (its context state, allocators, pinned
    pool) before a test's first leak check, as tests/cuda/conftest.py's ``warm_driver`` does for
    the driver: lazily opened fds are not a test's leak. Nothing without torch with CUDA."""
    torch = torch_with_cuda()
    if torch is None:
        return
    torch.cuda.init()
    host = torch.ones(1 << 20, dtype=torch.uint8, pin_memory=True)  # torch's pinned host allocator
    device = host.to("cuda", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert int(device.sum().item()) == 1 << 20
    del host, device


def page_locked(address: int) -> bool:
    """Return whether host ``address`` lies in page-locked memory (registered or cuMemHostAlloc'd).

    On a GPU: ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`` is host memory (pageable
    memory is CUDA_ERROR_INVALID_VALUE), what torch's ``is_pinned()`` asks the runtime. Over the
    driver model (a smoke run): the model's books.
    """
    drv = _driver.driver()
    registered = getattr(drv, "registered", None)
    if isinstance(registered, dict):  # tests/cuda/driver_model.py: no pointer attributes there
        host = getattr(drv, "host", {})
        return any(start <= address < start + size for start, size in registered.items()) or address in host
    try:
        kind = _driver.call("cuPointerGetAttribute", drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                            address)
    except cuda.CudaError:
        return False
    return int(kind) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST)
