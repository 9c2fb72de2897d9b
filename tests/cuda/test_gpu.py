"""shmshare.cuda on a real GPU: pinned pool, registered shm, device pools, fds across processes, DLPack.

Every test here is marked ``cuda`` and skipped, with the reason, where no
GPU can be used (tests/cuda/conftest.py).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

from shmshare import Segment, cuda, wire
from shmshare.memory import CachingAllocator
from shmshare.memory._host import CachingHostAllocator
from shmshare.testing import pattern, start_child

from .gpu_helpers import BusyStream, read_device, send_pattern_then_exit, warm_torch

pytestmark = pytest.mark.cuda
MiB = 1 << 20
WAIT = 30.0


@pytest.fixture(scope="module", autouse=True)
def torch_warmed_up() -> Iterator[None]:
    """torch's CUDA up before the first test's leak check (conftest's ``warm_driver`` did the driver):
    what torch opens lazily for the whole process is not a test's leak."""
    if cuda.available():
        warm_torch()
    yield


@pytest.fixture
def ctx() -> cuda.Context:
    return cuda.Context.primary(0)


@pytest.fixture
def busy(ctx: cuda.Context) -> Iterator[BusyStream]:
    stream = BusyStream(ctx)
    yield stream
    stream.close()


@pytest.fixture
def device(ctx: cuda.Context) -> Iterator[cuda.CudaDeviceProvider]:
    provider = cuda.CudaDeviceProvider(context=ctx)
    yield provider
    provider.close()


# --- pinned-host pool ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["", "pinned_use_cuda_host_register:True,pinned_num_register_threads:4"])
def test_pinned_blocks_are_reused_only_after_their_copy(ctx: cuda.Context, busy: BusyStream,
                                                        device: cuda.CudaDeviceProvider, config: str) -> None:
    provider = cuda.CudaHostProvider(ctx, config)
    pool = CachingHostAllocator(provider, config)
    nbytes = 8 * MiB
    target, handle = device.allocate(nbytes)
    data = pattern(1, nbytes, np.uint8)
    block = pool.allocate(nbytes)
    np.frombuffer(block.view(), np.uint8)[:] = data
    cuda.copy_host_to_device(target, block.address, nbytes, stream=busy.handle)  # queued behind the wait
    pool.record_event(block, busy.handle)
    pool.free(block)
    other = pool.allocate(nbytes)
    assert other.address != block.address, "a pinned block was reused while its copy was queued"
    busy.release()
    again = pool.allocate(nbytes)
    assert again is block
    assert (read_device(target, nbytes) == data).all()
    pool.check_invariants()
    stats = pool.host_memory_stats()
    assert stats["num_host_alloc"] == 2 and stats["segment.current"] == 2 and stats["allocated.current"] == 2
    for b in (other, again):
        pool.free(b)
    pool.close()
    assert pool.host_memory_stats()["num_host_free"] == 2
    provider.close()
    device.free(handle)


def test_the_background_thread_queries_cuda_events(ctx: cuda.Context, busy: BusyStream) -> None:
    provider = cuda.CudaHostProvider(ctx)
    pool = CachingHostAllocator(provider, "pinned_use_background_threads:True", background_interval=0.01)
    pool.free(pool.allocate(64))  # a miss starts the thread
    block = pool.allocate(MiB)
    pool.record_event(block, busy.handle)
    pool.free(block)
    busy.release()
    deadline = time.monotonic() + WAIT
    while block.event_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert block.event_count == 0, "the background thread did not return the block"
    pool.close()
    provider.close()


def test_pinned_reserve_segment_is_carved(ctx: cuda.Context) -> None:
    provider = cuda.CudaHostProvider(ctx)
    pool = CachingHostAllocator(provider, "pinned_reserve_segment_size_mb:16")
    blocks = [pool.allocate(n) for n in (100, MiB, 3 * MiB)]
    assert all(b.carved for b in blocks) and pool.host_memory_stats()["num_host_alloc"] == 1
    for b in blocks:
        pool.free(b)
    pool.close()
    provider.close()


# --- registered shm segment ----------------------------------------------------------------------


def test_a_registered_shm_segment_feeds_an_async_copy(ctx: cuda.Context, device: cuda.CudaDeviceProvider) -> None:
    nbytes = 64 * MiB
    seg = Segment.create(nbytes)
    data = pattern(2, nbytes, np.uint8)
    seg.view(np.uint8, nbytes)[:] = data
    reg = cuda.register_segment(seg, ctx)
    assert cuda.register_segment(seg, ctx) is reg
    target, handle = device.allocate(nbytes)
    stream = cuda.Stream(ctx)
    cuda.copy_host_to_device(target, seg.address + 4096, nbytes - 4096, stream=stream)
    stream.synchronize()
    assert (read_device(target, nbytes - 4096) == data[4096:]).all()
    assert cuda.unregister_segment(seg)
    seg.close()
    stream.close()
    device.free(handle)


# --- device pools ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config, ipc", [("expandable_segments:False", False), ("expandable_segments:True", False),
                                         ("expandable_segments:False", True), ("expandable_segments:True", True)])
def test_device_pool_churn_keeps_invariants_and_contents(ctx: cuda.Context, config: str, ipc: bool) -> None:
    rng = random.Random(20240605)
    provider = cuda.CudaDeviceProvider(ipc=ipc, context=ctx)
    allocator = CachingAllocator(provider, config)
    live: dict[int, tuple[object, int]] = {}  # address -> (block, tag byte)
    sizes = (1, 512, 4000, MiB - 1, MiB + 1, 3 * MiB, 11 * MiB, 25 * MiB)
    for step in range(300):
        if live and rng.random() < 0.45:
            address = rng.choice(list(live))
            block, tag = live.pop(address)
            _check_tag(block, tag)
            allocator.free(block)  # type: ignore[arg-type]
        else:
            block = allocator.malloc(rng.choice(sizes))
            tag = step % 251 + 1
            cuda.memset_device(block.address, tag, block.requested_size)
            live[block.address] = (block, tag)
        allocator.check_invariants()
        if step % 25 == 0:
            for block, tag in live.values():
                _check_tag(block, tag)
        if step == 150:
            allocator.empty_cache()  # unmaps whole free pages of expandable segments mid-run
    for block, tag in live.values():
        _check_tag(block, tag)
        allocator.free(block)  # type: ignore[arg-type]
    allocator.empty_cache()
    allocator.check_invariants()
    assert allocator.memory_stats()["reserved_bytes.all.current"] == 0


def _check_tag(block: object, tag: int) -> None:
    size = block.requested_size  # type: ignore[attr-defined]
    edge = min(size, 64)
    head = read_device(block.address, edge)  # type: ignore[attr-defined]
    tail = read_device(block.address + size - edge, edge)  # type: ignore[attr-defined]
    assert (head == tag).all() and (tail == tag).all(), f"{block!r} lost its contents"


# --- device memory across processes ------------------------------------------------------------


@pytest.mark.parametrize("config, nbytes", [("expandable_segments:True", 5 * MiB + 123),
                                            ("expandable_segments:False", 300 * MiB)])
def test_device_memory_reaches_another_process_by_fd_and_outlives_it(ctx: cuda.Context, config: str,
                                                                     nbytes: int) -> None:
    mine, theirs = wire.pipe()
    try:
        with start_child(send_pattern_then_exit, theirs, nbytes, 3, config, method="spawn") as child:
            imported = cuda.recv_device_memory(mine, timeout=120)
            mine.send({"imported": True})
            assert child.join(120) == 0  # the sender is gone...
        assert imported.meta == {"seed": 3} and imported.nbytes == nbytes
        assert (read_device(imported.address, nbytes) == pattern(3, nbytes, np.uint8)).all()  # ...its memory is not
        imported.close()
        gc.collect()
    finally:
        mine.close()
        theirs.close()


# --- DLPack and __cuda_array_interface__ ---------------------------------------------------------


def _torch_with_cuda():  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} here has no CUDA")
    return torch


def test_dlpack_and_cai_give_torch_the_pool_memory_without_a_copy(ctx: cuda.Context,
                                                                  device: cuda.CudaDeviceProvider) -> None:
    torch = _torch_with_cuda()
    allocator = CachingAllocator(device)
    block = allocator.malloc(4096 * 4)
    data = np.arange(4096, dtype=np.float32)
    cuda.copy_host_to_device(block.address, data, data.nbytes)
    arr = device.array(block, (4096,), np.float32)
    t = torch.from_dlpack(arr)
    assert t.is_cuda and t.data_ptr() == block.address and torch.equal(t.cpu(), torch.from_numpy(data))
    via_cai = torch.as_tensor(arr, device="cuda")
    assert via_cai.data_ptr() == block.address
    t.mul_(2)  # torch writes into the pool's memory
    allocator.record_stream(block, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    out = np.empty_like(data)
    cuda.copy_device_to_host(out, block.address, data.nbytes)
    assert (out == data * 2).all()
    del t, via_cai, arr
    gc.collect()
    allocator.free(block)
    allocator.empty_cache()


def test_dlpack_into_cupy(ctx: cuda.Context, device: cuda.CudaDeviceProvider) -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    address, handle = device.allocate(MiB)
    cuda.memset_device(address, 5, MiB)
    arr = device.array(address, (MiB,), np.uint8)
    assert int(cupy.from_dlpack(arr).sum()) == 5 * MiB
    assert int(cupy.asarray(arr).data.ptr) == address
    device.free(handle)
