"""Issue 11 over the strict driver model: releases from finalizers, graph capture, failure paths. NOT a GPU.

Each test here failed before its fix, on the model that refuses what the
driver refuses (tests/cuda/test_driver_model.py shows each of its rules).
"""

from __future__ import annotations

import ctypes
import gc
import os

import numpy as np
import pytest

from shmshare import Segment, cuda, wire
from shmshare.cuda import _vmm
from shmshare.memory._host import CachingHostAllocator
from shmshare.segment import Flags
from shmshare.testing import wait_exit

from .driver_model import CUresult, DriverModel
from .model_calls import begin_global_capture, end_capture

MiB = 1 << 20


_global_capture, _end_capture = begin_global_capture, end_capture


# --- 2. registered memory is unpinned before it is unmapped ------------------------------------------


@pytest.mark.parametrize("register", [True, False], ids=["register path", "cuMemHostAlloc"])
def test_a_pinned_pool_dropped_without_close_unpins_its_memory(driver_model: DriverModel, register: bool) -> None:
    # Was a defect: dropping the provider and pool let the mmap's own finalizer munmap pages still
    # registered (the model refuses an unregister of unmapped memory, and the range stayed registered),
    # and cuMemHostAlloc blocks just leaked.
    provider = cuda.CudaHostProvider(register=register)
    pool = CachingHostAllocator(provider, "")
    kept = pool.allocate(MiB)
    pool.free(pool.allocate(2 * MiB))  # cached, not given back
    del kept, pool, provider
    gc.collect()
    cuda.finish_releases()
    assert driver_model.live()["registered"] == 0 and driver_model.live()["host"] == 0
    assert not cuda.pending_releases()


def test_the_register_path_keeps_its_pages_out_of_forked_children(driver_model: DriverModel) -> None:
    # Was a defect: no advice, so a fork made the pinned private pages copy-on-write and the parent's
    # first write moved its page away from the one the DMA engine targets. With MADV_WIPEONFORK the
    # child has zero pages of its own at the address (and its copy of the mmap unmaps only those).
    provider = cuda.CudaHostProvider(register=True)
    address, handle = provider.allocate(MiB)
    ctypes.memset(address, 0xAB, MiB)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if ctypes.string_at(address, 4096) == bytes(4096) else 1)
    assert wait_exit(pid) == 0, "the child shares the parent's registered pages"
    assert ctypes.string_at(address, 4) == b"\xab" * 4
    provider.free(handle)
    provider.close()


# --- 5. no synchronize from finalizers or deleters during graph capture --------------------------------


def test_imported_memory_dropped_during_a_capture_does_not_break_it(driver_model: DriverModel,
                                                                    pipe: tuple[wire.Connection, wire.Connection]
                                                                    ) -> None:
    # Was a defect: the last holder's finalizer ran cuCtxSynchronize, which fails during a capture with
    # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates it (and the range was never unmapped).
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle = provider.allocate(2 * MiB)
    cuda.send_device_memory(pipe[0], provider, address, 2 * MiB, timeout=10)
    imported = cuda.recv_device_memory(pipe[1], timeout=10)
    arr = imported.array()
    imported.close()
    capturing = cuda.Stream(non_blocking=False)  # blocking: the legacy stream is part of its capture
    _global_capture(driver_model, capturing)
    del arr
    gc.collect()  # the unmap is queued: the legacy stream cannot be fenced while it captures
    assert cuda.pending_releases() and driver_model.live()["mappings"] > 1
    assert _end_capture(driver_model, capturing) == 0, "a finalizer invalidated the capture"
    cuda.finish_releases()
    assert not cuda.pending_releases()
    capturing.close()
    provider.free(handle)
    provider.close()
    assert driver_model.live()["mappings"] == 0


def test_a_registered_segment_collected_during_a_capture_does_not_break_it(driver_model: DriverModel) -> None:
    segment = Segment.create(MiB)
    cuda.register_segment(segment)
    capturing = cuda.Stream(non_blocking=False)
    _global_capture(driver_model, capturing)
    del segment
    gc.collect()
    assert driver_model.live()["registered"] == 1  # queued: no wait, no unregister during the capture
    assert _end_capture(driver_model, capturing) == 0, "a finalizer invalidated the capture"
    cuda.finish_releases()
    assert driver_model.live()["registered"] == 0
    capturing.close()


def test_a_dlpack_deleter_waits_for_the_consumers_stream_without_blocking(
        driver_model: DriverModel, pipe: tuple[wire.Connection, wire.Connection]) -> None:
    # The consumer's stream is fenced: the unmap waits for its work, and the deleter does not block on it.
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle = provider.allocate(2 * MiB)
    cuda.send_device_memory(pipe[0], provider, address, 2 * MiB, timeout=10)
    imported = cuda.recv_device_memory(pipe[1], timeout=10)
    consumer = cuda.Stream()
    capsule = imported.array().__dlpack__(stream=consumer.handle)
    imported.close()
    driver_model.hold(consumer.handle)  # the consumer's kernel on the memory
    del capsule  # never consumed: its destructor runs the deleter, as a consumer's release would
    gc.collect()
    assert cuda.pending_releases(), "unmapped while the consumer's stream may still read it"
    driver_model.finish(consumer.handle)
    cuda.finish_releases()
    assert not cuda.pending_releases()
    consumer.close()
    provider.free(handle)
    provider.close()


# --- 6. failure paths keep track of what is still mapped -----------------------------------------------


def test_an_imported_range_whose_unmap_fails_is_retried(driver_model: DriverModel,
                                                        pipe: tuple[wire.Connection, wire.Connection],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Was a defect: the finalizer swallowed the error and the imported range was never closed.
    provider = cuda.CudaDeviceProvider(ipc=True)
    address, handle = provider.allocate(2 * MiB)
    cuda.send_device_memory(pipe[0], provider, address, 2 * MiB, timeout=10)
    imported = cuda.recv_device_memory(pipe[1], timeout=10)
    real_unmap = DriverModel._cuMemUnmap
    monkeypatch.setattr(DriverModel, "_cuMemUnmap", lambda self, a, n: self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1])
    del imported
    gc.collect()
    with pytest.raises(cuda.CudaError, match="cuMemUnmap"):
        cuda.finish_releases()
    assert any("failed" in p for p in cuda.pending_releases())  # kept, not forgotten
    monkeypatch.setattr(DriverModel, "_cuMemUnmap", real_unmap)
    cuda.finish_releases()
    provider.free(handle)
    provider.close()
    assert driver_model.live()["mappings"] == 0 and driver_model.live()["reservations"] == 0


def test_a_chunk_whose_unmap_fails_stays_in_the_books(driver_model: DriverModel,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Was a defect: the chunk left the books before cuMemUnmap, so a failed unmap lost a mapped handle.
    ctx = cuda.Context.primary(0)
    vrange = _vmm.VirtualRange(ctx, 4 * MiB, 2 * MiB, shareable=False)
    vrange.map(0, 4 * MiB)
    real_unmap = DriverModel._cuMemUnmap
    monkeypatch.setattr(DriverModel, "_cuMemUnmap", lambda self, a, n: self._err(CUresult.CUDA_ERROR_INVALID_VALUE)[:1])
    with pytest.raises(cuda.CudaError, match="cuMemUnmap"):
        vrange.unmap(0, 2 * MiB)
    assert 0 in vrange.chunks  # still mapped, still known
    with pytest.raises(cuda.CudaError):
        vrange.close()
    monkeypatch.setattr(DriverModel, "_cuMemUnmap", real_unmap)
    vrange.close()  # the retry unmaps both chunks and frees the range
    assert driver_model.live() == {k: 0 for k in driver_model.live()}


# --- 7. the smaller items ------------------------------------------------------------------------------


def test_a_read_only_segment_on_a_device_without_read_only_register_is_refused_by_name(
        driver_model: DriverModel) -> None:
    driver_model.attributes["CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED"] = 0
    with Segment.create(MiB) as seg:
        reader = Segment.from_fd(seg.fd, flags=Flags.FROMFD | Flags.READONLY)
        with pytest.raises(cuda.CudaError, match="READ_ONLY_HOST_REGISTER_SUPPORTED"):
            cuda.register_segment(reader)
        reader.close()
    assert not [c for c, _ in driver_model.calls if c == "cuMemHostRegister"]


def test_chunks_are_the_recommended_granularity(driver_model: DriverModel) -> None:
    driver_model.granularity = 1 * MiB  # MINIMUM
    driver_model.recommended_granularity = 2 * MiB
    assert cuda.CudaDeviceProvider(ipc=True).chunk_size == 2 * MiB
    driver_model.recommended_granularity = 4 * MiB  # does not divide the core's 2 MiB page: MINIMUM then
    assert cuda.CudaDeviceProvider(ipc=True).chunk_size == 1 * MiB


def test_a_dlpack_read_only_device_array_is_not_exported_writable(driver_model: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider()
    address, handle = provider.allocate(MiB)
    arr = cuda.DeviceArray(address, (MiB,), np.uint8, readonly=True)
    with pytest.raises(BufferError, match="read-only"):
        arr.__dlpack__(stream=1)
    assert "dltensor_versioned" in repr(arr.__dlpack__(stream=1, max_version=(1, 0)))
    provider.free(handle)
    provider.close()
