"""Views of store objects across fork(): a child keeps what it had at fork, as it keeps every
other object it inherited, whatever its parent does next (Note [Views across fork] in
store/_inherited.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmshare.store import Daemon, Store
from shmshare.testing import pattern, procs, wait_until

from .helpers import WAIT, close_fds


def _check_after_go(view: np.ndarray, r: int, w: int, want: np.ndarray) -> None:
    os.close(w)
    go = os.read(r, 1)  # the parent's go, or EOF if it went first
    same = bool(go) and view.shape == want.shape and np.array_equal(view, want)
    os._exit(0 if same else 1)


@pytest.mark.parametrize(("n", "immutable"), [(1000, False), (600_000, False), (600_000, True)],
                         ids=["pool-block", "warm-large", "memfd-object"])
def test_a_forked_childs_view_keeps_its_bytes_after_the_parent_lets_go(
        own_daemon: Daemon, n: int, immutable: bool) -> None:
    """The parent deletes the object, drops its view (the daemon frees the object) and puts
    another of the same size, which the daemon's pool places in the freed block; the child's
    inherited view still reads the bytes it had at fork (before the fix a pool block's view
    read the new object's)."""
    with Store(own_daemon.path) as s:
        s.put("anchor", pattern(0, 10))  # the pool is never empty: its segment is not given back
        s.put("first", pattern(1, n), immutable=immutable)
        view = s.get("first")
        r, w = os.pipe()
        try:
            with procs.start_child(_check_after_go, view, r, w, pattern(1, n)) as child:
                os.close(r)
                r = -1
                s.delete("first")
                del view
                wait_until(lambda: s.stats()["deleted_viewed"] == 0, "the parent's reference is back")
                s.put("second", pattern(2, n), immutable=immutable)  # best fit: "first"'s block
                os.write(w, b"g")
                rc = child.join(WAIT)
        finally:
            close_fds(r, w)
        assert rc == 0, "the child's inherited view changed once the parent let go of its own"
        assert np.array_equal(s.get("second"), pattern(2, n))  # the parent's side is as it was
        for name in ("anchor", "second"):
            s.delete(name)


def _report_copies(view: np.ndarray, w: int) -> None:
    """In the child: the bytes of its private copies (memfds named after its pid) it maps."""
    mine = f"shmshare_{os.getpid()}_"
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if mine in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    os.write(w, str(total).encode())
    os._exit(0 if int(view[0]) == int(pattern(3, 10)[0]) else 1)


def test_a_forked_child_copies_the_pages_its_views_cover_not_their_segments(
        own_daemon: Daemon) -> None:
    """A view of a small object and of a large warm one (in segments of 2 and 20 MiB): the
    child copies the pages the two views cover, not the segments they lie in."""
    with Store(own_daemon.path) as s:
        s.put("small", pattern(3, 10))
        s.put("large", np.zeros(3 << 18, np.int32))  # 3 MiB: a 20 MiB segment of the pool
        small, large = s.get("small"), s.get("large")
        page = os.sysconf("SC_PAGE_SIZE")
        r, w = os.pipe()
        try:
            with procs.start_child(_report_copies, small, w) as child:
                os.close(w)
                w = -1
                rc = child.join(WAIT)
                copied = int(os.read(r, 64) or b"-1")
        finally:
            close_fds(r, w)
        assert rc == 0
        assert page + (3 << 20) <= copied <= 2 * page + (3 << 20), copied
        del small, large
