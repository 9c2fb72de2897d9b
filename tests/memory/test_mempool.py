"""User pools: routing, privacy, emptying, lifetime, threads."""

from __future__ import annotations

import gc
import threading

import pytest

from shmshare.memory import (
    CachingAllocator,
    MemPool,
    OutOfMemoryError,
    SimulatedDevice,
    current_mem_pool,
    use_mem_pool,
)

MiB = 1 << 20


def pool_ids(alloc: CachingAllocator) -> list[tuple[int, int]]:
    return [s["segment_pool_id"] for s in alloc.memory_snapshot()["segments"]]


def test_allocations_inside_the_context_use_the_pool(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    pool = MemPool()
    with use_mem_pool(pool) as active:
        assert active is pool and current_mem_pool() is pool
        inside = alloc.malloc(3 * MiB)
    assert current_mem_pool() is None
    outside = alloc.malloc(3 * MiB)
    assert inside.segment is not outside.segment  # a pool never shares segments
    assert sorted(pool_ids(alloc)) == sorted([(0, 0), pool.id])
    alloc.free(inside)  # back into the pool, even outside the context
    assert alloc.malloc(3 * MiB).segment is outside.segment
    alloc.check_invariants()


def test_contexts_nest_and_restore(device: SimulatedDevice) -> None:
    outer, inner = MemPool(), MemPool()
    with use_mem_pool(outer):
        with use_mem_pool(inner):
            assert current_mem_pool() is inner
        assert current_mem_pool() is outer
    assert current_mem_pool() is None
    with pytest.raises(TypeError), use_mem_pool("not a pool"):  # type: ignore[arg-type]
        pass


def test_the_current_pool_is_per_thread(device: SimulatedDevice) -> None:
    seen = []
    with use_mem_pool(MemPool()):
        thread = threading.Thread(target=lambda: seen.append(current_mem_pool()))
        thread.start()
        thread.join(timeout=10)
    assert seen == [None]


def test_empty_cache_keeps_a_live_pool_and_empties_it_on_request(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    pool = MemPool()
    with use_mem_pool(pool):
        alloc.free(alloc.malloc(3 * MiB))
    alloc.free(alloc.malloc(3 * MiB))
    alloc.empty_cache()
    assert pool_ids(alloc) == [pool.id]
    alloc.empty_cache(pool)
    assert pool_ids(alloc) == [] and device.used == 0
    alloc.empty_cache(MemPool())  # a pool this allocator never saw: nothing to do
    alloc.check_invariants()


def test_a_dropped_pool_is_released_by_the_next_empty_cache(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    pool = MemPool()
    with use_mem_pool(pool):
        alloc.free(alloc.malloc(3 * MiB))
    del pool
    gc.collect()
    alloc.empty_cache()
    assert pool_ids(alloc) == [] and alloc._private == {}
    alloc.check_invariants()


def test_a_block_outliving_its_dropped_pool_still_frees(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    pool = MemPool()
    with use_mem_pool(pool):
        block = alloc.malloc(3 * MiB)
    del pool
    gc.collect()
    alloc.empty_cache()  # the pool's segment is in use: kept, and so is the pool
    assert len(alloc._private) == 1
    alloc.free(block)
    alloc.empty_cache()
    assert alloc._private == {} and device.used == 0


def test_requests_inside_a_pool_do_not_borrow_from_other_pools() -> None:
    device = SimulatedDevice(100 * MiB)
    alloc = CachingAllocator(device)
    lender = MemPool(use_on_oom=True)
    with use_mem_pool(lender):
        alloc.free(alloc.malloc(60 * MiB))
    with use_mem_pool(MemPool()), pytest.raises(OutOfMemoryError):
        alloc.malloc(60 * MiB)
    alloc.check_invariants()


def test_pools_show_in_stats(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    with use_mem_pool(MemPool()):
        alloc.malloc(3 * MiB)
    assert alloc.memory_stats()["allocated_bytes.large_pool.current"] == 3 * MiB
    assert repr(MemPool(use_on_oom=True)).endswith("use_on_oom=True)")


def test_a_pool_open_on_another_thread_routes_only_that_thread(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    pool = MemPool()
    entered, release = threading.Event(), threading.Event()
    theirs: list[object] = []

    def other() -> None:
        with use_mem_pool(pool):
            theirs.append(alloc.malloc(3 * MiB))
            entered.set()
            release.wait(timeout=10)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert entered.wait(timeout=10)
        mine = alloc.malloc(3 * MiB)  # another thread's context is open; this one has none
        assert current_mem_pool() is None and mine.pool.owner is None
        with use_mem_pool(MemPool()) as own:
            assert alloc.malloc(3 * MiB).pool.owner.id == own.id  # type: ignore[union-attr]
    finally:
        release.set()
        thread.join(timeout=10)
    assert not thread.is_alive() and theirs[0].pool.owner.id == pool.id  # type: ignore[attr-defined]
    assert current_mem_pool() is None and alloc.malloc(3 * MiB).pool.owner is None
    alloc.check_invariants()


def test_a_context_left_by_an_exception_is_closed(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    with pytest.raises(RuntimeError), use_mem_pool(MemPool()):
        raise RuntimeError("leave")
    assert current_mem_pool() is None and alloc.malloc(3 * MiB).pool.owner is None
