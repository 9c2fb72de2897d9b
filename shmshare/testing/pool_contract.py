"""The contract suite that every pool provider runs, as RMM's resource tests do.

A provider's whole test file is a few lines::

    from shmshare.memory import SimulatedDevice
    from shmshare.testing.pool_contract import PoolContract

    class TestSimulated(PoolContract):
        def make_provider(self):
            return SimulatedDevice(1 << 30)

    class TestSimulatedExpandable(TestSimulated):
        config = "expandable_segments:True"

Every test builds a :class:`~shmshare.memory.CachingAllocator` over a fresh
provider, runs allocations and frees of mixed sizes, and after every step
calls ``check_invariants()`` and compares the statistics with an independent
walk of ``memory_snapshot()``. Override ``busy_stream`` to run the
stream-event tests, and set ``can_provoke_oom`` where asking for twice the
capacity fails quickly. The same checks run outside pytest through
:func:`run_pool_contract`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest

from shmshare.memory import Block, CachingAllocator, OutOfMemoryError

__all__ = ["PoolContract", "check_against_snapshot", "exercise_mixed_sizes", "run_pool_contract"]

MiB = 1 << 20
# Sizes that land in every size class: tiny, small pool, its edge, 1-10 MiB, large.
MIXED_SIZES = (0, 1, 511, 512, 4096, 100_000, MiB - 1, MiB, MiB + 1, 3 * MiB, 9 * MiB, 12 * MiB, 33 * MiB)


class PoolContract:
    """Run the pool contract against the provider that ``make_provider`` returns."""

    config: str = ""  # settings for the allocator, e.g. "expandable_segments:True"
    steps: int = 200  # random steps in the mixed-size test
    seed: int = 1234  # its seed
    live_limit: int = 256 * MiB  # most bytes allocated at once in the mixed-size test
    can_provoke_oom: bool = False  # set where malloc(2 x capacity) fails quickly

    def make_provider(self) -> Any:
        """Return a fresh provider."""
        raise NotImplementedError("a PoolContract subclass defines make_provider()")

    def close_provider(self, provider: Any) -> None:
        """Release what the provider holds (calls ``close()`` where it has one)."""
        close = getattr(provider, "close", None)
        if callable(close):
            close()

    def busy_stream(self, provider: Any) -> tuple[Hashable, Callable[[], None]] | None:
        """Return a stream with unfinished work and a function that finishes it, or None to skip."""
        return None

    @pytest.fixture
    def allocator(self) -> Iterator[CachingAllocator]:
        provider = self.make_provider()
        allocator = CachingAllocator(provider, self.config)
        try:
            yield allocator
        finally:
            allocator.empty_cache()
            self.close_provider(provider)

    def test_mixed_sizes_keep_invariants(self, allocator: CachingAllocator) -> None:
        exercise_mixed_sizes(allocator, random.Random(self.seed), self.steps, self.live_limit)

    def test_freed_block_is_reused(self, allocator: CachingAllocator) -> None:
        check_reuse(allocator)

    def test_free_neighbours_merge(self, allocator: CachingAllocator) -> None:
        check_merge(allocator)

    def test_empty_cache_returns_everything(self, allocator: CachingAllocator) -> None:
        check_empty_cache(allocator)

    def test_use_on_another_stream_delays_reuse(self, allocator: CachingAllocator) -> None:
        busy = self.busy_stream(allocator.provider)
        if busy is None:
            pytest.skip("the provider defines no busy_stream() for this test")
        check_stream_use(allocator, *busy)

    def test_out_of_memory_is_reported(self, allocator: CachingAllocator) -> None:
        if not self.can_provoke_oom or allocator.provider.capacity() is None:
            pytest.skip("the provider cannot be driven out of memory cheaply (can_provoke_oom)")
        check_oom(allocator)


def run_pool_contract(make_provider: Callable[[], Any], config: str = "", *, steps: int = 200,
                      seed: int = 1234) -> None:
    """Run the provider-independent checks of the contract once, outside pytest."""
    for check in (check_reuse, check_merge, check_empty_cache):
        check(CachingAllocator(make_provider(), config))
    exercise_mixed_sizes(CachingAllocator(make_provider(), config), random.Random(seed), steps, 256 * MiB)


def exercise_mixed_sizes(allocator: CachingAllocator, rng: random.Random, steps: int, live_limit: int) -> None:
    """Allocate and free blocks of mixed sizes at random, checking everything after each step."""
    live: list[Block] = []
    for _ in range(steps):
        in_use = sum(b.size for b in live)
        size = rng.choice(MIXED_SIZES)
        if live and (rng.random() < 0.45 or in_use + size > live_limit):
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            block = allocator.malloc(size)
            assert block.size >= size and block.requested_size == size
            live.append(block)
        allocator.check_invariants()
        check_against_snapshot(allocator)
        _check_disjoint(live)
    for block in live:
        allocator.free(block)
        allocator.check_invariants()
    check_empty_cache(allocator)


def check_against_snapshot(allocator: CachingAllocator) -> None:
    """Compare ``memory_stats()`` with a walk of the blocks in ``memory_snapshot()``."""
    stats = allocator.memory_stats()
    walked: dict[str, int] = {}
    for segment in allocator.memory_snapshot()["segments"]:
        kind = "small_pool" if segment["segment_type"] == "small" else "large_pool"
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
        for key, value in _segment_totals(segment).items():
            for pool in ("all", kind):
                walked[f"{key}.{pool}.current"] = walked.get(f"{key}.{pool}.current", 0) + value
    for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "allocation", "active"):
        for pool in ("all", "small_pool", "large_pool"):
            name = f"{key}.{pool}.current"
            assert stats[name] == walked.get(name, 0), f"{name}: stats {stats[name]}, snapshot {walked.get(name, 0)}"


def check_reuse(allocator: CachingAllocator) -> None:
    """Check that a freed block serves the next request of its size without the provider."""
    for size in (4096, 3 * MiB, 24 * MiB):
        block = allocator.malloc(size)
        address = block.address
        allocator.free(block)
        before = allocator.memory_stats()["num_device_alloc"]
        again = allocator.malloc(size)
        assert again.address == address, "a cached block of the same size was not reused"
        assert allocator.memory_stats()["num_device_alloc"] == before
        allocator.free(again)
        allocator.check_invariants()


def check_merge(allocator: CachingAllocator) -> None:
    """Check that neighbours split from one segment merge back into one free block."""
    blocks = [allocator.malloc(100_000) for _ in range(4)]
    assert len({_segment_of(allocator, b)["address"] for b in blocks}) == 1, "small blocks did not share a segment"
    for block in (blocks[1], blocks[3], blocks[0], blocks[2]):
        allocator.free(block)
        allocator.check_invariants()
    segment = _segment_of(allocator, blocks[0])
    states = [b["state"] for b in segment["blocks"]]
    assert states == ["inactive"], f"free neighbours did not merge: {states}"


def check_empty_cache(allocator: CachingAllocator) -> None:
    """Check that after freeing everything, ``empty_cache`` leaves nothing reserved."""
    blocks = [allocator.malloc(size) for size in (512, 2 * MiB, 12 * MiB)]
    for block in blocks:
        allocator.free(block)
    allocator.empty_cache()
    allocator.check_invariants()
    stats = allocator.memory_stats()
    assert stats["reserved_bytes.all.current"] == 0 and stats["segment.all.current"] == 0
    assert allocator.memory_snapshot()["segments"] == []


def check_stream_use(allocator: CachingAllocator, stream: Hashable, finish: Callable[[], None]) -> None:
    """Check that a block used on a busy stream is not reused before that stream finishes."""
    block = allocator.malloc(MiB)
    address = block.address
    allocator.record_stream(block, stream)
    allocator.free(block)
    allocator.check_invariants()
    states = [b["state"] for s in allocator.memory_snapshot()["segments"] for b in s["blocks"]
              if b["address"] == address]
    assert states == ["active_pending_free"]
    other = allocator.malloc(MiB)
    assert not (other.address <= address < other.address + other.size), "pending block was reused"
    finish()
    allocator.process_events()
    allocator.check_invariants()
    states = [b["state"] for s in allocator.memory_snapshot()["segments"] for b in s["blocks"]]
    assert "active_pending_free" not in states, "the block stayed pending after its stream finished"
    assert allocator.memory_stats()["active.all.current"] == 1
    allocator.free(other)
    allocator.check_invariants()


def check_oom(allocator: CachingAllocator) -> None:
    """Check that an impossible request raises OutOfMemoryError and leaves the pool sound."""
    capacity = allocator.provider.capacity()
    assert capacity is not None
    keep = allocator.malloc(MiB)
    with pytest.raises(OutOfMemoryError) as info:
        allocator.malloc(2 * capacity)
    assert isinstance(info.value, MemoryError)
    assert "out of memory" in str(info.value)
    assert allocator.memory_stats()["num_ooms"] == 1
    allocator.check_invariants()
    allocator.free(keep)
    allocator.free(allocator.malloc(MiB))
    allocator.check_invariants()


def _segment_totals(segment: dict[str, Any]) -> dict[str, int]:
    blocks = segment["blocks"]
    return {
        "reserved_bytes": segment["total_size"],
        "allocated_bytes": segment["allocated_size"],
        "active_bytes": segment["active_size"],
        "requested_bytes": segment["requested_size"],
        "allocation": sum(b["state"] == "active_allocated" for b in blocks),
        "active": sum(b["state"] != "inactive" for b in blocks),
    }


def _segment_of(allocator: CachingAllocator, block: Block) -> dict[str, Any]:
    segments: list[dict[str, Any]] = allocator.memory_snapshot()["segments"]
    for segment in segments:
        if segment["address"] <= block.address < segment["address"] + segment["total_size"]:
            return segment
    raise AssertionError(f"{block!r} is in no segment of the snapshot")


def _check_disjoint(blocks: list[Block]) -> None:
    ordered = sorted(blocks, key=lambda b: b.address)
    for low, high in itertools.pairwise(ordered):
        assert low.address + low.size <= high.address, f"{low!r} overlaps {high!r}"
