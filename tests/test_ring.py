"""The rings beside a connection's socket (Note [Rings] in shmshare/_ring.py, native/ring.c).

The C ring on its own; two Connections moving from the socket to the rings and
back (fds, large frames, forks, hand-overs); a hostile peer that writes the ring
memory directly; waking, sleeping and dying peers across processes.
"""

from __future__ import annotations

import array
import mmap
import os
import resource
import signal
import socket
import struct
import time

import msgpack
import numpy as np
import pytest

from shmshare import PeerDied, ProtocolError, ShmshareTimeout, _native, _ring, channel, wire

WAIT = 10.0  # s: the bound of any wait for what must happen
COUNT, SLOT = _ring.COUNT, _ring.SLOT
DIR = 256 + COUNT * SLOT  # bytes of one direction (native/ring.c)


def _memfd() -> int:
    return _ring.make_memfd()


def _pair() -> tuple[object, object]:
    fd = _memfd()
    try:
        return _native.Ring(fd, COUNT, SLOT, True), _native.Ring(fd, COUNT, SLOT, False)
    finally:
        os.close(fd)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


# -- the C ring ---------------------------------------------------------------------------------


def test_frames_come_out_in_order_across_many_wraps():
    a, b = _pair()
    buf = bytearray(SLOT)
    for i in range(5 * COUNT + 3):
        frame = i.to_bytes(4, "little") * (i % 100 + 1)
        assert a.push(frame) in (1, 3)
        n = b.pop_into(buf)
        assert bytes(buf[:n]) == frame
    assert b.pop_into(buf) == -1


def test_a_full_ring_refuses_and_takes_again_after_a_pop():
    a, b = _pair()
    for i in range(COUNT):
        assert a.push(bytes([i % 256])) in (1, 3)
    assert a.push(b"x") == 0 and a.pending == COUNT
    buf = bytearray(SLOT)
    assert b.pop_into(buf) == 1 and buf[0] == 0
    assert a.push(b"y") == 1


def test_a_sleeping_reader_is_woken_once_per_arm():
    a, b = _pair()
    assert b.arm() is False  # nothing there: it may sleep
    assert a.push(b"1") == 3  # the writer took the flag: wake it
    assert a.push(b"2") == 1  # once
    assert b.arm() is True  # frames wait: it must not sleep


@pytest.mark.parametrize(("call", "match"), [
    (lambda a, b: a.push(b"x" * (SLOT - 3)), "does not fit a slot"),
    (lambda a, b: b.pop_into(bytearray(SLOT - 1)), "less than a slot"),
    (lambda a, b: _native.Ring(-1, 3, SLOT, True), "power of two"),
    (lambda a, b: _native.Ring(-1, COUNT, 12, True), "multiple of 8"),
])
def test_misuse_raises_a_clear_error(call, match):
    a, b = _pair()
    a.push(b"x")
    with pytest.raises(ValueError, match=match):
        call(a, b)


def test_a_ring_over_a_bad_fd_raises_oserror():
    with pytest.raises(OSError, match="mmap"):
        _native.Ring(-1, COUNT, SLOT, True)


# -- scribbled by the peer: every index and length read is checked -----------------------------


def _scribble(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, _ring.nbytes())


@pytest.mark.parametrize(("where", "value", "side"), [
    (0, 2 * COUNT, "reader"),  # the writer's tail far ahead of what was read
    (0, (1 << 64) - 1, "reader"),  # ... or behind it
    (128, 5 * COUNT, "writer"),  # the reader's head ahead of anything written
    (128, 1 << 63, "writer"),
])
def test_an_index_out_of_bounds_is_reported_not_followed(where, value, side):
    fd = _memfd()
    try:
        a, b = _native.Ring(fd, COUNT, SLOT, True), _native.Ring(fd, COUNT, SLOT, False)
        m = _scribble(fd)
    finally:
        os.close(fd)
    a.push(b"ok")
    struct.pack_into("<Q", m, where, value)  # a's outgoing direction is the first
    if side == "reader":
        assert b.pop_into(bytearray(SLOT)) == -2
    else:
        assert a.push(b"more") == -2 and a.pending == -1
    m.close()


def test_a_slot_length_past_the_slot_is_reported_and_nothing_is_copied():
    fd = _memfd()
    try:
        a, b = _native.Ring(fd, COUNT, SLOT, True), _native.Ring(fd, COUNT, SLOT, False)
        m = _scribble(fd)
    finally:
        os.close(fd)
    a.push(b"hello")
    struct.pack_into("<I", m, 256, 1 << 31)
    buf = bytearray(b"\xee" * SLOT)
    assert b.pop_into(buf) == -2 and buf == bytearray(b"\xee" * SLOT)
    m.close()


# -- two Connections: from the socket to the rings ----------------------------------------------


def _ringed_pair() -> tuple[wire.Connection, wire.Connection]:
    """a offered, b accepted, and both switched: every later frame of each goes by ring."""
    a, b = wire.pipe()
    a.offer_ring()
    a.send({"n": -1})
    assert b.recv(timeout=WAIT)[0] == {"n": -1}  # b read OFFER, answered ACCEPT
    b.send({"n": -2})  # by ring
    assert a.recv(timeout=WAIT)[0] == {"n": -2}  # a read ACCEPT, sent SWITCH
    a.send({"n": -3})  # by ring
    assert b.recv(timeout=WAIT)[0] == {"n": -3}  # b read SWITCH
    assert a._rings is not None and b._rings is not None
    assert a._rings.reading and a._rings.writing and b._rings.reading and b._rings.writing
    return a, b


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


def test_a_forked_copy_sends_by_socket_and_refuses_to_receive():
    a, b = _ringed_pair()
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            b.send({"from": "child"})
            try:
                b.recv(timeout=0)
            except ValueError as exc:
                code = 0 if "forked copy cannot receive" in str(exc) else 2
        finally:
            os.write(wr, bytes([code]))
            os._exit(0)
    try:
        os.close(wr)
        assert os.read(rd, 1) == b"\x00"
        assert a.recv(timeout=WAIT)[0] == {"from": "child"}
        b.send({"from": "parent"})  # the parent's rings still work
        assert a.recv(timeout=WAIT)[0] == {"from": "parent"}
    finally:
        os.close(rd)
        _kill(pid)
        a.close()
        b.close()


def test_an_end_that_used_its_rings_cannot_be_handed_to_a_spawned_child():
    import multiprocessing as mp

    a, b = _ringed_pair()
    try:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=print, args=(b,))
        with pytest.raises(ValueError, match="hand an end to a child before using it"):
            p.start()
    finally:
        a.close()
        b.close()


# -- a hostile peer that speaks the protocol and then writes the ring memory --------------------


def _send(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([msgpack.packb(obj)], anc)


def _hostile_ringed() -> tuple[wire.Connection, socket.socket, mmap.mmap]:
    """A victim Connection whose peer is this test: it offered rings it keeps mapped itself."""
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    victim = wire.Connection(s1)
    fd = _memfd()
    m = mmap.mmap(fd, _ring.nbytes())
    _send(s2, [0, {"version": wire.PROTOCOL_VERSION, "pid": os.getpid(), "role": "hostile"}])
    _send(s2, [_ring.KIND_OFFER, 42], [fd])
    os.close(fd)
    _send(s2, [_ring.KIND_SWITCH, None])
    _send(s2, [1, {"n": 0}])  # on the socket, before the switch is read: fine
    assert victim.recv(timeout=WAIT)[0] == {"n": 0}
    assert victim._rings is not None
    return victim, s2, m


def _put(m: mmap.mmap, index: int, frame: bytes, tail: int | None = None) -> None:
    slot = 256 + (index % COUNT) * SLOT  # our outgoing direction is the first (we offered)
    struct.pack_into("<I", m, slot, len(frame))
    m[slot + 4:slot + 4 + len(frame)] = frame
    struct.pack_into("<Q", m, 0, index + 1 if tail is None else tail)


@pytest.mark.parametrize(("frame", "tail", "match"), [
    (b"\xc1", None, "malformed frame"),
    (msgpack.packb({"a": 1}), None, r"must be \[kind, body\]"),
    (msgpack.packb([0, {"version": 3}]), None, "only messages and markers"),
    (msgpack.packb([_ring.KIND_MARK, 5]), None, "where 0 is next"),
    (msgpack.packb([_ring.KIND_MARK, 0]), None, "not on the socket"),
    (msgpack.packb([1, [1, 2]]), None, "must be a map"),
    (msgpack.packb([1, {}]), 10 * COUNT, "write index"),
])
def test_a_scribbled_ring_is_a_protocol_error(frame, tail, match):
    victim, peer, m = _hostile_ringed()
    try:
        _put(m, 0, frame, tail)
        with pytest.raises(ProtocolError, match=match):
            victim.recv(timeout=WAIT)
    finally:
        victim.close()
        peer.close()
        m.close()


def test_random_ring_contents_never_crash_or_hang():
    rng = np.random.default_rng(7)
    for _ in range(40):
        victim, peer, m = _hostile_ringed()
        try:
            m[:DIR] = rng.integers(0, 256, DIR, dtype=np.uint8).tobytes()
            struct.pack_into("<Q", m, 0, int(rng.integers(0, 2 * COUNT)))
            for _ in range(COUNT + 1):
                try:
                    got = victim.recv(timeout=0)
                except (ProtocolError, ShmshareTimeout):
                    break
                if got is None:
                    break
        finally:
            victim.close()
            peer.close()
            m.close()


@pytest.mark.parametrize(("frames", "match"), [
    ([[_ring.KIND_OFFER, 1]], "carried 0 fds"),
    ([[_ring.KIND_ACCEPT, 1]], "kind 3 where none may be"),
    ([[_ring.KIND_CARRIED, [0, {}]]], "kind 5 where none may be"),
])
def test_ring_frames_out_of_place_are_protocol_errors(frames, match):
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    victim = wire.Connection(s1)
    try:
        _send(s2, [0, {"version": wire.PROTOCOL_VERSION, "pid": 1, "role": "hostile"}])
        for f in frames:
            _send(s2, f)
        with pytest.raises(ProtocolError, match=match):
            victim.recv(timeout=WAIT)
    finally:
        victim.close()
        s2.close()


def test_an_offer_that_is_not_sealed_or_of_the_wrong_size_is_refused():
    for make in ("unsealed", "small"):
        s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        victim = wire.Connection(s1)
        fd = os.memfd_create("bad", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, _ring.nbytes() if make == "unsealed" else 4096)
        try:
            _send(s2, [0, {"version": wire.PROTOCOL_VERSION, "pid": 1, "role": "hostile"}])
            _send(s2, [_ring.KIND_OFFER, 1], [fd])
            with pytest.raises(ProtocolError, match="not sealed" if make == "unsealed" else "4096 bytes"):
                victim.recv(timeout=WAIT)
        finally:
            os.close(fd)
            victim.close()
            s2.close()


# -- across processes: waking, sleeping, dying --------------------------------------------------


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
        _kill(pid)
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
        _kill(pid)
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
            _kill(pid)
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
