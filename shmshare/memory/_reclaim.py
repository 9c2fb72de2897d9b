"""Giving cached memory back to the provider: steps 1, 3 and 4 of the retry chain.

Note [Retry chain]
~~~~~~~~~~~~~~~~~~
When no cached block fits, ``malloc`` tries, in order (the seed notes'
order, cheapest first):

0. the free-memory callbacks, then the pool again;
1. garbage collection (``garbage_collection_threshold``): while reserved
   memory is above the threshold fraction of the capacity, release unsplit
   cached large blocks, oldest first (age = get_free_block calls since the
   block was cached); no synchronization. Runs *before* asking the provider.
   Then the provider;
2. a ``MemPool(use_on_oom=True)``: borrow one of its cached blocks;
3. release cached blocks of at least ``max_split_size`` (one big enough,
   else the largest until enough bytes went back), then the provider;
4. synchronize every stream with pending events, free those blocks, release
   every cached segment that is wholly free (and unmap every free page of
   expandable segments), then the provider once more. Only this last
   attempt counts in ``num_alloc_retries``: it is the expensive one, and a
   growing count says the program runs close to its limit.

Then ``OutOfMemoryError``. Classic segments go back only when wholly free:
a split segment cannot be returned in part, which is what fragmentation
costs, and what ``max_split_size`` and expandable segments limit.
"""

from __future__ import annotations

from ._block import Block, BlockPool
from ._config import UNLIMITED
from ._expandable import ExpandableMixin
from ._mempool import PrivatePool
from ._stats import decrease

__all__ = ["ReclaimMixin"]


class ReclaimMixin(ExpandableMixin):
    """Release cached blocks: whole segments, oversize ones, old ones, or all."""

    def _release_block(self, block: Block) -> None:
        """Give a cached block that spans a whole classic segment back to the provider."""
        segment = block.segment
        if segment.expandable or block.is_split():
            raise AssertionError(f"cannot release {block!r}: not a whole classic segment")
        self.provider.free(segment.handle)
        block.pool.remove(block)
        self._segments.remove(segment)
        self._total_reserved -= block.size
        stats = self.stats
        stats.num_device_free += 1
        decrease(stats.segment, block.pool.stat_type, 1)
        decrease(stats.reserved_bytes, block.pool.stat_type, block.size)
        if block.size >= self._max_split:
            stats.oversize_segments.decrease(1)
        if self._trace is not None:
            self._trace.record("segment_free", block.address, block.size, block.stream_id,
                               self._pool_id(block.pool))

    def _release_blocks(self, pool: BlockPool) -> None:
        """Release every wholly free segment of ``pool`` and unmap every free page."""
        for block in pool.blocks():
            if block.segment.expandable:
                self._unmap_block(block)
            elif not block.is_split():
                self._release_block(block)
        for block in pool.unmapped():
            if not block.is_split():
                self._release_expandable_segment(block)

    def _garbage_collect_cached_blocks(self) -> None:
        """Release old unsplit large blocks while reserved memory is above the threshold."""
        capacity = self.provider.capacity()
        if capacity is None:
            return
        threshold = int(self.config.garbage_collection_threshold * capacity)
        if self._total_reserved <= threshold:
            return
        target = self._total_reserved - threshold
        pool = self._large
        clock = pool.get_free_blocks_call_count
        freeable = [b for b in pool.blocks() if _collectable(b)]
        total_age = sum(clock - b.gc_count_base for b in freeable)
        count = len(freeable)
        reclaimed, freed_any = 0, True
        while reclaimed < target and freed_any and count > 0:
            # Free every block at least as old as the average, even past the
            # target, so that collection does not run again on the next malloc.
            average_age = total_age / count
            freed_any = False
            for block in pool.blocks():
                age = clock - block.gc_count_base
                if _collectable(block) and age >= average_age:
                    freed_any = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    def _release_available_cached_blocks(self, pool: BlockPool, sid: int, size: int) -> bool:
        """Release cached oversize blocks (>= max_split_size) of ``sid`` to make room for ``size``."""
        max_split = self.config.max_split_size
        if max_split == UNLIMITED:
            return False
        wanted = max(size, max_split)
        index = pool.lower_bound(sid, wanted)
        block = pool.block_at(index)
        if block is not None and block.stream_id == sid and _collectable(block):
            self._release_block(block)
            return True
        # No single block is large enough: release oversize blocks from the largest down.
        released = 0
        index -= 1
        while released < wanted and index >= 0:
            block = pool.block_at(index)
            assert block is not None
            if block.size < max_split or block.stream_id != sid:
                break
            if _collectable(block):
                released += block.size
                self._release_block(block)
            index -= 1
        return released >= wanted

    def _synchronize_and_free_events(self) -> None:
        """Wait for every stream with pending events, then free the blocks whose events completed."""
        self.stats.num_sync_all_streams += 1
        for stream in list(self._events):
            self.provider.synchronize(stream)
        self._process_events()

    def _release_cached_blocks(self, target: PrivatePool | None = None) -> bool:
        """Synchronize, then release all cached memory of the default pools (or of ``target``).

        With no target, pools of ``MemPool`` objects that no longer exist are
        emptied too, and forgotten once they hold no segment.
        """
        self._synchronize_and_free_events()
        if target is not None:
            for pool in target.pools():
                self._release_blocks(pool)
            return True
        self._release_blocks(self._large)
        self._release_blocks(self._small)
        for pool_id, private in list(self._private.items()):
            if private.alive:
                continue
            for pool in private.pools():
                self._release_blocks(pool)
            if not any(seg.pool.owner is private for seg in self._segments):
                del self._private[pool_id]
        return True


def _collectable(block: Block) -> bool:
    """Return whether a cached block is a whole classic segment, which can go back."""
    return not block.segment.expandable and not block.is_split()
