"""A second hostile round, channel only: notes on a full socket, retired blocks after peer death.

Tests whose comment starts "Was a defect" failed on the code they were written
against (ea1f2f4); the rest pin down behaviour that held up.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

from shmshare import PeerDied, ShmshareTimeout, wire
from shmshare.channel import Receiver, Sender, channel
from shmshare.testing import wait_until

_WAIT = 10.0  # s: the bound of a wait for what must happen (only a failing test waits it out)
_LARGE = "x" * 1000  # a note larger than a ring slot: it goes on the socket (Note [Rings] in _ring.py)


def _fill_with_notes(rx: Receiver, sender: int) -> int:
    """Tell `sender` (which never reads) notes until its socket is full; return how many."""
    n = 0
    while True:
        try:
            rx.tell(sender, _LARGE, timeout=0)
        except ShmshareTimeout:
            return n
        n += 1


def test_a_tell_waiting_on_a_full_socket_does_not_wedge_releases_or_close():
    # Was a defect (fixed): Receiver.tell(timeout=None) to a sender that never reads waits holding the
    # connection's send lock (wire.Connection.send). Every "never wait" send behind it --
    # the flusher's releases (timeout=0, holding the receiver's _flush_lock), _drop's REFUSE,
    # the loader's tell(["s"], timeout=0) -- blocks on that lock instead of timing out, and
    # close() from another thread then blocks on _flush_lock forever: tell never sees the close.
    tx, rx = channel()
    t = closer = threading.Thread(target=lambda: None)
    try:
        tx.send(np.zeros(3))
        arr = rx.recv(timeout=5)
        _fill_with_notes(rx, 0)
        out: list[BaseException] = []

        def tell() -> None:
            try:
                rx.tell(0, "one more" + _LARGE, timeout=None)
            except BaseException as exc:  # noqa: BLE001
                out.append(exc)

        t = threading.Thread(target=tell, daemon=True)
        t.start()
        time.sleep(0.2)  # tell is waiting for room now
        del arr  # a release: the flusher tries to send it (timeout=0)
        gc.collect()
        time.sleep(0.2)
        closer = threading.Thread(target=rx.close, daemon=True)
        closer.start()
        closer.join(3)
        assert not closer.is_alive(), "Receiver.close() hung behind a tell() waiting for room"
        t.join(3)
        assert not t.is_alive() and out and isinstance(out[0], (ValueError, PeerDied))
    finally:
        deadline = time.monotonic() + 10  # the sender reads its notes now: the threads go on
        while time.monotonic() < deadline and (t.is_alive() or closer.is_alive()):
            tx.poll_releases()
            time.sleep(0.05)
        tx.close()
        rx.close()


def test_a_release_flush_never_waits_behind_another_threads_tell():
    # Was a defect (fixed; the same lock): _flush's timeout=0 sends wait as long as the other thread's
    # send; recv() on the consumer's thread, which flushes, stalls with it. Here the other thread's
    # tell waits for room for as long as the test keeps the sender from reading (timeout=None),
    # so flush_releases() returns at all only if it does not wait behind it.
    tx, rx = channel()
    t = flusher = None
    held = []  # cleared in finally too: a failing test must not keep the mapping
    try:
        tx.send(np.zeros(3))
        held.append(rx.recv(timeout=5))
        _fill_with_notes(rx, 0)
        send_lock = rx._peers[0].conn._send_lock
        t = threading.Thread(target=_quiet, args=(rx.tell, 0, "late" + _LARGE), kwargs={"timeout": None},
                             daemon=True)
        t.start()
        wait_until(send_lock.locked, "the tell waits for room on the full socket, holding its send lock", _WAIT)
        held.clear()  # its release goes to the flusher
        rx._releases.items.append((rx._peers[0], 12345))  # a release to flush (unknown ids are ignored)
        flushed = threading.Event()

        def flush() -> None:
            rx.flush_releases()  # "without waiting"
            flushed.set()

        flusher = threading.Thread(target=flush, daemon=True)
        flusher.start()
        assert flushed.wait(_WAIT), "flush_releases() waited behind a tell on another thread"
        assert t.is_alive() and send_lock.locked(), "the tell ended: nothing shows flush did not wait"
    finally:
        held.clear()
        deadline = time.monotonic() + _WAIT  # the sender reads its notes now: the tell goes on
        while time.monotonic() < deadline and any(x is not None and x.is_alive() for x in (t, flusher)):
            tx.poll_releases()
            time.sleep(0.01)
        tx.close()
        rx.close()


def _quiet(f, *a, **kw):
    try:
        f(*a, **kw)
    except Exception:  # noqa: BLE001, S110
        pass


def test_notes_past_max_notes_end_the_connection_with_a_reason(monkeypatch):
    from shmshare.channel import _inbox

    monkeypatch.setattr(_inbox, "MAX_NOTES", 10)
    tx, rx = channel()
    try:
        tx.send(np.zeros(3))
        rx.recv(timeout=5)
        for i in range(11):
            rx.tell(0, i, timeout=5)
        time.sleep(0.05)
        assert tx.poll_releases() == 0
        with pytest.raises(Exception, match="notes that were never read"):
            tx.send(np.zeros(3))
        with pytest.raises(PeerDied):
            for _ in range(100):
                rx.recv(timeout=5)
    finally:
        tx.close()
        rx.close()


def test_retired_blocks_fill_the_pool_then_close_gives_everything_back():
    tx, rx = channel(limit=8 << 20)
    held = []
    for i in range(6):
        tx.send(np.full(1 << 20, i, np.uint8))
        held.append(rx.recv(timeout=5))
    rx.close()
    with pytest.raises(PeerDied):
        for i in range(20):
            tx.send(np.full(1 << 20, 100 + i, np.uint8), timeout=2)
    assert all((h == i).all() for i, h in enumerate(held))  # never overwritten
    tx.close()
    assert tx.memory_stats()["reserved_bytes.all.current"] == 0
    assert all((h == i).all() for i, h in enumerate(held))
    del held
    gc.collect()


def _orphaned_sender(values: list[int]):
    """A sender whose receiver closed after receiving one 1 MiB array per value: (sender, arrays)."""
    tx, rx = channel(limit=8 << 20)
    held = []
    for v in values:
        tx.send(np.full(1 << 20, v, np.uint8))
        held.append(rx.recv(timeout=5))
    rx.close()
    with pytest.raises(PeerDied):
        tx.send(np.zeros(4), timeout=1)
    return tx, held


def test_statistics_after_peer_death_count_the_retired_blocks():
    # Was a defect (accounting): after the receiver goes, the blocks it still maps are retired
    # but statistics() said nothing of them while they held allocated_bytes. Leases are void
    # then (leases_out 0); retired_bytes counts the blocks.
    tx, held = _orphaned_sender([0, 1, 2])
    try:
        st = tx.statistics()
        assert st.leases_out == 0 and st.retired_bytes >= 3 << 20, st
    finally:
        tx.close()
        del held


def test_a_sender_collected_unclosed_after_peer_death_gives_its_pool_back():
    tx, (kept,) = _orphaned_sender([7])
    alloc = tx.allocator
    with pytest.warns(ResourceWarning):
        del tx
        gc.collect()
    assert alloc.memory_stats()["reserved_bytes.all.current"] == 0
    assert (kept == 7).all()
    del kept


def test_a_fork_of_a_sender_after_peer_death_is_dead_too_and_leaks_nothing():
    tx, (kept,) = _orphaned_sender([7])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                tx.send(np.zeros(4), timeout=1)
            except PeerDied:
                code = 0 if tx.memory_stats()["reserved_bytes.all.current"] == 0 else 2
            tx.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (kept == 7).all()
    tx.close()
    del kept


def test_several_conns_one_sender_floods_the_other_is_still_served():
    ends = [wire.pipe() for _ in range(2)]
    txs = [Sender(a) for a, _ in ends]
    rx = Receiver([b for _, b in ends])
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                txs[0].send(np.zeros(16), timeout=0.2)
            except Exception:  # noqa: BLE001
                return

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        time.sleep(0.1)
        txs[1].send({"me": 1})
        for _ in range(2000):
            n, _b = rx.recv_from(timeout=5)
            if n == 1:
                break
        else:
            pytest.fail("sender 1 starved by sender 0")
    finally:
        stop.set()
        t.join(5)
        for tx in txs:
            tx.close()
        rx.close()
