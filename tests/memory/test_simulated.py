"""SimulatedDevice: streams, events, capacity, addresses, and the provider rules it enforces."""

from __future__ import annotations

import itertools

import pytest

from shmshare.memory import (
    ExpandableProvider,
    Provider,
    ProviderOutOfMemory,
    SimulatedDevice,
    SimulatedDeviceError,
)

MiB = 1 << 20


def test_it_is_an_expandable_provider() -> None:
    device = SimulatedDevice(MiB)
    assert isinstance(device, Provider) and isinstance(device, ExpandableProvider)


def test_events_complete_with_the_work_before_them() -> None:
    device = SimulatedDevice(MiB)
    stream = device.new_stream()
    stream.enqueue(2)
    event = device.record_event(stream)
    stream.enqueue()
    later = device.record_event(stream)
    assert not device.event_done(event)
    assert stream.run(1) == 1 and not device.event_done(event)
    assert stream.run(1) == 1 and device.event_done(event) and not device.event_done(later)
    assert stream.run() == 1 and device.event_done(later) and stream.pending == 0
    assert stream.run() == 0


def test_an_event_on_an_idle_stream_is_done_at_once() -> None:
    device = SimulatedDevice(MiB)
    assert device.event_done(device.record_event(device.new_stream()))


def test_synchronize_completes_one_stream_or_all() -> None:
    device = SimulatedDevice(MiB)
    a, b = device.new_stream(), device.new_stream()
    a.enqueue(3)
    b.enqueue(2)
    device.synchronize(a)
    assert a.pending == 0 and b.pending == 2
    device.synchronize()
    assert b.pending == 0
    assert list(device.log) == [("synchronize", a.id), ("synchronize", None)]


def test_capacity_is_enforced_in_2_mib_granules() -> None:
    device = SimulatedDevice(10 * MiB)
    _, handle = device.allocate(3 * MiB)
    assert device.used == 4 * MiB and device.free_bytes() == 6 * MiB
    with pytest.raises(ProviderOutOfMemory, match=r"4\.00 MiB of 10\.00 MiB in use"):
        device.allocate(7 * MiB)
    assert device.used == 4 * MiB and device.statistics().ooms == 1
    device.free(handle)
    assert device.used == 0


def test_addresses_are_aligned_disjoint_and_reused() -> None:
    device = SimulatedDevice(100 * MiB)
    sizes = (2 * MiB, 6 * MiB, 2 * MiB)
    ranges = [device.allocate(size) for size in sizes]
    spans = sorted((address, address + size) for (address, _), size in zip(ranges, sizes, strict=True))
    assert all(start % (2 * MiB) == 0 for start, _ in spans)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end + 2 * MiB <= start  # disjoint, with a guard gap between
    device.free(ranges[1][1])
    assert device.allocate(4 * MiB)[0] == ranges[1][0]  # first fit reuses the hole


def test_expandable_reservations_map_and_unmap_pages() -> None:
    device = SimulatedDevice(50 * MiB)
    _, handle = device.reserve(100 * MiB)  # reserving counts nothing
    assert device.used == 0
    device.map(handle, 20 * MiB, 40 * MiB)
    assert device.used == 40 * MiB
    with pytest.raises(ProviderOutOfMemory):
        device.map(handle, 0, 20 * MiB)
    assert device.used == 40 * MiB  # all or nothing
    device.unmap(handle, 20 * MiB, 20 * MiB)
    device.map(handle, 0, 10 * MiB)
    assert device.used == 30 * MiB
    with pytest.raises(SimulatedDeviceError, match="pages still mapped"):
        device.release(handle)
    device.unmap(handle, 0, 10 * MiB)
    device.unmap(handle, 40 * MiB, 20 * MiB)
    device.release(handle)
    stats = device.statistics()
    assert (stats.reserves, stats.maps, stats.unmaps, stats.releases) == (1, 2, 3, 1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d, h: d.map(h, MiB, 2 * MiB), "unaligned"),
        (lambda d, h: d.map(h, 0, 200 * MiB), "outside"),
        (lambda d, h: d.unmap(h, 0, 2 * MiB), "not wholly mapped"),
        (lambda d, h: d.map(999, 0, 2 * MiB), "unknown"),
        (lambda d, h: d.free(h), "unknown or freed"),
        (lambda d, h: d.reserve(3 * MiB), "multiple of 2 MiB"),
        (lambda d, h: d.record_event("stream"), "not a stream of this device"),
        (lambda d, h: d.record_event(SimulatedDevice(1).default_stream()), "not a stream of this device"),
        (lambda d, h: d.event_done(object()), "not an event"),
        (lambda d, h: d.synchronize("x"), "not a stream"),
    ],
)
def test_rule_breaking_calls_are_refused(call, message: str) -> None:
    device = SimulatedDevice(100 * MiB)
    _, handle = device.reserve(100 * MiB)
    with pytest.raises(SimulatedDeviceError, match=message):
        call(device, handle)


def test_a_map_twice_is_refused() -> None:
    device = SimulatedDevice(100 * MiB)
    _, handle = device.reserve(20 * MiB)
    device.map(handle, 0, 2 * MiB)
    with pytest.raises(SimulatedDeviceError, match="already mapped"):
        device.map(handle, 0, 4 * MiB)
    with pytest.raises(ValueError):
        SimulatedDevice(-1)
    with pytest.raises(ValueError):
        device.new_stream().enqueue(-1)
    assert "SimulatedDevice" in repr(device) and "pending" in repr(device.default_stream())
