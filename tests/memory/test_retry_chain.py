"""The retry chain: each step, their order, what counts as a retry, and the OOM report."""

from __future__ import annotations

import pytest

from shmshare._errors import ShmshareError
from shmshare.memory import (
    CachingAllocator,
    MemPool,
    OutOfMemoryError,
    ProviderOutOfMemory,
    SimulatedDevice,
    use_mem_pool,
)

MiB = 1 << 20


def frees_and_allocations(device: SimulatedDevice) -> list[tuple[object, ...]]:
    return [entry for entry in device.log if entry[0] in ("free", "allocate", "oom", "synchronize")]


def test_the_chain_runs_in_the_seeds_order() -> None:
    device = SimulatedDevice(200 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30,garbage_collection_threshold:0.78")
    busy = device.new_stream()
    live = alloc.malloc(90 * MiB)
    old, pending = alloc.malloc(24 * MiB), alloc.malloc(3 * MiB)
    alloc.free(old)
    for _ in range(4):  # age the cached 24 MiB block: each malloc ticks the large pool's clock
        alloc.free(alloc.malloc(5 * MiB))
    oversize = alloc.malloc(40 * MiB)
    alloc.free(oversize)
    alloc.record_stream(pending, busy)
    busy.enqueue()
    alloc.free(pending)
    handles = old.segment.handle, oversize.segment.handle, pending.segment.handle
    device.log.clear()

    block = alloc.malloc(60 * MiB)

    assert frees_and_allocations(device) == [
        ("free", handles[0]),  # 1. garbage collection: the old block, before asking the provider
        ("oom", "allocate", 60 * MiB),  # the provider refuses
        ("free", handles[1]),  # 3. release of blocks >= max_split_size
        ("synchronize", busy.id),  # 4. synchronize, then release everything
        ("free", handles[2]),
        ("allocate", block.segment.handle, 60 * MiB),
    ]
    stats = alloc.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_sync_all_streams"] == 1 and stats["num_ooms"] == 0
    assert live.allocated
    alloc.check_invariants()


def test_garbage_collection_runs_before_the_provider_and_frees_the_oldest() -> None:
    device = SimulatedDevice(200 * MiB)
    # max_split_size keeps the 12 MiB requests out of the two big blocks
    alloc = CachingAllocator(device, "garbage_collection_threshold:0.55,max_split_size_mb:40")
    older, younger = alloc.malloc(50 * MiB), alloc.malloc(54 * MiB)
    alloc.free(older)
    for _ in range(3):
        alloc.free(alloc.malloc(12 * MiB))
    alloc.free(younger)  # reserved now 50 + 54 + 12 = 116 MiB, above the 110 MiB threshold
    handles = older.segment.handle, younger.segment.handle
    device.log.clear()
    alloc.malloc(60 * MiB)  # the provider could serve it; collection still runs first
    log = frees_and_allocations(device)
    assert ("free", handles[0]) in log and ("free", handles[1]) not in log
    assert log.index(("free", handles[0])) < [e[0] for e in log].index("allocate")
    assert alloc.memory_stats()["num_alloc_retries"] == 0
    alloc.check_invariants()


def test_no_garbage_collection_below_the_threshold() -> None:
    device = SimulatedDevice(1000 * MiB)
    alloc = CachingAllocator(device, "garbage_collection_threshold:0.5")
    alloc.free(alloc.malloc(50 * MiB))
    device.log.clear()
    alloc.malloc(60 * MiB)
    assert not [e for e in device.log if e[0] == "free"]


def cached_pool_block(pool: MemPool, alloc: CachingAllocator, size: int) -> int:
    with use_mem_pool(pool):
        block = alloc.malloc(size)
    alloc.free(block)
    return block.address


def test_a_use_on_oom_pool_lends_before_cached_memory_is_released() -> None:
    device = SimulatedDevice(120 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30")
    pool = MemPool(use_on_oom=True)
    lent = cached_pool_block(pool, alloc, 40 * MiB)
    alloc.free(alloc.malloc(64 * MiB))  # cached oversize block, 64 >= 40 + 20: cannot serve 40 MiB
    device.log.clear()
    block = alloc.malloc(40 * MiB)
    assert block.address == lent and block.pool.owner is not None
    assert not [e for e in device.log if e[0] == "free"], "cached memory was released before borrowing"
    alloc.free(block)  # goes back to the pool it came from
    owners = {s["address"]: s["segment_pool_id"] for s in alloc.memory_snapshot()["segments"]}
    assert owners[lent] == pool.id
    with use_mem_pool(pool):
        assert alloc.malloc(40 * MiB).address == lent
    alloc.check_invariants()


def test_without_use_on_oom_the_oversize_block_is_released_instead() -> None:
    device = SimulatedDevice(120 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30")
    pool = MemPool(use_on_oom=False)
    kept = cached_pool_block(pool, alloc, 40 * MiB)
    alloc.free(alloc.malloc(64 * MiB))
    block = alloc.malloc(40 * MiB)
    assert block.address != kept and block.pool.owner is None
    stats = alloc.memory_stats()
    assert stats["num_device_free"] == 1 and stats["num_alloc_retries"] == 0


def test_releasing_oversize_blocks_is_not_a_retry() -> None:
    device = SimulatedDevice(120 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30")
    busy = device.new_stream()
    alloc.free(alloc.malloc(3 * MiB))  # a cached 20 MiB segment, not oversize
    pending = alloc.malloc(12 * MiB)
    alloc.record_stream(pending, busy)
    busy.enqueue()
    alloc.free(pending)
    alloc.free(alloc.malloc(80 * MiB))  # cached oversize, 80 >= 50 + 20: it cannot serve 50 MiB
    alloc.malloc(50 * MiB)  # 20 + 80 + 50 > 120: releasing the 80 MiB block is enough
    stats = alloc.memory_stats()
    assert stats["num_alloc_retries"] == 0 and stats["num_sync_all_streams"] == 0
    assert stats["reserved_bytes.all.current"] == 20 * MiB + 50 * MiB
    assert busy.pending == 1 and stats["active.all.current"] == 2


def test_oversize_blocks_are_released_from_the_largest_down() -> None:
    device = SimulatedDevice(200 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30")
    blocks = [alloc.malloc(size) for size in (32 * MiB, 40 * MiB, 48 * MiB, 60 * MiB)]
    for block in blocks:
        alloc.free(block)
    alloc.malloc(90 * MiB)  # 180 + 90 > 200: 60 + 48 MiB must go, 32 and 40 stay
    assert alloc.memory_stats()["reserved_bytes.all.current"] == (32 + 40 + 90) * MiB
    assert alloc.memory_stats()["num_alloc_retries"] == 0


def test_releasing_everything_is_the_one_counted_retry() -> None:
    device = SimulatedDevice(120 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30")
    busy = device.new_stream()
    alloc.malloc(40 * MiB)
    alloc.free(alloc.malloc(3 * MiB))
    pending = alloc.malloc(2 * MiB, busy)
    pending_too = alloc.malloc(2 * MiB)  # shares a 20 MiB segment with nothing else on stream 0
    alloc.record_stream(pending_too, busy)
    busy.enqueue()
    alloc.free(pending_too)
    alloc.free(pending)
    alloc.malloc(60 * MiB)  # 40 + 20 + 20 + 20 + 60 > 120, and nothing oversize is cached
    stats = alloc.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_sync_all_streams"] == 1
    assert busy.pending == 0 and stats["active.all.current"] == 2
    alloc.check_invariants()


def test_free_memory_callbacks_run_before_the_provider(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    kept = alloc.malloc(12 * MiB)
    calls = []

    def callback() -> bool:
        calls.append(len(device.log))
        alloc.free(kept)  # a cache elsewhere lets go of its block
        return True

    alloc.add_free_memory_callback(callback)
    block = alloc.malloc(12 * MiB)
    assert calls and block.address == kept.address
    assert alloc.memory_stats()["num_device_alloc"] == 1


def test_out_of_memory_after_every_step() -> None:
    device = SimulatedDevice(100 * MiB)
    alloc = CachingAllocator(device, "max_split_size_mb:30")
    alloc.record_memory_history()
    observed = []
    alloc.add_observer(observed.append)
    alloc.malloc(60 * MiB)
    alloc.free(alloc.malloc(3 * MiB))
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(80 * MiB)
    error = info.value
    assert isinstance(error, MemoryError) and isinstance(error, ShmshareError)
    assert isinstance(error.__cause__, ProviderOutOfMemory)
    assert (error.requested, error.capacity, error.free) == (80 * MiB, 100 * MiB, 40 * MiB)
    assert (error.allocated, error.reserved) == (60 * MiB, 60 * MiB)
    stats = alloc.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert observed[-1].action == "oom" and observed[-1].size == 80 * MiB
    oom = alloc.memory_snapshot()["device_traces"][0][-1]
    assert oom["action"] == "oom" and oom["device_free"] == 40 * MiB and "addr" not in oom
    alloc.check_invariants()
    alloc.malloc(30 * MiB)  # still usable


def test_the_oom_message_reads_like_pytorchs() -> None:
    device = SimulatedDevice(100 * MiB)
    alloc = CachingAllocator(device)
    blocks = [alloc.malloc(3 * MiB) for _ in range(30)]  # 30 x 3 MiB in five 20 MiB segments
    for block in blocks[::2]:
        alloc.free(block)  # fragmentation: reserved but unallocated
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(5 * MiB)  # 3 MiB holes cannot take it, and no 20 MiB segment fits
    message = str(info.value)
    for fragment in (
        "simulated device out of memory. Tried to allocate 5.00 MiB (a new 20.00 MiB segment).",
        "has a total capacity of 100.00 MiB of which 0 bytes is free.",
        "45.00 MiB is allocated by shmshare, and 55.00 MiB is reserved by shmshare but unallocated.",
        "SHMSHARE_ALLOC_CONF=expandable_segments:True",
        "max_split_size_mb",
    ):
        assert fragment in message, (fragment, message)


def test_the_oom_message_with_expandable_segments_asks_to_lower_the_peak() -> None:
    alloc = CachingAllocator(SimulatedDevice(100 * MiB), "expandable_segments:True")
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(200 * MiB)
    assert "Tried to allocate 200.00 MiB." in str(info.value)
    assert "lower the peak" in str(info.value) and "expandable_segments:True" not in str(info.value)


def test_other_provider_errors_propagate_unchanged(device: SimulatedDevice) -> None:
    class Broken(SimulatedDevice):
        def allocate(self, nbytes: int) -> tuple[int, int]:
            raise PermissionError("the driver said no")

    alloc = CachingAllocator(Broken(1 << 30))
    with pytest.raises(PermissionError, match="the driver said no"):
        alloc.malloc(MiB)
    assert alloc.memory_stats()["num_ooms"] == 0
    alloc.check_invariants()


def test_a_retry_that_succeeds_keeps_nothing_of_its_caller_alive() -> None:
    # The provider's failure on the first try must not be kept: its traceback holds the
    # caller's frame, and with it every local of the caller (a sender's pool array once).
    import weakref

    device = SimulatedDevice(64 * MiB)
    alloc = CachingAllocator(device)
    alloc.free(alloc.malloc(40 * MiB))  # cached: the next large request needs it released

    class Local:
        pass

    def caller():
        local = Local()
        return weakref.ref(local), alloc.malloc(50 * MiB)  # provider OOM, then a retry

    ref, block = caller()
    assert alloc.memory_stats()["num_alloc_retries"] == 1
    assert ref() is None
    alloc.free(block)
