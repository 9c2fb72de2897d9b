"""Views of store objects across fork(): a child keeps what it had at fork, as it keeps every
other object it inherited, whatever its parent does next (Note [Views across fork] in
store/_inherited.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmshare.store import Daemon, Store
from shmshare.testing import pattern, procs, wait_until

from .helpers import WAIT


def _check_after_go(view: np.ndarray, r: int, w: int, want: np.ndarray) -> None:
    os.close(w)
    go = os.read(r, 1)  # the parent's go, or EOF if it went first
    same = bool(go) and view.shape == want.shape and np.array_equal(view, want)
    os._exit(0 if same else 1)


@pytest.mark.parametrize("n", [1000, 600_000], ids=["pool-block", "memfd-object"])
def test_a_forked_childs_view_keeps_its_bytes_after_the_parent_lets_go(own_daemon: Daemon,
                                                                        n: int) -> None:
    """The parent deletes the object, drops its view (the daemon frees the object) and puts
    another of the same size, which the daemon's pool places in the freed block; the child's
    inherited view still reads the bytes it had at fork (before the fix a pool block's view
    read the new object's)."""
    with Store(own_daemon.path) as s:
        s.put("anchor", pattern(0, 10))  # the pool is never empty: its segment is not given back
        s.put("first", pattern(1, n))
        view = s.get("first")
        r, w = os.pipe()
        try:
            with procs.start_child(_check_after_go, view, r, w, pattern(1, n)) as child:
                os.close(r)
                r = -1
                s.delete("first")
                del view
                wait_until(lambda: s.stats()["deleted_viewed"] == 0, "the parent's reference is back")
                s.put("second", pattern(2, n))  # best fit: the block "first" had
                os.write(w, b"g")
                rc = child.join(WAIT)
        finally:
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
        assert rc == 0, "the child's inherited view changed once the parent let go of its own"
        assert np.array_equal(s.get("second"), pattern(2, n))  # the parent's side is as it was
        for name in ("anchor", "second"):
            s.delete(name)
