"""Expandable segments: reserve, map, merge, unmap in three, best fit, release."""

from __future__ import annotations

import pytest

from shmshare.memory import CachingAllocator, OutOfMemoryError, SimulatedDevice

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def alloc(device: SimulatedDevice) -> CachingAllocator:
    return CachingAllocator(device, "expandable_segments:True")


def layout(alloc: CachingAllocator, base: int) -> list[tuple[int, list[tuple[int, str]]]]:
    """Return each mapped range as (offset MiB from base, [(block MiB, state)])."""
    return [
        ((s["address"] - base) // MiB, [(b["size"] // MiB, b["state"]) for b in s["blocks"]])
        for s in alloc.memory_snapshot()["segments"]
    ]


def test_reserve_capacity_and_an_eighth_map_whole_pages(alloc: CachingAllocator,
                                                        device: SimulatedDevice) -> None:
    block = alloc.malloc(3 * MiB)
    assert device.statistics().reserves == 1
    reserve = next(entry for entry in device.log if entry[0] == "reserve")
    assert reserve[2] == -(-(8 * GiB * 9 // 8) // (20 * MiB)) * 20 * MiB  # capacity x 1.125, whole pages
    assert device.used == 20 * MiB  # one large page mapped
    small = alloc.malloc(4096)
    assert device.used == 22 * MiB  # and one 2 MiB small page, in a reservation of its own
    assert alloc.memory_stats()["segment.all.current"] == 2
    assert block.segment.expandable and small.segment is not block.segment
    alloc.check_invariants()


def test_a_segment_grows_at_its_end_and_merges_with_free_neighbours(alloc: CachingAllocator) -> None:
    first = alloc.malloc(3 * MiB)
    base = first.address
    alloc.free(first)
    grown = alloc.malloc(30 * MiB)  # the free 20 MiB page plus one more, merged
    assert grown.address == base
    assert layout(alloc, base) == [(0, [(30, "active_allocated"), (10, "inactive")])]
    assert alloc.memory_stats()["num_device_alloc"] == 2
    alloc.check_invariants()


def test_release_splits_a_free_block_three_ways(alloc: CachingAllocator, device: SimulatedDevice) -> None:
    a, middle, _ = alloc.malloc(3 * MiB), alloc.malloc(54 * MiB), alloc.malloc(3 * MiB)
    base = a.address
    assert layout(alloc, base) == [(0, [(3, "active_allocated"), (54, "active_allocated"), (3, "active_allocated")])]
    alloc.free(middle)
    device.log.clear()
    alloc.empty_cache()
    # the free 3..57 MiB block: mapped before (3..20), the unmapped page (20..40), mapped after (40..57)
    assert layout(alloc, base) == [(0, [(3, "active_allocated"), (17, "inactive")]),
                                   (40, [(17, "inactive"), (3, "active_allocated")])]
    assert list(device.log) == [("synchronize", 0), ("unmap", a.segment.handle, 20 * MiB, 20 * MiB)]
    assert alloc.memory_stats()["reserved_bytes.all.current"] == 40 * MiB == device.used
    alloc.check_invariants()
    again = alloc.malloc(20 * MiB)  # the hole is mapped again and merges with both sides
    assert again.address == base + 3 * MiB
    alloc.check_invariants()


def test_every_unmap_follows_a_synchronize_of_the_segments_stream(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "expandable_segments:True")
    side = device.new_stream()
    blocks = [alloc.malloc(size, stream) for size in (3 * MiB, 45 * MiB, 200_000) for stream in (None, side)]
    for block in blocks:
        alloc.free(block)
    alloc.empty_cache()
    log = list(device.log)
    unmaps = [i for i, entry in enumerate(log) if entry[0] == "unmap"]
    assert unmaps
    for i in unmaps:
        assert log[i - 1][0] == "synchronize", log[i - 3:i + 1]
    assert device.used == 0 and alloc.memory_stats()["segment.all.current"] == 0
    assert device.statistics().releases == device.statistics().reserves == 4
    alloc.check_invariants()


def test_best_fit_prefers_the_block_that_could_grow_least(alloc: CachingAllocator) -> None:
    a = alloc.malloc(10 * MiB)
    address = a.address  # a Block means nothing once freed: the allocator reuses the object
    alloc.malloc(2 * MiB)
    alloc.free(a)  # [free 10][2][free 8][unmapped ...]
    # 8 MiB is the tighter fit, but it sits at the growable end of the segment
    chosen = alloc.malloc(7 * MiB)
    assert chosen.address == address
    alloc.check_invariants()


def test_classic_best_fit_takes_the_tighter_block(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "expandable_segments:False")
    a = alloc.malloc(10 * MiB)  # own 10 MiB segment
    address = a.address
    b = alloc.malloc(3 * MiB)  # 20 MiB segment, 17 MiB free after it
    alloc.free(a)
    chosen = alloc.malloc(10 * MiB)
    assert chosen.address == address and b.allocated


def test_a_run_of_free_and_unmapped_blocks_serves_a_large_request(alloc: CachingAllocator) -> None:
    a, b, c = alloc.malloc(3 * MiB), alloc.malloc(30 * MiB), alloc.malloc(3 * MiB)
    base = a.address
    alloc.free(b)
    alloc.free(c)  # [a 3][free 37][unmapped ...]
    big = alloc.malloc(100 * MiB)  # the free 37 MiB plus new pages above it
    assert big.address == base + 3 * MiB
    assert alloc.memory_stats()["reserved_bytes.all.current"] == 120 * MiB
    alloc.check_invariants()


def test_mapping_that_fails_leaves_the_pool_sound() -> None:
    device = SimulatedDevice(100 * MiB)
    alloc = CachingAllocator(device, "expandable_segments:True")
    kept = alloc.malloc(50 * MiB)
    address = kept.address
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(60 * MiB)
    alloc.check_invariants()
    assert device.used == alloc.memory_stats()["reserved_bytes.all.current"]
    alloc.free(kept)
    assert alloc.malloc(90 * MiB).address == address  # everything merged back into one range
    alloc.check_invariants()


def test_free_blocks_inside_one_page_stay_mapped(alloc: CachingAllocator, device: SimulatedDevice) -> None:
    _, b, _ = alloc.malloc(3 * MiB), alloc.malloc(4 * MiB), alloc.malloc(13 * MiB)
    alloc.free(b)  # [a][free 4][c] all inside the first 20 MiB page
    alloc.empty_cache()
    assert device.statistics().unmaps == 0 and alloc.memory_stats()["reserved_bytes.all.current"] == 20 * MiB
    alloc.check_invariants()


def test_unknown_capacity_reserves_a_bounded_default() -> None:
    class Unbounded(SimulatedDevice):
        def capacity(self) -> None:  # type: ignore[override]
            return None

    device = Unbounded(1 << 40)
    alloc = CachingAllocator(device, "expandable_segments:True")
    alloc.malloc(3 * MiB)
    reserve = next(entry for entry in device.log if entry[0] == "reserve")
    assert reserve[2] == -(-(64 * GiB) // (20 * MiB)) * 20 * MiB
    huge = alloc.malloc(100 * GiB)  # larger than the default reservation: a segment of its own
    assert huge.segment.size >= 100 * GiB
    alloc.check_invariants()


def test_large_pages_follow_large_segment_size(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "expandable_segments:True,large_segment_size_mb:32")
    alloc.malloc(3 * MiB)
    assert device.used == 32 * MiB
