"""The daemon's arena is the lenders' pool (Note [The store's pool] in store/_objects.py): a freed
object's block stays warm for the next put of its size, and none is kept under a limit."""

from __future__ import annotations

import numpy as np
import pytest

from shmshare.store import Daemon, Store, StoreFull
from shmshare.testing import wait_until

KB = 1000


def _freed(s: Store) -> None:
    wait_until(lambda: s.stats()["objects"] == 0 and s.stats()["deleted_viewed"] == 0, "every object freed",
               timeout=5)


def test_a_deleted_objects_block_is_the_next_put_of_its_size(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", np.full(300 * KB, 1, np.uint8))
        first = g.get("a")
        where = first.__array_interface__["data"][0]  # g maps the segment once: same block, same address
        del first
        s.delete("a")
        _freed(s)
        st = s.stats()
        assert st["arena_spare_bytes"] >= 300 * KB and st["arena_allocated_bytes"] == 0, st
        s.put("b", np.full(300 * KB, 2, np.uint8))
        st = s.stats()
        assert st["arena_spare_bytes"] == 0 and st["arena_allocated_bytes"] >= 300 * KB, st
        second = g.get("b")
        assert second.__array_interface__["data"][0] == where
        assert int(second.min()) == int(second.max()) == 2  # every byte the new object's


def test_a_viewed_objects_block_is_never_a_spare(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", np.full(300 * KB, 1, np.uint8))
        held = g.get("a")
        s.delete("a")  # unnamed, but g views it: the block stays the object's
        assert s.stats()["arena_spare_bytes"] == 0
        s.put("b", np.full(300 * KB, 2, np.uint8))
        assert int(held.min()) == int(held.max()) == 1
        assert g.get("b").__array_interface__["data"][0] != held.__array_interface__["data"][0]


def _fill(s: Store, prefix: str, size: int) -> int:
    """Put objects of `size` bytes until the limit refuses one; how many fit."""
    n = 0
    with pytest.raises(StoreFull, match="--limit"):
        for n in range(1000):  # the count is read after the loop
            s.put(f"{prefix}{n}", np.full(size, n % 251, np.uint8))
    assert all(int(s.get(f"{prefix}{i}")[-1]) == i % 251 for i in range(n))
    return n


def _empty(s: Store, prefix: str, n: int) -> None:
    for i in range(n):
        s.delete(f"{prefix}{i}")
    _freed(s)


@pytest.mark.daemon_args(limit=(4 << 20) + (256 << 10))
def test_under_a_limit_puts_of_other_sizes_fit_as_in_a_fresh_store(own_daemon: Daemon) -> None:
    """As many 1 MB objects fit after the limit's worth of 600 kB objects came and went as fit in
    the fresh store (a store with a limit keeps no spares: one in a segment pushes the puts of
    other sizes elsewhere, and fragments the room; with spares kept, 2 of the 3 fit here)."""
    with Store(own_daemon.path) as s:
        fresh = _fill(s, "m", 1000 * KB)
        assert fresh >= 2
        _empty(s, "m", fresh)
        small = _fill(s, "s", 600 * KB)
        _empty(s, "s", small)
        assert s.stats()["arena_spare_bytes"] == 0
        assert _fill(s, "n", 1000 * KB) == fresh
