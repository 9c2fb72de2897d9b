"""memory_stats(): PyTorch's key names, and what each statistic counts."""

from __future__ import annotations

from shmshare.memory import CachingAllocator, SimulatedDevice, round_size

MiB = 1 << 20
NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
         "active_bytes", "inactive_split_bytes", "requested_bytes")
FIELDS = ("current", "peak", "allocated", "freed")


def test_keys_are_torch_cuda_memory_stats_keys(device: SimulatedDevice) -> None:
    stats = CachingAllocator(device).memory_stats()
    expected = {f"{n}.{p}.{f}" for n in NAMES for p in ("all", "small_pool", "large_pool") for f in FIELDS}
    expected |= {f"{n}.{f}" for n in ("oversize_allocations", "oversize_segments") for f in FIELDS}
    expected |= {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "max_split_size"}
    assert set(stats) == expected
    assert list(stats) == sorted(stats)
    assert stats["max_split_size"] == -1
    assert CachingAllocator(device, "max_split_size_mb:64").memory_stats()["max_split_size"] == 64 * MiB


def test_current_peak_allocated_freed(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    a, b = alloc.malloc(3 * MiB), alloc.malloc(1000)
    alloc.free(a)
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.all.current"] == 1024
    assert stats["allocated_bytes.all.peak"] == 3 * MiB + 1024
    assert stats["allocated_bytes.all.allocated"] == 3 * MiB + 1024
    assert stats["allocated_bytes.all.freed"] == 3 * MiB
    assert stats["allocated_bytes.small_pool.current"] == 1024
    assert stats["allocated_bytes.large_pool.peak"] == 3 * MiB
    assert stats["requested_bytes.all.current"] == 1000
    assert stats["reserved_bytes.all.current"] == 22 * MiB and stats["segment.all.current"] == 2
    assert stats["num_device_alloc"] == 2 and stats["num_device_free"] == 0
    alloc.reset_peak_stats()
    assert alloc.memory_stats()["allocated_bytes.all.peak"] == 1024
    alloc.reset_accumulated_stats()
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.all.allocated"] == stats["allocated_bytes.all.freed"] == 0
    assert stats["num_device_alloc"] == 0 and stats["allocated_bytes.all.current"] == 1024
    assert b.allocated


def test_inactive_split_counts_free_pieces_of_split_segments(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    a, b = alloc.malloc(3 * MiB), alloc.malloc(3 * MiB)
    stats = alloc.memory_stats()
    assert stats["inactive_split.all.current"] == 1 and stats["inactive_split_bytes.all.current"] == 14 * MiB
    alloc.free(a)
    stats = alloc.memory_stats()
    assert stats["inactive_split.all.current"] == 2 and stats["inactive_split_bytes.all.current"] == 17 * MiB
    alloc.free(b)  # everything merges: the segment is whole again, not split
    stats = alloc.memory_stats()
    assert stats["inactive_split.all.current"] == 0 and stats["inactive_split_bytes.all.current"] == 0
    alloc.check_invariants()


def test_active_includes_blocks_waiting_on_events(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    side = device.new_stream()
    block = alloc.malloc(MiB)
    alloc.record_stream(block, side)
    side.enqueue()
    alloc.free(block)
    stats = alloc.memory_stats()
    assert stats["allocation.all.current"] == 0 and stats["active.all.current"] == 1
    assert stats["active_bytes.all.current"] == MiB and stats["requested_bytes.all.current"] == MiB
    side.run()
    alloc.process_events()
    assert alloc.memory_stats()["active.all.current"] == 0


def test_oversize_counters(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "max_split_size_mb:64")
    big = alloc.malloc(100 * MiB)
    stats = alloc.memory_stats()
    assert stats["oversize_allocations.current"] == 1 and stats["oversize_segments.current"] == 1
    alloc.free(big)
    alloc.empty_cache()
    stats = alloc.memory_stats()
    assert stats["oversize_allocations.current"] == 0 and stats["oversize_segments.current"] == 0
    assert stats["oversize_segments.peak"] == 1 and stats["num_device_free"] == 1


def test_expandable_segments_count_reservations_and_mapped_bytes(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "expandable_segments:True")
    alloc.malloc(3 * MiB)
    stats = alloc.memory_stats()
    assert stats["segment.all.current"] == 1 and stats["reserved_bytes.all.current"] == 20 * MiB
    assert stats["inactive_split.all.current"] == 0  # as in PyTorch: never counted for expandable
    assert stats["num_device_alloc"] == 1


def test_repr_shows_the_totals(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    alloc.malloc(3 * MiB)
    assert repr(alloc) == "<CachingAllocator over simulated device: 3.00 MiB allocated, 20.00 MiB reserved>"


def test_all_is_the_sum_of_the_pools_with_a_peak_of_its_own(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    small = alloc.malloc(MiB)
    alloc.free(small)
    large = alloc.malloc(3 * MiB)  # the pools peak at different times: "all" never holds 4 MiB
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.small_pool.peak"] == MiB
    assert stats["allocated_bytes.large_pool.peak"] == 3 * MiB
    assert stats["allocated_bytes.all.peak"] == 3 * MiB
    for name in NAMES:
        for field in ("current", "allocated", "freed"):
            pools = stats[f"{name}.small_pool.{field}"] + stats[f"{name}.large_pool.{field}"]
            assert stats[f"{name}.all.{field}"] == pools, (name, field)
        assert stats[f"{name}.all.peak"] >= stats[f"{name}.all.current"]
    alloc.free(large)
    alloc.check_invariants()


def test_freed_counts_from_the_last_reset(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    a, b = alloc.malloc(3 * MiB), alloc.malloc(1000)
    alloc.reset_accumulated_stats()
    alloc.free(a)
    stats = alloc.memory_stats()
    assert stats["allocated_bytes.all.freed"] == stats["allocated_bytes.large_pool.freed"] == 3 * MiB
    assert stats["allocated_bytes.all.allocated"] == 0 and stats["allocated_bytes.small_pool.freed"] == 0
    assert stats["active.all.freed"] == 1 and stats["requested_bytes.all.freed"] == 3 * MiB
    alloc.free(b)
    c = alloc.malloc(1000)
    alloc.reset_accumulated_stats()
    stats = alloc.memory_stats()
    assert {k: v for k, v in stats.items() if k.endswith((".allocated", ".freed"))} == dict.fromkeys(
        [k for k in stats if k.endswith((".allocated", ".freed"))], 0)
    assert stats["allocated_bytes.all.current"] == 1024 and stats["requested_bytes.small_pool.current"] == 1000
    alloc.free(c)
    assert alloc.memory_stats()["allocated_bytes.small_pool.freed"] == 1024
    alloc.check_invariants()


def test_a_malloc_rounds_as_round_size_does() -> None:
    for config in ("", "roundup_power2_divisions:4"):
        alloc = CachingAllocator(SimulatedDevice(1 << 30), config)
        for nbytes in (0, 1, 511, 512, 513, 1000, 4095, MiB - 1, MiB, MiB + 1, 3 * MiB + 7):
            block = alloc.malloc(nbytes)
            assert block.size == round_size(nbytes, alloc.config), (config, nbytes)
            alloc.free(block)
        alloc.check_invariants()
