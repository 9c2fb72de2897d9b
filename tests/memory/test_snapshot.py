"""Snapshots in PyTorch's layout, the history ring, observers, and PyTorch's visualizer."""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from shmshare.memory import (
    CachingAllocator,
    MemoryEvent,
    OutOfMemoryError,
    SimulatedDevice,
)

MiB = 1 << 20
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
TRACE_KEYS = {"action", "size", "stream", "time_us", "frames", "pool_id", "compile_context", "user_metadata"}


def busy_history(config: str) -> CachingAllocator:
    """Run a little of everything with history on: every trace action appears."""
    device = SimulatedDevice(100 * MiB)
    alloc = CachingAllocator(device, config)
    alloc.record_memory_history()
    side = device.new_stream()
    kept = alloc.malloc(3 * MiB)
    lent = alloc.malloc(200_000)
    alloc.record_stream(lent, side)
    side.enqueue()
    alloc.free(lent)
    alloc.free(alloc.malloc(45 * MiB))
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(99 * MiB)  # more than is left, even with expandable segments
    alloc.malloc(10 * MiB)
    lent_again = alloc.malloc(300_000)
    alloc.record_stream(lent_again, side)
    side.enqueue()
    alloc.free(lent_again)  # stays pending in the snapshot
    assert kept.allocated
    return alloc


@pytest.mark.parametrize("config", ["expandable_segments:False", "expandable_segments:True"])
def test_snapshot_layout_is_pytorchs(config: str) -> None:
    snapshot = busy_history(config).memory_snapshot()
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings"}
    states = set()
    for segment in snapshot["segments"]:
        assert set(segment) == SEGMENT_KEYS
        assert segment["segment_type"] in ("small", "large") and segment["segment_pool_id"] == (0, 0)
        assert segment["is_expandable"] == config.endswith("True")
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
        address = segment["address"]
        for block in segment["blocks"]:
            assert set(block) == BLOCK_KEYS and block["address"] == address
            address += block["size"]
            states.add(block["state"])
    assert states == {"active_allocated", "active_pending_free", "inactive"}
    assert snapshot["segments"] == sorted(snapshot["segments"], key=lambda s: s["address"])
    (trace,) = snapshot["device_traces"]
    actions = {entry["action"] for entry in trace}
    expected = {"alloc", "free_requested", "free_completed", "oom"}
    expected |= {"segment_map", "segment_unmap"} if config.endswith("True") else {"segment_alloc", "segment_free"}
    assert expected <= actions
    for entry in trace:
        assert set(entry) == TRACE_KEYS | ({"device_free"} if entry["action"] == "oom" else {"addr"})


def test_history_is_a_bounded_ring(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    alloc.record_memory_history(max_entries=5)
    for _ in range(20):
        alloc.free(alloc.malloc(MiB))
    trace = alloc.memory_snapshot()["device_traces"][0]
    assert len(trace) == 5
    assert [e["action"] for e in trace][-2:] == ["free_requested", "free_completed"]
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)


def test_stopping_history_drops_it(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    assert alloc.memory_snapshot()["device_traces"] == [[]]
    alloc.record_memory_history()
    alloc.malloc(MiB)
    alloc.record_memory_history(enabled=False)
    alloc.malloc(MiB)
    assert alloc.memory_snapshot()["device_traces"] == [[]]
    with pytest.raises(ValueError):
        alloc.record_memory_history(max_entries=0)


def test_stacks_record_where_blocks_were_allocated(device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    alloc.record_memory_history(stacks=True)
    alloc.malloc(MiB)
    (block,) = [b for s in alloc.memory_snapshot()["segments"] for b in s["blocks"]
                if b["state"] == "active_allocated"]
    innermost = block["frames"][0]
    assert innermost["filename"] == __file__ and innermost["name"] == "test_stacks_record_where_blocks_were_allocated"
    assert alloc.memory_snapshot()["device_traces"][0][-1]["frames"][0] == innermost


def test_observers_see_every_alloc_free_and_oom() -> None:
    device = SimulatedDevice(40 * MiB)
    alloc = CachingAllocator(device)
    seen: list[MemoryEvent] = []
    alloc.add_observer(seen.append)
    block = alloc.malloc(3 * MiB)
    address = block.address
    alloc.free(block)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(60 * MiB)
    assert [(e.action, e.size) for e in seen] == [("alloc", 3 * MiB), ("free", 3 * MiB), ("oom", 60 * MiB)]
    assert seen[0].address == address and seen[0].stream is device.default_stream()
    assert (seen[0].allocated_bytes, seen[0].reserved_bytes) == (3 * MiB, 20 * MiB)
    assert (seen[1].allocated_bytes, seen[1].reserved_bytes) == (0, 20 * MiB)
    alloc.remove_observer(seen.append)
    alloc.malloc(MiB)
    assert len(seen) == 3


def test_dump_snapshot_writes_a_pickle(tmp_path: Path, device: SimulatedDevice) -> None:
    alloc = CachingAllocator(device)
    alloc.record_memory_history()
    alloc.malloc(MiB)
    path = tmp_path / "snap.pickle"
    alloc.dump_snapshot(path)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    expected = alloc.memory_snapshot()
    assert loaded["segments"] == expected["segments"]
    assert [e["action"] for e in loaded["device_traces"][0]] == ["segment_alloc", "alloc"]


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@needs_torch
@pytest.mark.parametrize("config", ["expandable_segments:False", "expandable_segments:True"])
def test_pytorchs_memory_viz_reads_the_dump(tmp_path: Path, config: str) -> None:
    viz = pytest.importorskip("torch.cuda._memory_viz")
    path = tmp_path / "snap.pickle"
    busy_history(config).dump_snapshot(path)
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert "total_reserved" in viz.segsum(data)  # checks the accounting of every segment
    assert "raise OutOfMemoryError" in viz.trace(data)
    assert "snapshot.pickle" in viz.trace_plot(data) and "snapshot.pickle" in viz.segment_plot(data)


@needs_torch
def test_pytorchs_memory_viz_command_line_renders_the_dump(tmp_path: Path) -> None:
    path, out = tmp_path / "snap.pickle", tmp_path / "out.html"
    busy_history("expandable_segments:True").dump_snapshot(path)
    command = [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)]
    run = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "snapshot.pickle" in out.read_text()
