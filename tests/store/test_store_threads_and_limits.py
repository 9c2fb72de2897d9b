"""The store attacked, part three: one Store on several threads, the flusher racing requests,
full fd tables on either end, eviction and the small-object fallback under --limit, and the
command line (see test_store_hostile.py for the conventions)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

from shmshare import _native
from shmshare._errors import ShmshareError, ShmshareTimeout
from shmshare._plane.trust import check_fd
from shmshare.store import Daemon, Store, StoreError, StoreFull, StoreGone
from shmshare.store._packing import Plan
from shmshare.store._protocol import LARGE
from shmshare.testing import pid_alive, wait_until

from .hostile_helpers import (
    MiB,
    _ask,
    _no_free_fds,
    _raw,
    _start_with_nofile,
    _stopped,
    fill_with_memfd_puts,
)

# -- the client: threads, the flusher, close(), collection, its fd table -----------------------


def test_an_owed_get_reply_read_by_the_idle_flusher_is_not_thrown_away(
        own_daemon: Daemon) -> None:
    """A get that timed out is answered late; when the client stays idle, the flusher reads
    that owed reply first and drops it with its fd (_flush_locked: `elif self._owed`), so the
    reference it took is never given back and the segment is marked sent but never mapped:
    the next get fails with ProtocolError. A fix must hand an owed reply read by the flusher
    to the same code as _call_locked's (_late: release its reference, forget its segment)."""
    with Store(own_daemon.path) as writer, Store(own_daemon.path, timeout=0.3) as s:
        writer.put("x", np.arange(1000))
        with _stopped(own_daemon.pid), pytest.raises(ShmshareTimeout):
            s.get("x")
        time.sleep(1.5)  # idle: the flusher (1 s poll) reads the late reply
        err = None
        try:
            got = s.get("x")
            np.testing.assert_array_equal(got, np.arange(1000))
            del got
        except ShmshareError as exc:
            err = exc
        assert err is None, f"a get after the flusher read an owed reply failed: {err!r}"
        gc.collect()
        writer.delete("x")
        wait_until(lambda: writer.stats()["deleted_viewed"] == 0,
                   "the timed-out get's reference is given back", timeout=3)


def test_threads_getting_objects_of_one_segment_at_once_all_succeed(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads get two objects of one pool segment: the daemon sends the segment's fd
    with the first reply only, and the second thread looks in _segs (outside the lock) before
    the first has mapped it, so its get fails with ProtocolError ("without its segment's fd");
    it happens without help about 1 run in 10 with 8 threads. A fix must map (or wait for the
    mapping of) a segment whose fd is in flight under the lock that orders the replies."""
    store.put("a", np.full(100, 1))
    store.put("b", np.full(100, 2))  # the same 2 MiB pool segment
    first = threading.Event()

    def slow_check(*args: Any, **kw: Any) -> None:  # the first mapper is descheduled
        if not first.is_set():
            first.set()
            time.sleep(0.3)
        check_fd(*args, **kw)

    monkeypatch.setattr("shmshare._plane.borrow.check_fd", slow_check)
    got: dict[str, Any] = {}

    def get_a() -> None:
        try:
            got["a"] = int(store.get("a")[0])
        except Exception as exc:  # noqa: BLE001 - reported below
            got["a"] = exc

    t = threading.Thread(target=get_a)
    t.start()
    assert first.wait(5)
    try:
        got["b"] = int(store.get("b")[0])
    except ShmshareError as exc:
        got["b"] = exc
    t.join(10)
    assert got == {"a": 1, "b": 2}, f"concurrent gets of one segment: {got}"


def test_close_from_another_thread_during_a_get_keeps_the_views_memory(
        own_daemon: Daemon) -> None:
    """close() on one thread while another's get waits for its reply: the flusher finds no
    view alive, decides to shut down, and closes the connection as soon as the get returns,
    so the daemon gives back the reference of a view that is alive and reuses its pool block
    (the view then shows another object's bytes). A fix must decide idleness under the lock
    (after the get counted its view), or make a get that races close() fail."""
    with Store(own_daemon.path) as other:
        other.put("x", np.full(1000, 7))
        s = Store(own_daemon.path)
        s.stats()
        out: dict[str, Any] = {}

        def getter() -> None:
            try:
                out["view"] = s.get("x")
            except StoreError as exc:
                out["error"] = exc

        t = threading.Thread(target=getter)
        with _stopped(own_daemon.pid):
            t.start()
            time.sleep(0.2)
            s.close()
            time.sleep(1.0)  # the flusher gives up on the lock and commits to shutting down
        t.join(10)
        refs = None
        if "view" in out:
            wait_until(lambda: not s._conn.closed or other.info("x").refs == 0,
                       "the connection settles", timeout=2)
            refs = other.info("x").refs
            other.delete("x")
            other.put("y", np.full(1000, 9))  # the freed block again
            seen = int(out["view"][0])
            flusher = s._flusher
            out.clear()  # the view goes before any assertion ...
            s._segs.clear()  # ... and a mapping the get cached after the shutdown
            del s
            flusher.join(5)
            assert refs == 1 and seen == 7, (
                f"a view got while close() ran on another thread is alive, but the daemon "
                f"counts {refs} references to it and it now reads {seen}, not 7")


def _drop_unclosed(path: str) -> tuple[int, int, str, threading.Thread, Any]:
    s = Store(path)
    s.put("staged", np.arange(10))
    s.delete("staged")
    fd, address = s._staging  # type: ignore[misc]
    # __del__'s poke could wake the flusher while the Store is being finalized, and it would
    # then shut the Store down itself (a race the common case loses): __del__ pokes a stand-in
    # (the flusher keeps the real pipe), and the test wakes the flusher once the Store is gone
    real = s._waker.wake
    s._waker.wake = types.SimpleNamespace(poke=lambda: None)  # type: ignore[assignment]
    return fd, address, os.readlink(f"/proc/self/fd/{fd}"), s._flusher, real


def test_a_store_collected_unclosed_closes_its_staging_memfd(daemon: Daemon) -> None:
    """A Store dropped without close() after a small put leaks its 1 MiB staging memfd (a fd
    and a mapping) for the process's life: __del__ closes only the connection, and the
    flusher, finding the Store gone, ends without _shutdown. A fix must close the staging
    memfd and unmap it when the Store is collected (a finalizer that does not need the
    Store, e.g. weakref.finalize on the fd and address)."""
    fd, address, target, flusher, wake = _drop_unclosed(daemon.path)  # the Store goes here
    gc.collect()
    wake.poke()
    flusher.join(3)
    try:
        leaked = os.readlink(f"/proc/self/fd/{fd}") == target
    except OSError:
        leaked = False
    if leaked:  # clean up what the Store left, so only the assertion fails
        os.close(fd)
        _native.unmap(address, LARGE, release=True)
    assert not leaked, f"the collected Store left its staging memfd open: fd {fd} -> {target}"


def test_a_full_fd_table_at_a_get_leaves_the_store_usable(daemon: Daemon) -> None:
    """A get whose reply brings a fd into a full fd table raises FdLimitError (MSG_CTRUNC, the
    reply consumed), which _call_locked counts as owed (except BaseException): every later
    request waits for a reply that never comes and raises ShmshareTimeout, for good, and the
    daemon keeps the lost get's reference and marks its segment sent. A fix must not count a
    consumed reply as owed, and must give back its reference and ask for the fd again."""
    with Store(daemon.path, timeout=2) as s:
        s.put("big", np.arange(MiB // 4, dtype=np.int32))  # its own memfd: the get brings it
        with _no_free_fds(), contextlib.suppress(ShmshareError):
            s.get("big")  # fails (its fd cannot arrive), or gets the fd again
        errors = []
        try:
            s.stats()
        except ShmshareError as exc:
            errors.append(f"stats: {exc!r}")
        try:
            got = s.get("big")
            ok = int(got[-1]) == MiB // 4 - 1
            del got
            if not ok:
                errors.append("get: wrong contents")
        except ShmshareError as exc:
            errors.append(f"get: {exc!r}")
        assert not errors, f"after a get lost its fd to a full fd table: {errors}"
        gc.collect()
        wait_until(lambda: s.info("big").refs == 0, "the lost get's reference is given back",
                   timeout=3)
        s.delete("big")


# -- the daemon: its own fd table, --limit's fallback, eviction ------------------------------


def test_a_get_the_daemon_cannot_answer_for_lack_of_fds_takes_no_reference(
        sockdir: str) -> None:
    """With its fd table full, a get of a small object whose pool segment no getter mapped yet
    fails in ro_fd (EMFILE) with an error reply, after _get counted the reference: the client
    never gets a view to release, so the object can never be freed while it is connected. A
    fix must take the reference (and mark the segment sent) only once the reply is built."""
    path = os.path.join(sockdir, f"nofile3-{os.getpid()}.sock")
    d = _start_with_nofile(path, 64)
    try:
        with Store(path, timeout=5) as a, Store(path, timeout=5) as b:
            a.put("s", np.arange(10))
            n = fill_with_memfd_puts(b)  # a fd each, until none is left
            with pytest.raises(StoreError):
                a.get("s")
            for i in range(min(n, 8)):
                b.delete(f"big{i}")
            v = a.get("s")
            del v
            gc.collect()
            time.sleep(0.3)
            refs = a.info("s").refs
            assert refs == 0, (f"a get the daemon failed (out of fds) left {refs} reference "
                               "held for a view that never existed")
    finally:
        d.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.mark.daemon_args(limit=MiB)
def test_replacing_a_small_object_kept_in_a_fallback_memfd_counts_it_as_room(
        own_daemon: Daemon) -> None:
    """Under --limit 1 MiB every small object lives in a daemon-made memfd (the pool cannot
    grow); put(name, 600 kB, replace=True) over an unreferenced 600 kB one fails StoreFull,
    because _frees_room_for only counts pool blocks (and put-memfds) as room. A fix must
    count the old fallback object's charge as room too, as for the other kinds."""
    with Store(own_daemon.path) as s:
        s.put("w", np.zeros(600_000, np.uint8))
        assert s.info("w").kind == "memfd"
        try:
            s.put("w", np.ones(600_000, np.uint8), replace=True)
        except StoreFull as exc:
            raise AssertionError(f"replacing a fallback object of the same size failed: "
                                 f"{exc}") from exc
        assert int(s.get("w")[0]) == 1


@pytest.mark.daemon_args(limit=4 * MiB, evict=True)
def test_a_put_refused_because_the_name_is_taken_evicts_nothing(own_daemon: Daemon) -> None:
    """A put of a name that exists makes room for its meta (evicting) before it looks at the
    name: with the store full, put("b", value with 9 kB of meta) evicts "a" and then raises
    ObjectExists. A fix must check the name (and everything else that can refuse the put)
    before making room."""
    with Store(own_daemon.path) as s:
        s.put("a", np.zeros(2 * MiB, np.uint8))
        s.put("b", np.zeros(2 * MiB - 8192, np.uint8))
        with pytest.raises(KeyError):
            s.put("b", {"x": "y" * 9000})
        assert "a" in s and s.stats()["evicted"] == 0, "a refused put evicted an object"


@pytest.mark.daemon_args(limit=3 * MiB, evict=True)
def test_a_put_that_cannot_fit_after_eviction_evicts_nothing(own_daemon: Daemon) -> None:
    """_could_fit counts the pool's cached bytes and idle pool objects as room, but a segment
    that a viewed object pins is never given back: a 1.5 MiB put evicts all 8 idle small
    objects one by one and then fails StoreFull, against the docs ("fails at once, and evicts
    nothing"). A fix must count as room only what trimming and eviction really free (whole
    segments), or evict nothing until it knows the put fits."""
    with Store(own_daemon.path) as s:
        s.put("pin", np.zeros(1000, np.uint8))
        pin = s.get("pin")
        for i in range(8):
            s.put(f"idle{i}", np.zeros(100_000, np.uint8))
        with pytest.raises(StoreFull):
            s.put("big", np.zeros(3 * MiB // 2, np.uint8))
        left = sorted(o.name for o in s.list())
        del pin
        assert len(left) == 9, f"a put that failed evicted objects; left: {left}"


@pytest.mark.daemon_args(limit=3 * MiB, evict=True)
def test_a_small_put_that_fits_as_a_fallback_memfd_evicts_nothing(own_daemon: Daemon) -> None:
    """A 1000-byte put into a store holding one 1.5 MiB object under --limit 3 MiB --evict
    evicts that object: the pool's malloc evicts until a 2 MiB segment fits, before the
    memfd fallback (4 KiB here) is tried. A fix must try the fallback (or count what fits)
    before evicting for a small object."""
    with Store(own_daemon.path) as s:
        s.put("big", np.zeros(3 * MiB // 2, np.uint8))
        s.put("small", np.zeros(1000, np.uint8))
        names = sorted(o.name for o in s.list())
        assert names == ["big", "small"], f"a 1000-byte put evicted; the store holds {names}"


@pytest.mark.daemon_args(limit=8 * MiB)
def test_a_replacing_put_refused_keeps_the_old_object(own_daemon: Daemon) -> None:
    """A replacing small put under --limit lets the old object go before it reads the staged
    bytes (_frees_room_for): a put then refused ("bytes were to be staged first") has
    deleted the old object, against "a put that fails leaves the old object as it was". A
    fix must unname the old object only once the new one is complete."""
    with Store(own_daemon.path) as s:
        s.put("w", np.full(1000, 5, np.uint8))
        with _raw(own_daemon.path) as c:
            plan = Plan(np.full(1000, 6, np.uint8))
            h = _ask(c, {"k": "put", "n": "w", "m": plan.meta, "s": plan.size, "t": False,
                         "r": True, "st": plan.size})  # nothing staged on this connection
        assert h["k"] == "err", h
        assert "w" in s, f"a refused replacing put ({h.get('w')}) deleted the old object"


# -- the command line -------------------------------------------------------------------------


def test_serve_detach_with_a_relative_socket_listens_where_it_says(sockdir: str) -> None:
    """`shmshare serve --detach --socket rel.sock` chdirs to / before it binds, so it listens
    on /rel.sock while printing "rel.sock": clients in the caller's directory find nothing.
    A fix must make the path absolute before the chdir (and print that)."""
    name = f"rel-{os.getpid()}.sock"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(_native.__file__)))
    got = subprocess.run([sys.executable, "-m", "shmshare", "serve", "--detach", "--socket",
                          name], cwd=sockdir, capture_output=True, text=True, timeout=20, env=env)
    pid = int(got.stdout.rsplit("(pid ", 1)[1].rstrip(")\n")) if "(pid " in got.stdout else None
    try:
        assert got.returncode == 0, got.stderr
        wanted = os.path.join(sockdir, name)
        wait_until(lambda: os.path.exists(wanted) or os.path.exists("/" + name),
                   "the detached daemon binds", timeout=5)
        assert os.path.exists(wanted), (f"the detached daemon listens on "
                                        f"{'/' + name if os.path.exists('/' + name) else '?'}"
                                        f", not on {wanted} (it printed {got.stdout.strip()!r})")
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not pid_alive(pid), "the detached daemon exits", timeout=10)
        for p in ("/" + name, os.path.join(sockdir, name)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def test_stat_does_not_print_control_characters_of_names(store: Store, daemon: Daemon) -> None:
    """A name with ESC and a newline is escaped in `shmshare stat`'s table: no terminal
    control reaches the reader, no made-up line ("store pid 1 at /fake") appears."""
    store.put("evil\x1b[2J\nstore pid 1 at /fake", 1)
    got = subprocess.run([sys.executable, "-m", "shmshare", "stat", "--pid", str(daemon.pid)],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert "\x1b" not in got.stdout and not any(
        line.startswith("store pid 1 at /fake") for line in got.stdout.splitlines()), (
        f"stat printed a name's control characters: {got.stdout[-200:]!r}")


# -- attacks that hold (cheap) ----------------------------------------------------------------


def test_a_get_with_an_infinite_timeout_waits_for_the_put(store: Store, daemon: Daemon) -> None:
    """get(timeout=inf) (and 1e300) waits, and returns once another client puts the name."""
    with Store(daemon.path) as writer:
        t = threading.Timer(0.2, writer.put, ("late", 5))
        t.start()
        try:
            assert store.get("late", timeout=float("inf")) == 5
        finally:
            t.join(5)


def test_a_thousand_held_torch_gets_hold_no_fd_and_their_mappings_go(store: Store) -> None:
    """1000 held gets of a 1 MiB torch object: 1000 copy-on-write mappings, no fd; a write
    stays private; all unmapped and released once dropped."""
    torch = pytest.importorskip("torch")
    store.put("t", torch.arange(MiB // 4, dtype=torch.int32))

    def maps() -> int:
        with open("/proc/self/maps") as f:
            return sum("/memfd:shmshare_" in line for line in f)

    store.get("t")  # the first get maps the store's index and our counts (fast gets)
    gc.collect()
    base, fds = maps(), len(os.listdir("/proc/self/fd"))
    held = [store.get("t") for _ in range(1000)]
    assert maps() - base == 1000 and len(os.listdir("/proc/self/fd")) == fds
    held[0][0] = 7
    assert int(held[1][0]) == 0
    del held
    gc.collect()
    wait_until(lambda: maps() == base and store.info("t").refs == 0, "the mappings go", timeout=5)


def test_sigterm_while_a_client_creates_is_a_clean_exit(own_daemon: Daemon) -> None:
    """SIGTERM with a 2 MiB create unsealed: the daemon exits 0, the seal says StoreGone, and
    the creator's mapping goes with its array."""
    with Store(own_daemon.path) as s:
        arr = s.create("c", (2 * MiB,), np.uint8)
        arr[:] = 1
        assert own_daemon.stop() == 0
        with pytest.raises(StoreGone):
            s.seal("c")
        del arr
