"""Blocks, the segments they tile, and the pools that keep free blocks.

A *segment* is one range of memory from the provider (a classic allocation,
or the reserved range of an expandable segment). It is tiled by *blocks*:
``prev``/``next`` link the blocks of one segment in address order. A block
is allocated (handed to a caller), pending (freed by the caller but waiting
for events on other streams), free (cached in a :class:`BlockPool`), or,
in an expandable segment, unmapped (address space without memory).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

from ._stats import LARGE_POOL, SMALL_POOL

if TYPE_CHECKING:
    from ._mempool import PrivatePool

__all__ = ["Block", "BlockPool", "SegmentRecord"]

Stream = Hashable


class Block:
    """Describe one piece of a segment: where it is, how big, and who uses it.

    Callers see ``address``, ``size`` (rounded), ``requested_size`` and
    ``stream``; the rest is the allocator's bookkeeping. A block means
    something only while it is allocated: after ``free`` the allocator
    reuses the object (merged with neighbours, or as the remainder of a
    split), so keep the address, not the block, to compare later.
    """

    __slots__ = (
        "pool",
        "stream",
        "stream_id",
        "size",
        "requested_size",
        "address",
        "prev",
        "next",
        "allocated",
        "mapped",
        "stream_uses",
        "event_count",
        "counter",
        "segment",
        "gc_count_base",
        "frames",
    )

    def __init__(
        self,
        pool: BlockPool,
        stream: Stream,
        stream_id: int,
        size: int,
        address: int,
        segment: SegmentRecord,
        counter: int,
    ) -> None:
        self.pool = pool  # the pool this block returns to when free
        self.stream = stream  # the stream it was allocated on (provider's object)
        self.stream_id = stream_id  # the allocator's small int for stream, for ordering
        self.size = size  # bytes, a multiple of 512
        self.requested_size = 0  # bytes the caller asked for (0 while free)
        self.address = address  # first byte
        self.prev: Block | None = None  # block just below, in the same segment
        self.next: Block | None = None  # block just above, in the same segment
        self.allocated = False  # handed to a caller and not yet freed
        self.mapped = True  # backed by memory (False: expandable address space only)
        self.stream_uses: set[Stream] = set()  # other streams that used it (record_stream)
        self.event_count = 0  # events still to complete before the block is free
        self.counter = counter  # registration order, ties sizes in the free list
        self.segment = segment  # the provider segment this block is part of
        self.gc_count_base = 0  # pool's get_free_block count when the block was cached
        self.frames: list[dict[str, Any]] = []  # Python stack at malloc, when recorded

    def is_split(self) -> bool:
        """Return whether the block shares its segment with other blocks."""
        return self.prev is not None or self.next is not None

    @property
    def end(self) -> int:
        """Return the address one past the block's last byte."""
        return self.address + self.size

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "pending" if self.event_count else "free"
        if not self.mapped:
            state = "unmapped"
        return f"<Block {state} 0x{self.address:x}+{self.size} stream={self.stream_id}>"


class SegmentRecord:
    """Record one range the allocator got from its provider.

    Classic segments are given back whole (``provider.free(handle)``) once a
    single free block covers them. :class:`ExpandableSegment` extends this
    with the page map of a reserved range.
    """

    __slots__ = ("address", "size", "handle", "pool", "stream", "stream_id")

    expandable = False

    def __init__(
        self, address: int, size: int, handle: object, pool: BlockPool, stream: Stream, stream_id: int
    ) -> None:
        self.address = address  # first byte
        self.size = size  # bytes (expandable: the reserved range)
        self.handle = handle  # the provider's handle, given back exactly once
        self.pool = pool  # the pool all its blocks belong to
        self.stream = stream  # the stream it was created for
        self.stream_id = stream_id

    def __repr__(self) -> str:
        kind = "small" if self.pool.is_small else "large"
        return f"<{type(self).__name__} {kind} 0x{self.address:x}+{self.size}>"


class BlockPool:
    """Keep the free blocks of one size class, ordered for best fit.

    ``blocks`` is ordered by (stream, size, registration counter) so that a
    lower bound on (stream, size) is the best fit. ``unmapped`` holds the
    unmapped blocks of expandable segments ordered by (stream, address), so
    that the lowest free address range of a stream comes first. Both are a
    sorted list of keys searched with ``bisect`` plus a dict from key to
    block.
    """

    __slots__ = ("is_small", "stat_type", "owner", "get_free_blocks_call_count", "_keys", "_blocks", "_ukeys",
                 "_unmapped")

    def __init__(self, is_small: bool, owner: PrivatePool | None = None) -> None:
        self.is_small = is_small  # True: requests <= 1 MiB
        self.stat_type = SMALL_POOL if is_small else LARGE_POOL  # its statistics column
        self.owner = owner  # the user pool (MemPool) this belongs to; None: default pool
        self.get_free_blocks_call_count = 0  # clock for garbage collection ages
        self._keys: list[tuple[int, int, int]] = []
        self._blocks: dict[tuple[int, int, int], Block] = {}
        self._ukeys: list[tuple[int, int]] = []
        self._unmapped: dict[tuple[int, int], Block] = {}

    # --- free, mapped blocks ---------------------------------------------------

    def insert(self, block: Block) -> None:
        """Cache a free block; it must not be in the pool already."""
        key = (block.stream_id, block.size, block.counter)
        blocks = self._blocks
        if key in blocks:
            raise KeyError(f"{block!r} is already in the pool")
        insort(self._keys, key)
        blocks[key] = block
        block.gc_count_base = self.get_free_blocks_call_count

    def remove(self, block: Block) -> None:
        """Take a cached block out; it must be there with its current size."""
        key = (block.stream_id, block.size, block.counter)
        del self._blocks[key]
        keys = self._keys
        del keys[bisect_left(keys, key)]

    def lower_bound(self, stream_id: int, size: int) -> int:
        """Return the index of the first block of ``stream_id`` with at least ``size`` bytes."""
        return bisect_left(self._keys, (stream_id, size, -1))

    def best_fit(self, stream_id: int, size: int) -> tuple[int, Block | None]:
        """Return (index, block) of the smallest block of ``stream_id`` with ``size`` bytes, or (index, None).

        ``lower_bound`` and ``block_at`` in one call, for malloc's hot path.
        """
        keys = self._keys
        index = bisect_left(keys, (stream_id, size, -1))
        if index < len(keys):
            key = keys[index]
            if key[0] == stream_id:
                return index, self._blocks[key]
        return index, None

    def block_at(self, index: int) -> Block | None:
        """Return the block at ``index`` in (stream, size) order, or None past the end."""
        if index >= len(self._keys):
            return None
        return self._blocks[self._keys[index]]

    def pop_at(self, index: int) -> Block:
        """Take out and return the block at ``index`` in (stream, size) order."""
        return self._blocks.pop(self._keys.pop(index))

    def blocks(self) -> list[Block]:
        """Return the cached blocks in (stream, size) order, as a copy safe to mutate under."""
        return [self._blocks[k] for k in self._keys]

    def __contains__(self, block: Block) -> bool:
        return self._blocks.get((block.stream_id, block.size, block.counter)) is block

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks())

    # --- unmapped blocks (expandable segments) -----------------------------------

    def insert_unmapped(self, block: Block) -> None:
        """Keep an unmapped block; it must not be there already."""
        key = (block.stream_id, block.address)
        if key in self._unmapped:
            raise KeyError(f"{block!r} is already in the unmapped set")
        insort(self._ukeys, key)
        self._unmapped[key] = block

    def remove_unmapped(self, block: Block) -> None:
        """Take an unmapped block out; it must be there at its current address."""
        key = (block.stream_id, block.address)
        del self._unmapped[key]
        del self._ukeys[bisect_left(self._ukeys, key)]

    def unmapped_from(self, stream_id: int) -> list[Block]:
        """Return the unmapped blocks of ``stream_id`` in address order."""
        start = bisect_left(self._ukeys, (stream_id, -1))
        end = bisect_left(self._ukeys, (stream_id + 1, -1))
        return [self._unmapped[k] for k in self._ukeys[start:end]]

    def unmapped(self) -> list[Block]:
        """Return every unmapped block in (stream, address) order."""
        return [self._unmapped[k] for k in self._ukeys]

    def has_unmapped(self, block: Block) -> bool:
        """Return whether ``block`` is in the unmapped set at its current address."""
        return self._unmapped.get((block.stream_id, block.address)) is block

    def __repr__(self) -> str:
        kind = "small" if self.is_small else "large"
        owner = "" if self.owner is None else f" of {self.owner!r}"
        return f"<BlockPool {kind}{owner}: {len(self._keys)} free, {len(self._ukeys)} unmapped>"
