"""Two ends of a connection on rings: order, fds and large frames, poll and selectors, full
rings, waking and sleeping, close from another thread, peers that die (Note [Rings]).
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import threading
import time

import numpy as np
import pytest

from shmshare import PeerDied, ShmshareTimeout, _ring, channel, wire
from shmshare.testing import kill, wait_until

from .helpers import (
    COUNT,
    WAIT,
    _ring_maps,
    _ringed_pair,
    _SwitchAfterRelease,
)


def test_messages_fds_and_large_frames_keep_their_order():
    a, b = _ringed_pair()
    r, w = os.pipe()
    try:
        sent = []
        for i in range(3 * COUNT):
            if i % 50 == 7:
                h = {"n": i, "pad": "x" * 2000}  # larger than a slot: carried on the socket
                a.send(h)
            elif i % 50 == 9:
                h = {"n": i, "fd": True}
                a.send(h, [r])  # with an fd: carried
            else:
                h = {"n": i}
                a.send(h)
            sent.append(h)
            if i % 40 == 39:  # the ring holds COUNT: let b catch up now and then
                for want in sent:
                    got, fds = b.recv(timeout=WAIT)
                    assert got == want
                    assert len(fds) == (1 if "fd" in want else 0)
                    for f in fds:
                        f.close()
                sent.clear()
        for want in sent:
            got, fds = b.recv(timeout=WAIT)
            assert got == want
            for f in fds:
                f.close()
        before = b.statistics().frames_received
        assert b.poll(0) is False and b.statistics().frames_received == before
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()


def test_poll_keeps_the_message_it_found_for_recv():
    a, b = _ringed_pair()
    try:
        a.send({"n": 1})
        assert b.poll(WAIT) is True and b.pending()
        assert b.recv(timeout=0)[0] == {"n": 1}
        assert b.poll(0) is False
    finally:
        a.close()
        b.close()


def test_a_full_ring_times_out_the_send_and_a_dead_reader_is_seen():
    a, b = _ringed_pair()
    try:
        for i in range(COUNT):
            a.send({"n": i}, timeout=0)
        with pytest.raises(ShmshareTimeout, match="full ring"):
            a.send({"n": "one too many"}, timeout=0.05)
        b.close()
        with pytest.raises(PeerDied, match="ring full"):
            a.send({"n": "to no one"}, timeout=WAIT)
    finally:
        a.close()
        b.close()


def test_a_connection_whose_fd_went_to_a_selector_declines_rings():
    a, b = wire.pipe()
    try:
        b.fileno()
        a.offer_ring()
        a.send({"n": 1})
        assert b.recv(timeout=WAIT)[0] == {"n": 1}
        assert b._rings is None
        b.send({"n": 2})
        assert a.recv(timeout=WAIT)[0] == {"n": 2}
        a.send({"n": 3})  # still on the socket: no answer came
        assert b.recv(timeout=WAIT)[0] == {"n": 3}
        assert a._rings is not None and not a._rings.reading and not a._rings.writing
    finally:
        a.close()
        b.close()


def test_rings_off_by_setting(monkeypatch):
    monkeypatch.setenv("SHMSHARE_RINGS", "0")
    a, b = wire.pipe()
    try:
        a.offer_ring()
        assert a._rings is None
    finally:
        a.close()
        b.close()
    monkeypatch.setenv("SHMSHARE_RINGS", "yes")
    with pytest.raises(ValueError, match="SHMSHARE_RINGS='yes' must be 1"):
        _ring.enabled()
    monkeypatch.setenv("SHMSHARE_SPIN_US", "fast")
    with pytest.raises(ValueError, match="SHMSHARE_SPIN_US='fast' is not a number"):
        _ring.spin_ns()


def test_no_wake_up_is_lost_when_the_reader_sleeps_at_once(monkeypatch):
    monkeypatch.setenv("SHMSHARE_SPIN_US", "0")  # every empty ring: arm and sleep
    tx, rx = channel()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            rx.close()
            for i in range(3000):
                a = tx.empty(4, np.int64)
                a[0] = i
                tx.send(a)
                if i % 97 == 0:
                    time.sleep(0.001)  # let the reader fall asleep now and then
            tx.close()
        finally:
            os._exit(0)
    try:
        tx.close()
        for i in range(3000):
            assert rx.recv(timeout=WAIT)[0] == i
        assert rx._peers[0].conn._rings is not None and rx._peers[0].conn._rings.reading
    finally:
        kill(pid)
        rx.close()


def test_a_reader_asleep_sees_its_writer_killed():
    tx, rx = channel()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        rx.close()
        tx.send(np.arange(3))
        deadline = time.monotonic() + WAIT
        while not tx._conn._rings.writing and time.monotonic() < deadline:
            tx.poll_releases()  # reads the receiver's ACCEPT: its frames go by ring then
            time.sleep(0.01)
        tx.send(np.arange(3))
        time.sleep(60)
        os._exit(0)
    try:
        tx.close()
        rx.recv(timeout=WAIT)
        rx.recv(timeout=WAIT)
        assert rx._peers[0].conn._rings is not None and rx._peers[0].conn._rings.reading
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(PeerDied):
            rx.recv(timeout=WAIT)
    finally:
        kill(pid)
        rx.close()


def test_an_idle_reader_uses_almost_no_cpu():
    tx, rx = channel()
    try:
        tx.send(np.arange(3))
        rx.recv(timeout=WAIT)  # rings set up; the sender now sends nothing
        before = resource.getrusage(resource.RUSAGE_SELF)
        with pytest.raises(ShmshareTimeout):
            rx.recv(timeout=1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        assert cpu < 0.05, f"an idle receiver used {cpu:.3f} s of CPU in a 1 s wait"
    finally:
        tx.close()
        rx.close()


def test_many_senders_into_one_listening_receiver_lose_nothing(tmp_path):
    rx = channel.__globals__["listen"](str(tmp_path / "s.sock"))
    pids = []
    try:
        for k in range(3):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    tx = channel.__globals__["connect"](rx.path, timeout=WAIT)
                    for i in range(700):
                        tx.send({"k": k, "i": i})
                    tx.close()
                finally:
                    os._exit(0)
            pids.append(pid)
        seen = {k: 0 for k in range(3)}
        while sum(seen.values()) < 3 * 700:
            b = rx.recv(timeout=WAIT)
            assert b["i"] == seen[b["k"]]
            seen[b["k"]] += 1
    finally:
        for pid in pids:
            kill(pid)
        rx.close()


def test_a_writer_gone_between_a_carried_frame_and_its_marker_leaks_no_fd():
    a, b = _ringed_pair()
    r, w = os.pipe()
    try:
        before = len(os.listdir("/proc/self/fd"))
        a._send_frame(a._packer.pack([_ring.KIND_CARRIED, [0, {"x": 1}]]), [r], None)  # no marker
        a.close()
        with pytest.raises(PeerDied):
            b.recv(timeout=WAIT)
        assert len(os.listdir("/proc/self/fd")) == before  # a's socket gone, the carried fd kept
        b.close()
        assert len(os.listdir("/proc/self/fd")) == before - 2  # b's socket and the carried fd gone
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()


# DEFECT 4. A Connection.send(timeout=None) waiting for room in a full ring never sees its peer
# die if any frame of the peer is still queued on its socket. _wait_room asks
# conn._at_end_of_stream(), which is True only for POLLHUP *and nothing left to read* -- a reader's
# test, used here by a writer. The queued frame is typically a WAKE: this end once slept in
# recv() (armed), the peer pushed a frame and woke it. So: recv times out once, the peer sends one
# message, this end fills the ring, the peer exits -> send() hangs forever (or, with a timeout,
# reports ShmshareTimeout "the peer did not take from its full ring" for a dead peer). The socket
# path sees the same death at once (sendmsg: EPIPE). (The channel's Sender escapes it only because
# it sends in slices and drains its socket in between.)
# Where: RingLink._wait_room (conn._at_end_of_stream()). Fix: for a writer, POLLHUP (or POLLERR) on
# the socket is the peer's end whatever is queued: poll(POLLHUP|POLLRDHUP, 0) and raise PeerDied.
def test_a_send_waiting_on_a_full_ring_sees_its_peer_die_with_a_wake_queued():
    a, b = _ringed_pair()
    outcome: list[BaseException | str] = []
    t = None
    try:
        with pytest.raises(ShmshareTimeout):
            a.recv(timeout=0.05)  # a armed its ring and slept
        b.send({"n": "one"})  # by ring; a was armed: a WAKE lands on a's socket
        for i in range(COUNT):
            a.send({"n": i}, timeout=0)
        b.close()  # the peer is gone; its WAKE is still queued for a

        def blocked_send() -> None:
            try:
                a.send({"n": "to no one"}, timeout=None)
                outcome.append("sent")
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        t = threading.Thread(target=blocked_send, daemon=True)
        t.start()
        t.join(WAIT)
        assert outcome and isinstance(outcome[0], PeerDied), \
            f"send() on a full ring did not see its peer's death in {WAIT} s: {outcome}"
    finally:
        a.close()  # ends a blocked send (ValueError)
        if t is not None:
            t.join(WAIT)
        b.close()


# DEFECT 7. fork() while another thread spins in Ring.spin() leaves the rings mapped in the child
# for good: the child inherits `spinners == 1` (the thread that spun does not exist there), so
# the fork handler's ring.close() never unmaps (unmap_if_idle waits for spinners == 0), and no
# spin() will ever return in the child to do it. Each such fork leaks a mapping of the peer's
# memfd (266 KiB, and the memfd itself stays alive while the child lives).
# Where: native/ring.c Ring_close/unmap_if_idle with a `spinners` count copied by fork.
# Fix: remember getpid() in Ring_init; in close(), a process other than the one that counted the
# spinners has none (munmap at once); or reset spinners in a pthread_atfork child handler.
def test_a_fork_while_a_thread_spins_leaves_no_ring_mapped_in_the_child(monkeypatch):
    monkeypatch.setenv("SHMSHARE_SPIN_US", "1000000")  # 1 s spins: the thread is in spin() at fork
    a, b = _ringed_pair()
    stop = threading.Event()
    rd, wr = os.pipe()
    pid = -1

    def spinner() -> None:
        while not stop.is_set():
            try:
                b.recv(timeout=0.001)  # spins 1 s, GIL released, then a 1 ms poll
            except ShmshareTimeout:
                pass
            except ValueError:  # closed
                return

    t = threading.Thread(target=spinner, daemon=True)
    try:
        t.start()
        time.sleep(0.2)  # well inside its first 1 s spin
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                gc.collect()
                os.write(wr, bytes([_ring_maps()]))
            finally:
                os._exit(0)
        left = os.read(rd, 1)[0]
        assert left == 0, f"the forked child still maps {left} ring(s) of its parent"
    finally:
        stop.set()
        if pid > 0:
            kill(pid)
        b.close()
        t.join(WAIT)
        a.close()
        os.close(rd)
        os.close(wr)


# DEFECT 8. poll() and recv() from two threads deliver messages out of order. With rings,
# Connection.poll() does not just look: RingLink.poll receives the next message under the receive
# lock, *releases the lock*, and only then puts the message back with stash.appendleft(). A recv()
# of another thread that takes the lock in between finds the stash empty and returns the message
# after it. (Without rings poll() only polls the socket, and order holds.)
# Where: RingLink.poll (the appendleft after conn._recv_lock.release()).
# Fix: put the message in the stash before releasing the lock.
def test_poll_and_recv_from_two_threads_keep_the_order():
    a, b = _ringed_pair()
    order: list[int] = []
    # sent once poll() waits: it must take message 1 off the ring itself (a message already
    # there when poll() starts is only looked at, and recv() here would take it)
    sender = threading.Timer(0.2, lambda: (a.send({"n": 1}), a.send({"n": 2})))
    try:
        b._recv_lock = _SwitchAfterRelease(lambda: order.append(b.recv(timeout=WAIT)[0]["n"]))
        sender.start()
        assert b.poll(WAIT) is True
        order.append(b.recv(timeout=WAIT)[0]["n"])
        assert order == [1, 2], f"messages sent 1, 2 were received {order}"
    finally:
        sender.join(WAIT)
        a.close()
        b.close()


# DEFECT 9. A send() of one thread that races the accept of a ring offer in another thread's
# recv() is received after frames sent later. RingLink.accept() sends the ACCEPT (from
# try_start_writing, under the send lock) *before* wire._control stores the link in conn._rings;
# a send that takes the send lock in that window sees _rings None and goes on the socket after
# the ACCEPT. The offerer, reading ring frames first once it has read ACCEPT, delivers the frames
# sent after it first. (The channel's Receiver sends releases from its flusher thread while the
# main thread receives: the same window.)
# Where: RingLink.accept (link.try_start_writing() before conn._rings = link in wire._control).
# Fix: set conn._rings = link before sending ACCEPT (e.g. in accept(), or try_start_writing from
# _control after the assignment).
def test_a_send_racing_the_accept_of_an_offer_keeps_the_order():
    a, b = wire.pipe()
    try:
        a.offer_ring()
        a.send({"n": 0})
        b.send({"n": "hello"})  # b's HELLO goes now, so it answers the OFFER at once
        assert a.recv(timeout=WAIT)[0] == {"n": "hello"}
        b._send_lock = _SwitchAfterRelease(lambda: b.send({"n": "S"}))  # another thread's send
        assert b.recv(timeout=WAIT)[0] == {"n": 0}  # reads the OFFER: ACCEPT goes out
        b.send({"n": "T"})  # after S
        got = [a.recv(timeout=WAIT)[0]["n"] for _ in range(2)]
        assert got == ["S", "T"], f"sent S then T, received {got}"
    finally:
        a.close()
        b.close()


# DEFECT 12. The last frames a peer pushes into the ring just before it closes can be lost: recv()
# reports PeerDied while they sit in the ring. RingLink.next_frame pops the ring (empty), then
# reads the socket; if the peer pushed a frame and closed in between (nothing forces a WAKE: a
# reader that is not armed, e.g. every recv_nowait() caller such as the listening Receiver and the
# store daemon, gets none), _recv_frame sees end of stream and raises PeerDied without looking at
# the ring again. The peer's push happened before its close, so a second look would find it. For
# the channel, the lost frame is the last batch and/or the BYE: a clean close reported as a death,
# a batch sent successfully never delivered. Seen without any instrumentation too: 1 in 1500
# cross-process trials (the writer sends one message and closes; the reader loops recv_nowait()).
# Here the peer's push-and-close is made to happen at that moment: the victim's poll object does
# it just before the victim first looks at its socket.
# Where: RingLink.next_frame (got = self._socket_frame() raising PeerDied after ring.pop_into
# returned -1). Fix: on PeerDied from the socket, pop the ring once more (and deliver what is
# there, raising PeerDied on the next call); end of stream is sticky, so nothing else changes.
def test_frames_pushed_just_before_the_peer_closes_are_not_lost():
    a, b = _ringed_pair()
    real = b._pollin

    class PeerActsNow:
        fired = False

        def poll(self, *args):
            if not self.fired:  # the peer, in its own process, pushes and closes at this moment
                self.fired = True
                a.send({"n": "last"})  # by ring, no WAKE: b is not asleep
                a.close()
            return real.poll(*args)

    try:
        b._pollin = PeerActsNow()
        assert b.recv(timeout=WAIT)[0] == {"n": "last"}  # PeerDied, the frame still in the ring
        with pytest.raises(PeerDied):
            b.recv(timeout=WAIT)
    finally:
        a.close()
        b.close()


# DEFECT 11 (a regression against the socket path rather than a broken promise). A send() waiting
# for room in a full ring wakes every ROOM_BACKOFF[1] = 2 ms to look (~500 wake-ups a second),
# where a send() waiting for room on a full socket sleeps in poll(). A producer stuck behind a
# slow or paused consumer for minutes burns ~4 % of a core (measured: 0.087 s of CPU in a 2 s wait,
# 0.0025 s on the socket path).
# Where: RingLink._wait_room. Fix: a "producer waiting" flag in the ring beside cons_sleep (the
# same Dekker handshake): the reader that frees a slot sends a WAKE, and the writer sleeps in
# poll() on the socket (which also sees the peer's death at once; cf. DEFECT 4).
def test_a_send_waiting_on_a_full_ring_sleeps():
    a, b = _ringed_pair()
    try:
        for i in range(COUNT):
            a.send({"n": i}, timeout=0)
        before = resource.getrusage(resource.RUSAGE_THREAD)
        with pytest.raises(ShmshareTimeout):
            a.send({"n": "no room"}, timeout=2.0)
        after = resource.getrusage(resource.RUSAGE_THREAD)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        assert cpu < 0.03, f"a send waiting 2 s for room in a full ring used {cpu:.3f} s of CPU"
    finally:
        a.close()
        b.close()


# HELD. close() from another thread while recv() spins (1 s spins, GIL released): the spinner
# raises ValueError at once, and the mapping goes when the spin returns.
def test_close_during_a_spin_ends_it_and_unmaps(monkeypatch):
    monkeypatch.setenv("SHMSHARE_SPIN_US", "1000000")
    a, b = _ringed_pair()
    outcome: list[BaseException | str] = []

    def reader() -> None:
        try:
            b.recv(timeout=WAIT)
            outcome.append("received")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=reader, daemon=True)
    try:
        t.start()
        time.sleep(0.1)
        b.close()
        t.join(WAIT)
        assert outcome and isinstance(outcome[0], ValueError), outcome
        a.close()
        assert _ring_maps() == 0
    finally:
        a.close()
        b.close()
        t.join(WAIT)


# HELD. close() from another thread while send() waits for room in a full ring (timeout=None):
# ValueError, and a channel Sender's close() does the same to its send() (close() itself then
# waits, by design, up to _BYE_WAIT for room for its goodbye: the receiver's close ends that).
def test_close_ends_a_send_waiting_for_room_in_a_full_ring():
    a, b = _ringed_pair()
    outcome: list[BaseException | str] = []

    def writer() -> None:
        try:
            a.send({"n": "no room"}, timeout=None)
            outcome.append("sent")
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    try:
        for i in range(COUNT):
            a.send({"n": i}, timeout=0)
        t = threading.Thread(target=writer, daemon=True)
        t.start()
        time.sleep(0.1)
        a.close()
        t.join(WAIT)
        assert outcome and isinstance(outcome[0], ValueError), outcome
    finally:
        a.close()
        b.close()

    tx, rx = channel()
    outcome.clear()
    closer = threading.Thread()
    try:
        tx.send(np.arange(4))
        got = rx.recv(timeout=WAIT)
        del got
        gc.collect()
        rx.flush_releases()  # rx's ACCEPT: the rings are up; rx reads no more
        deadline = time.monotonic() + WAIT
        while not (tx._conn._rings is not None and tx._conn._rings.reading) and time.monotonic() < deadline:
            tx.poll_releases()
            time.sleep(0.01)
        stop = threading.Event()

        def sender() -> None:
            i = 0
            try:
                while not stop.is_set():
                    tx.send({"n": i})
                    i += 1
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)

        t = threading.Thread(target=sender, daemon=True)
        t.start()
        deadline = time.monotonic() + WAIT
        while (tx._conn._rings is None or tx._conn._rings.ring.pending < COUNT) and time.monotonic() < deadline:
            time.sleep(0.01)
        closer = threading.Thread(target=tx.close, daemon=True)  # it waits to say goodbye
        closer.start()
        t.join(WAIT)
        stop.set()
        assert outcome and isinstance(outcome[0], ValueError), outcome
    finally:
        rx.close()  # the goodbye close() waits to send finds no one: it returns
        if closer.is_alive():
            closer.join(WAIT)
        tx.close()


# HELD. Four threads sending on one Sender at once (its lock serializes them): every message
# arrives, each thread's in its order.
def test_threads_sending_on_one_sender_lose_and_reorder_nothing():
    tx, rx = channel()
    per = 400
    try:
        tx.send({"t": -1, "i": 0})
        assert rx.recv(timeout=WAIT) == {"t": -1, "i": 0}

        def run(k: int) -> None:
            for i in range(per):
                a = tx.empty(2, np.int64)
                a[:] = (k, i)
                tx.send({"t": k, "i": i, "a": a} if i % 9 == 0 else {"t": k, "i": i}, timeout=WAIT)

        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        seen = {k: 0 for k in range(4)}
        for _ in range(4 * per):
            got = rx.recv(timeout=WAIT)
            assert got["i"] == seen[got["t"]]
            if "a" in got:
                assert list(got["a"]) == [got["t"], got["i"]]
            seen[got["t"]] += 1
        for t in threads:
            t.join(WAIT)
        assert seen == {k: per for k in range(4)}
    finally:
        tx.close()
        rx.close()


# HELD. Thousands of releases at once travel in frames that fit a ring slot (Connection.frame_room):
# the receiver carries none of them on the socket, and every lease comes back.
def test_thousands_of_releases_go_by_ring_and_all_come_back():
    tx, rx = channel(limit=64 << 20)
    try:
        tx.send(np.arange(3))
        rx.recv(timeout=WAIT)
        gc.collect()
        rx.flush_releases()
        wait_until(lambda: tx.poll_releases() == 0 and tx._conn._rings.reading, "rings up", WAIT)
        held = []
        for i in range(40):
            tx.send([np.full(40, i) for _ in range(100)])  # 100 leases a batch (past INLINE_BYTES each)
            held.append(rx.recv(timeout=WAIT))
        assert tx.statistics().leases_out == 4000
        del held
        gc.collect()
        rx.flush_releases()
        wait_until(lambda: tx.poll_releases() == 0, "every lease back", WAIT)
        link = rx._peers[0].conn._rings
        assert link is not None and link.writing and link.next_out == 0, "a release went carried"
    finally:
        tx.close()
        rx.close()
