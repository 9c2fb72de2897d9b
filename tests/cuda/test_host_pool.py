"""The pinned-host pool's policy, on the host fallback provider (no CUDA needed)."""

from __future__ import annotations

import gc
import itertools
import random
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from shmshare.memory import OutOfMemoryError, SimulatedStream
from shmshare.memory._host import CachingHostAllocator, HostBlock
from shmshare.memory._host_fallback import AnonymousMemory, HostFallbackProvider
from shmshare.testing import wait_until

MiB = 1 << 20
WAIT = 10.0  # seconds any bounded wait may take before the test fails


@pytest.fixture
def provider() -> Iterator[HostFallbackProvider]:
    p = HostFallbackProvider()
    yield p
    p.close()


def make_pool(provider: HostFallbackProvider, config: str = "", **kw: float) -> CachingHostAllocator:
    return CachingHostAllocator(provider, config, **kw)


def busy(provider: HostFallbackProvider) -> SimulatedStream:
    stream = provider.new_stream()
    stream.enqueue()
    return stream


# --- size classes --------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, size", [(1, 1), (2, 2), (3, 4), (1000, 1024), (4096, 4096),
                                          (4097, 8192), (MiB + 1, 2 * MiB)])
def test_sizes_round_up_to_a_power_of_two(provider: HostFallbackProvider, nbytes: int, size: int) -> None:
    with make_pool(provider) as pool:
        block = pool.allocate(nbytes)
        assert (block.size, block.requested_size) == (size, nbytes)
        pool.free(block)
        pool.check_invariants()


def test_a_freed_block_serves_its_size_class_only(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        block = pool.allocate(3000)  # class 4096
        address = block.address
        pool.free(block)
        other = pool.allocate(5000)  # class 8192: must not take it
        assert other.address != address
        same = pool.allocate(2049)  # class 4096 again: takes it, no provider call
        assert same.address == address and provider.statistics().allocations == 2
        for b in (other, same):
            pool.free(b)
        pool.check_invariants()


def test_free_lists_hand_out_the_last_freed_block_first(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        blocks = [pool.allocate(4096) for _ in range(3)]
        for b in blocks:
            pool.free(b)
        assert pool.allocate(4096).address == blocks[-1].address  # LIFO: the warmest block


def test_zero_bytes_give_an_empty_block_without_memory(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        block = pool.allocate(0)
        assert (block.address, block.size) == (0, 0) and len(block.view()) == 0
        pool.free(block)
        assert provider.statistics().allocations == 0


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1 << 63, ValueError), (1.5, TypeError),
                                        (True, TypeError), ("8", TypeError)])
def test_bad_sizes_are_refused(provider: HostFallbackProvider, bad: object, error: type) -> None:
    with make_pool(provider) as pool, pytest.raises(error):
        pool.allocate(bad)  # type: ignore[arg-type]


def test_bad_frees_and_providers_are_refused(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool, make_pool(HostFallbackProvider()) as other:
        block = pool.allocate(64)
        with pytest.raises(ValueError, match="did not allocate"):
            other.free(block)
        pool.free(block)
        with pytest.raises(ValueError, match="double free"):
            pool.free(block)
        with pytest.raises(ValueError, match="did not allocate"):
            pool.free("block")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="record_event"):
        CachingHostAllocator(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="background_interval"):
        CachingHostAllocator(provider, background_interval=0)


# --- events ----------------------------------------------------------------------------------


def test_a_block_used_on_a_busy_stream_waits_for_it(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        stream = busy(provider)
        block = pool.allocate(4096)
        assert pool.record_event(block, stream)
        pool.free(block)
        pool.check_invariants()
        other = pool.allocate(4096)
        assert other.address != block.address, "a block was reused before its stream finished"
        stats = pool.host_memory_stats()
        assert stats["allocated.current"] == 2 and stats["segment.current"] == 2
        stream.run()
        again = pool.allocate(4096)  # process_events at allocate returns it first
        assert again is block and again.allocated
        pool.check_invariants()
        pool.free(other)
        pool.free(again)


def test_events_are_recorded_only_at_free_once_per_stream(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        s1, s2 = busy(provider), busy(provider)
        block = pool.allocate(100)
        for stream in (s1, s2, s1, s1):  # many uses, two streams
            assert pool.record_event(block.address, stream)
        assert provider.statistics().events == 0  # lazy: nothing recorded yet
        pool.free(block)
        assert provider.statistics().events == 2 and block.event_count == 2
        s1.run()
        pool.process_events()
        assert block.event_count >= 1 and not block.allocated  # still pending on s2
        s2.run()
        pool.process_events()
        assert block.event_count == 0
        pool.check_invariants()


def test_record_event_on_foreign_memory_says_false(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        block = pool.allocate(100)
        assert not pool.record_event(block.address + 8, provider.default_stream())
        with pytest.raises(TypeError):
            pool.record_event("0x10", provider.default_stream())  # type: ignore[arg-type]
        pool.free(block)
        with pytest.raises(ValueError, match="not allocated"):
            pool.record_event(block, provider.default_stream())


def test_a_bad_stream_fails_the_free_and_changes_nothing(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        block = pool.allocate(100)
        pool.record_event(block, "not a stream")
        with pytest.raises(ValueError, match="not a stream of this provider"):
            pool.free(block)
        assert block.allocated
        pool.check_invariants()
        block.streams.clear()
        pool.free(block)


def test_processing_stops_at_the_oldest_unfinished_event(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        slow, fast = busy(provider), busy(provider)
        first, second = pool.allocate(64), pool.allocate(64)
        pool.record_event(first, slow)
        pool.record_event(second, fast)
        pool.free(first)
        pool.free(second)
        fast.run()
        pool.process_events()  # FIFO, as PyTorch: `second` waits behind `first`
        assert second.event_count == 1
        slow.run()
        pool.process_events()
        assert first.event_count == second.event_count == 0
        pool.check_invariants()


# --- background thread ------------------------------------------------------------------------


def test_the_background_thread_returns_blocks_without_allocations(provider: HostFallbackProvider) -> None:
    with make_pool(provider, "pinned_use_background_threads:True", background_interval=0.01) as pool:
        warm = pool.allocate(64)  # a miss starts the thread
        stream = busy(provider)
        block = pool.allocate(4096)
        pool.record_event(block, stream)
        pool.free(block)
        assert pool._thread is not None and pool._thread.is_alive()
        stream.run()
        wait_until(lambda: block.event_count == 0, "the background thread returning the block", WAIT)
        pool.check_invariants()
        pool.free(warm)
    assert pool._thread is None


def test_with_background_threads_a_miss_drains_only_its_size(provider: HostFallbackProvider) -> None:
    # A long interval keeps the thread out of the way: the allocate itself must find the block.
    with make_pool(provider, "pinned_use_background_threads:True", background_interval=3600) as pool:
        small_stream, big_stream = busy(provider), busy(provider)
        small, big = pool.allocate(64), pool.allocate(8192)
        pool.record_event(small, small_stream)
        pool.record_event(big, big_stream)
        pool.free(small)
        pool.free(big)
        small_stream.run()
        big_stream.run()
        again = pool.allocate(8192)
        assert again is big and small.event_count == 1  # the 64-byte event was not even queried
        pool.free(again)
        pool.check_invariants()


def test_a_background_error_reaches_the_next_allocate(provider: HostFallbackProvider,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with make_pool(provider, "pinned_use_background_threads:True", background_interval=0.01) as pool:
        pool.free(pool.allocate(64))
        stream = busy(provider)
        block = pool.allocate(4096)
        pool.record_event(block, stream)
        pool.free(block)

        def broken(event: object) -> bool:
            raise RuntimeError("driver went away")

        monkeypatch.setattr(provider, "event_done", broken)
        wait_until(lambda: pool._background_error is not None, "the thread catching the error", WAIT)
        with pytest.raises(RuntimeError, match="driver went away"):
            pool.allocate(64)
        monkeypatch.undo()
        stream.run()


def test_the_thread_ends_when_the_pool_is_collected(provider: HostFallbackProvider) -> None:
    pool = make_pool(provider, "pinned_use_background_threads:True", background_interval=0.01)
    pool.free(pool.allocate(64))
    thread = pool._thread
    assert thread is not None
    pool.empty_cache()
    del pool
    gc.collect()
    thread.join(WAIT)
    assert not thread.is_alive()


# --- reserve segment ---------------------------------------------------------------------------


def test_requests_are_carved_from_the_reserve_segment_first(provider: HostFallbackProvider) -> None:
    with make_pool(provider, "pinned_reserve_segment_size_mb:1") as pool:
        blocks = [pool.allocate(n) for n in (100, 5000, 64 * 1024)]
        base = min(b.address for b in blocks)
        assert provider.statistics().allocations == 1  # the reserve itself, nothing else
        assert all(b.carved and (b.address - base) % 4096 == 0 for b in blocks)
        assert [b.address - base for b in blocks] == [0, 4096, 4096 + 8192]
        pool.check_invariants()
        big = pool.allocate(MiB)  # does not fit what is left: the provider serves it
        assert not big.carved and provider.statistics().allocations == 2
        for b in (*blocks, big):
            pool.free(b)
        pool.empty_cache()  # carved blocks stay cached: giving them back frees nothing
        assert provider.statistics().frees == 1
        assert pool.allocate(100).address == blocks[0].address
        pool.check_invariants()


def test_close_gives_the_reserve_back_once_no_carved_block_is_in_use(provider: HostFallbackProvider) -> None:
    pool = make_pool(provider, "pinned_reserve_segment_size_mb:1")
    held = pool.allocate(100)
    pool.close()
    assert provider.statistics().live == 1  # a carved block is still in use: the reserve stays
    pool.free(held)
    pool.close()
    assert provider.statistics().live == 0
    assert pool.host_memory_stats()["segment.current"] == 0


def test_a_reserve_that_cannot_be_had_is_reported(provider: HostFallbackProvider) -> None:
    small = HostFallbackProvider(limit=MiB)
    with make_pool(small, "pinned_reserve_segment_size_mb:2") as pool, \
            pytest.raises(OutOfMemoryError, match="reserve segment"):
        pool.allocate(64)


# --- statistics -------------------------------------------------------------------------------


def test_stats_have_pytorchs_keys(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        keys = set(pool.host_memory_stats())
    stats = {f"{n}.{f}" for n in ("allocated", "allocated_bytes", "segment", "reserved_bytes")
             for f in ("current", "peak", "allocated", "freed")}
    times = {f"{n}.{f}" for n in ("host_alloc_time", "host_free_time") for f in ("total", "max", "min", "count", "avg")}
    assert keys == stats | times | {"num_host_alloc", "num_host_free"}


def test_stats_follow_blocks_through_their_life(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        stream = busy(provider)
        a, b = pool.allocate(1000), pool.allocate(3000)
        pool.record_event(b, stream)
        pool.free(a)
        pool.free(b)
        s = pool.host_memory_stats()
        assert (s["allocated.current"], s["allocated.peak"], s["allocated.freed"]) == (1, 2, 1)  # b pending
        assert (s["allocated_bytes.current"], s["segment.current"], s["reserved_bytes.current"]) == (4096, 2, 5120)
        assert (s["num_host_alloc"], s["host_alloc_time.count"]) == (2, 2)
        stream.run()
        pool.empty_cache()
        s = pool.host_memory_stats()
        assert (s["allocated.current"], s["segment.current"], s["segment.freed"]) == (0, 0, 2)
        assert (s["num_host_free"], s["host_free_time.count"], s["reserved_bytes.peak"]) == (2, 2, 5120)
        assert s["host_alloc_time.min"] <= s["host_alloc_time.avg"] <= s["host_alloc_time.max"]
        pool.reset_peak_stats()
        pool.reset_accumulated_stats()
        s = pool.host_memory_stats()
        assert (s["reserved_bytes.peak"], s["segment.allocated"], s["num_host_alloc"],
                s["host_free_time.count"]) == (0, 0, 0, 0)


# --- out of memory, arrays, threads, churn --------------------------------------------------------


def test_out_of_memory_empties_the_cache_and_retries_once() -> None:
    limited = HostFallbackProvider(limit=5 * MiB // 2)
    with make_pool(limited) as pool:
        pool.free(pool.allocate(2 * MiB))  # cached, and in the way of a 1 MiB block
        block = pool.allocate(MiB)
        stats = limited.statistics()
        assert (stats.ooms, stats.frees, stats.allocations) == (1, 1, 2)
        assert pool.host_memory_stats()["segment.current"] == 1
        pool.free(block)
        pool.check_invariants()


def test_out_of_memory_after_the_retry_is_reported() -> None:
    limited = HostFallbackProvider(limit=5 * MiB // 2)
    with make_pool(limited) as pool:
        held = pool.allocate(2 * MiB)
        with pytest.raises(OutOfMemoryError, match="pinned host pool out of memory") as info:
            pool.allocate(MiB)
        assert isinstance(info.value, MemoryError) and info.value.requested == MiB
        assert limited.statistics().ooms == 2  # the first try and the retry
        pool.check_invariants()
        pool.free(held)


def test_an_array_frees_its_block_when_it_dies(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        arr = pool.empty((256, 4), np.float32)
        arr[:] = 7
        view = arr[10:20]
        address = arr.__array_interface__["data"][0]
        assert pool.block_of(address).allocated
        del arr
        assert pool.block_of(address).allocated  # a view still lives
        assert view.sum() == 7 * 40
        del view
        assert not pool.block_of(address).allocated
        assert pool.empty(0).size == 0
        pool.check_invariants()


def test_concurrent_threads_keep_the_books(provider: HostFallbackProvider) -> None:
    with make_pool(provider) as pool:
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(300):
                    block = pool.allocate(rng.choice((64, 1000, 4096, 70_000)))
                    block.view()[:8] = seed.to_bytes(8, "little")
                    assert bytes(block.view()[:8]) == seed.to_bytes(8, "little")
                    pool.free(block)
            except BaseException as exc:  # noqa: BLE001 - the main thread fails on it
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 6)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        pool.check_invariants()
        assert pool.host_memory_stats()["allocated.current"] == 0


def test_seeded_churn_with_streams_keeps_every_invariant(provider: HostFallbackProvider) -> None:
    rng = random.Random(20240605)
    with make_pool(provider, "pinned_reserve_segment_size_mb:1") as pool:
        streams = [provider.new_stream() for _ in range(3)]
        live: list[HostBlock] = []
        for step in range(600):
            roll = rng.random()
            if live and roll < 0.4:
                block = live.pop(rng.randrange(len(live)))
                assert bytes(block.view()[:4]) == tag(block), "block contents clobbered"
                pool.free(block)
            elif roll < 0.5:
                stream = rng.choice(streams)
                stream.enqueue() if rng.random() < 0.5 else stream.run()
            else:
                block = pool.allocate(rng.choice((1, 100, 4096, 5000, 300_000)))
                block.view()[:4] = tag(block)
                if rng.random() < 0.3:
                    pool.record_event(block, rng.choice(streams))
                live.append(block)
            pool.check_invariants()
            addresses = sorted((b.address, b.size) for b in live)
            assert all(a + s <= b for (a, s), (b, _) in itertools.pairwise(addresses)), f"overlap at step {step}"
        for block in live:
            pool.free(block)
        for stream in streams:
            stream.run()
        pool.empty_cache()
        pool.check_invariants()


def tag(block: HostBlock) -> bytes:
    """Return the pattern a churned block carries: its address, cut to its size."""
    return block.address.to_bytes(8, "little")[:min(4, block.requested_size)]


def test_anonymous_memory_is_page_aligned_and_refuses_bad_sizes() -> None:
    memory = AnonymousMemory(5000)
    assert memory.address % 4096 == 0 and memory.length == 8192
    memory.close()
    memory.close()
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError):
            AnonymousMemory(bad)  # type: ignore[arg-type]


def test_the_fallback_provider_refuses_foreign_handles_and_events(provider: HostFallbackProvider) -> None:
    with pytest.raises(ValueError, match="not live memory"):
        provider.free(AnonymousMemory(10))
    with pytest.raises(ValueError, match="not an event"):
        provider.event_done(object())
    with pytest.raises(ValueError, match="limit"):
        HostFallbackProvider(limit=0)
