"""check_invariants() finds each kind of corruption and names it."""

from __future__ import annotations

import pytest

from shmshare.memory import Block, CachingAllocator, InvariantError, SimulatedDevice

MiB = 1 << 20


@pytest.fixture
def alloc(device: SimulatedDevice) -> CachingAllocator:
    alloc = CachingAllocator(device)
    alloc.malloc(3 * MiB)  # a 20 MiB segment: [3 MiB allocated][17 MiB free]
    return alloc


def free_block(alloc: CachingAllocator) -> Block:
    return alloc._large.blocks()[0]


def test_a_sound_pool_passes(alloc: CachingAllocator) -> None:
    alloc.check_invariants()
    assert issubclass(InvariantError, AssertionError)


def test_a_gap_in_a_segment_breaks_invariant_1(alloc: CachingAllocator) -> None:
    block = free_block(alloc)
    alloc._large.remove(block)
    block.address += 512
    block.size -= 512
    alloc._large.insert(block)
    with pytest.raises(InvariantError, match=r"invariant 1: .* starts at offset 0x300200, .* ends at offset 0x300000"):
        alloc.check_invariants()


def test_a_broken_link_breaks_invariant_1(alloc: CachingAllocator) -> None:
    free_block(alloc).prev = None
    with pytest.raises(InvariantError, match=r"invariant 1: .* prev/next links"):
        alloc.check_invariants()


def test_unmerged_free_neighbours_break_invariant_2(alloc: CachingAllocator) -> None:
    block = free_block(alloc)
    alloc._large.remove(block)
    upper = Block(block.pool, block.stream, block.stream_id, MiB, block.end - MiB, block.segment, 999)
    block.size -= MiB
    upper.prev, block.next = block, upper
    alloc._large.insert(block)
    alloc._large.insert(upper)
    with pytest.raises(InvariantError, match=r"invariant 2: .* adjacent and free but not merged"):
        alloc.check_invariants()


def test_a_lost_block_breaks_invariant_3(alloc: CachingAllocator) -> None:
    alloc._large.remove(free_block(alloc))
    with pytest.raises(InvariantError, match="invariant 1"):  # the tiling notices the hole first
        alloc.check_invariants()


def test_a_stale_key_breaks_invariant_3(alloc: CachingAllocator) -> None:
    free_block(alloc).size += 512  # changed while in the free list
    with pytest.raises(InvariantError, match=r"invariant 3: .* stale key"):
        alloc.check_invariants()


def test_an_allocated_block_in_a_free_list_breaks_invariant_3(alloc: CachingAllocator) -> None:
    (allocated,) = alloc._active
    alloc._active.discard(allocated)
    alloc._large.insert(allocated)
    with pytest.raises(InvariantError, match=r"invariant 3: .* not free and mapped"):
        alloc.check_invariants()


def test_a_page_mapped_behind_the_allocators_back_breaks_invariant_4(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "expandable_segments:True")
    block = alloc.malloc(3 * MiB)
    block.segment.pages[1] = 1  # type: ignore[attr-defined]
    with pytest.raises(InvariantError, match=r"invariant 4: .* covers a mapped page"):
        alloc.check_invariants()


def test_a_wrong_statistic_breaks_invariant_5(alloc: CachingAllocator) -> None:
    alloc.stats.allocated_bytes[2].current += 512
    with pytest.raises(InvariantError, match=r"invariant 5: statistic allocated_bytes\.large_pool is"):
        alloc.check_invariants()


def test_shmshare_debug_checks_after_every_call(device: SimulatedDevice,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMSHARE_DEBUG", "1")
    alloc = CachingAllocator(device)
    block = alloc.malloc(3 * MiB)
    alloc.stats.active[0].current += 1
    with pytest.raises(InvariantError):
        alloc.free(block)
