"""The lending pool under the channel's sender and the multiprocessing owner (_plane/pool.py):
its books stay consistent through any order of takes, leases, releases, local views dying,
a borrower going and closing; a block in use is never handed out again; spares follow Note
[Spare blocks]; a retirer keeps a forked child's blocks back until it lets them go.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from shmshare._plane import LendingPool
from shmshare.memory import InvariantError

_LIMIT = 8 << 20


def _pool(spare_limit: int = 1 << 20) -> LendingPool:
    return LendingPool(_LIMIT, "memfd", None, spare_limit)


def _close(pool: LendingPool) -> None:
    pool.borrower_gone()
    pool.free_retired()
    pool.drain_local()
    pool.free_spares()
    pool.alloc.empty_cache()
    pool.provider.close()


@pytest.mark.parametrize("seed", range(6))
def test_any_order_of_steps_keeps_the_books_consistent_and_never_reuses_a_block_in_use(seed):
    rng = random.Random(seed)
    pool = _pool()
    local, leases, clock = [], [], 0
    try:
        for _ in range(400):
            op = rng.random()
            clock += 1
            if op < 0.35:
                n = rng.choice([100, 512, 4000, 70_000])
                held = pool.take(n, clock, pool.alloc.malloc, True)
                assert held.local and not held.spare and held not in pool.retired
                assert all(held is not h for h in local)  # never a block viewed here already
                assert all(held is not pool.leases[x] for x in leases)  # nor one lent
                local.append(held)
            elif op < 0.55 and local:
                held = rng.choice(local)
                leases.append(pool.lend(held))
            elif op < 0.75 and local:  # a local view dies (its callback queues it)
                held = local.pop(rng.randrange(len(local)))
                pool.local_done.append(held)
                pool.drain_local()
            elif op < 0.95 and leases:  # some releases come back, a few ids unknown
                back = [leases.pop(rng.randrange(len(leases))) for _ in range(rng.randint(1, len(leases)))]
                pool.give_back([*back, rng.getrandbits(40)])
            elif op < 0.97:
                pool.free_spares()
            pool.check_invariants()
        assert set(pool.leases) == set(leases)
        pool.borrower_gone()
        assert not pool.leases and not pool.spares
        pool.check_invariants()
        for held in local:
            pool.local_done.append(held)
        pool.drain_local()
        pool.free_retired()
        pool.check_invariants()
        assert not pool.held  # nothing viewed, nothing lent, nothing spared once the borrower went
    finally:
        _close(pool)


def test_a_released_block_is_the_next_request_of_its_size_and_old_sizes_go_back():
    pool = _pool()
    try:
        held = pool.take(4096, 0, pool.alloc.malloc, True)
        lease = pool.lend(held)
        pool.local_done.append(held)
        pool.drain_local()
        assert held.block.address in pool.held and not held.spare  # still lent
        pool.give_back([lease])
        assert held.spare and pool.spare_bytes == held.block.size
        assert pool.take(4000, 1, pool.alloc.malloc, False) is held  # the same size key
        pool.give_back([])
        pool.maybe_free(held)
        assert held.spare
        pool.take(100, 200, pool.alloc.malloc, False)  # a miss 199 ticks later sweeps the old size
        assert held.block.address not in pool.held and not pool.spares.get(4096)
        pool.check_invariants()
    finally:
        _close(pool)


def test_spares_of_a_size_no_longer_asked_for_go_back_while_other_requests_hit():
    """Sizes that stop being asked for go back even when every later request finds a spare (the
    store's review: a producer of 400 kB objects turned to 600 kB ones, every put a hit, kept
    16 MB of 400 kB spares for good and grew its pool around them)."""
    pool = _pool()
    try:
        old = pool.take(4096, 0, pool.alloc.malloc, True)
        new = pool.take(8192, 0, pool.alloc.malloc, True)
        for held in (old, new):
            pool.local_done.append(held)
        pool.drain_local()
        assert old.spare and new.spare
        for clock in range(1, 200):  # every request a hit: its spare taken and given back
            assert pool.take(8192, clock, pool.alloc.malloc, True) is new
            pool.local_done.append(new)
            pool.drain_local()
        assert old.block.address not in pool.held and pool.spare_bytes == new.block.size
        pool.check_invariants()
    finally:
        _close(pool)


def test_a_take_without_spares_drains_first_and_takes_what_the_drain_gave_back():
    pool = _pool()
    try:
        held = pool.take(4096, 0, pool.alloc.malloc, False)
        lease = pool.lend(held)
        calls = []

        def drain() -> None:
            calls.append(1)
            pool.give_back([lease])

        assert pool.take(4096, 1, _no_malloc, False, drain) is held and calls == [1]
    finally:
        _close(pool)


def _no_malloc(n: int) -> None:
    raise AssertionError("a spare was there: no malloc")


class _Retirer:
    def __init__(self) -> None:
        self.kept: list = []
        self.child_alive = True

    def busy(self) -> bool:  # as ForkBook's: something marked (every block here) or kept
        return self.child_alive or bool(self.kept)

    def retire(self, address: int, block) -> bool:
        if self.child_alive:
            self.kept.append(block)
        return self.child_alive

    def free_now(self) -> list:
        if self.child_alive:
            return []
        kept, self.kept = self.kept, []
        return kept


def test_blocks_a_forked_child_may_map_are_never_reused_until_it_is_gone():
    pool = _pool()
    pool.retirer = retirer = _Retirer()
    try:
        held = pool.take(4096, 0, pool.alloc.malloc, True)
        pool.local_done.append(held)
        pool.drain_local()
        assert retirer.kept == [held.block] and held.block.address not in pool.held
        again = pool.take(4096, 1, pool.alloc.malloc, True)
        assert again.block.address != held.block.address
        pool.check_invariants()
        retirer.child_alive = False
        pool.local_done.append(again)
        pool.drain_local()  # the next free lets the child's block go too
        assert retirer.kept == []
        pool.check_invariants()
    finally:
        _close(pool)


def test_copy_in_copies_every_byte_of_strided_and_structured_arrays():
    pool = _pool()
    try:
        base = np.arange(64, dtype=np.int32).reshape(8, 8)
        for arr in (base[:, ::3], base.T, np.zeros(5, np.dtype([("a", "u1"), ("b", "<i8")], align=True))):
            from shmshare import _native

            ptr, lo, span = _native.extent(arr)
            held = pool.copy_in(arr, ptr + lo, span, 0, pool.alloc.malloc)
            got = np.ndarray(arr.shape, arr.dtype, _native.Lease(None, held.block.address, arr.nbytes))
            assert np.array_equal(got, arr) and not held.local
            pool.maybe_free(held)
        pool.check_invariants()
    finally:
        _close(pool)


def test_the_invariants_name_a_broken_book():
    pool = _pool()
    try:
        held = pool.take(4096, 0, pool.alloc.malloc, True)
        pool.lend(held)
        held.leases += 1  # a count that no lease backs
        with pytest.raises(InvariantError, match="counts 2 leases, 1 name it"):
            pool.check_invariants()
        held.leases -= 1
        pool.spare_bytes += 1
        with pytest.raises(InvariantError, match="spare_bytes"):
            pool.check_invariants()
        pool.spare_bytes -= 1
        pool.addrs.append(0)
        with pytest.raises(InvariantError, match="sorted"):
            pool.check_invariants()
        pool.addrs.pop()
    finally:
        _close(pool)
