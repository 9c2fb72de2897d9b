"""CudaDeviceProvider, device memory over fds and DLPack stream hand-offs, over the driver MODEL.

No GPU is involved (see tests/cuda/driver_model.py): the pool contract runs
the allocator core over CudaDeviceProvider's Python, with the model keeping
the books a driver would, and cuda-python (where installed) checking every
call's arguments. The real thing is test_gpu.py and test_contract_cuda.py.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import numpy as np
import pytest

from shmshare import ProtocolError, cuda, wire
from shmshare.cuda import _driver
from shmshare.memory import CachingAllocator, OutOfMemoryError
from shmshare.testing import pattern
from shmshare.testing.pool_contract import PoolContract

from .driver_model import DriverModel
from .gpu_helpers import read_device as _read

MiB = 1 << 20


class TestModelClassic(PoolContract):
    """The pool contract over CudaDeviceProvider (cuMemAlloc segments) and the driver model."""

    config = "expandable_segments:False"
    can_provoke_oom = True
    ipc = False

    @pytest.fixture(autouse=True)
    def _model(self, driver_model: DriverModel) -> None:
        self.model = driver_model

    def make_provider(self) -> cuda.CudaDeviceProvider:
        return cuda.CudaDeviceProvider(ipc=self.ipc)

    def busy_stream(self, provider: cuda.CudaDeviceProvider) -> tuple[cuda.Stream, Callable[[], None]]:
        stream = provider.new_stream()
        self.model.hold(stream.handle)
        return stream, lambda: self.model.finish(stream.handle)

    def close_provider(self, provider: cuda.CudaDeviceProvider) -> None:
        provider.close()
        live = self.model.live()
        assert live["mallocs"] == live["reservations"] == live["mappings"] == live["phys"] == 0, live


class TestModelExpandable(TestModelClassic):
    config = "expandable_segments:True"


class TestModelIpcClassic(TestModelClassic):
    ipc = True


class TestModelIpcExpandable(TestModelClassic):
    config = "expandable_segments:True"
    ipc = True


# --- the provider's own rules ------------------------------------------------------------------


def test_expandable_pages_are_mapped_and_unmapped_in_granules(driver_model: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider()
    address, vrange = provider.reserve(40 * MiB)
    provider.map(vrange, 20 * MiB, 20 * MiB)  # one large page: ten 2 MiB chunks
    assert len(driver_model.mappings) == 10 and provider.range_of(address + 30 * MiB) == (vrange, 30 * MiB)
    provider.unmap(vrange, 24 * MiB, 4 * MiB)  # any whole-chunk range can go back
    assert len(driver_model.mappings) == 8
    with pytest.raises(ValueError, match="not mapped"):
        provider.unmap(vrange, 24 * MiB, 2 * MiB)
    with pytest.raises(ValueError, match="whole"):
        provider.map(vrange, MiB, 2 * MiB)
    with pytest.raises(ValueError, match="overlaps"):
        provider.map(vrange, 20 * MiB, 2 * MiB)
    with pytest.raises(ValueError, match="still mapped"):
        provider.release(vrange)
    provider.unmap(vrange, 20 * MiB, 4 * MiB)
    provider.unmap(vrange, 28 * MiB, 12 * MiB)
    provider.release(vrange)
    with pytest.raises(ValueError, match="not a live segment"):
        provider.release(vrange)
    assert driver_model.live()["reservations"] == 0 and provider.range_of(address) is None
    provider.close()


def test_a_map_that_runs_out_of_memory_maps_nothing(driver_model: DriverModel,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    driver_model.capacity = 9 * MiB
    provider = cuda.CudaDeviceProvider()
    _, vrange = provider.reserve(20 * MiB)
    with pytest.raises(cuda.CudaOutOfMemory, match=r"reports 9\.00 MiB free"):
        provider.map(vrange, 0, 20 * MiB)  # hopeless: refused before any chunk is made
    assert "cuMemCreate" not in [n for n, _ in driver_model.calls]
    monkeypatch.setattr(provider, "free_bytes", lambda: 1 << 40)  # another process freed memory, then took it back
    with pytest.raises(cuda.CudaOutOfMemory, match=r"cuMemCreate.*CUDA_ERROR_OUT_OF_MEMORY"):
        provider.map(vrange, 0, 20 * MiB)
    assert not driver_model.mappings and not driver_model.handles and driver_model.used == 0
    provider.release(vrange)
    with pytest.raises(cuda.CudaOutOfMemory):
        provider.allocate(10 * MiB)
    provider.close()


def test_the_allocator_retries_then_reports_a_driver_out_of_memory(driver_model: DriverModel) -> None:
    driver_model.capacity = 64 * MiB
    provider = cuda.CudaDeviceProvider()
    allocator = CachingAllocator(provider, "expandable_segments:False")
    allocator.free(allocator.malloc(40 * MiB))  # cached; must go back for the next one
    block = allocator.malloc(50 * MiB)
    with pytest.raises(OutOfMemoryError):
        allocator.malloc(50 * MiB)
    allocator.free(block)
    allocator.empty_cache()
    provider.close()


def test_freeing_an_ipc_classic_segment_waits_first(driver_model: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider(ipc=True)
    _, handle = provider.allocate(3 * MiB)  # rounded to two chunks
    assert len(driver_model.mappings) == 2
    driver_model.calls.clear()
    provider.free(handle)
    calls = [n for n, _ in driver_model.calls]
    assert calls.index("cuCtxSynchronize") < calls.index("cuMemUnmap")
    provider.close()


def test_records_and_syncs_take_any_stream(driver_model: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider()
    owned = provider.new_stream()  # what a torch.cuda.Stream would own

    class TorchStream:
        cuda_stream = owned.handle

    event = provider.record_event(TorchStream())
    assert provider.event_done(event)
    provider.synchronize(TorchStream())
    provider.synchronize()
    with pytest.raises(ValueError, match="not an event"):
        provider.event_done(object())
    with pytest.raises(TypeError, match="not a CUDA stream"):
        provider.record_event("stream 7")
    owned.close()
    provider.close()


def test_bad_sizes_are_refused(driver_model: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider()
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError):
            provider.allocate(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            provider.reserve(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a positive multiple"):
        provider.reserve(3 * MiB)
    provider.close()


def _cuda_python_installed() -> bool:
    try:
        _driver._import_driver()
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _cuda_python_installed(),
                    reason="cuda-python is not installed here: the model cannot check call shapes against it")
def test_the_model_catches_an_argument_cuda_python_rejects(driver_model: DriverModel) -> None:
    with pytest.raises(AssertionError, match="cuda-python rejects cuMemExportToShareableHandle"):
        _driver.call("cuMemExportToShareableHandle", 5, 1, 0)  # the enum, not 1, is what it takes


# --- device memory over fds ---------------------------------------------------------------------


def _fill(block_address: int, data: np.ndarray) -> None:
    cuda.copy_host_to_device(block_address, data, data.nbytes)


@pytest.mark.parametrize("config, nbytes", [("expandable_segments:True", 5 * MiB + 123),
                                            ("expandable_segments:False", 700_000),
                                            ("expandable_segments:True", 140 * MiB)])  # two batches of chunk fds
def test_device_memory_crosses_a_wire_by_fd_and_outlives_its_sender(
        driver_model: DriverModel, pipe: tuple[wire.Connection, wire.Connection], config: str, nbytes: int) -> None:
    sender_side, receiver_side = pipe
    provider = cuda.CudaDeviceProvider(ipc=True)
    allocator = CachingAllocator(provider, config)
    keep = allocator.malloc(1000)  # so the block does not start at its segment's first byte
    block = allocator.malloc(nbytes)
    data = pattern(nbytes, nbytes, np.uint8)
    _fill(block.address, data)
    cuda.send_device_memory(sender_side, provider, block, nbytes, meta={"dtype": "uint8"})
    imported = cuda.recv_device_memory(receiver_side, timeout=10)
    assert imported.nbytes == nbytes and imported.meta == {"dtype": "uint8"}
    assert imported.address != block.address
    for b in (keep, block):  # the sender lets everything go
        allocator.free(b)
    allocator.empty_cache()
    provider.close()
    assert (_read(imported.address, nbytes) == data).all()
    arr = imported.array((nbytes // 4,), np.uint32)
    imported.close()
    mapped = len(driver_model.mappings)
    assert mapped > 0  # the array still holds the mapping
    assert arr.__cuda_array_interface__["data"][0] == imported.address
    del arr
    gc.collect()
    cuda.finish_releases()  # the finalizer only queued the release (Note [Deferred releases])
    assert len(driver_model.mappings) == 0 and driver_model.live()["phys"] == 0


def test_received_memory_is_unmapped_after_the_last_dlpack_consumer(
        driver_model: DriverModel, pipe: tuple[wire.Connection, wire.Connection]) -> None:
    provider = cuda.CudaDeviceProvider(ipc=True)
    allocator = CachingAllocator(provider, "expandable_segments:True")
    block = allocator.malloc(MiB)
    cuda.send_device_memory(pipe[0], provider, block)
    with cuda.recv_device_memory(pipe[1], timeout=10) as imported:
        capsule = imported.array().__dlpack__()
    assert driver_model.mappings  # the capsule (like a consumer's tensor) keeps it mapped
    del capsule
    gc.collect()
    cuda.finish_releases()  # the deleter only queued the unmap (Note [Deferred releases])
    allocator.free(block)
    allocator.empty_cache()
    provider.close()
    assert not driver_model.mappings
    with pytest.raises(ValueError, match="closed"):
        imported.array()


def test_only_virtual_memory_of_an_ipc_provider_can_be_sent(driver_model: DriverModel,
                                                             pipe: tuple[wire.Connection, wire.Connection]) -> None:
    provider = cuda.CudaDeviceProvider()  # cuMemAlloc segments
    address, handle = provider.allocate(MiB)
    with pytest.raises(ValueError, match="ipc=True"):
        cuda.send_device_memory(pipe[0], provider, address, MiB)
    with pytest.raises(ValueError, match="positive"):
        cuda.send_device_memory(pipe[0], provider, address, 0)
    provider.free(handle)
    local = cuda.CudaDeviceProvider()
    _, vrange = local.reserve(2 * MiB)
    local.map(vrange, 0, 2 * MiB)
    with pytest.raises(ValueError, match="not made shareable"):
        vrange.export(0, MiB)
    local.unmap(vrange, 0, 2 * MiB)
    local.release(vrange)
    local.close()
    provider.close()


@pytest.mark.parametrize("header, nfds, match", [
    ({"kind": "other"}, 0, "expected a 'shmshare.cuda.memory' message"),
    ({"version": 9}, 1, "version 9"),
    ({"version": 1}, 1, "version 1, expected 2"),  # before batches: no "batch", no abort
    ({"nbytes": "ten"}, 1, "'nbytes'"),
    ({"batch": None}, 1, "'batch'"),
    ({"offset": 2 * MiB}, 1, "does not add up"),
    ({"nchunks": 2}, 1, "does not add up"),  # more chunks than the bytes need
    ({"batch": 0}, 0, "batches of 0 fds"),
    ({"batch": wire.MAX_FDS + 1}, 1, f"batches of {wire.MAX_FDS + 1} fds"),
    ({"nchunks": 3000, "nbytes": 3000 * 2 * MiB, "batch": 1}, 1, "more than device 0's"),  # the model has 4 GiB
    ({}, 2, "carries 2 fds"),
    ({"nchunks": 3, "nbytes": 5 * MiB, "batch": 2}, 3, "batches of 2 but carries 3 fds"),
])
def test_malformed_messages_are_protocol_errors_and_their_fds_closed(
        driver_model: DriverModel, pipe: tuple[wire.Connection, wire.Connection],
        header: dict[str, object], nfds: int, match: str) -> None:
    good = {"kind": "shmshare.cuda.memory", "version": 2, "device": 0, "device_uuid": b"\0" * 16,
            "chunk_size": 2 * MiB, "nchunks": 1, "batch": wire.MAX_FDS, "offset": 0, "nbytes": MiB, "meta": {}}
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open("/dev/null")) for _ in range(nfds)]
        pipe[0].send({**good, **header}, files)
    with pytest.raises(ProtocolError, match=match):
        cuda.recv_device_memory(pipe[1], timeout=10)


def test_a_device_the_receiver_cannot_see_is_named(driver_model: DriverModel,
                                                  pipe: tuple[wire.Connection, wire.Connection]) -> None:
    header = {"kind": "shmshare.cuda.memory", "version": 2, "device": 3, "device_uuid": b"\1" * 16,
              "chunk_size": 2 * MiB, "nchunks": 1, "batch": wire.MAX_FDS, "offset": 0, "nbytes": MiB, "meta": {}}
    with open("/dev/null") as f:
        pipe[0].send(header, [f])
    with pytest.raises(ProtocolError, match="CUDA_VISIBLE_DEVICES"):
        cuda.recv_device_memory(pipe[1], timeout=10)


# --- DLPack stream hand-off ----------------------------------------------------------------------


def test_dlpack_makes_the_consumer_stream_wait_for_the_producer(driver_model: DriverModel) -> None:
    provider = cuda.CudaDeviceProvider()
    producer, consumer = provider.new_stream(), provider.new_stream()
    address, handle = provider.allocate(MiB)
    arr = provider.array(address, (256,), np.float32, stream=producer)
    driver_model.calls.clear()
    capsule = arr.__dlpack__(stream=consumer.handle)
    calls = [(n, a) for n, a in driver_model.calls if n in ("cuEventRecord", "cuStreamWaitEvent")]
    assert [n for n, _ in calls] == ["cuEventRecord", "cuStreamWaitEvent"]
    assert int(calls[0][1][1]) == producer.handle and int(calls[1][1][0]) == consumer.handle
    driver_model.calls.clear()
    del capsule
    arr.__dlpack__(stream=-1)  # "do not synchronize"
    assert not [n for n, _ in driver_model.calls if n == "cuStreamWaitEvent"]
    provider.free(handle)
    producer.close()
    consumer.close()
    provider.close()
