"""Lifetimes across real processes: objects outlive producers, deaths release and abort,
views outlive delete, and the daemon's own death."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import mmap
import os
import signal
import threading
import time

import numpy as np
import pytest

from shmshare import wire
from shmshare.store import Daemon, Store, StoreFull, StoreGone
from shmshare.store._protocol import LARGE
from shmshare.testing import pattern, procs, wait_until

from ..devshm_helpers import foreign
from .helpers import WAIT, dev_shm, memfds

SMALL, BIG = 2000, LARGE // 4 + 4096  # items of 4 bytes


def _producer(path: str) -> None:
    with Store(path) as s:
        s.put("small", pattern(1, SMALL))
        s.put("big", {"a": pattern(2, BIG), "t": ("tag", 3)})
    os._exit(0)


def test_objects_outlive_their_producer(store: Store, daemon: Daemon) -> None:
    with procs.start_child(_producer, daemon.path) as child:
        assert child.join(WAIT) == 0
    np.testing.assert_array_equal(store.get("small"), pattern(1, SMALL))
    big = store.get("big")
    np.testing.assert_array_equal(big["a"], pattern(2, BIG))
    assert big["t"] == ("tag", 3)


def _creator(path: str, n: int) -> None:
    s = Store(path)
    arr = s.create("c", (n,), np.uint32)
    arr[: n // 2] = 7
    s.put("ready", 1)
    time.sleep(WAIT)  # killed here, before seal
    os._exit(3)


@pytest.mark.parametrize("n", [SMALL, BIG])
def test_a_creator_killed_before_seal_aborts_its_object(store: Store, daemon: Daemon,
                                                        n: int) -> None:
    base = memfds(daemon.pid)
    got: list[BaseException] = []

    def waiter() -> None:
        with Store(daemon.path) as other:
            try:
                other.get("c", timeout=WAIT)
            except BaseException as exc:  # noqa: BLE001 - checked below
                got.append(exc)

    with procs.start_child(_creator, daemon.path, n) as child:
        pid = child.pid
        store.get("ready", timeout=WAIT)
        assert not store.info("c").sealed
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.1)  # the waiter is waiting
        child.kill()
        t.join(WAIT)
    assert got and isinstance(got[0], KeyError), got
    assert "aborted" in str(got[0]) and str(pid) in str(got[0])
    assert "c" not in store
    with pytest.raises(KeyError):
        store.info("c")
    wait_until(lambda: memfds(daemon.pid) <= base, "the aborted object's memfd is closed")


def _getter(path: str) -> None:
    s = Store(path)
    held = [s.get("small"), s.get("big"), s.get("big")]
    s.put("held", len(held))
    time.sleep(WAIT)  # killed here, holding views
    os._exit(3)


def test_a_getter_killed_holding_views_gives_its_references_back(store: Store,
                                                                  daemon: Daemon) -> None:
    store.put("small", pattern(3, SMALL))
    store.put("big", pattern(4, BIG))
    with procs.start_child(_getter, daemon.path) as child:
        store.get("held", timeout=WAIT)
        assert store.info("big").refs == 2 and store.info("small").refs == 1
        assert store.info("big").holders == 1
        child.kill()
    wait_until(lambda: store.info("big").refs == 0 and store.info("small").refs == 0,
               "a killed getter's references are given back")
    before = store.stats()["freed"]
    store.delete("big")
    store.delete("small")
    assert store.stats()["freed"] == before + 2  # nothing viewed: freed at once


@pytest.mark.parametrize("immutable", [False, True], ids=["warm", "immutable"])
def test_delete_while_views_are_held_keeps_them_valid_until_they_go(
        store: Store, daemon: Daemon, immutable: bool) -> None:
    store.put("small", pattern(5, SMALL))
    store.put("big", pattern(6, BIG), immutable=immutable)
    with Store(daemon.path) as reader:
        small, big = reader.get("small"), reader.get("big")
        store.delete("small")
        store.delete("big")
        assert "small" not in store
        for i in range(200):  # the pool's blocks are not reused under the held views
            store.put(f"new{i}", pattern(100 + i, SMALL))
        np.testing.assert_array_equal(small, pattern(5, SMALL))
        np.testing.assert_array_equal(big, pattern(6, BIG))
        st = store.stats()
        assert st["deleted_viewed"] == 2
        key = "held_bytes" if immutable else "arena_allocated_bytes"  # (warm: the pool keeps it)
        held = st[key]
        del small, big
        gc.collect()
        wait_until(lambda: store.stats()["deleted_viewed"] == 0, "deleted objects are freed once "
                   "their last view is gone")
        assert store.stats()[key] <= held - BIG * 4  # the big object's bytes came back


def test_a_client_maps_each_segment_once_and_keeps_few_fds(store: Store, daemon: Daemon) -> None:
    for i in range(50):
        store.put(f"s{i}", pattern(i, 100))
    store.put("big", pattern(7, BIG))
    with Store(daemon.path) as reader:
        fds_before = len(os.listdir("/proc/self/fd"))
        for _ in range(4):
            views = [reader.get(f"s{i}") for i in range(50)] + [reader.get("big")]
            assert all((v == pattern(i, 100)).all() for i, v in enumerate(views[:50]))
            del views
            gc.collect()
        # one arena segment, one memfd, and the store's index (Note [Gets without a round trip])
        assert reader._conn.statistics().fds_received == 3
        assert len(os.listdir("/proc/self/fd")) == fds_before  # mapped, not kept open


def _mprotect_writable(address: int, nbytes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rc = libc.mprotect(ctypes.c_void_p(address), nbytes, mmap.PROT_READ | mmap.PROT_WRITE)
    return 0 if rc == 0 else ctypes.get_errno()


def _raw_get(path: str, name: str) -> tuple[dict, int]:
    conn = wire.connect(path, timeout=WAIT)
    try:
        conn.send({"k": "get", "n": name}, timeout=WAIT)
        h, fds = conn.recv(timeout=WAIT)
        assert h["k"] == "obj" and len(fds) == 1, h
        return h, os.dup(fds[0].fileno())
    finally:
        conn.close()


def test_the_write_seal_refuses_writable_mappings_writes_and_mprotect(store: Store,
                                                                       daemon: Daemon) -> None:
    store.put("sealed", pattern(8, BIG), immutable=True)
    _, fd = _raw_get(daemon.path, "sealed")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SHRINK
        with pytest.raises(PermissionError):
            mmap.mmap(fd, BIG * 4, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        m = mmap.mmap(fd, BIG * 4, mmap.MAP_SHARED, mmap.PROT_READ)  # reading is fine
        assert m[:4] == pattern(8, 1).tobytes()
        m.close()
    finally:
        os.close(fd)
    view = store.get("sealed")
    address = view.__array_interface__["data"][0]
    page = address - address % mmap.PAGESIZE
    assert _mprotect_writable(page, mmap.PAGESIZE) == errno.EACCES
    np.testing.assert_array_equal(view, pattern(8, BIG))


def test_a_created_object_is_sealed_against_new_writers_while_its_creator_maps_it(
        store: Store, daemon: Daemon) -> None:
    arr = store.create("c", (BIG,), np.uint32, immutable=True)
    arr[:] = 5
    store.seal("c")
    assert store.info("c").write_seal == "future"
    _, fd = _raw_get(daemon.path, "c")
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, BIG * 4, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)
    del arr
    gc.collect()
    wait_until(lambda: store.info("c").write_seal == "full", "the full seal once the creator unmapped")


@pytest.mark.daemon_args(limit=8 << 20)
def test_the_limit_refuses_with_a_clear_error(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", np.zeros(5 << 20, np.uint8))
        with pytest.raises(StoreFull, match=r"--limit is 8\.00 MiB.*--evict"):
            s.put("b", np.zeros(4 << 20, np.uint8))
        with pytest.raises(MemoryError):  # StoreFull is a MemoryError
            s.create("b", (4 << 20,), np.uint8)
        assert "b" not in s
        small = 0
        with pytest.raises(StoreFull):
            for small in range(10_000):  # the pool's segments count too
                s.put(f"s{small}", np.zeros(LARGE // 2, np.uint8))
        assert 0 < small < 10
        s.delete("a")
        s.put("b", np.zeros(4 << 20, np.uint8))  # room again


@pytest.mark.daemon_args(limit=8 << 20, evict=True)
def test_eviction_takes_unreferenced_objects_least_recently_used_first(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("old", np.zeros(3 << 20, np.uint8))
        s.put("mid", np.zeros(3 << 20, np.uint8))
        s.get("old")  # used: now "mid" is the least recently used (the view is dropped at once)
        gc.collect()
        wait_until(lambda: s.info("old").refs == 0, "the reference comes back")
        s.put("new", np.zeros(3 << 20, np.uint8))
        assert "mid" not in s and "old" in s and "new" in s
        held = s.get("old")
        s.put("newer", np.zeros(3 << 20, np.uint8))  # evicts "new", not the viewed "old"
        assert "new" not in s and "old" in s
        with pytest.raises(StoreFull, match="getters hold views"):
            s.put("huge", np.zeros(7 << 20, np.uint8))
        assert held[0] == 0
        assert s.stats()["evicted"] == 2


def _client(path: str, k: int, clients: int, rounds: int) -> None:
    ok = True
    with Store(path) as s:
        for i in range(rounds):
            n = 16 << (i % 18)  # 64 B .. 8 MiB
            s.put(f"c{k}-{i}", {"a": pattern(k * 1000 + i, n // 4), "i": i})
        for other in range(clients):
            for i in range(rounds):
                got = s.get(f"c{other}-{i}", timeout=WAIT)
                n = 16 << (i % 18)
                ok &= got["i"] == i and bool((got["a"] == pattern(other * 1000 + i, n // 4)).all())
    os._exit(0 if ok else 1)


def test_eight_clients_in_parallel_see_each_others_objects_intact(store: Store,
                                                                   daemon: Daemon) -> None:
    clients, rounds = 8, 18
    children = [procs.start_child(_client, daemon.path, k, clients, rounds)
                for k in range(clients)]
    try:
        codes = [c.join(WAIT * 2) for c in children]
    finally:
        for c in children:
            c.stop()
    assert codes == [0] * clients
    assert len(store.list()) == clients * rounds
    got = store.get("c3-17")
    np.testing.assert_array_equal(got["a"], pattern(3017, (16 << 17) // 4))


def test_a_daemon_killed_with_sigkill_is_a_clear_error_and_leaves_nothing(sockdir: str) -> None:
    shm = dev_shm()
    path = os.path.join(sockdir, "killed.sock")
    d = Daemon.start(path)
    s = Store(path)
    try:
        s.put("x", pattern(9, BIG))
        s.put("y", pattern(10, SMALL))
        held = s.get("x"), s.get("y")
        d.kill()
        with pytest.raises(StoreGone, match=rf"pid {d.pid}.*is gone"):
            s.get("x")
        with pytest.raises(StoreGone):
            s.put("z", 1)
        np.testing.assert_array_equal(held[0], pattern(9, BIG))  # views stay valid
        np.testing.assert_array_equal(held[1], pattern(10, SMALL))
        # memfds only: nothing in /dev/shm, dead daemon or not (a live process's beside: another test's)
        assert not {n for n in dev_shm() - shm if not foreign(n, {os.getpid(), d.pid})}
        again = Daemon.start(path)  # the dead daemon's socket file is taken over
        try:
            with Store(path) as s2:
                assert s2.list() == []
        finally:
            again.stop()
    finally:
        del held
        s.close()
        if d.proc.poll() is None:
            d.kill()


def test_sigterm_stops_the_daemon_cleanly_under_live_clients(sockdir: str) -> None:
    path = os.path.join(sockdir, "term.sock")
    d = Daemon.start(path)
    s = Store(path)
    s.put("x", pattern(11, BIG))
    view = s.get("x")
    os.kill(d.pid, signal.SIGTERM)
    assert d.proc.wait(WAIT) == 0
    d.stop()
    assert not os.path.exists(path)
    np.testing.assert_array_equal(view, pattern(11, BIG))
    with pytest.raises(StoreGone):
        s.info("x")
    del view
    s.close()
