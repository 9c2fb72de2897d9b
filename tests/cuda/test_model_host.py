"""shmshare.cuda's contexts, events, pinned provider and registered segments, run over the driver MODEL.

No GPU is involved (see tests/cuda/driver_model.py): these tests check the
Python around the driver calls, and, where cuda-python is installed, that
cuda-python accepts every call's arguments. The real thing is test_gpu.py.
"""

from __future__ import annotations

import errno
import gc
import os
import threading
from typing import ClassVar

import numpy as np
import pytest

from shmshare import Flags, Segment, _native, cuda
from shmshare._procfs import shm_mappings
from shmshare.cuda import _pinned
from shmshare.memory import OutOfMemoryError, ProviderOutOfMemory
from shmshare.memory._host import CachingHostAllocator
from shmshare.memory._host_fallback import AnonymousMemory

from .driver_model import DriverModel

MiB = 1 << 20


def names(model: DriverModel) -> list[str]:
    return [name for name, _ in model.calls]


# --- context, streams, events --------------------------------------------------------------


def test_the_primary_context_is_retained_once_and_made_current_per_thread(driver_model: DriverModel) -> None:
    ctx = cuda.Context.primary(0)
    assert cuda.Context.primary(0) is ctx and driver_model.retains == 1
    ctx.make_current()
    driver_model.calls.clear()
    ctx.make_current()
    assert names(driver_model) == ["cuCtxGetCurrent"]  # already current: nothing set
    seen: list[list[str]] = []
    thread = threading.Thread(target=lambda: (ctx.make_current(), seen.append(names(driver_model))))
    thread.start()
    thread.join(10)
    assert seen and seen[0][-1] == "cuCtxSetCurrent"  # a new thread has no current context
    with pytest.raises(ValueError, match="does not exist"):
        cuda.Context(3)
    own = cuda.Context(0)
    own.close()
    own.close()
    assert driver_model.retains == 1 and own.closed
    with pytest.raises(ValueError, match="closed"):
        own.make_current()


def test_events_come_back_to_their_pool_once_done(driver_model: DriverModel) -> None:
    ctx = cuda.Context.primary(0)
    pool = cuda.EventPool(ctx)
    stream = cuda.Stream(ctx)
    driver_model.hold(stream.handle)
    event = pool.get().record(stream)
    assert not event.query() and len(pool) == 0
    driver_model.finish(stream.handle)
    assert event.query() and event.query()  # done, and stays done after giving its raw event back
    assert len(pool) == 1
    again = pool.get().record(0)
    assert pool.created == 1  # reused, not created
    again.synchronize()
    with pytest.raises(ValueError, match="released"):
        again.record(stream)
    dropped = pool.get()
    del dropped
    gc.collect()
    assert len(pool) == 1
    stream.close()
    pool.close()
    assert not driver_model.events and not [s for s in driver_model.streams if s > 2]


def test_events_out_when_the_pool_closes_are_destroyed_when_they_come_back(driver_model: DriverModel) -> None:
    ctx = cuda.Context.primary(0)
    pool = cuda.EventPool(ctx)
    stream = cuda.Stream(ctx)
    pool.get().release()  # one event in the pool
    driver_model.hold(stream.handle)
    pending = pool.get()
    pending.record(stream)  # a copy still running: its holder will query it after the close
    dropped = pool.get()  # given back only when collected
    assert pool.created == 2 and pool.handed_out == 2 and len(driver_model.events) == 2
    pool.close()
    assert len(driver_model.events) == 2 and pool.closed  # only the pooled one could go at once
    assert not pending.query()  # still a live event after the close
    with pytest.raises(ValueError, match="closed event pool"):
        pool.get()
    driver_model.finish(stream.handle)
    assert pending.query()  # done: gives its event back, and the closed pool destroys it
    assert len(driver_model.events) == 1 and len(pool) == 0
    del dropped
    gc.collect()
    assert not driver_model.events and pool.handed_out == 0 and len(pool) == 0
    pool.close()  # idempotent
    assert names(driver_model).count("cuEventDestroy") == names(driver_model).count("cuEventCreate") == 2
    stream.close()


def test_streams_equal_their_handles(driver_model: DriverModel) -> None:
    stream = cuda.Stream()
    assert stream == stream.handle and hash(stream) == hash(stream.handle)
    assert {stream: 1}[stream.handle] == 1
    wrapped = cuda.Stream.wrap(stream.handle)
    assert wrapped == stream and wrapped.__cuda_stream__() == (0, stream.handle)
    wrapped.close()  # not owned: nothing destroyed
    driver_model.hold(stream.handle)
    assert not stream.query()
    stream.synchronize()
    assert stream.query()
    stream.close()
    stream.close()


# --- the pinned provider under the pinned pool -------------------------------------------------


@pytest.mark.parametrize("config", ["", "pinned_use_cuda_host_register:True,pinned_num_register_threads:4"])
def test_the_pinned_pool_over_cuda_events(driver_model: DriverModel, config: str) -> None:
    provider = cuda.CudaHostProvider(config=config)
    pool = CachingHostAllocator(provider, config)
    stream = cuda.Stream()
    block = pool.allocate(3 * MiB)
    block.view()[:5] = b"hello"  # the memory is real host memory in both paths
    assert pool.record_event(block, stream.handle)
    driver_model.hold(stream.handle)
    pool.free(block)
    other = pool.allocate(3 * MiB)
    assert other.address != block.address  # the copy stream is not done
    driver_model.finish(stream.handle)
    again = pool.allocate(3 * MiB)
    assert again is block and bytes(again.view()[:5]) == b"hello"
    pool.check_invariants()
    for b in (other, again):
        pool.free(b)
    pool.close()
    provider.close()
    stream.close()
    made = "cuMemHostRegister" if provider.register else "cuMemHostAlloc"
    freed = "cuMemHostUnregister" if provider.register else "cuMemFreeHost"
    assert names(driver_model).count(made) == names(driver_model).count(freed) == 2
    assert driver_model.live()["host"] == driver_model.live()["registered"] == 0


def test_the_register_path_pins_whole_pages_it_faulted_in(driver_model: DriverModel) -> None:
    provider = cuda.CudaHostProvider(register=True, register_threads=8)
    address, handle = provider.allocate(5000)
    (_, (start, length, flags)), = [c for c in driver_model.calls if c[0] == "cuMemHostRegister"]
    assert (start, length, flags) == (address, 8192, 1) and address % 4096 == 0
    provider.free(handle)
    with pytest.raises(ValueError, match="not live memory"):
        provider.free(handle)
    with pytest.raises(ValueError, match="register_threads"):
        cuda.CudaHostProvider(register_threads=65)
    provider.close()


class _Recorded(AnonymousMemory):
    """AnonymousMemory that remembers every instance, to check that a failed allocation unmapped its memory."""

    made: ClassVar[list[AnonymousMemory]] = []

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.made.append(self)


def _failing_prefault(monkeypatch: pytest.MonkeyPatch, errors: list[int]) -> None:
    """Make the next ``len(errors)`` prefaults fail with those errnos (a real ENOMEM cannot be provoked
    here without starving the test process), and later ones run for real."""
    real = _native.prefault

    def prefault(address: int, nbytes: int, threads: int = 1, writable: bool = False) -> None:
        if errors:
            err = errors.pop(0)
            detail = f"MADV_POPULATE_WRITE, 0x{address:x}, {nbytes} bytes"
            raise OSError(err, f"madvise failed: {os.strerror(err)} ({detail})")
        real(address, nbytes, threads, writable)

    monkeypatch.setattr(_native, "prefault", prefault)
    monkeypatch.setattr(_pinned, "AnonymousMemory", _Recorded)
    _Recorded.made = []


def test_a_prefault_out_of_memory_empties_the_pinned_pool_and_retries(driver_model: DriverModel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = "pinned_use_cuda_host_register:True"
    provider = cuda.CudaHostProvider(config=config)
    pool = CachingHostAllocator(provider, config)
    pool.free(pool.allocate(MiB))  # cached: what the pool gives back when memory runs short
    _failing_prefault(monkeypatch, [errno.ENOMEM])
    driver_model.calls.clear()
    block = pool.allocate(4 * MiB)
    calls = [n for n in names(driver_model) if n.startswith("cuMemHost")]
    assert calls == ["cuMemHostUnregister", "cuMemHostRegister"]  # failed before the driver, emptied the cache, retried
    assert list(driver_model.registered.values()) == [4 * MiB]
    first, second = _Recorded.made
    assert first._map is None and second._map is not None  # the failed attempt unmapped its memory
    pool.free(block)
    pool.close()
    provider.close()
    assert not driver_model.registered


def test_a_prefault_that_stays_out_of_memory_is_the_pools_out_of_memory(driver_model: DriverModel,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    provider = cuda.CudaHostProvider(register=True, register_threads=2)
    _failing_prefault(monkeypatch, [errno.ENOMEM])
    with pytest.raises(ProviderOutOfMemory, match=r"faulting in 2.00 MiB.*2 threads.*Cannot allocate memory"):
        provider.allocate(2 * MiB)
    pool = CachingHostAllocator(provider, "pinned_use_cuda_host_register:True")
    _failing_prefault(monkeypatch, [errno.ENOMEM, errno.ENOMEM])
    with pytest.raises(OutOfMemoryError, match="pinned host pool out of memory"):
        pool.allocate(MiB)
    assert all(m._map is None for m in _Recorded.made) and len(_Recorded.made) == 2
    assert not driver_model.registered and "cuMemHostRegister" not in names(driver_model)
    pool.close()
    provider.close()


def test_a_prefault_failing_otherwise_is_not_taken_for_out_of_memory(driver_model: DriverModel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    provider = cuda.CudaHostProvider(register=True)
    pool = CachingHostAllocator(provider, "pinned_use_cuda_host_register:True")
    pool.free(pool.allocate(MiB))
    _failing_prefault(monkeypatch, [errno.EFAULT])
    with pytest.raises(OSError, match="Bad address") as info:
        pool.allocate(4 * MiB)
    assert not isinstance(info.value, ProviderOutOfMemory)
    assert "cuMemHostUnregister" not in names(driver_model)  # no empty-and-retry for it: the cache is intact
    assert _Recorded.made[0]._map is None
    pool.close()
    provider.close()
    assert not driver_model.registered


def test_host_allocator_is_one_pool_per_process(driver_model: DriverModel) -> None:
    pool = cuda.host_allocator("pinned_reserve_segment_size_mb:4")
    assert cuda.host_allocator() is pool and pool.config.pinned_reserve_segment_size == 4 * MiB
    pool.free(pool.allocate(100))
    pool.close()
    pool.provider.close()


# --- registered segments --------------------------------------------------------------------------


def test_a_segment_is_registered_once_and_unregistered_before_unmapping(driver_model: DriverModel) -> None:
    seg = Segment.create(3 * MiB + 100)
    seg.view(np.uint8, 16)[:] = 7
    reg = cuda.register_segment(seg)
    assert cuda.register_segment(seg) is reg and cuda.registered(seg) is reg
    assert driver_model.registered == {seg.address: 3 * MiB + 4096}
    seg.close()  # the registration holds the mapping: it cannot go while pinned
    assert any(m.start == reg.address for m in shm_mappings("self"))
    assert cuda.unregister_segment(seg)
    calls = names(driver_model)
    assert calls.index("cuCtxSynchronize", calls.index("cuMemHostRegister")) < calls.index("cuMemHostUnregister")
    assert not driver_model.registered and not cuda.unregister_segment(seg)
    assert not any(m.start == reg.address for m in shm_mappings("self"))


def test_collecting_the_segment_unregisters_it(driver_model: DriverModel) -> None:
    seg = Segment.create(MiB)
    cuda.register_segment(seg)
    assert driver_model.registered
    del seg
    gc.collect()
    cuda.finish_releases()  # the finalizer only queued the release (Note [Deferred releases])
    assert not driver_model.registered


def test_a_read_only_segment_is_registered_read_only(driver_model: DriverModel) -> None:
    with Segment.create(MiB) as seg:
        reader = Segment.from_fd(seg.fd, flags=Flags.FROMFD | Flags.READONLY)
        reg = cuda.register_segment(reader)
        (_, (_, _, flags)), = [c for c in driver_model.calls if c[0] == "cuMemHostRegister"]
        assert flags == 1 | 8 and reg.readonly  # PORTABLE | READ_ONLY
        reg.unregister()
        reg.unregister()
        reader.close()


def test_register_refuses_what_is_not_an_open_segment(driver_model: DriverModel) -> None:
    with pytest.raises(TypeError, match="Segment"):
        cuda.register_segment(bytearray(10))  # type: ignore[arg-type]
    seg = Segment.create(4096)
    seg.close()
    with pytest.raises(ValueError, match="closed"):
        cuda.register_segment(seg)


def test_a_failed_register_holds_nothing(driver_model: DriverModel) -> None:
    with Segment.create(MiB) as seg:
        driver_model.registered[seg.address] = 10  # somebody else pinned it
        with pytest.raises(cuda.CudaError, match=r"cuMemHostRegister.*CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"):
            cuda.register_segment(seg)
        del driver_model.registered[seg.address]
    assert not any(m.start == seg.address for m in shm_mappings("self"))
    assert os.environ.get("SHMSHARE_ALLOC_CONF") is None
