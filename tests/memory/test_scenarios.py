"""The seed notes' scenarios, one named test each."""

from __future__ import annotations

from shmshare.memory import CachingAllocator, SimulatedDevice

MiB = 1 << 20
GiB = 1 << 30


def test_a_1_to_10_mib_request_carves_a_20_mib_segment(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "expandable_segments:False")
    first = alloc.malloc(3 * MiB)
    assert alloc.memory_stats()["reserved_bytes.large_pool.current"] == 20 * MiB
    assert first.size == 3 * MiB
    second = alloc.malloc(5 * MiB)  # carved from the same segment's remainder
    assert second.address == first.address + 3 * MiB
    stats = alloc.memory_stats()
    assert stats["segment.all.current"] == 1 and stats["num_device_alloc"] == 1
    assert stats["inactive_split_bytes.large_pool.current"] == 12 * MiB
    alloc.check_invariants()


def test_small_requests_share_a_2_mib_segment(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    blocks = [alloc.malloc(200_000) for _ in range(10)]
    stats = alloc.memory_stats()
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB and stats["segment.small_pool.current"] == 1
    assert all(b.size == 200_192 for b in blocks)
    alloc.check_invariants()


def test_an_oversize_block_is_never_split_and_never_serves_a_small_request(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "max_split_size_mb:64")
    big = alloc.malloc(100 * MiB)
    address = big.address
    alloc.free(big)
    small = alloc.malloc(30 * MiB)  # below max_split_size: must not take the cached 100 MiB block
    assert small.address != address and small.size == 30 * MiB
    oversize = alloc.malloc(90 * MiB)  # oversize request within the rounding limit: takes it whole
    assert oversize.address == address and oversize.size == 100 * MiB and not oversize.is_split()
    stats = alloc.memory_stats()
    assert stats["oversize_allocations.current"] == 1 and stats["oversize_segments.current"] == 1
    alloc.check_invariants()


def test_max_non_split_rounding_bounds_the_waste(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device, "max_split_size_mb:64,max_non_split_rounding_mb:32")
    cached = alloc.malloc(200 * MiB)
    address = cached.address
    alloc.free(cached)
    wasteful = alloc.malloc(150 * MiB)  # 200 >= 150 + 32: would waste 50 MiB, so a new segment
    assert wasteful.address != address and wasteful.size == 150 * MiB
    alloc.free(wasteful)
    fitting = alloc.malloc(180 * MiB)  # 200 < 180 + 32: reuse, wasting under the bound
    assert fitting.address == address and fitting.size - fitting.requested_size < 32 * MiB
    alloc.check_invariants()


def test_a_block_freed_while_in_use_on_another_stream_waits_for_the_event(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    side = device.new_stream()
    block = alloc.malloc(MiB)
    address = block.address
    alloc.record_stream(block, side)
    side.enqueue()  # work on the side stream still uses the block
    alloc.free(block)
    assert alloc.memory_stats()["active.all.current"] == 1  # pending, not free
    other = alloc.malloc(MiB)
    assert other.address != address
    side.run()  # the side stream finishes: the next malloc collects the block
    again = alloc.malloc(MiB)
    assert again.address == address
    alloc.check_invariants()


def test_uses_on_the_allocating_stream_need_no_event(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    block = alloc.malloc(MiB)
    alloc.record_stream(block, device.default_stream())
    alloc.free(block)
    assert device.statistics().events == 0
    assert alloc.memory_stats()["active.all.current"] == 0


def test_events_of_one_stream_drain_in_order_and_streams_do_not_block_each_other(
        device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    slow, fast = device.new_stream(), device.new_stream()
    first, second, third = (alloc.malloc(MiB) for _ in range(3))
    alloc.record_stream(first, slow)
    slow.enqueue()
    alloc.free(first)  # waits for slow's 1st item
    alloc.record_stream(second, slow)
    slow.enqueue()
    alloc.free(second)  # waits for slow's 2nd item
    alloc.record_stream(third, fast)
    fast.enqueue()
    alloc.free(third)
    fast.run()
    slow.run(1)
    alloc.process_events()
    states = {b["address"]: b["state"] for s in alloc.memory_snapshot()["segments"] for b in s["blocks"]}
    assert states[second.address] == "active_pending_free"
    assert first.address not in states or states[first.address] == "inactive"
    assert alloc.memory_stats()["active.all.current"] == 1
    alloc.check_invariants()


def test_a_block_used_on_two_streams_waits_for_both(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    s1, s2 = device.new_stream(), device.new_stream()
    block = alloc.malloc(MiB)
    for stream in (s1, s2):
        alloc.record_stream(block, stream)
        stream.enqueue()
    alloc.free(block)
    s1.run()
    alloc.process_events()
    assert alloc.memory_stats()["active.all.current"] == 1
    s2.run()
    alloc.process_events()
    assert alloc.memory_stats()["active.all.current"] == 0
    alloc.check_invariants()


def test_streams_have_their_own_blocks(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    side = device.new_stream()
    block = alloc.malloc(MiB)
    alloc.free(block)
    on_side = alloc.malloc(MiB, side)  # the cached block belongs to stream 0
    assert on_side.stream is side and on_side.address != block.address
    assert alloc.memory_stats()["segment.small_pool.current"] == 2


def growing_batch(config: str) -> tuple[int, int]:
    """Run the "ExpandableSegment/场景" story; return (peak allocated, peak reserved).

    A model of 20 layers whose activations grow with the batch: each step
    allocates every layer's activation for batch N, then frees them all, and
    the next step does the same for N + 1.
    """
    alloc = CachingAllocator(SimulatedDevice(64 * GiB), config)
    per_sample = [(256 + 64 * i) * 1024 for i in range(20)]  # 0.25 .. 1.44 MiB per sample
    reserved_by_step = []
    for batch in range(8, 33):
        blocks = [alloc.malloc(batch * size) for size in per_sample]
        for block in reversed(blocks):
            alloc.free(block)
        reserved_by_step.append(alloc.memory_stats()["reserved_bytes.all.current"])
        alloc.check_invariants()
    stats = alloc.memory_stats()
    assert reserved_by_step == sorted(reserved_by_step)
    return stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]


def test_growing_batch_with_expandable_segments_stays_near_the_peak() -> None:
    allocated, reserved = growing_batch("expandable_segments:True")
    assert reserved <= 1.15 * allocated, (allocated, reserved)


def test_growing_batch_without_expandable_segments_grows_past_it() -> None:
    allocated, reserved = growing_batch("expandable_segments:False")
    assert reserved > 1.15 * allocated, (allocated, reserved)
