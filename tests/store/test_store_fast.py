"""Gets without a round trip (Note [Gets without a round trip] in store/_index.py): a name got
once is got again from shared memory, never stale, and its views hold the object as a get's
references do -- against delete, replace, eviction, spilling and reuse -- until they die or
their client does; hostile counts and a hostile index change nothing but what they may."""

from __future__ import annotations

import gc
import os
import random
import signal

import numpy as np
import pytest

from shmshare import _native, wire
from shmshare.store import BadRequest, Daemon, Store, StoreFull
from shmshare.store._index import WORDS
from shmshare.testing import pattern, procs, wait_until

from .helpers import WAIT, close_fds

MiB = 1 << 20


def _sent(s: Store) -> int:
    return s._conn.statistics().frames_sent


def _once(s: Store, name: str) -> None:
    """A get whose views are dropped at once (the first of a name: from the daemon)."""
    s.get(name)


def _fast(s: Store, name: str) -> np.ndarray:
    """A get that must not ask the daemon (the name was got before)."""
    before = _sent(s)
    got = s.get(name)
    assert _sent(s) == before, "the get asked the daemon"
    return got


def test_a_name_got_once_is_got_again_without_a_request_and_counted(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", pattern(1, 1000))
        s.put("d", {"x": pattern(2, 10), "t": ("k", 3)})
        _once(g, "a")
        _once(g, "d")  # the first gets: from the daemon
        v, d = _fast(g, "a"), _fast(g, "d")
        np.testing.assert_array_equal(v, pattern(1, 1000))
        assert not v.flags.writeable and d["t"] == ("k", 3)
        np.testing.assert_array_equal(d["x"], pattern(2, 10))
        wait_until(lambda: s.info("a").refs == 1, "the first gets' references given back")
        assert s.info("a").holders == 1  # a fast get's views count
        del v, d
        gc.collect()
        wait_until(lambda: s.info("a").refs == 0 and s.info("d").refs == 0, "every view's count back")


def test_a_replaced_or_deleted_name_is_never_got_stale(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", pattern(1, 1000))
        _once(g, "a")
        _fast(g, "a")
        s.put("a", pattern(2, 1000), replace=True)
        np.testing.assert_array_equal(g.get("a"), pattern(2, 1000))
        s.delete("a")
        with pytest.raises(KeyError):
            g.get("a")
        s.put("a", pattern(3, 3 * MiB // 4))  # 3 MiB: warm, elsewhere
        np.testing.assert_array_equal(g.get("a"), pattern(3, 3 * MiB // 4))


def test_a_fast_views_object_is_kept_from_reuse_until_they_die(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("anchor", pattern(0, 10))
        s.put("a", pattern(1, 100_000))
        _once(g, "a")
        v = _fast(g, "a")
        wait_until(lambda: s.info("a").refs == 1, "the first get's reference given back")
        s.delete("a")
        st = s.stats()
        assert st["fast_held"] == 1 and st["deleted_viewed"] == 1
        for i in range(20):  # the pool's room is not the held block's
            s.put(f"n{i}", pattern(10 + i, 100_000))
        np.testing.assert_array_equal(v, pattern(1, 100_000))
        del v
        gc.collect()
        wait_until(lambda: s.stats()["fast_held"] == 0 and s.stats()["deleted_viewed"] == 0,
                   "the object freed once the fast views died")


@pytest.mark.daemon_args(limit=8 * MiB, evict=True)
def test_eviction_passes_over_objects_with_fast_views(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("old", pattern(1, 3 * MiB // 4))  # 3 MiB each, memfds under this limit
        s.put("mid", pattern(2, 3 * MiB // 4))
        _once(g, "old")
        v = _fast(g, "old")  # the least recently used, but viewed
        s.put("new", pattern(3, 3 * MiB // 4))
        assert "old" in s and "mid" not in s
        np.testing.assert_array_equal(v, pattern(1, 3 * MiB // 4))
        del v


def test_a_spill_passes_over_objects_with_fast_views(sockdir: str, tmp_path) -> None:
    with Daemon.start(os.path.join(sockdir, f"fs-{os.getpid()}.sock"), limit="8M",
                      spill=tmp_path / "spill") as d, Store(d.path) as s, Store(d.path) as g:
        s.put("old", pattern(1, 3 * MiB // 4))
        s.put("mid", pattern(2, 3 * MiB // 4))
        _once(g, "old")
        v = _fast(g, "old")
        s.put("new", pattern(3, 3 * MiB // 4))
        kinds = {o.name: o.kind for o in s.list()}
        assert kinds["old"] == "memfd" and kinds["mid"] == "spilled"
        del v
        gc.collect()
        np.testing.assert_array_equal(g.get("mid"), pattern(2, 3 * MiB // 4))


def _hold_fast_and_wait(path: str, w: int) -> None:
    s = Store(path)
    _once(s, "a")
    v = s.get("a")  # fast
    os.write(w, b"k")
    signal.pause()
    del v


def test_a_client_killed_holding_fast_views_lets_go_of_them(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", pattern(1, 1000))
        r, w = os.pipe()
        try:
            with procs.start_child(_hold_fast_and_wait, own_daemon.path, w) as child:
                assert os.read(r, 1) == b"k"
                wait_until(lambda: s.info("a").refs == 1, "only the fast get's views held")
                s.delete("a")
                wait_until(lambda: s.stats()["fast_held"] == 1, "held by the fast views only")
                child.kill()
        finally:
            os.close(r)
            os.close(w)
        wait_until(lambda: s.stats()["fast_held"] == 0 and s.stats()["deleted_viewed"] == 0,
                   "a killed client's fast views let go of")


def _report_after_go(view: np.ndarray, r: int, w: int) -> None:
    os.close(w)
    os.read(r, 1)
    os._exit(0 if np.array_equal(view, pattern(1, 100_000)) else 1)


def test_a_forked_childs_fast_view_keeps_its_bytes(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("anchor", pattern(0, 10))
        s.put("a", pattern(1, 100_000))
        _once(s, "a")
        v = _fast(s, "a")
        r, w = os.pipe()
        try:
            with procs.start_child(_report_after_go, v, r, w) as child:
                os.close(r)
                r = -1
                s.delete("a")
                del v
                gc.collect()
                wait_until(lambda: s.stats()["deleted_viewed"] == 0, "the object freed")
                s.put("b", pattern(2, 100_000))  # best fit: "a"'s block
                os.write(w, b"g")
                rc = child.join(WAIT)
        finally:
            close_fds(r, w)
        assert rc == 0, "a forked child's fast view changed once its parent let go"


def test_hostile_counts_pin_objects_only_while_their_client_lives(own_daemon: Daemon) -> None:
    """A raw client registers counts of its own making, every word huge: it pins what a get's
    references would, and nothing once it goes; a counts fd that is not a sealed memfd of the
    right size is refused and the client kept."""
    with Store(own_daemon.path) as s:
        s.put("a", pattern(1, 1000))
        conn = wire.connect(own_daemon.path, timeout=WAIT)
        try:
            fd = os.memfd_create("bad")  # unsealed
            os.ftruncate(fd, WORDS)
            conn.send({"k": "fast"}, [fd], timeout=WAIT)
            os.close(fd)
            h, _ = conn.recv(timeout=WAIT)
            assert h["k"] == "err" and h["e"] == "bad", h
            from shmshare.store._index import new_counts
            fd, address = new_counts()
            for k in range(0, WORDS // 8, 97):
                _native.store64(address + 8 * k, random.getrandbits(64))
            _native.store64(address, 1 << 62)
            conn.send({"k": "fast"}, [fd], timeout=WAIT)
            os.close(fd)
            h, fds = conn.recv(timeout=WAIT)
            assert h["k"] == "fast" and len(fds) == 1
            for f in fds:
                f.close()
            s.delete("a")  # slot 0 is "a"'s: pinned by the hostile count
            assert s.stats()["fast_held"] == 1
            assert s.info is not None and s.stats()["objects"] == 0
        finally:
            conn.close()
        wait_until(lambda: s.stats()["fast_held"] == 0, "the hostile client's pins gone")
        _native.unmap(address, WORDS, release=True)


def test_the_index_can_be_written_by_the_daemon_only(own_daemon: Daemon) -> None:
    """The index as hostile shared memory: a client's read-only fd of it, or the daemon's own,
    reopened read-write through /proc, can neither write it nor map it writable (sealed
    F_SEAL_FUTURE_WRITE): no generation can be forged."""
    import mmap

    with Store(own_daemon.path) as s:
        s.put("a", pattern(1, 500))
        _once(s, "a")
        fd = _index_fd(own_daemon.pid)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(fd, (12345).to_bytes(8, "little"), 0)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, WORDS, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        np.testing.assert_array_equal(_fast(s, "a"), pattern(1, 500))


def _index_fd(pid: int) -> int:
    """The daemon's index, opened read-write through its fd (as root: a hostile daemon's view)."""
    for n in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{n}"
        try:
            if os.readlink(path).startswith("/memfd:") and os.stat(path).st_size == WORDS:
                return os.open(path, os.O_RDWR)
        except OSError:
            continue
    raise AssertionError("no index memfd in the daemon")


def test_a_fast_request_twice_or_without_an_fd_is_refused(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", 1)
        _once(s, "a")
        _once(s, "a")
        with pytest.raises(BadRequest, match="once per connection"):
            s._call({"k": "fast"})
        assert s.get("a") == 1


@pytest.mark.daemon_args(limit=4 * MiB)
def test_a_full_store_counts_fast_views_as_viewed(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", np.zeros(MiB, np.uint8), immutable=True)
        _once(s, "a")
        v = _fast(s, "a")
        with pytest.raises(StoreFull):
            s.put("b", np.zeros(3 * MiB, np.uint8), immutable=True)
        del v


def _drop_inherited(view: np.ndarray) -> None:
    del view
    gc.collect()  # the child's views die, in a collection too: nothing of the parent's counts
    os._exit(0)


def test_a_forked_childs_views_never_give_back_the_parents_counts(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", pattern(1, 1000))
        _once(s, "a")
        v = _fast(s, "a")
        slot = s._fastgets.known["a"][0]
        word = s._fastgets.counts.address + 8 * slot
        for _ in range(3):
            with procs.start_child(_drop_inherited, [v, v[1:]]) as child:
                assert child.join(WAIT) == 0
            wait_until(lambda: _native.load64(word) == 1, "the parent's fork holds taken back")
        assert s.info("a").refs == 1
        del v


@pytest.mark.daemon_args(limit=8 * MiB)
def test_a_failed_replace_keeps_an_object_fast_views_hold(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", pattern(1, 3 * MiB // 4))
        _once(s, "a")
        v = _fast(s, "a")
        wait_until(lambda: s.info("a").refs == 1, "the first get's reference back")
        with pytest.raises(StoreFull):
            s.put("a", pattern(2, 6 * MiB // 4), replace=True)
        np.testing.assert_array_equal(s.get("a"), pattern(1, 3 * MiB // 4))
        del v
