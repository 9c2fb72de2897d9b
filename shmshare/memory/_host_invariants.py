"""``check_invariants()`` of the pinned-host pool: a walk of its blocks against its books."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ._exceptions import InvariantError
from ._host_block import RESERVE_ALIGNMENT

if TYPE_CHECKING:
    from ._host import CachingHostAllocator

__all__ = ["check_host_invariants"]


def check_host_invariants(pool: CachingHostAllocator) -> None:
    """Walk every block and compare with the free lists, the event queue and the statistics."""
    free_ids = {id(b) for blocks in pool._free.values() for b in blocks}
    pending: dict[int, int] = {}
    for _, block in pool._events:
        pending[id(block)] = pending.get(id(block), 0) + 1
    in_use = 0
    for address, block in pool._blocks.items():
        where = f"{block!r}"
        if block.address != address or block.size & (block.size - 1):
            raise InvariantError(f"host pool: {where} is filed under 0x{address:x} or not a power of two")
        states = [block.allocated, block.event_count > 0, id(block) in free_ids]
        if sum(states) != 1:
            raise InvariantError(f"host pool: {where} must be exactly one of allocated/pending/free, is {states}")
        if pending.get(id(block), 0) != block.event_count:
            raise InvariantError(f"host pool: {where} counts {block.event_count} events, the queue holds "
                                 f"{pending.get(id(block), 0)}")
        if block.carved and (pool._reserve is None or not pool._reserve.owns(address)):
            raise InvariantError(f"host pool: carved {where} lies outside the reserve segment")
        in_use += block.allocated or block.event_count > 0
    for index, blocks in pool._free.items():
        for block in blocks:
            if pool._blocks.get(block.address) is not block or block.size != 1 << index:
                raise InvariantError(f"host pool: free list {index} holds {block!r}, "
                                     f"not a free pool block of 2**{index}")
    _check_stats(pool, in_use)
    _check_carving(pool)


def _check_stats(pool: CachingHostAllocator, in_use: int) -> None:
    s, blocks = pool.stats, pool._blocks.values()
    expected = {
        "allocated": (s.allocated.current, in_use),
        "allocated_bytes": (s.allocated_bytes.current, sum(b.size for b in blocks if b.allocated or b.event_count)),
        "segment": (s.segment.current, len(pool._blocks)),
        "reserved_bytes": (s.reserved_bytes.current, sum(b.size for b in blocks)),
    }
    for name, (stat, walked) in expected.items():
        if stat != walked:
            raise InvariantError(f"host pool: {name}.current is {stat}, a walk of the blocks gives {walked}")


def _check_carving(pool: CachingHostAllocator) -> None:
    carved = sorted((b for b in pool._blocks.values() if b.carved), key=lambda b: b.address)
    for low, high in itertools.pairwise(carved):
        if low.address + low.size > high.address:
            raise InvariantError(f"host pool: carved blocks {low!r} and {high!r} overlap")
    for block in carved:
        if (block.address - pool._reserve.address) % RESERVE_ALIGNMENT:  # type: ignore[union-attr]
            raise InvariantError(f"host pool: carved {block!r} is not 4 KiB aligned in the reserve")
