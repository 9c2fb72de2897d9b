"""Issue 11 over the strict driver model: ordering before memory leaves, and more than one GPU. NOT a GPU.

Each test here failed before its fix, on the model that refuses what the
driver refuses (tests/cuda/test_driver_model.py shows each of its rules).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from shmshare import cuda, wire
from shmshare.memory import CachingAllocator
from shmshare.memory._host import CachingHostAllocator

from .driver_model import DriverModel

MiB = 1 << 20


def _current(model: DriverModel) -> int:
    return int(model.cuCtxGetCurrent()[1])


# --- 1. ordering before device memory leaves the process ---------------------------------------------


@pytest.mark.parametrize("named", [True, False], ids=["stream named", "whole context"])
def test_a_send_waits_for_the_work_that_writes_the_memory(driver_model: DriverModel,
                                                         pipe: tuple[wire.Connection, wire.Connection],
                                                         named: bool) -> None:
    # Was a defect: the chunks' fds went out while the memset writing them was still queued (held),
    # and the receiver, in another process, has no way to wait for the sender's stream.
    sender_side, receiver_side = pipe
    provider = cuda.CudaDeviceProvider(ipc=True)
    allocator = CachingAllocator(provider)
    block = allocator.malloc(3 * MiB)
    stream = cuda.Stream()
    driver_model.hold(stream.handle)  # a long kernel before the fill
    cuda.memset_device(block.address, 7, block.size, stream=stream)
    assert driver_model.read(block.address, 4) == b"\0" * 4  # not landed yet
    if named:
        cuda.send_device_memory(sender_side, provider, block, stream=stream, timeout=10)
    else:
        cuda.send_device_memory(sender_side, provider, block, timeout=10)
    assert stream.query(), "the send went out before the stream that writes the memory was done"
    imported = cuda.recv_device_memory(receiver_side, timeout=10)
    out = np.empty(block.size, np.uint8)
    cuda.copy_device_to_host(out, imported.address, block.size)
    assert (out == 7).all()
    imported.close()
    allocator.free(block)
    allocator.empty_cache()
    stream.close()
    provider.close()
    gc.collect()


def test_a_send_refuses_a_stream_of_another_device(two_gpus: DriverModel,
                                                   pipe: tuple[wire.Connection, wire.Connection]) -> None:
    provider = cuda.CudaDeviceProvider(0, ipc=True)
    address, handle = provider.allocate(2 * MiB)
    other = cuda.Stream(cuda.Context.primary(1))
    with pytest.raises(ValueError, match="belongs to device 1"):
        cuda.send_device_memory(pipe[0], provider, address, 2 * MiB, stream=other)
    other.close()
    provider.free(handle)
    provider.close()


def test_cuda_array_interface_hands_over_ready_data(driver_model: DriverModel) -> None:
    # Was a defect: the interface named the producer's stream and left the wait to consumers, which may
    # ignore it (numba can be told to; v3 makes it optional): they read before the copy landed.
    provider = cuda.CudaDeviceProvider()
    address, handle = provider.allocate(MiB)
    stream = cuda.Stream()
    driver_model.hold(stream.handle)
    cuda.memset_device(address, 3, MiB, stream=stream)
    arr = provider.array(address, (MiB,), np.uint8, stream=stream)
    interface = arr.__cuda_array_interface__
    assert "stream" not in interface and stream.query(), "the consumer got memory still being written"
    assert driver_model.read(address, 4) == b"\3" * 4
    del arr
    stream.close()
    provider.free(handle)
    provider.close()


# --- 3. every context is waited on, not device 0's ---------------------------------------------------


def test_unregister_waits_for_copies_queued_in_another_context(two_gpus: DriverModel) -> None:
    # Was a defect: unregister synchronized device 0's primary context only; a copy from the pages
    # queued on a device-1 stream could still run after the pages were unpinned and unmapped.
    from shmshare import Segment

    segment = Segment.create(MiB)
    registration = cuda.register_segment(segment, cuda.Context.primary(0))
    device1 = cuda.CudaDeviceProvider(1)
    target, handle = device1.allocate(MiB)
    stream1 = cuda.Stream(cuda.Context.primary(1))
    two_gpus.hold(stream1.handle)
    cuda.copy_host_to_device(target, segment.address, MiB, stream=stream1)
    registration.unregister()
    assert stream1.query(), "the pages were unpinned while a copy from them was still queued on device 1"
    stream1.close()
    device1.free(handle)
    device1.close()
    segment.close()


# --- 4. more than one GPU ------------------------------------------------------------------------------


def test_shmshare_calls_restore_the_callers_current_context(two_gpus: DriverModel) -> None:
    # Was a defect: Context.make_current() switched the calling thread to device 0 for good.
    device1 = cuda.Context.primary(1)
    device1.make_current()
    provider = cuda.CudaDeviceProvider(0)
    address, handle = provider.allocate(MiB)
    cuda.memset_device(address, 1, MiB)
    host = cuda.CudaHostProvider()
    _, pinned = host.allocate(4096)
    stream = cuda.Stream(cuda.Context.primary(0))
    host.record_event(stream).synchronize()
    assert _current(two_gpus) == device1.handle, "a device-0 call left the thread on device 0"
    stream.close()
    host.free(pinned)
    host.close()
    provider.free(handle)
    provider.close()
    assert _current(two_gpus) == device1.handle


def test_the_pinned_pool_records_on_a_stream_of_any_device(two_gpus: DriverModel) -> None:
    # Was a defect: the pool recorded device-0 events on the user's stream; on a device-1 stream the
    # driver answers CUDA_ERROR_INVALID_HANDLE.
    provider = cuda.CudaHostProvider()  # device 0's context
    pool = CachingHostAllocator(provider, "")
    stream1 = cuda.Stream(cuda.Context.primary(1))
    block = pool.allocate(MiB)
    pool.record_event(block, stream1.handle)
    two_gpus.hold(stream1.handle)
    pool.record_event(block, stream1.handle)
    pool.free(block)
    assert pool.allocate(MiB) is not block  # still in use on device 1's stream
    two_gpus.finish(stream1.handle)
    again = pool.allocate(MiB)
    assert again is block
    pool.free(again)
    pool.close()
    provider.close()
    stream1.close()


def test_copies_run_in_the_context_of_their_stream(two_gpus: DriverModel) -> None:
    # Was a defect: _copy.py made device 0's context current whatever the stream; a device-1 stream
    # there is CUDA_ERROR_INVALID_HANDLE.
    device1 = cuda.CudaDeviceProvider(1)
    address, handle = device1.allocate(MiB)
    stream1 = cuda.Stream(cuda.Context.primary(1))
    data = np.arange(4096, dtype=np.uint8)
    cuda.copy_host_to_device(address, data, data.nbytes, stream=stream1)
    cuda.memset_device(address + 4096, 9, 16, stream=stream1)
    out = np.empty(4096 + 16, np.uint8)
    cuda.copy_device_to_host(out, address, out.nbytes, stream=stream1)
    stream1.synchronize()
    assert (out[:4096] == data).all() and (out[4096:] == 9).all()
    cuda.memset_device(address, 5, 16)  # no stream: the memory's own device, found from the pointer
    cuda.copy_device_to_host(out, address, 16)
    assert (out[:16] == 5).all()
    stream1.close()
    device1.free(handle)
    device1.close()


def test_a_device_allocator_refuses_a_stream_of_another_device(two_gpus: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider(0)
    other = cuda.Stream(cuda.Context.primary(1))
    with pytest.raises(ValueError, match="belongs to device 1"):
        provider.record_event(other)
    other.close()
    provider.close()
