"""BlockPool: free blocks by (stream, size, counter), unmapped blocks by (stream, address)."""

from __future__ import annotations

import pytest

from shmshare.memory import Block
from shmshare.memory._block import BlockPool, SegmentRecord


def make(pool: BlockPool, stream_id: int, size: int, address: int, counter: int) -> Block:
    segment = SegmentRecord(0, 1 << 30, None, pool, stream_id, stream_id)
    return Block(pool, stream_id, stream_id, size, address, segment, counter)


def test_best_fit_is_a_lower_bound_on_stream_and_size() -> None:
    pool = BlockPool(is_small=False)
    blocks = [make(pool, s, size, addr, c) for c, (s, size, addr) in enumerate(
        [(0, 4096, 0), (0, 1024, 8192), (1, 512, 16384), (0, 4096, 32768), (0, 2048, 65536)], start=1)]
    for block in blocks:
        pool.insert(block)
    order = [(b.stream_id, b.size, b.counter) for b in pool.blocks()]
    assert order == sorted(order) and len(pool) == 5
    assert pool.block_at(pool.lower_bound(0, 1500)).size == 2048
    tie = pool.block_at(pool.lower_bound(0, 3000))
    assert tie.size == 4096 and tie.counter == 1  # equal sizes: the earlier registered block first
    assert pool.block_at(pool.lower_bound(0, 5000)).stream_id == 1  # past stream 0: no fit there
    assert pool.block_at(pool.lower_bound(1, 1024)) is None
    pool.remove(tie)
    assert tie not in pool and pool.block_at(pool.lower_bound(0, 3000)).counter == 4


def test_a_block_enters_once() -> None:
    pool = BlockPool(is_small=True)
    block = make(pool, 0, 512, 0, 1)
    pool.insert(block)
    with pytest.raises(KeyError):
        pool.insert(block)
    pool.remove(block)
    with pytest.raises(KeyError):
        pool.remove(block)


def test_unmapped_blocks_come_in_address_order_per_stream() -> None:
    pool = BlockPool(is_small=False)
    blocks = [make(pool, s, 1 << 21, addr, c) for c, (s, addr) in enumerate(
        [(1, 100 << 21), (0, 50 << 21), (0, 10 << 21), (1, 5 << 21)], start=1)]
    for block in blocks:
        block.mapped = False
        pool.insert_unmapped(block)
    assert [b.address >> 21 for b in pool.unmapped_from(0)] == [10, 50]
    assert [b.address >> 21 for b in pool.unmapped_from(1)] == [5, 100]
    assert pool.has_unmapped(blocks[0])
    pool.remove_unmapped(blocks[0])
    assert not pool.has_unmapped(blocks[0]) and len(pool.unmapped()) == 3
    with pytest.raises(KeyError):
        pool.insert_unmapped(blocks[1])
    assert repr(pool) == "<BlockPool large: 0 free, 3 unmapped>"
