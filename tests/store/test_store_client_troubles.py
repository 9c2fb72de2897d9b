"""The store attacked, part two: a client timed out, interrupted, forked or failing to map, and
the attacks that hold (see test_store_hostile.py for the conventions)."""

from __future__ import annotations

import fcntl
import gc
import math
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from shmshare import _native, _ring, tensors, wire
from shmshare._errors import ShmshareTimeout
from shmshare.store import Daemon, Store, StoreError, _client
from shmshare.store._packing import SEALS
from shmshare.testing import procs, wait_until

from ..clock_helpers import PollClock
from .hostile_helpers import (
    MiB,
    _ask,
    _memfd,
    _meta,
    _nfds,
    _raw,
    _stopped,
)

# -- the client: timeouts, interruptions and failed mappings ----------------------------------


def test_a_get_that_timed_out_leaves_the_connection_usable_and_its_reference_given_back(
        own_daemon: Daemon) -> None:
    """A get that times out (a SIGSTOPped daemon) is answered later; the client throws the
    owed reply away with its fd, but the daemon counted a reference and marked the segment as
    sent: the next get of any object in that segment fails with ProtocolError ("without its
    segment's fd") forever, and the reference is never given back (the object stays
    deleted_viewed). A fix must process an owed get reply (map or remember its segment, and
    release its reference) instead of dropping it."""
    with Store(own_daemon.path) as writer, Store(own_daemon.path, timeout=0.3) as s:
        writer.put("x", np.arange(1000))
        with _stopped(own_daemon.pid), pytest.raises(ShmshareTimeout):
            s.get("x")
        time.sleep(0.1)
        got = s.get("x")
        np.testing.assert_array_equal(got, np.arange(1000))
        del got
        gc.collect()
        writer.delete("x")
        wait_until(lambda: writer.stats()["deleted_viewed"] == 0,
                   "the timed-out get's reference is given back", timeout=3)


def test_a_get_interrupted_by_keyboardinterrupt_does_not_shift_later_replies(
        own_daemon: Daemon) -> None:
    """A KeyboardInterrupt while a get waits for its reply leaves that reply unread and not
    counted as owed: the next request reads it as its own, so get("b") returns a's arrays and
    every later call is off by one (stats() fails with TypeError). A fix must count any
    interrupted request's reply as owed (try/except BaseException around the wait), or
    close the connection and say so."""
    with Store(own_daemon.path, timeout=5) as s:
        s.put("a", np.full(10, 1))
        s.put("b", np.full(10, 2))

        def interrupt(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            with _stopped(own_daemon.pid):
                signal.setitimer(signal.ITIMER_REAL, 0.2)
                with pytest.raises(KeyboardInterrupt):
                    s.get("a")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        time.sleep(0.1)
        b = s.get("b")
        first = int(b[0])
        del b  # before the assertion: a failing test must not keep the mapping
        assert first == 2, f"get('b') returned {first}s: the interrupted get('a')'s object"


def test_get_timeout_holds_when_the_daemon_does_not_answer(own_daemon: Daemon,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """get(name, timeout=0.2) on a Store made with timeout=3 takes 3 s when the daemon is
    stopped: the request itself waits Store.timeout whatever get's timeout says. A fix must
    bound the whole get by the smaller of the two: on a clock that moves only while the
    client waits (its connection's polls and get's own deadline), the get waits 0.2 s in all."""
    clock = PollClock()
    monkeypatch.setattr(wire, "time", clock)
    monkeypatch.setattr(wire, "select", clock.select())  # before the Store: its connection's polls
    monkeypatch.setattr(_ring, "time", clock)  # its rings' waits (the daemon answers their offer at once)
    monkeypatch.setattr(_client, "time", clock)
    with (Store(own_daemon.path, timeout=3) as s, _stopped(own_daemon.pid),
          pytest.raises((ShmshareTimeout, StoreError))):
        s.get("nothing", timeout=0.2)
    waited = clock.waited
    assert waited <= 0.2 + 0.01, f"get(timeout=0.2) waited {waited:.1f} s for a stopped daemon"


def test_a_get_whose_mapping_failed_once_can_be_retried(store: Store,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A get whose mmap fails (ENOMEM: RLIMIT_AS or vm.max_map_count) loses the segment's fd,
    but the daemon sends each segment's fd only once per client: every later get of that
    object fails with ProtocolError ("without its segment's fd") for the Store's life. A fix
    must tell the daemon the segment was not mapped (or have it resend the fd on request)."""
    store.put("m", np.arange(MiB // 4, dtype=np.int32))  # its own memfd
    real, failed = _native.mmap, []

    def mmap_once(*args: Any, **kw: Any) -> Any:
        if not failed:
            failed.append(1)
            raise OSError(12, "Cannot allocate memory (simulated)")
        return real(*args, **kw)

    monkeypatch.setattr(_native, "mmap", mmap_once)
    with pytest.raises(OSError):
        store.get("m")
    monkeypatch.setattr(_native, "mmap", real)
    got = store.get("m")
    np.testing.assert_array_equal(got, np.arange(MiB // 4, dtype=np.int32))
    del got


# -- attacks that hold (cheap; they document what the daemon refuses) -----------------------


def test_fds_attached_to_requests_that_take_none_are_closed(store: Store, daemon: Daemon) -> None:
    """64 fds on each kind of request (one-way ones too) leave no fd in the daemon."""
    store.put("fds", np.arange(10))
    store.get("fds")  # the pool segment's read-only fd exists before the count
    base = _nfds(daemon.pid)
    extra = [os.memfd_create("hostile-extra", os.MFD_CLOEXEC) for _ in range(wire.MAX_FDS)]
    try:
        with _raw(daemon.path) as c:
            for kind in ("stats", "info", "list", "del", "rel", "unmapped", "seal", "stage",
                         "put", "create", "wait", "get"):
                c.send({"k": kind, "n": "no-such-name", "o": 10 ** 9 if kind == "unmapped"
                        else [10 ** 9], "s": 8, "m": b"", "t": 0.0}, extra, timeout=5)
            assert _ask(c, {"k": "stats"})["k"] == "stats"
            time.sleep(0.2)
            assert _nfds(daemon.pid) <= base + 1  # + this connection
    finally:
        for fd in extra:
            os.close(fd)
    wait_until(lambda: _nfds(daemon.pid) <= base, "the daemon holds none of the fds sent", timeout=5)


@pytest.mark.parametrize("kind", ["unsealed", "no-write-seal", "holes", "short", "regular",
                                  "pipe"])
def test_a_put_memfd_that_is_not_what_it_must_be_is_refused(store: Store, daemon: Daemon,
                                                            kind: str, tmp_path: Any) -> None:
    """A put's fd that is unsealed, writable, holed, short, a file on disk or a pipe is
    refused with an error reply, and the connection stays usable."""
    closers: list[int] = []
    if kind == "unsealed":
        fd = _memfd(MiB, seals=0)
    elif kind == "no-write-seal":
        fd = _memfd(MiB)
    elif kind == "holes":
        fd = _memfd(MiB, SEALS | fcntl.F_SEAL_WRITE, fill=False)
    elif kind == "short":
        fd = _memfd(MiB - 4096, SEALS | fcntl.F_SEAL_WRITE)
    elif kind == "regular":
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        os.ftruncate(fd, MiB)
    else:
        fd, w = os.pipe()
        closers.append(w)
    closers.append(fd)
    try:
        with _raw(daemon.path) as c:
            h = _ask(c, {"k": "put", "n": "refused", "m": _meta(MiB), "s": MiB, "t": False,
                         "r": False}, [fd])
            assert h["k"] == "err" and h["e"] == "bad", h
            assert _ask(c, {"k": "stats"})["k"] == "stats"
        assert "refused" not in store
    finally:
        for f in closers:
            os.close(f)


def _desc_meta(offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> bytes:
    ext = tensors.pack_desc(1, 0, offset, b"|u1", shape, strides, b"")
    return tensors.encode(ext, lambda o: None)


@pytest.mark.parametrize("offset,shape,strides", [
    (4000, (200,), (1,)),  # past the end
    (-1, (10,), (1,)),  # before the start
    (0, (10,), (-1,)),  # a negative stride from element 0
    (0, (2, 1 << 62), (1 << 62, 1)),  # a span that overflows 64 bits
    (0, (3,), (1 << 40,)),  # strides far outside
])
def test_meta_whose_arrays_lie_outside_the_object_is_refused(store: Store, daemon: Daemon,
                                                             offset: int, shape: Any,
                                                             strides: Any) -> None:
    """Array descriptors pointing outside the object, or overflowing, are refused at put."""
    with _raw(daemon.path) as c:
        h = _ask(c, {"k": "create", "n": "outside", "m": _desc_meta(offset, shape, strides),
                     "s": 4096, "t": False})
        assert h["k"] == "err" and h["e"] == "bad", h
        assert _ask(c, {"k": "stats"})["k"] == "stats"
    assert "outside" not in store


def test_releases_of_references_not_held_change_nothing(store: Store, daemon: Daemon) -> None:
    """rel frames naming another client's references, unknown ids and junk leave refs alone."""
    store.put("mine", np.arange(10))
    view = store.get("mine")
    with _raw(daemon.path) as c:
        h = _ask(c, {"k": "get", "n": "mine"})
        theirs = h["o"]
        c.send({"k": "rel", "o": [theirs, theirs, theirs, -1, 2 ** 63, "x", None, [1]]},
               timeout=5)
        assert _ask(c, {"k": "stats"})["k"] == "stats"
        assert store.info("mine").refs == 1  # ours stays; theirs went once
    wait_until(lambda: store.info("mine").refs == 1, "the raw peer's reference goes with it")
    del view


def test_a_wait_with_a_timeout_that_is_not_a_number_of_seconds_is_refused(
        daemon: Daemon) -> None:
    """NaN, negative, None or a string as a wait's seconds: an error reply, not a hang."""
    with _raw(daemon.path) as c:
        for t in (math.nan, -1, None, "1"):
            h = _ask(c, {"k": "wait", "n": "never", "t": t})
            assert h["k"] == "err" and h["e"] == "bad", (t, h)


def test_seal_and_unmapped_of_another_clients_object_are_refused(store: Store,
                                                                 daemon: Daemon) -> None:
    """Sealing an object another client is creating is refused; its creator still seals it."""
    arr = store.create("theirs", (10,), np.uint8)
    arr[:] = 3
    with _raw(daemon.path) as c:
        h = _ask(c, {"k": "seal", "n": "theirs"})
        assert h["k"] == "err" and h["e"] == "not_yours", h
        c.send({"k": "unmapped", "o": 1}, timeout=5)
    store.seal("theirs")
    assert int(store.get("theirs")[0]) == 3


def _use_parents_store(s: Store) -> None:
    try:
        s.stats()
    except StoreError as exc:
        os._exit(0 if "fork" in str(exc) else 1)
    os._exit(2)


def test_a_parents_store_used_in_a_forked_child_says_fork(store: Store) -> None:
    """In a forked child the parent's Store raises "this Store is closed: make a new one", as
    if the user had closed it: the fork message that _after_fork_in_child sets is never shown,
    because _call_locked tests _closed before _gone. A fix must check _gone first (or word the
    closed message for the fork), so the child is told it inherited the Store through fork()."""
    with procs.start_child(_use_parents_store, store) as child:
        rc = child.join(10)
    assert rc == 0, ("the child's error did not say the Store was made before fork()"
                     if rc == 1 else f"the child's use of the parent's Store: status {rc}")
    assert store.stats()["connected"] >= 1  # the parent's Store is still its own


def test_a_drop_read_just_before_the_daemon_ended_leaves_nothing_pending(own_daemon: Daemon) -> None:
    """A drop frame and the daemon's end queued together, read by an idle client's flush: the
    drop was left in the queue of a Store whose daemon is gone, so its flusher saw releases
    pending for good and flushed every 2 ms until close() (5 % of a core; the hostile review
    of the one release path). Its mapping goes with the rest."""
    with Store(own_daemon.path) as a, Store(own_daemon.path) as b:
        a.put("x", np.ones(1 << 20))
        del_view = b.get("x")  # b maps x's segment
        del del_view
        gc.collect()
        wait_until(lambda: a.info("x").refs == 0, "b's reference back", 10)
        with b._lock:  # b's flusher reads nothing until both the drop and the end are queued
            a.delete("x")  # the daemon sends b a drop
            wait_until(lambda: b._conn.poll(0), "the drop queued for b", 10)
            assert own_daemon.stop() == 0
        wait_until(lambda: b._gone is not None, "b's idle flush saw the daemon gone", 10)
        wait_until(lambda: not b._drops and not b._flushing._flusher_pending(), "nothing pending "
                   "in a Store whose daemon is gone", 10)
