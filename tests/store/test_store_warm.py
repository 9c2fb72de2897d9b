"""Warm memory for large objects (Note [Warm memory] in store/_putting.py): puts of 1 MiB or more
copied into the daemon's pool through a mapping the putter keeps, recycled blocks that getters
read without a fault, read-only getters, the fallback to a memfd of its own, and rooms given up
or left behind by a client that went."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import resource

import numpy as np
import pytest

from shmshare import wire
from shmshare.store import BadRequest, Daemon, Store
from shmshare.store._packing import Plan
from shmshare.testing import pattern, procs, wait_until

from .helpers import WAIT, close_fds

MiB = 1 << 20


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _where(view: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0])


def test_a_recycled_block_is_put_and_got_without_new_pages_or_faults(own_daemon: Daemon) -> None:
    """The second put of a size lands in the first one's block: no new fd, and the getter
    reads every page of it without a page fault (its mapping has the pages already)."""
    n = 8 * MiB
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", pattern(1, n // 4))
        v = g.get("a")
        assert int(v[::1024].sum()) == int(pattern(1, n // 4)[::1024].sum())  # faults them in
        first = _where(v)
        del v
        s.delete("a")
        wait_until(lambda: s.stats()["arena_allocated_bytes"] == 0, "the block back in the pool")
        fds = g._conn.statistics().fds_received
        s.put("b", pattern(2, n // 4))
        before = _faults()
        v = g.get("b")
        total = int(v[::1024].sum())  # a read of every page
        faults = _faults() - before
        assert _where(v) == first  # best fit: the same block, the same mapping
        assert g._conn.statistics().fds_received == fds  # no segment sent again
        assert total == int(pattern(2, n // 4)[::1024].sum())
        assert faults < 16, f"{faults} page faults reading a recycled 8 MiB block"
        assert s.info("b").kind == "arena"


def _mprotect_writable(address: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = address - address % mmap.PAGESIZE
    rc = libc.mprotect(ctypes.c_void_p(page), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
    return 0 if rc == 0 else ctypes.get_errno()


def test_a_getter_maps_warm_objects_read_only(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", np.zeros(2 * MiB, np.uint8))
        v = g.get("a")
        assert not v.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):
            v.flags.writeable = True
        assert _mprotect_writable(_where(v)) == errno.EACCES  # PROT_READ, from an O_RDONLY fd
        del v


@pytest.mark.daemon_args(limit=8 * MiB)
def test_under_a_limit_an_object_the_pool_cannot_take_gets_a_memfd_of_its_own(
        own_daemon: Daemon) -> None:
    """A 2 MiB object would take a 20 MiB segment of the pool, past an 8 MiB limit: it falls
    back to a sealed memfd of its own, charged by the page."""
    with Store(own_daemon.path) as s:
        s.put("a", pattern(3, MiB // 2))
        info = s.info("a")
        assert (info.kind, info.write_seal) == ("memfd", "full")
        assert s.stats()["pending"] == 0 and s.stats()["arena_reserved_bytes"] == 0
        np.testing.assert_array_equal(s.get("a"), pattern(3, MiB // 2))
        arr = s.create("c", (2 * MiB,), np.uint8)  # create falls back the same way
        arr[:] = 9
        s.seal("c")
        assert s.info("c").kind == "memfd" and int(s.get("c")[-1]) == 9


@pytest.mark.daemon_args(limit=40 * MiB, evict=True)
def test_with_evict_a_warm_object_of_10_mib_or_more_evicts_the_least_recently_used(
        own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        for name in ("a", "b", "c"):
            s.put(name, np.zeros(12 * MiB, np.uint8))
        assert s.info("a").kind == "arena"
        s.put("d", np.zeros(12 * MiB, np.uint8))  # 48 MiB past 40: "a" goes
        assert "a" not in s and all(n in s for n in "bcd")
        assert s.info("d").kind == "arena" and s.stats()["evicted"] == 1


def _raw(path: str) -> wire.Connection:
    return wire.connect(path, timeout=WAIT)


def test_a_room_of_a_client_that_goes_before_its_put_goes_back(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        conn = _raw(own_daemon.path)
        conn.send({"k": "room", "n": "x", "s": 4 * MiB}, timeout=WAIT)
        h, fds = conn.recv(timeout=WAIT)
        assert h["k"] == "room" and len(fds) == 1 and h["n"] >= 4 * MiB
        for f in fds:
            f.close()
        assert s.stats()["pending"] == 1 and s.stats()["arena_allocated_bytes"] >= 4 * MiB
        assert "x" not in s  # not named until its put
        conn.close()  # as a kill -9 between room and put
        wait_until(lambda: s.stats()["pending"] == 0, "the room given back")
        assert s.stats()["arena_allocated_bytes"] == 0


def test_a_put_may_name_only_a_room_of_its_own_clients_and_of_its_size(
        own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        a, b = _raw(own_daemon.path), _raw(own_daemon.path)
        try:
            a.send({"k": "room", "n": "x", "s": 2 * MiB}, timeout=WAIT)
            h, fds = a.recv(timeout=WAIT)
            for f in fds:
                f.close()
            plan = Plan(np.zeros(2 * MiB, np.uint8))  # the meta of a 2 MiB array, as a client's
            put = {"k": "put", "n": "x", "m": plan.meta, "s": plan.size, "t": False, "o": h["o"]}
            b.send(put, timeout=WAIT)  # another client's room
            got, _ = b.recv(timeout=WAIT)
            assert got["k"] == "err" and "not given" in got["w"], got
            small = Plan(np.zeros(MiB, np.uint8))
            a.send({**put, "m": small.meta, "s": small.size}, timeout=WAIT)  # not its size
            got, _ = a.recv(timeout=WAIT)
            assert got["k"] == "err" and "is not what room" in got["w"], got
            assert s.stats()["pending"] == 0  # a refused put gives its room back
            for bad in ({"k": "room", "n": "y", "s": 100}, {"k": "room", "n": "y", "s": "big"}):
                a.send(bad, timeout=WAIT)
                got, _ = a.recv(timeout=WAIT)
                assert got["k"] == "err" and got["e"] == "bad", got
        finally:
            a.close()
            b.close()
        with pytest.raises(BadRequest):
            s._call({"k": "put", "n": "z", "m": plan.meta, "s": plan.size, "t": False, "o": 10**9})


def _write_and_report(arr: np.ndarray, w: int) -> None:
    arr[:] = 7  # the child's writes stay its own (its copy of the array's pages)
    os.write(w, b"k")
    os._exit(0)


def test_a_warm_creates_array_in_a_forked_child_is_the_childs_own(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        arr = s.create("c", (2 * MiB,), np.uint8)
        arr[:] = 1
        r, w = os.pipe()
        try:
            with procs.start_child(_write_and_report, arr, w) as child:
                os.close(w)
                w = -1
                assert os.read(r, 1) == b"k"
                assert child.join(WAIT) == 0
        finally:
            close_fds(r, w)
        s.seal("c")
        assert int(arr.max()) == 1 and int(s.get("c").max()) == 1
        del arr
        gc.collect()


# -- what a hostile review found (each a silent corruption before its fix) ------------------


def _report_tensor(t: object, r: int, w: int) -> None:
    os.close(w)
    os.read(r, 1)  # the parent's go: the block is another object's by now
    os._exit(int(t[0]) * 10 + int(t[-1]))  # type: ignore[index]


def test_a_forked_childs_tensor_of_a_warm_object_keeps_its_bytes(own_daemon: Daemon) -> None:
    """A torch object's get is a copy-on-write mapping of the pool segment, whose untouched pages
    are the daemon's: the child copies them at fork, as it does a numpy view's."""
    torch = pytest.importorskip("torch")
    with Store(own_daemon.path) as s, Store(own_daemon.path) as g:
        s.put("a", torch.full((4 * MiB,), 1, dtype=torch.uint8))
        t = g.get("a")
        r, w = os.pipe()
        try:
            with procs.start_child(_report_tensor, t, r, w) as child:
                os.close(r)
                r = -1
                del t
                gc.collect()
                s.delete("a")
                wait_until(lambda: s.stats()["arena_allocated_bytes"] == 0, "the block freed")
                s.put("b", torch.full((4 * MiB,), 2, dtype=torch.uint8))  # into "a"'s block
                os.write(w, b"g")
                rc = child.join(WAIT)
        finally:
            close_fds(r, w)
        assert rc == 11, f"the child's tensor read {rc // 10}, {rc % 10}: not the bytes it had"


def test_close_during_a_warm_puts_copy_keeps_its_room_from_other_puts(
        own_daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() from another thread while a put copies: the Store is not idle (a room is being
    written), so the connection stays and the daemon gives the room to nobody else."""
    import threading

    from shmshare.store import _putting

    copy, copying, go = _putting.copy_plan, threading.Event(), threading.Event()

    def slow_copy(plan: Plan, address: int) -> None:
        copying.set()
        go.wait(WAIT)  # stands for a long copy
        copy(plan, address)

    monkeypatch.setattr(_putting, "copy_plan", slow_copy)
    with Store(own_daemon.path) as b:
        a = Store(own_daemon.path)
        failed: list[BaseException] = []

        def put_a() -> None:
            try:
                a.put("A", np.full(16 * MiB, 1, np.uint8))
            except Exception as exc:  # noqa: BLE001 - looked at below
                failed.append(exc)

        t = threading.Thread(target=put_a)
        t.start()
        assert copying.wait(WAIT)
        a.close()
        monkeypatch.setattr(_putting, "copy_plan", copy)
        b.put("B", np.full(16 * MiB, 7, np.uint8))
        go.set()
        t.join(WAIT)
        v = b.get("B")
        assert int((v != 7).sum()) == 0, "another put's copy wrote into B's block"
        assert len(failed) == 1 and "closed" in str(failed[0])  # a put after close() is refused
        del v
        wait_until(lambda: b.stats()["pending"] == 0, "A's room given back")


def _fork_and_exit(path: str, w: int, w2: int, gate: int) -> None:
    """The client: get a view, fork a child that copies it only once the test says so (its fork
    handler waits on `gate`) and then reports what it reads, and exit at once."""
    from shmshare.store import _inherited

    copy = _inherited.copy_in_place

    def gated(*args: object) -> None:
        os.read(gate, 1)
        copy(*args)  # type: ignore[arg-type]

    _inherited.copy_in_place = gated  # type: ignore[assignment]
    s = Store(path)
    v = s.get("a")
    child = os.fork()
    if child == 0:
        os.write(w2, bytes([int(v[0]), int(v[len(v) // 2]), int(v[-1])]))
        os._exit(0)
    os.write(w, str(child).encode())
    os._exit(0)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_child_whose_parent_exits_at_fork_copies_its_views_before_letting_go(
        own_daemon: Daemon) -> None:
    """The child copies its views before it closes its copy of the parent's connection: with the
    parent gone, that copy is what keeps the parent's references. Here the child's copy waits
    until the object is deleted and another put where its block was, if it was freed."""
    n = 8 * MiB
    with Store(own_daemon.path) as o:
        o.put("a", np.full(n, 1, np.uint8))
        r, w = os.pipe()
        r2, w2 = os.pipe()
        gate_r, gate_w = os.pipe()
        try:
            with procs.start_child(_fork_and_exit, own_daemon.path, w, w2, gate_r) as client:
                os.close(w)
                os.close(w2)
                w = w2 = -1
                int(os.read(r, 32))
                # the client has exited (a zombie: its join would wait on a sentinel fd that
                # the gated grandchild holds too): its child copies
                wait_until(lambda: _state(client.pid) == "Z", "the client exited")
                o.delete("a")
                with contextlib.suppress(AssertionError):  # freed only if the bug is back
                    wait_until(lambda: o.stats()["deleted_viewed"] == 0, "a freed", timeout=1)
                o.put("b", np.full(n, 2, np.uint8))  # into "a"'s block, if it was freed
                os.write(gate_w, b"g")
                got = os.read(r2, 3)  # the grandchild then exits (it is init's to reap)
        finally:
            close_fds(r, w, r2, w2, gate_r, gate_w)
        assert list(got) == [1, 1, 1], f"the child's view read {list(got)}"


def test_a_putter_cannot_seal_a_pool_segment(own_daemon: Daemon) -> None:
    """The read-write fd of a room is of a segment sealed F_SEAL_SEAL: a write seal added there
    would refuse every other putter and pass the segment off as an object's own memfd."""
    import fcntl

    conn = _raw(own_daemon.path)
    try:
        conn.send({"k": "room", "n": "x", "s": 2 * MiB}, timeout=WAIT)
        _, fds = conn.recv(timeout=WAIT)
        try:
            with pytest.raises(PermissionError):
                fcntl.fcntl(fds[0].fileno(), fcntl.F_ADD_SEALS, 0x10)  # F_SEAL_FUTURE_WRITE
        finally:
            for f in fds:
                f.close()
    finally:
        conn.close()
    with Store(own_daemon.path) as s:
        s.put("y", np.zeros(2 * MiB, np.uint8))
        assert s.info("y").kind == "arena"


def test_a_put_refused_for_its_meta_gives_its_room_back(own_daemon: Daemon) -> None:
    conn = _raw(own_daemon.path)
    try:
        conn.send({"k": "room", "n": "x", "s": 2 * MiB}, timeout=WAIT)
        h, fds = conn.recv(timeout=WAIT)
        for f in fds:
            f.close()
        conn.send({"k": "put", "n": "x", "m": b"\xc1 not meta", "s": 2 * MiB, "t": False,
                   "o": h["o"]}, timeout=WAIT)
        got, _ = conn.recv(timeout=WAIT)
        assert got["k"] == "err" and got["e"] == "bad", got
        with Store(own_daemon.path) as s:
            assert s.stats()["pending"] == 0
    finally:
        conn.close()


# -- what a new user's review found ----------------------------------------------------------


@pytest.mark.daemon_args(limit=64 * MiB)
def test_replacing_a_large_object_under_a_limit_it_fits_once_works(own_daemon: Daemon) -> None:
    """40 MiB put twice with replace=True under 64 MiB: no room for two in the pool, so the new
    one takes a memfd of its own, for which the old one (unreferenced, alone in its segment) is
    let go first -- as delete and put would."""
    with Store(own_daemon.path) as s:
        s.put("w", np.ones(40 * MiB, np.uint8))
        s.put("w", np.full(40 * MiB, 2, np.uint8), replace=True)
        assert int(s.get("w")[-1]) == 2
        s.put("w", np.full(40 * MiB, 3, np.uint8), replace=True)
        assert int(s.get("w")[0]) == 3 and s.stats()["objects"] == 1


@pytest.mark.daemon_args(limit=24 * MiB)
def test_under_a_limit_free_room_in_a_pool_segment_takes_a_warm_put(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", np.ones(5 * MiB, np.uint8))  # a 20 MiB segment, 15 MiB of it free
        s.put("b", np.ones(5 * MiB, np.uint8))
        assert s.info("a").kind == s.info("b").kind == "arena"


def test_seal_of_a_created_object_another_client_replaced_raises_key_error(
        own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as a, Store(own_daemon.path) as b:
        arr = a.create("x", (2 * MiB,), np.uint8)
        b.put("x", np.zeros(2 * MiB, np.uint8), replace=True)
        with pytest.raises(KeyError):
            a.seal("x")
        with pytest.raises(KeyError, match="not created through this Store"):
            a.seal("x")  # forgotten: the same error, not the daemon's again
        with pytest.raises(TypeError, match=r"put\(replace=...\) takes True or False"):
            a.put("y", 1, replace="no")  # type: ignore[arg-type]
        del arr
