"""``check_invariants()``: the pool invariants (docs/architecture.md), checked by a walk.

1. Blocks of a segment tile it exactly: sorted by address, each starts where
   the previous ends, sizes add up to the segment's size, and ``prev``/
   ``next`` follow that order.
2. No two adjacent free blocks (both mapped or both unmapped) in a segment:
   they would have merged. A block waiting on events is not free.
3. The free lists hold exactly the free, mapped blocks (each under its
   current key), the unmapped sets exactly the unmapped blocks, and the
   active set exactly the allocated and pending blocks; nothing else exists.
4. Expandable segments: mapped blocks cover exactly the mapped pages;
   mapped and unmapped ranges start and end on page boundaries.
5. ``allocated + cached == reserved`` per pool, and every statistic agrees
   with a walk of the blocks.

Each failure raises :class:`InvariantError` naming the invariant, the
segment and the block.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from ._block import Block, BlockPool, SegmentRecord
from ._exceptions import InvariantError
from ._stats import ALL, LARGE_POOL, SMALL_POOL, STAT_NAMES, TYPE_NAMES

if TYPE_CHECKING:
    from ._core import AllocatorCore
    from ._expandable import ExpandableSegment

__all__ = ["check_invariants"]


def check_invariants(alloc: AllocatorCore) -> None:
    """Walk every pool, segment and block of ``alloc`` and check the invariants."""
    free, unmapped = _check_pools(alloc)
    _check_active(alloc)
    overlap = (free & unmapped) | (free & alloc._active) | (unmapped & alloc._active)
    if overlap:
        raise InvariantError(f"invariant 3: {min(overlap, key=_addr)!r} is in two sets at once")
    tiles = _check_segments(alloc, free | unmapped | alloc._active)
    _check_stats(alloc, tiles)


def _check_pools(alloc: AllocatorCore) -> tuple[set[Block], set[Block]]:
    """Check each pool's free list and unmapped set; return their blocks."""
    free: set[Block] = set()
    unmapped: set[Block] = set()
    for pool in alloc._all_pools():
        keys = pool._keys
        if keys != sorted(keys) or set(keys) != set(pool._blocks):
            raise InvariantError(f"invariant 3: {pool!r}: free-list keys are unsorted or out of step")
        for key, block in pool._blocks.items():
            if key != (block.stream_id, block.size, block.counter):
                raise InvariantError(f"invariant 3: {block!r} is in {pool!r} under a stale key {key}")
            if block.pool is not pool or block.allocated or not block.mapped or block.event_count \
                    or block.stream_uses:
                raise InvariantError(f"invariant 3: {pool!r} holds {block!r}, which is not free and mapped")
            free.add(block)
        if pool._ukeys != sorted(pool._ukeys) or set(pool._ukeys) != set(pool._unmapped):
            raise InvariantError(f"invariant 3: {pool!r}: unmapped keys are unsorted or out of step")
        for ukey, block in pool._unmapped.items():
            if ukey != (block.stream_id, block.address):
                raise InvariantError(f"invariant 3: {block!r} is unmapped under a stale key {ukey}")
            if block.pool is not pool or block.mapped or block.allocated or not block.segment.expandable:
                raise InvariantError(f"invariant 3: {pool!r} holds {block!r} as unmapped")
            unmapped.add(block)
    return free, unmapped


def _check_active(alloc: AllocatorCore) -> None:
    """Check that active blocks are allocated or pending, with one queued event per count."""
    queued = Counter(block for queue in alloc._events.values() for _, block in queue)
    for block in alloc._active:
        if not block.mapped or not (block.allocated or block.event_count):
            raise InvariantError(f"invariant 3: active set holds {block!r}, neither allocated nor pending")
        if queued[block] != block.event_count:
            raise InvariantError(
                f"invariant 3: {block!r} counts {block.event_count} events, {queued[block]} are queued"
            )
    for block in queued:
        if block not in alloc._active or block.allocated:
            raise InvariantError(f"invariant 3: an event is queued for {block!r}, which is not pending")


def _check_segments(alloc: AllocatorCore, known: set[Block]) -> dict[SegmentRecord, list[Block]]:
    """Check invariants 1, 2 and 4 for every segment; return each segment's blocks in order."""
    by_segment: dict[SegmentRecord, list[Block]] = defaultdict(list)
    for block in known:
        by_segment[block.segment].append(block)
    strays = set(by_segment) - alloc._segments
    if strays:
        raise InvariantError(f"invariant 1: blocks belong to a segment the allocator forgot: {strays.pop()!r}")
    tiles = {}
    previous_end, previous = -1, None
    for segment in sorted(alloc._segments, key=_addr):
        if segment.address < previous_end:
            raise InvariantError(f"invariant 1: {segment!r} overlaps {previous!r}")
        previous_end, previous = segment.address + segment.size, segment
        blocks = sorted(by_segment.get(segment, []), key=_addr)
        _check_tiling(segment, blocks)
        _check_no_free_neighbours(segment, blocks)
        if segment.expandable:
            _check_pages(segment, blocks)  # type: ignore[arg-type]
        tiles[segment] = blocks
    return tiles


def _check_tiling(segment: SegmentRecord, blocks: list[Block]) -> None:
    if not blocks:
        raise InvariantError(f"invariant 1: {segment!r} has no blocks; they were lost")
    position = segment.address
    for i, block in enumerate(blocks):
        where = f"invariant 1: {segment!r}: {block!r}"
        if block.address != position:
            raise InvariantError(f"{where} starts at offset {block.address - segment.address:#x}, "
                                 f"the previous block ends at offset {position - segment.address:#x}")
        if block.size <= 0 or block.size % 512:
            raise InvariantError(f"{where} has a size that is not a positive multiple of 512")
        expected_prev = blocks[i - 1] if i else None
        expected_next = blocks[i + 1] if i + 1 < len(blocks) else None
        if block.prev is not expected_prev or block.next is not expected_next:
            raise InvariantError(f"{where} has prev/next links that disagree with address order")
        if block.pool is not segment.pool or block.stream_id != segment.stream_id:
            raise InvariantError(f"{where} has another pool or stream than its segment")
        position += block.size
    if position != segment.address + segment.size:
        raise InvariantError(f"invariant 1: {segment!r}: blocks add up to {position - segment.address} bytes")


def _check_no_free_neighbours(segment: SegmentRecord, blocks: list[Block]) -> None:
    for left, right in itertools.pairwise(blocks):
        if _is_free(left) and _is_free(right) and left.mapped == right.mapped:
            raise InvariantError(
                f"invariant 2: {segment!r}: {left!r} and {right!r} are adjacent and free but not merged"
            )


def _check_pages(segment: ExpandableSegment, blocks: list[Block]) -> None:
    page = segment.page_size
    if segment.size % page or len(segment.pages) != segment.size // page:
        raise InvariantError(f"invariant 4: {segment!r} is not a whole number of {page}-byte pages")
    for i, block in enumerate(blocks):
        starts_range = i == 0 or blocks[i - 1].mapped != block.mapped
        ends_range = i + 1 == len(blocks) or blocks[i + 1].mapped != block.mapped
        offset = block.address - segment.address
        if (starts_range and offset % page) or (ends_range and (offset + block.size) % page):
            kind = "mapped" if block.mapped else "unmapped"
            raise InvariantError(f"invariant 4: {segment!r}: {kind} range at {block!r} is not page aligned")
        first, last = offset // page, -(-(offset + block.size) // page)
        want = 1 if block.mapped else 0
        if any(segment.pages[p] != want for p in range(first, last)):
            state = "a page that is not mapped" if block.mapped else "a mapped page"
            raise InvariantError(f"invariant 4: {segment!r}: {block!r} covers {state}")


def _check_stats(alloc: AllocatorCore, tiles: dict[SegmentRecord, list[Block]]) -> None:
    """Check invariant 5: recompute every statistic from the blocks and compare."""
    max_split = alloc.config.max_split_size
    walk = {name: [0, 0, 0] for name in STAT_NAMES}
    oversize_allocations = oversize_segments = 0
    cached: Counter[BlockPool] = Counter()
    allocated: Counter[BlockPool] = Counter()
    reserved: Counter[BlockPool] = Counter()
    for segment, blocks in tiles.items():
        t = SMALL_POOL if segment.pool.is_small else LARGE_POOL
        walk["segment"][t] += 1
        if not segment.expandable and segment.size >= max_split:
            oversize_segments += 1
        for block in blocks:
            counts = _block_counts(block, segment.expandable, len(blocks) > 1)
            for name, value in counts.items():
                walk[name][t] += value
            oversize_allocations += block.allocated and block.size >= max_split
            reserved[segment.pool] += counts["reserved_bytes"]
            allocated[segment.pool] += counts["allocated_bytes"]
            cached[segment.pool] += block.size if block.mapped and not block.allocated else 0
    for pool in reserved:
        if allocated[pool] + cached[pool] != reserved[pool]:
            raise InvariantError(f"invariant 5: {pool!r}: allocated {allocated[pool]} + cached "
                                 f"{cached[pool]} != reserved {reserved[pool]}")
    stats = alloc.stats
    for name, values in walk.items():
        values[ALL] = values[SMALL_POOL] + values[LARGE_POOL]
        # pools first: "all" is kept as their sum (_stats.py), so a wrong pool
        # column shows in "all" too, and naming the pool says where it went wrong
        for t in (SMALL_POOL, LARGE_POOL, ALL):
            value = values[t]
            label = f"{name}.{TYPE_NAMES[t]}"
            _compare(label, getattr(stats, name)[t].current, value)
            if getattr(stats, name)[t].peak < value:
                raise InvariantError(f"invariant 5: statistic {label}: peak is below current")
    _compare("oversize_allocations", stats.oversize_allocations.current, oversize_allocations)
    _compare("oversize_segments", stats.oversize_segments.current, oversize_segments)
    _compare("total reserved", alloc._total_reserved, walk["reserved_bytes"][ALL])


def _block_counts(block: Block, expandable: bool, split: bool) -> dict[str, int]:
    """Return what one block adds to each statistic."""
    active = block.allocated or block.event_count > 0
    inactive_split = split and not expandable and block.mapped and _is_free(block)
    return {
        "allocation": int(block.allocated),
        "allocated_bytes": block.size if block.allocated else 0,
        "active": int(active),
        "active_bytes": block.size if active else 0,
        "requested_bytes": block.requested_size if active else 0,
        "reserved_bytes": block.size if block.mapped else 0,
        "inactive_split": int(inactive_split),
        "inactive_split_bytes": block.size if inactive_split else 0,
    }


def _compare(name: str, kept: int, walked: int) -> None:
    if kept != walked:
        raise InvariantError(f"invariant 5: statistic {name} is {kept}, a walk of the blocks gives {walked}")


def _is_free(block: Block) -> bool:
    return not block.allocated and block.event_count == 0


def _addr(item: Block | SegmentRecord) -> int:
    return item.address
