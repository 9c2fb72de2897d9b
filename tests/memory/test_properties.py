"""Random alloc / free / record_stream / event-completion sequences, invariants after each step.

A model beside the allocator tracks every block freed while in use on other
streams, with the work each stream had then; no new block may overlap one
of them before its streams have done that work.
"""

from __future__ import annotations

import gc
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmshare.memory import (
    Block,
    CachingAllocator,
    MemPool,
    OutOfMemoryError,
    SimulatedDevice,
    use_mem_pool,
)
from shmshare.testing.pool_contract import check_against_snapshot

MiB = 1 << 20
CAPACITY = 160 * MiB  # small enough that OOM and every retry step happen
SIZES = st.one_of(
    st.sampled_from([0, 1, 512, 4096, MiB, MiB + 1, 3 * MiB, 10 * MiB, 21 * MiB, 33 * MiB, 64 * MiB]),
    st.integers(0, 2 * MiB),
    st.integers(2 * MiB, 48 * MiB),
)
STREAM = st.integers(0, 2)


class PoolMachine(RuleBasedStateMachine):
    """Drive one allocator over a simulated device at random."""

    config = "expandable_segments:False"

    def __init__(self) -> None:
        super().__init__()
        self.device = SimulatedDevice(CAPACITY)
        self.alloc = CachingAllocator(self.device, self.config)
        self.streams = [self.device.default_stream(), self.device.new_stream(), self.device.new_stream()]
        self.pool = MemPool(use_on_oom=True)
        self.live: list[Block] = []
        self.pending: list[tuple[int, int, list[tuple[object, int]]]] = []  # (address, size, [(stream, work)])

    @rule(size=SIZES, stream=STREAM, in_pool=st.booleans())
    def malloc(self, size: int, stream: int, in_pool: bool) -> None:
        try:
            if in_pool:
                with use_mem_pool(self.pool):
                    block = self.alloc.malloc(size, self.streams[stream])
            else:
                block = self.alloc.malloc(size, self.streams[stream])
        except OutOfMemoryError:
            return
        assert block.allocated and block.size >= size and block.requested_size == size
        self._check_not_pending(block)
        self.live.append(block)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        uses = [(stream, stream.enqueued) for stream in block.stream_uses]
        if uses:
            self.pending.append((block.address, block.size, uses))
        self.alloc.free(block)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=STREAM, work=st.sampled_from([1, 1, 2, 0]))
    def record_stream(self, data: st.DataObject, stream: int, work: int) -> None:
        block = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        self.alloc.record_stream(block, self.streams[stream])
        self.streams[stream].enqueue(work)

    @rule(stream=STREAM, n=st.one_of(st.none(), st.integers(1, 3)))
    def run(self, stream: int, n: int | None) -> None:
        self.streams[stream].run(n)

    @rule()
    def process_events(self) -> None:
        self.alloc.process_events()

    @rule(pool=st.booleans())
    def empty_cache(self, pool: bool) -> None:
        self.alloc.empty_cache(self.pool if pool else None)

    @invariant()
    def sound(self) -> None:
        self.alloc.check_invariants()
        log = list(self.device.log)
        for i, entry in enumerate(log):
            if entry[0] == "unmap":  # pages go only after their stream's work is done
                assert i > 0 and log[i - 1][0] == "synchronize", log[max(0, i - 3):i + 1]
        self.device.log.clear()
        self._check_pending_kept()
        check_against_snapshot(self.alloc)
        assert self.device.used == self.alloc.memory_stats()["reserved_bytes.all.current"]
        ordered = sorted(self.live, key=lambda b: b.address)
        for low, high in itertools.pairwise(ordered):
            assert low.address + low.size <= high.address, (low, high)

    def teardown(self) -> None:
        for block in self.live:
            self.alloc.free(block)
        self.device.synchronize()
        del self.pool
        gc.collect()
        self.alloc.empty_cache()
        self.alloc.check_invariants()
        assert self.device.used == 0 and self.alloc.memory_stats()["segment.all.current"] == 0

    def _check_pending_kept(self) -> None:
        """Fail unless every freed block whose streams are still busy shows as pending."""
        self.pending = [p for p in self.pending if any(s.completed < work for s, work in p[2])]
        states = {(b["address"], b["size"]): b["state"]
                  for seg in self.alloc.memory_snapshot()["segments"] for b in seg["blocks"]}
        for address, size, _ in self.pending:
            assert states.get((address, size)) == "active_pending_free", f"0x{address:x}+{size} was not kept"

    def _check_not_pending(self, block: Block) -> None:
        """Fail if ``block`` overlaps a freed block whose streams have not done their work."""
        self.pending = [p for p in self.pending if any(s.completed < work for s, work in p[2])]
        for address, size, _ in self.pending:
            assert block.address + block.size <= address or address + size <= block.address, (
                f"{block!r} reuses memory freed at 0x{address:x} before its events completed"
            )


class ExpandableMachine(PoolMachine):
    config = "expandable_segments:True"


class TunedMachine(PoolMachine):
    config = ("max_split_size_mb:24,max_non_split_rounding_mb:22,garbage_collection_threshold:0.5,"
              "roundup_power2_divisions:[1:4,32:8,>:2]")


class TunedExpandableMachine(PoolMachine):
    config = "expandable_segments:True,large_segment_size_mb:10,roundup_power2_divisions:4"


PROPERTY_SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestClassic = PoolMachine.TestCase
TestClassic.settings = PROPERTY_SETTINGS
TestExpandable = ExpandableMachine.TestCase
TestExpandable.settings = PROPERTY_SETTINGS
TestTuned = TunedMachine.TestCase
TestTuned.settings = PROPERTY_SETTINGS
TestTunedExpandable = TunedExpandableMachine.TestCase
TestTunedExpandable.settings = PROPERTY_SETTINGS
