"""The caching allocator: PyTorch's CUDACachingAllocator over any provider.

Note [Caching allocator]
~~~~~~~~~~~~~~~~~~~~~~~~
Asking a provider for memory is slow (a system call, a driver call, a
synchronization), so blocks are cached and reused. The policy is PyTorch's:

- Requests are rounded (``round_size``) and go to the small pool (at most
  1 MiB; 2 MiB segments) or the large pool (1-10 MiB requests share a 20 MiB
  segment; larger ones get their size rounded to 2 MiB).
- Best fit: the smallest cached block of the same stream that is large
  enough, except that a request below ``max_split_size`` never takes a block
  at or above it, and a request at or above it takes a block only if the
  waste stays under ``max_non_split_rounding``.
- The rest of a block is split off when it is still useful: in the small
  pool any 512 B remainder, in the large pool a remainder over 1 MiB, and
  never for requests of ``max_split_size`` or more.
- A freed block merges with free neighbours in its segment, unless it was
  used on other streams (``record_stream``): then it waits until an event
  recorded on each of them completes. ``process_events`` (run at the start
  of every ``malloc``) drains those events in order.
- When nothing fits, the retry chain of Note [Retry chain] in
  ``_reclaim.py`` runs, then ``OutOfMemoryError``.

The allocator is thread safe (one re-entrant lock). Blocks belong to the
allocator that made them; ``free`` checks that.

Note [Hot path]
~~~~~~~~~~~~~~~
A malloc+free pair served from the cache is the steady state of every pool,
and in Python each call, attribute lookup and allocation in it shows: the
aim is a pair in a few microseconds. So ``malloc``/``free`` and what they
always run (``_get_free_block``, ``_alloc_found_block``, ``_free_block``)
read settings from plain attributes set once (``_max_split``...), round
sizes inline unless ``roundup_power2_divisions`` is set, count statistics
through ``HotStats`` (Note [Statistics on the hot path] in ``_stats.py``),
and test each optional feature (events, callbacks, history, observers,
debug checks, user pools) with one ``if`` before doing anything for it.
Everything else (the retry chain, expandable mapping, releasing) is
written for clarity. ``scripts/bench_pool.py`` measures the pair.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Hashable
from os import PathLike
from typing import Any, NoReturn

from .. import _registry
from . import _mempool
from ._block import Block, BlockPool, SegmentRecord
from ._config import UNLIMITED, AllocatorConfig, get_config, parse_config
from ._core import Observer
from ._exceptions import OutOfMemoryError
from ._invariants import check_invariants
from ._mempool import MemPool, PrivatePool, current_mem_pool
from ._policy import (
    MIN_BLOCK_SIZE,
    SMALL_SIZE,
    allocation_size,
    format_size,
    round_size,
)
from ._provider import ExpandableProvider, Provider, ProviderOutOfMemory
from ._reclaim import ReclaimMixin
from ._report import report_allocator
from ._snapshot import TraceRecorder, build_segments, capture_frames
from ._stats import ALL, increase

__all__ = ["CachingAllocator"]


class CachingAllocator(ReclaimMixin):
    """Cache the memory of one provider in blocks, as PyTorch's CUDA allocator does.

    Parameters
    ----------
    provider : Provider
        Where segments come from (see Note [Providers]).
    config : str, AllocatorConfig or None
        Settings. A string is parsed onto the process-wide settings
        (``SHMSHARE_ALLOC_CONF`` / ``configure()``); None uses those as they
        are now. They are fixed for the allocator's life.
    """

    def __init__(self, provider: Provider, config: str | AllocatorConfig | None = None) -> None:
        if isinstance(config, str):
            config = parse_config(config, get_config(), source="CachingAllocator(config=...)")
        elif config is None:
            config = get_config()
        if config.expandable_segments and not isinstance(provider, ExpandableProvider):
            raise ValueError(
                f"expandable_segments:True needs a provider with reserve/map/unmap/release; "
                f"{type(provider).__name__} has none"
            )
        super().__init__(provider, config)
        _registry.register("pools", self, report_allocator)  # Note [Reporters]: weakly, once

    # --- allocation ------------------------------------------------------------

    def malloc(self, nbytes: int, stream: Hashable | None = None) -> Block:
        """Return a block of at least ``nbytes`` bytes, for use on ``stream``.

        Raises
        ------
        OutOfMemoryError
            When the retry chain could not find the memory.
        """
        if nbytes < 0:
            raise ValueError(f"malloc: nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if self._events:
                self._process_events()
            if stream is None:
                stream, sid = self._default_stream, 0
            else:
                sid = self._stream_id(stream)
            if self._rounding:
                size = round_size(nbytes, self.config)
            else:  # round_size without roundup_power2_divisions, inline (see Note [Hot path])
                size = MIN_BLOCK_SIZE if nbytes < MIN_BLOCK_SIZE else -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
            if _mempool.open_contexts:  # some thread is in use_mem_pool: maybe this one
                pool = self._get_pool(size)
            else:
                pool = self._small if size <= SMALL_SIZE else self._large
            block = self._get_free_block(pool, sid, size)
            if block is None and self._callbacks and self._trigger_free_memory_callbacks():
                block = self._get_free_block(pool, sid, size)
            if block is None:
                block = self._allocate_slow(pool, stream, sid, size, nbytes)
            block = self._alloc_found_block(block, size, nbytes)
            if self._observers:
                self._notify("alloc", block.address, block.size, stream)
            if self._debug:
                self.check_invariants()
            return block

    def free(self, block: Block) -> None:
        """Give a block back; it is reused once every stream that used it is done with it."""
        with self._lock:
            if not block.allocated or block not in self._active:
                raise ValueError(f"free() of {block!r}, which this allocator has not allocated")
            block.allocated = False
            pool = block.pool
            self._hot[pool.stat_type].on_free_requested(block.size)
            if block.size >= self._max_split:
                self.stats.oversize_allocations.decrease(1)
            if self._trace is not None:
                self._trace.record("free_requested", block.address, block.requested_size, block.stream_id,
                                   self._pool_id(pool))  # with stacks: where free() was called
            address, size = block.address, block.size  # merging may change them
            if block.stream_uses:
                self._insert_events(block)
            else:
                self._free_block(block)
            if self._observers:
                self._notify("free", address, size, block.stream)
            if self._debug:
                self.check_invariants()

    def record_stream(self, block: Block, stream: Hashable) -> None:
        """Note that ``block`` is also used on ``stream``: ``free`` will wait for it."""
        with self._lock:
            if not block.allocated:
                raise ValueError(f"record_stream() on {block!r}, which is not allocated")
            if stream != block.stream:  # uses on the block's own stream need no event
                block.stream_uses.add(stream)

    def process_events(self) -> None:
        """Return to the pools the freed blocks whose events have completed."""
        with self._lock:
            self._process_events()

    def empty_cache(self, pool: MemPool | None = None) -> None:
        """Give every wholly free cached segment back to the provider, after synchronizing.

        Without ``pool``: the default pools, and those of ``MemPool`` objects
        that no longer exist. With ``pool``: that pool's cached memory.
        """
        with self._lock:
            target = None if pool is None else self._private.get(pool.id)
            if pool is None or target is not None:
                self._release_cached_blocks(target)

    def add_free_memory_callback(self, callback: Callable[[], bool]) -> None:
        """Call ``callback`` before asking the provider; it returns whether it freed anything."""
        with self._lock:
            self._callbacks.append(callback)

    # --- statistics, history, observers -------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """Return the statistics flattened like ``torch.cuda.memory_stats()``."""
        with self._lock:
            max_split = self.config.max_split_size
            return self.stats.flat(-1 if max_split == UNLIMITED else max_split)

    def reset_peak_stats(self) -> None:
        """Set every peak statistic to its current value."""
        with self._lock:
            self.stats.reset_peak()

    def reset_accumulated_stats(self) -> None:
        """Zero the allocated/freed totals and the counters (retries, OOMs, ...)."""
        with self._lock:
            self.stats.reset_accumulated()

    def record_memory_history(self, enabled: bool = True, max_entries: int = sys.maxsize,
                              stacks: bool = False) -> None:
        """Start (or stop, clearing it) recording the trace that snapshots carry.

        Parameters
        ----------
        enabled : bool
            Record from now on; False stops and drops the history.
        max_entries : int
            Keep only the latest this many entries.
        stacks : bool
            Also record the Python stack of each entry and allocated block.
        """
        with self._lock:
            self._trace = TraceRecorder(max_entries, stacks) if enabled else None

    def memory_snapshot(self) -> dict[str, Any]:
        """Return segments, blocks and trace in the layout of ``torch.cuda.memory._snapshot()``."""
        with self._lock:
            traces = [dict(entry) for entry in self._trace.entries] if self._trace is not None else []
            return {
                "segments": build_segments(self._all_blocks()),
                "device_traces": [traces],
                "allocator_settings": self._settings_dict(),
            }

    def dump_snapshot(self, path: str | PathLike[str]) -> None:
        """Write ``memory_snapshot()`` as a pickle that ``torch.cuda._memory_viz`` reads."""
        snapshot = self.memory_snapshot()
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(MemoryEvent)`` after every alloc, free and OOM, with the lock held."""
        with self._lock:
            self._observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        """Stop calling ``observer``."""
        with self._lock:
            self._observers.remove(observer)

    def check_invariants(self) -> None:
        """Check the pool invariants (docs/architecture.md); raise ``InvariantError`` naming one."""
        with self._lock:
            check_invariants(self)

    def __repr__(self) -> str:
        stats = self.stats
        return (f"<CachingAllocator over {self.name}: {format_size(stats.allocated_bytes[ALL].current)} "
                f"allocated, {format_size(stats.reserved_bytes[ALL].current)} reserved>")

    # --- malloc internals (the lock is held) -----------------------------------------

    def _get_pool(self, size: int) -> BlockPool:
        mem_pool = current_mem_pool()
        if mem_pool is None:
            return self._small if size <= SMALL_SIZE else self._large
        private = self._private.get(mem_pool.id)
        if private is None:
            private = self._private[mem_pool.id] = PrivatePool(mem_pool)
        return private.small if size <= SMALL_SIZE else private.large

    def _get_free_block(self, pool: BlockPool, sid: int, size: int) -> Block | None:
        """Take the best-fitting cached block of ``pool`` for ``size`` bytes on stream ``sid``."""
        if self._gc_on:
            pool.get_free_blocks_call_count += 1  # the clock garbage collection ages blocks by
        index, block = pool.best_fit(sid, size)
        if block is None:
            return None
        if block.segment.expandable:
            index, block = _least_expandable(pool, sid, index, block)
        max_split = self._max_split
        if size < max_split:
            if block.size >= max_split:
                return None  # an oversize block is never used for a smaller request
        elif block.size >= size + self._max_non_split:
            return None  # nor for an oversize request it would waste too much on
        return pool.pop_at(index)

    def _trigger_free_memory_callbacks(self) -> bool:
        freed = False
        for callback in list(self._callbacks):
            freed = bool(callback()) or freed
        return freed

    def _alloc_found_block(self, block: Block, size: int, requested: int) -> Block:
        """Split ``block`` if worth it and hand its first ``size`` bytes out."""
        pool = block.pool
        hot = self._hot[pool.stat_type]
        counts_split = not block.segment.expandable  # see _free_block on inactive_split
        already_split = block.prev is not None or block.next is not None
        remaining = block.size - size
        if pool.is_small or self._expandable:  # split on any 512 B remainder
            split = remaining >= MIN_BLOCK_SIZE
        else:  # large pool: never an oversize request, and only a remainder over 1 MiB
            split = size < self._max_split and remaining > SMALL_SIZE
        if split:
            block = self._split(block, size)
            if counts_split and already_split:  # the free piece shrank by what was cut off
                hot.on_split(0, -size)
            elif counts_split:  # the segment is split now: its free remainder counts
                hot.on_split(1, block.next.size)  # type: ignore[union-attr]
        elif counts_split and already_split:
            hot.on_split(-1, -block.size)
        block.allocated = True
        block.requested_size = requested
        self._active.add(block)
        hot.on_alloc(block.size, requested)
        if block.size >= self._max_split:
            self.stats.oversize_allocations.increase(1)
        if self._trace is not None:
            if self._trace.stacks:
                block.frames = capture_frames()
            self._trace.record("alloc", block.address, requested, block.stream_id, self._pool_id(pool),
                               block.frames)
        return block

    def _split(self, remaining: Block, size: int) -> Block:
        """Cut the first ``size`` bytes off a free block; cache the rest and return the new front block."""
        pool = remaining.pool  # Block() directly, not _new_block(): one call less on the hot path
        block = Block(pool, remaining.stream, remaining.stream_id, size, remaining.address, remaining.segment,
                      next(self._counter))
        block.prev, block.next = remaining.prev, remaining
        if block.prev is not None:
            block.prev.next = block
        remaining.prev = block
        remaining.address += size
        remaining.size -= size
        pool.insert(remaining)
        return block

    def _allocate_slow(self, pool: BlockPool, stream: Hashable, sid: int, size: int, requested: int) -> Block:
        """Get a block from the provider, running the retry chain of Note [Retry chain]."""
        alloc_size = allocation_size(size, self.config)
        self._last_provider_error = None
        if self._gc_on:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, stream, sid, size, alloc_size, False)
        if block is None and pool.owner is None and self._private:
            block = self._try_mempool_fallback(sid, size)
        if block is None and self._release_available_cached_blocks(pool, sid, size):
            block = self._alloc_block(pool, stream, sid, size, alloc_size, False)
        if block is None and self._release_cached_blocks():
            block = self._alloc_block(pool, stream, sid, size, alloc_size, True)
        if block is None:
            self._raise_oom(stream, sid, pool, size, alloc_size, requested)
        # A kept provider error would keep its traceback's frames -- the caller's among
        # them, with every local they hold (arrays, leases) -- until the next slow path.
        self._last_provider_error = None
        return block

    def _alloc_block(self, pool: BlockPool, stream: Hashable, sid: int, size: int, alloc_size: int,
                     is_retry: bool) -> Block | None:
        """Ask the provider for a new segment (or pages) that holds ``size`` bytes."""
        if is_retry:
            self.stats.num_alloc_retries += 1
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, sid, size)
        try:
            address, handle = self.provider.allocate(alloc_size)
        except ProviderOutOfMemory as exc:
            self._last_provider_error = exc
            return None
        segment = SegmentRecord(address, alloc_size, handle, pool, stream, sid)
        self._segments.add(segment)
        self._total_reserved += alloc_size
        stats = self.stats
        increase(stats.segment, pool.stat_type, 1)
        increase(stats.reserved_bytes, pool.stat_type, alloc_size)
        if alloc_size >= self._max_split:
            stats.oversize_segments.increase(1)
        stats.num_device_alloc += 1
        if self._trace is not None:
            self._trace.record("segment_alloc", address, alloc_size, sid, self._pool_id(pool))
        return self._new_block(pool, stream, sid, alloc_size, address, segment)

    def _try_mempool_fallback(self, sid: int, size: int) -> Block | None:
        """Borrow a cached block from a live ``MemPool(use_on_oom=True)``."""
        for private in list(self._private.values()):
            if private.use_on_oom and private.alive:
                pool = private.small if size <= SMALL_SIZE else private.large
                block = self._get_free_block(pool, sid, size)
                if block is not None:
                    return block
        return None

    def _raise_oom(self, stream: Hashable, sid: int, pool: BlockPool, size: int, alloc_size: int,
                   requested: int) -> NoReturn:
        capacity, free = self.provider.capacity(), self.provider.free_bytes()
        stats = self.stats
        stats.num_ooms += 1
        if self._trace is not None:
            self._trace.record("oom", free or 0, size, sid, self._pool_id(pool))
        if self._observers:
            self._notify("oom", 0, size, stream)
        allocated = stats.allocated_bytes[ALL].current
        reserved = stats.reserved_bytes[ALL].current
        cause, self._last_provider_error = self._last_provider_error, None
        raise OutOfMemoryError(
            self._oom_message(requested, size, alloc_size, capacity, free, allocated, reserved),
            requested=requested, size=max(size, alloc_size), capacity=capacity, free=free,
            allocated=allocated, reserved=reserved,
        ) from cause

    def _oom_message(self, requested: int, size: int, alloc_size: int, capacity: int | None,
                     free: int | None, allocated: int, reserved: int) -> str:
        what = format_size(requested)
        if self.config.expandable_segments or alloc_size == size:
            tried = f"Tried to allocate {what}."
        else:
            tried = f"Tried to allocate {what} (a new {format_size(alloc_size)} segment)."
        cap = "an unknown capacity" if capacity is None else f"a total capacity of {format_size(capacity)}"
        free_text = "" if free is None else f" of which {format_size(free)} is free"
        return (
            f"{self.name} out of memory. {tried} The {self.name} has {cap}{free_text}. "
            f"Of the allocated memory {format_size(allocated)} is allocated by shmshare, and "
            f"{format_size(reserved - allocated)} is reserved by shmshare but unallocated. "
            + self._oom_hint()
        )

    def _oom_hint(self) -> str:
        config = self.config
        if config.expandable_segments:
            return ("Every cached page was already unmapped; free blocks you no longer need, or "
                    "lower the peak. See docs/allocator.md.")
        hint = ("If reserved but unallocated memory is large try setting "
                "SHMSHARE_ALLOC_CONF=expandable_segments:True to avoid fragmentation")
        if config.max_split_size == UNLIMITED:
            hint += ", or max_split_size_mb:<MiB> so that large blocks are never split"
        return hint + ". See docs/allocator.md."

    def _settings_dict(self) -> dict[str, Any]:
        config = self.config
        return {
            "SHMSHARE_ALLOC_CONF": config.to_string(),
            "max_split_size": -1 if config.max_split_size == UNLIMITED else config.max_split_size,
            "garbage_collection_threshold": config.garbage_collection_threshold,
            "expandable_segments": config.expandable_segments,
            "roundup_power2_divisions": {
                (">" if bound == UNLIMITED else str(bound >> 20)): div
                for bound, div in config.roundup_power2_divisions
            },
            "pinned_num_register_threads": config.pinned_num_register_threads,
            "pinned_use_host_register": config.pinned_use_cuda_host_register,
            "release_lock_on_malloc": False,
        }


def _least_expandable(pool: BlockPool, sid: int, index: int, block: Block) -> tuple[int, Block]:
    """Move up the fitting blocks while the next could grow less (see Note [Expandable segments])."""
    while True:
        candidate = pool.block_at(index + 1)
        if candidate is None or candidate.stream_id != sid:
            return index, block
        if _expandable_size(candidate) >= _expandable_size(block):
            return index, block
        block, index = candidate, index + 1


def _expandable_size(block: Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)

