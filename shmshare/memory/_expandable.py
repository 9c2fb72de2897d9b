"""Expandable segments: reserve address space once, map pages as needed.

Note [Expandable segments]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Rationale. A classic segment binds its addresses to its memory, so when a
program's requests grow a little each step (batch N, then N+1), each step
needs new segments while the old ones stay cached, split and half empty;
reserved memory grows far past what is ever allocated at once. PyTorch's
answer (``Note [Expandable Segments]``) is to separate addresses from memory:
reserve one large address range per (pool, stream) and map memory into it
page by page, so the segment grows at its end and freed blocks merge with
their neighbours into ranges that later, larger requests can use.

Approach.
- ``reserve``: capacity x 1.125 of address space (64 GiB when the capacity
  is unknown, never less than the request), rounded to whole pages. The
  extra eighth leaves room to unmap pages early in the range and map new
  ones at its end.
- Pages are 2 MiB in small pools and ``large_segment_size`` (20 MiB) in
  large ones: mapping costs grow with the number of pages, small pages
  waste less.
- The segment's blocks tile it as usual; a block is *mapped* or not, and
  unmapped blocks live in the pool's ``unmapped`` set ordered by (stream,
  address). Mapped ranges always start and end on page boundaries; blocks
  inside a mapped range split anywhere (512 B granularity).
- ``find_expandable_block``: the lowest-address unmapped block of the
  stream, together with a free mapped block just below it, and further
  free/unmapped blocks above, that adds up to the request; else a new
  reservation. ``map_block`` maps the pages, splits off the unmapped rest
  and merges the new pages with free mapped neighbours.
- Best fit prefers, among fitting free blocks, the one that could grow
  least (its size plus the unmapped block above it), keeping the growable
  end of a segment for the requests that need it.
- Releasing (``empty_cache``, retry step 4) unmaps the whole pages inside
  each free block, splitting it in three: mapped before, unmapped pages,
  mapped after. It synchronizes the segment's stream first: unlike
  ``cudaFree``, ``cuMemUnmap`` does not wait for work in flight, and the
  same holds for punching holes in a memfd. A reservation wholly unmapped
  is released.
- Free blocks split on any 512 B remainder (as the small pool does), since
  an expandable segment can always give whole free pages back.

Limitations. Expandable segments are counted once per reservation in the
``segment`` statistic (PyTorch does not count them at all); they take no
part in ``inactive_split`` (as in PyTorch) nor in garbage collection or in
the release of oversize blocks, which work on whole classic segments. The
settings of an allocator are fixed when it is created, so a pool never mixes
classic and expandable segments.
"""

from __future__ import annotations

from collections.abc import Hashable

from ._block import Block, BlockPool, SegmentRecord
from ._core import AllocatorCore
from ._policy import SMALL_BUFFER
from ._provider import ExpandableProvider, ProviderOutOfMemory
from ._stats import decrease, increase

__all__ = ["DEFAULT_RESERVE", "ExpandableMixin", "ExpandableSegment"]

DEFAULT_RESERVE = 64 << 30  # address space per segment when the capacity is unknown


class ExpandableSegment(SegmentRecord):
    """Record a reserved address range and which of its pages are mapped."""

    __slots__ = ("page_size", "pages")

    expandable = True

    def __init__(self, address: int, size: int, handle: object, pool: BlockPool, stream: Hashable,
                 stream_id: int, page_size: int) -> None:
        super().__init__(address, size, handle, pool, stream, stream_id)
        self.page_size = page_size  # bytes mapped or unmapped at a time
        self.pages = bytearray(size // page_size)  # 1 where the page is mapped

    def map(self, provider: ExpandableProvider, address: int, size: int) -> int:
        """Map the pages covering ``[address, address + size)``; return the bytes mapped.

        ``address`` is page aligned and the pages are unmapped. Raises
        ``ProviderOutOfMemory`` with nothing mapped.
        """
        page = self.page_size
        begin = (address - self.address) // page
        end = -(-(address - self.address + size) // page)
        provider.map(self.handle, begin * page, (end - begin) * page)
        self.pages[begin:end] = b"\x01" * (end - begin)
        return (end - begin) * page

    def unmap(self, provider: ExpandableProvider, address: int, size: int) -> tuple[int, int]:
        """Unmap the whole pages inside ``[address, address + size)``; return (address, bytes)."""
        page = self.page_size
        begin = -(-(address - self.address) // page)
        end = (address - self.address + size) // page
        if begin >= end:
            return self.address + begin * page, 0
        provider.synchronize(self.stream)  # see Note [Expandable segments]: unmap does not wait
        provider.unmap(self.handle, begin * page, (end - begin) * page)
        self.pages[begin:end] = bytes(end - begin)
        return self.address + begin * page, (end - begin) * page


class ExpandableMixin(AllocatorCore):
    """Find, map, unmap and release the blocks of expandable segments."""

    def _try_allocate_expandable_block(self, pool: BlockPool, stream: Hashable, sid: int,
                                       size: int) -> Block | None:
        """Map enough pages for a free block of at least ``size`` bytes and take it from the pool."""
        candidate = self._find_expandable_block(pool, stream, sid, size)
        if candidate is None:
            return None
        # candidate starts a run: unmapped -> end, unmapped -> free -> ..., or free -> unmapped -> ...
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next  # unmapped, by the run's shape
            assert following is not None and not following.mapped
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # map_block merged the candidate into it
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: BlockPool, stream: Hashable, sid: int, size: int) -> Block | None:
        """Return the first run of free and unmapped blocks with ``size`` bytes, or a new segment."""
        for block in pool.unmapped_from(sid):
            # the lowest unmapped block, with a free mapped block just below if there is one
            if _allocatable(block.prev):
                block = block.prev  # type: ignore[assignment]
            if _run_size(block, size) >= size:
                return block
        return self._new_expandable_segment(pool, stream, sid, size)

    def _new_expandable_segment(self, pool: BlockPool, stream: Hashable, sid: int, size: int) -> Block | None:
        """Reserve a new range and return its one unmapped block (None if out of address space)."""
        page = SMALL_BUFFER if pool.is_small else self.config.large_segment_size
        capacity = self.provider.capacity()
        wanted = DEFAULT_RESERVE if capacity is None else capacity + capacity // 8
        nbytes = -(-max(wanted, size) // page) * page
        provider: ExpandableProvider = self.provider  # type: ignore[assignment]
        try:
            address, handle = provider.reserve(nbytes)
        except ProviderOutOfMemory as exc:
            self._last_provider_error = exc
            return None
        segment = ExpandableSegment(address, nbytes, handle, pool, stream, sid, page)
        self._segments.add(segment)
        increase(self.stats.segment, pool.stat_type, 1)
        block = self._new_block(pool, stream, sid, nbytes, address, segment)
        block.mapped = False
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: Block, size: int) -> bool:
        """Map the first ``size`` bytes (rounded to pages) of an unmapped block."""
        segment: ExpandableSegment = to_map.segment  # type: ignore[assignment]
        address = to_map.address
        try:
            mapped = segment.map(self.provider, address, size)  # type: ignore[arg-type]
        except ProviderOutOfMemory as exc:
            self._last_provider_error = exc
            return False
        pool = to_map.pool
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:  # to_map -> rest (unmapped) -> to_map.next
            rest = self._new_block(pool, to_map.stream, to_map.stream_id, to_map.size - mapped,
                                   address + mapped, segment)
            rest.mapped = False
            _splice_after(to_map, rest)
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._total_reserved += mapped
        increase(self.stats.reserved_bytes, pool.stat_type, mapped)
        self.stats.num_device_alloc += 1
        if self._trace is not None:
            self._trace.record("segment_map", address, mapped, to_map.stream_id, self._pool_id(pool))
        return True

    def _unmap_block(self, block: Block) -> None:
        """Unmap the whole pages of a cached block: mapped before, unmapped pages, mapped after."""
        segment: ExpandableSegment = block.segment  # type: ignore[assignment]
        start, length = segment.unmap(self.provider, block.address, block.size)  # type: ignore[arg-type]
        if length == 0:
            return
        pool = block.pool
        pool.remove(block)
        before = start - block.address
        if before > 0:  # prev -> before -> block
            piece = self._new_block(pool, block.stream, block.stream_id, before, block.address, segment)
            _splice_before(block, piece)
            pool.insert(piece)
        after = block.size - before - length
        if after > 0:  # block -> after -> next
            piece = self._new_block(pool, block.stream, block.stream_id, after, start + length, segment)
            _splice_after(block, piece)
            pool.insert(piece)
        block.address, block.size, block.mapped = start, length, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self._total_reserved -= length
        decrease(self.stats.reserved_bytes, pool.stat_type, length)
        self.stats.num_device_free += 1
        if self._trace is not None:
            self._trace.record("segment_unmap", start, length, block.stream_id, self._pool_id(pool))

    def _release_expandable_segment(self, block: Block) -> None:
        """Give back the address space of a segment that one unmapped block covers."""
        segment = block.segment
        if block.mapped or block.is_split() or block.size != segment.size:
            raise AssertionError(f"cannot release {segment!r}: {block!r} does not cover it unmapped")
        provider: ExpandableProvider = self.provider  # type: ignore[assignment]
        provider.release(segment.handle)
        block.pool.remove_unmapped(block)
        self._segments.remove(segment)
        decrease(self.stats.segment, block.pool.stat_type, 1)


def _allocatable(block: Block | None) -> bool:
    return block is not None and not block.allocated and block.event_count == 0 and not block.stream_uses


def _run_size(block: Block | None, size: int) -> int:
    """Add up free and unmapped blocks upward from ``block`` until ``size`` is reached."""
    total = 0
    while total < size and block is not None and _allocatable(block):
        total += block.size
        block = block.next
    return total


def _splice_after(block: Block, piece: Block) -> None:
    piece.prev, piece.next = block, block.next
    if block.next is not None:
        block.next.prev = piece
    block.next = piece


def _splice_before(block: Block, piece: Block) -> None:
    piece.prev, piece.next = block.prev, block
    if block.prev is not None:
        block.prev.next = piece
    block.prev = piece
