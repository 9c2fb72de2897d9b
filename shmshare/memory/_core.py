"""State and primitives shared by the allocator's parts.

:class:`AllocatorCore` holds everything one allocator knows (pools, active
blocks, segments, event queues, statistics, trace) and the primitives that
every path uses: merging a block with a free neighbour, returning a block to
its pool, recording and draining events. ``_reclaim.py`` (giving memory
back), ``_expandable.py`` (expandable segments) and ``_allocator.py`` (the
public API and the malloc/free paths) build on it.

Precondition of every method here: the caller holds ``self._lock``.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ._block import Block, BlockPool, SegmentRecord
from ._config import AllocatorConfig
from ._mempool import PrivatePool
from ._provider import Provider, ProviderOutOfMemory
from ._snapshot import TraceRecorder
from ._stats import ALL, MemoryStats

__all__ = ["AllocatorCore", "MemoryEvent"]


@dataclass(frozen=True, slots=True)
class MemoryEvent:
    """Tell an observer what the allocator just did.

    ``action`` is ``"alloc"``, ``"free"`` (the caller's free; the block may
    still wait for events) or ``"oom"``. ``size`` is the block size (for
    ``"oom"``, the bytes that could not be had). The totals are over every
    pool of the allocator, after the action.
    """

    action: str  # "alloc", "free" or "oom"
    address: int  # the block's address (0 for "oom")
    size: int  # bytes
    stream: Hashable  # the block's stream, or the stream of the failed request
    allocated_bytes: int  # allocated_bytes.all.current after the action
    reserved_bytes: int  # reserved_bytes.all.current after the action


Observer = Callable[[MemoryEvent], None]


class AllocatorCore:
    """Hold one allocator's state and the primitives its paths share."""

    def __init__(self, provider: Provider, config: AllocatorConfig) -> None:
        self.provider = provider  # where segments come from
        self.config = config  # settings, fixed for the allocator's life
        self.name: str = getattr(provider, "name", type(provider).__name__)
        self.stats = MemoryStats()
        self._hot = self.stats.hot  # [pool.stat_type]: what malloc and free count
        # The settings the hot path reads, as plain attributes: the config is
        # frozen for the allocator's life, and two lookups per use add up.
        self._max_split = config.max_split_size
        self._max_non_split = config.max_non_split_rounding
        self._expandable = config.expandable_segments
        self._rounding = bool(config.roundup_power2_divisions)
        self._lock = threading.RLock()
        self._small = BlockPool(True)  # default pool, requests <= 1 MiB
        self._large = BlockPool(False)  # default pool, larger requests
        self._private: dict[tuple[int, int], PrivatePool] = {}  # MemPool id -> its pools
        self._active: set[Block] = set()  # allocated blocks and blocks waiting on events
        self._segments: set[SegmentRecord] = set()  # every live provider segment
        self._events: dict[Hashable, deque[tuple[object, Block]]] = {}  # per stream, in record order
        self._stream_ids: dict[Hashable, int] = {}
        self._default_stream = provider.default_stream()
        self._stream_id(self._default_stream)  # the default stream is 0
        self._counter = itertools.count(1)  # block registration counter
        self._trace: TraceRecorder | None = None  # memory history, when recording
        self._observers: list[Observer] = []
        self._callbacks: list[Callable[[], bool]] = []  # free-memory callbacks
        self._total_reserved = 0  # bytes backed by the provider (PyTorch's total_allocated_memory)
        self._last_provider_error: ProviderOutOfMemory | None = None
        self._gc_on = config.garbage_collection_threshold > 0 and provider.capacity() is not None
        self._debug = os.environ.get("SHMSHARE_DEBUG", "") not in ("", "0")

    # --- small helpers ---------------------------------------------------------

    def _stream_id(self, stream: Hashable) -> int:
        """Return the small int that orders ``stream`` in the pools (first sight order)."""
        sid = self._stream_ids.get(stream)
        if sid is None:
            sid = self._stream_ids[stream] = len(self._stream_ids)
        return sid

    @staticmethod
    def _pool_id(pool: BlockPool) -> tuple[int, int]:
        return (0, 0) if pool.owner is None else pool.owner.id

    def _all_pools(self) -> list[BlockPool]:
        """Return the default pools and every private pool."""
        pools = [self._small, self._large]
        for private in self._private.values():
            pools.extend(private.pools())
        return pools

    def _all_blocks(self) -> list[Block]:
        """Return every mapped block: cached ones and active ones."""
        blocks = list(self._active)
        for pool in self._all_pools():
            blocks.extend(pool.blocks())
        return blocks

    def _new_block(self, pool: BlockPool, stream: Hashable, sid: int, size: int, address: int,
                   segment: SegmentRecord) -> Block:
        return Block(pool, stream, sid, size, address, segment, next(self._counter))

    def _notify(self, action: str, address: int, size: int, stream: Hashable) -> None:
        """Tell every observer; callers test ``self._observers`` first, so none costs one ``if``."""
        event = MemoryEvent(
            action,
            address,
            size,
            stream,
            self.stats.allocated_bytes[ALL].current,
            self.stats.reserved_bytes[ALL].current,
        )
        for observer in list(self._observers):
            observer(event)

    # --- merging and freeing ---------------------------------------------------

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """Absorb ``src`` into its neighbour ``dst`` if it is free; return the bytes absorbed.

        Precondition: ``dst`` is in neither of the pool's sets (its key may change).
        """
        if src is None or src.allocated or src.event_count or src.stream_uses or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        dst.size += src.size
        return src.size

    def _free_block(self, block: Block) -> None:
        """Return a freed block, with no events left, to its pool, merging free neighbours."""
        if self._trace is not None:
            self._trace.record("free_completed", block.address, block.requested_size, block.stream_id,
                               self._pool_id(block.pool), block.frames)
        original_size, requested = block.size, block.requested_size
        pool = block.pool
        merged = absorbed = 0  # neighbours merged in, and their bytes
        if block.prev is not None:
            absorbed = self._try_merge_blocks(block, block.prev, pool)
            merged = 1 if absorbed else 0
        if block.next is not None:
            nbytes = self._try_merge_blocks(block, block.next, pool)
            if nbytes:
                merged += 1
                absorbed += nbytes
        self._active.remove(block)
        block.requested_size = 0
        if block.frames:  # nothing mutates a frames list in place, so an empty one can stay
            block.frames = []
        pool.insert(block)
        hot = self._hot[pool.stat_type]
        # inactive_split means "cannot be given back"; whole pages of an
        # expandable segment always can be, so PyTorch leaves them out.
        if not block.segment.expandable:
            if block.prev is not None or block.next is not None:  # still split: a free piece now
                hot.on_split(1 - merged, block.size - absorbed)
            elif merged:
                hot.on_split(-merged, -absorbed)
        hot.on_free_completed(original_size, requested)

    # --- events ----------------------------------------------------------------

    def _insert_events(self, block: Block) -> None:
        """Record an event on every stream that used ``block``; it is free once all complete."""
        streams, block.stream_uses = block.stream_uses, set()
        for stream in streams:
            event = self.provider.record_event(stream)
            block.event_count += 1
            queue = self._events.get(stream)
            if queue is None:
                queue = self._events[stream] = deque()
            queue.append((event, block))

    def _process_events(self) -> None:
        """Free the blocks whose events completed, stopping per stream at the first that has not."""
        done = self.provider.event_done
        for stream in list(self._events):
            queue = self._events[stream]
            while queue:
                event, block = queue[0]
                if not done(event):
                    break  # events of one stream complete in order
                queue.popleft()
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not queue:
                del self._events[stream]

