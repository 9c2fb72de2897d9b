"""The daemon's arena is the lenders' pool without spares (Note [The store's pool] in
store/_objects.py): a freed object's room serves later puts of any size, a viewed object's block is
never reused, and the room under a limit is what a fresh store has."""

from __future__ import annotations

import numpy as np
import pytest

from shmshare.store import Daemon, Store, StoreFull
from shmshare.testing import wait_until

KB = 1000


def _freed(s: Store) -> None:
    wait_until(lambda: s.stats()["objects"] <= 1 and s.stats()["deleted_viewed"] == 0, "the objects freed",
               timeout=5)


def test_a_viewed_objects_block_is_never_reused(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", np.full(300 * KB, 1, np.uint8))
        held = g.get("a")
        s.delete("a")  # unnamed, but g views it: the block stays the object's
        s.put("b", np.full(300 * KB, 2, np.uint8))
        assert int(held.min()) == int(held.max()) == 1
        assert g.get("b").__array_interface__["data"][0] != held.__array_interface__["data"][0]


def test_a_freed_objects_room_serves_puts_of_another_size(own_daemon: Daemon) -> None:
    """Forty 400 kB objects come and go while one object stays; then 600 kB ones: the pool does not
    grow around the old room (with spares of the old size kept, it held 35.7 MB here, not 18.9)."""
    with Store(own_daemon.path) as s:
        s.put("keep", np.zeros(10, np.uint8))  # the pool is never empty: no idle trim
        for i in range(40):
            s.put(f"x{i}", np.full(400 * KB, 1, np.uint8))
        before = s.stats()["arena_reserved_bytes"]
        for i in range(40):
            s.delete(f"x{i}")
        _freed(s)
        for i in range(25):
            s.put(f"y{i}", np.full(600 * KB, 2, np.uint8))
        # 600 kB objects pack 3 to a 2 MiB segment where 400 kB ones packed 5: one segment more at most
        assert s.stats()["arena_reserved_bytes"] <= before + (2 << 20)
        assert all(int(s.get(f"y{i}")[-1]) == 2 for i in range(25))


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
    wait_until(lambda: s.stats()["objects"] == 0 and s.stats()["deleted_viewed"] == 0, "every object freed",
               timeout=5)


@pytest.mark.daemon_args(limit=(4 << 20) + (256 << 10))
def test_under_a_limit_puts_of_other_sizes_fit_as_in_a_fresh_store(own_daemon: Daemon) -> None:
    """As many 1 MB objects fit after the limit's worth of 600 kB objects came and went as fit in
    the fresh store (with spares kept, one in a segment pushed the puts of other sizes elsewhere
    and fragmented the room: 2 of the 3 fit here)."""
    with Store(own_daemon.path) as s:
        fresh = _fill(s, "m", 1000 * KB)
        assert fresh >= 2
        _empty(s, "m", fresh)
        small = _fill(s, "s", 600 * KB)
        _empty(s, "s", small)
        assert _fill(s, "n", 1000 * KB) == fresh
