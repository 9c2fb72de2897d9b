"""shmshare.wire: frames, fds in SCM_RIGHTS, handshake, credentials and every failure mode."""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import stat
import threading
import time

import msgpack
import numpy as np
import pytest

from shmshare import FdLimitError, PeerDied, PeerRefused, ProtocolError, Segment, ShmshareTimeout, _handshake, wire
from shmshare.testing import start_child


@pytest.fixture
def pair():
    a, b = wire.pipe()
    yield a, b
    a.close()
    b.close()


def test_round_trip_header_and_fds(pair):
    a, b = pair
    seg = Segment.create(4096)
    seg.view(np.uint32, 4)[:] = [1, 2, 3, 4]
    header = {"none": None, "t": True, "i": -(2**40), "f": 1.5, "s": "ü", "b": b"\x00\xff",
              "l": [1, [2, 3]], "d": {"k": {1: "int key"}}, "tup": (1, 2)}
    a.send(header, fds=[seg])
    got, fds = b.recv(timeout=5)
    assert got == {**header, "tup": [1, 2]}  # msgpack has no tuple
    assert len(fds) == 1 and isinstance(fds[0], wire.Fd)
    with fds[0] as fd, Segment.from_fd(fd) as rx:
        assert rx.view(np.uint32, 4).tolist() == [1, 2, 3, 4]
    seg.close()
    assert b.peer_hello["pid"] == os.getpid() and b.peer_hello["version"] == wire.PROTOCOL_VERSION
    assert b.state is wire.State.READY
    assert a.statistics().frames_sent == 1 and a.statistics().fds_sent == 1
    assert b.statistics().frames_received == 1 and b.statistics().fds_received == 1


def test_fd_ownership_take_and_close():
    r, w = os.pipe()
    f = wire.Fd(r)
    assert f.fileno() == r
    n = f.take()
    assert f.closed and n == r
    with pytest.raises(ValueError, match="taken or closed"):
        f.fileno()
    f.close()  # nothing owned: no-op, never closes someone else's fd
    os.close(n)
    os.close(w)


def test_nothing_is_pickled(pair):
    a, _ = pair
    with pytest.raises(TypeError, match="nothing is pickled"):
        a.send({"x": object()})
    with pytest.raises(TypeError, match="header must be a dict"):
        a.send(["not", "a", "dict"])  # type: ignore[arg-type]
    a.send({"after": "a refused header"})  # the packer was left clean
    assert pair[1].recv(timeout=5)[0] == {"after": "a refused header"}


def test_caps_on_frame_size_and_fd_count():
    a, b = wire.pipe(max_frame=1024, max_fds=2)
    with pytest.raises(ProtocolError, match="exceeds max_frame=1024"):
        a.send({"blob": b"x" * 2000})
    with pytest.raises(ProtocolError, match="exceed max_fds=2"):
        a.send({}, fds=[0, 1, 2])
    with pytest.raises(TypeError, match="non-negative int"):
        a.send({}, fds=[-3])
    with pytest.raises(ValueError, match=r"max_fds must be 1\.\.253"):
        wire.pipe(max_fds=300)
    a.close()
    b.close()


def test_oversize_frame_from_peer_is_a_protocol_error():
    a, b = wire.pipe()
    small = wire.Connection(b._sock, max_frame=512)  # the same socket, a smaller cap
    a.send({"blob": b"x" * 4000})
    with pytest.raises(ProtocolError, match="larger than max_frame=512"):
        small.recv(timeout=5)
    a.close()
    small.close()


def test_timeout_then_eof_after_queued_messages(pair):
    a, b = pair
    with pytest.raises(ShmshareTimeout, match=r"recv timed out after 0\.05 s"):
        b.recv(timeout=0.05)
    a.send({"n": 1})
    a.send({"n": 2})
    a.close()
    assert b.recv(timeout=5)[0] == {"n": 1}
    assert b.recv(timeout=5)[0] == {"n": 2}
    with pytest.raises(PeerDied, match="closed the connection"):
        b.recv(timeout=5)


def test_recv_nowait(pair):
    a, b = pair
    assert b.recv_nowait() is None
    a.send({"n": 1})
    assert b.recv_nowait()[0] == {"n": 1}
    assert b.recv_nowait() is None
    a.close()
    with pytest.raises(PeerDied):
        b.recv_nowait()


def test_send_to_a_closed_peer_raises_peer_died(pair):
    a, b = pair
    b.close()
    with pytest.raises(PeerDied):
        a.send({"x": 1})


def test_send_timeout_when_the_peer_does_not_read():
    a, b = wire.pipe(max_frame=64 * 1024)
    with pytest.raises(ShmshareTimeout, match="send timed out"):
        for _ in range(10_000):
            a.send({"blob": b"x" * 60_000}, timeout=0.05)
    a.close()
    b.close()


def _raw_pair():
    x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return x, wire.Connection(y)


@pytest.mark.parametrize("frame, match", [
    (b"\xc1", "malformed frame"),  # 0xc1 is never valid msgpack
    (msgpack.packb({"not": "a list"}), r"must be \[kind, body\]"),
    (msgpack.packb([7, {}]), r"kind 0\.\.6"),
    (msgpack.packb([1, {}]), "before its HELLO"),
    (msgpack.packb([0, {"pid": 1}]), "malformed HELLO"),
])
def test_malformed_frames(frame, match):
    raw, conn = _raw_pair()
    raw.send(frame)
    with pytest.raises(ProtocolError, match=match):
        conn.recv(timeout=5)
    raw.close()
    conn.close()


def test_message_header_must_be_a_map():
    raw, conn = _raw_pair()
    raw.send(msgpack.packb([0, {"version": wire.PROTOCOL_VERSION, "pid": 1, "role": "x"}]))
    raw.send(msgpack.packb([1, [1, 2]]))
    with pytest.raises(ProtocolError, match="must be a map"):
        conn.recv(timeout=5)
    raw.close()
    conn.close()


def test_protocol_version_mismatch_is_refused():
    raw, conn = _raw_pair()
    raw.send(msgpack.packb([0, {"version": 99, "pid": 123, "role": "x"}]))
    with pytest.raises(PeerRefused, match=f"version 99, this process version {wire.PROTOCOL_VERSION}"):
        conn.recv(timeout=5)
    raw.close()
    conn.close()


def test_fds_on_a_bad_frame_are_closed_not_leaked():
    raw, conn = _raw_pair()
    seg = Segment.create(4096)
    socket.send_fds(raw, [b"\xc1"], [seg.fd, seg.fd])
    with pytest.raises(ProtocolError):
        conn.recv(timeout=5)
    socket.send_fds(raw, [msgpack.packb([0, {"version": 1}])], [seg.fd])
    with pytest.raises(ProtocolError, match="HELLO frame carried fds"):
        conn.recv(timeout=5)
    seg.close()
    raw.close()
    conn.close()  # the autouse leak checker proves the received copies were closed


def test_more_fds_than_max_fds_is_fd_limit_error():
    a, b = wire.pipe(max_fds=16)
    small = wire.Connection(b._sock, max_fds=2)
    seg = Segment.create(4096)
    a.send({}, fds=[seg.fd] * 8)
    with pytest.raises(FdLimitError, match=r"MSG_CTRUNC.*RLIMIT_NOFILE is .*max_fds=2"):
        small.recv(timeout=5)
    seg.close()
    a.close()
    small.close()


def test_exhausted_fd_table_is_fd_limit_error_not_silent_loss():
    a, b = wire.pipe()
    seg = Segment.create(4096)
    a.send({"n": 1}, fds=[seg.fd] * 32)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nopen = len(os.listdir("/proc/self/fd"))
    try:
        # at most a couple of free slots below the limit: 32 fds cannot all be installed
        resource.setrlimit(resource.RLIMIT_NOFILE, (nopen + 1, hard))
        with pytest.raises(FdLimitError, match=r"RLIMIT_NOFILE is \d+ .* fds are open: raise it"):
            b.recv(timeout=5)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    seg.close()
    a.close()
    b.close()


def test_eintr_is_retried(pair):
    a, b = pair
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))

    def later():
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        a.send({"late": True})

    t = threading.Thread(target=later)
    t.start()
    try:
        assert b.recv()[0] == {"late": True}
    finally:
        t.join(10)
        signal.signal(signal.SIGUSR1, old)
    assert hits == [1]


def test_poll_and_selectors(pair):
    a, b = pair
    assert not b.poll(0)
    a.send({"x": 1})
    with selectors.DefaultSelector() as sel:
        sel.register(b, selectors.EVENT_READ)
        assert sel.select(timeout=5)
    assert b.poll(1)
    b.recv()


def test_repeated_hello_from_a_handed_over_end(pair):
    a, b = pair
    a.send({"n": 1})
    a._hello_sent = False  # what a fresh process holding this end does: introduce itself again
    a.send({"n": 2})
    assert [b.recv(timeout=5)[0]["n"] for _ in range(2)] == [1, 2]


def test_listener_socket_is_private_and_cleaned_up(tmp_path):
    with wire.Listener() as lst:
        assert stat.S_IMODE(os.stat(lst.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(lst.path)).st_mode) == 0o700
        c = wire.connect(lst.path, timeout=5)
        s = lst.accept(timeout=5)
        c.send({"hi": 1})
        assert s.recv(timeout=5)[0] == {"hi": 1}
        assert s.peer_cred.pid == os.getpid() and s.peer_cred.uid == os.getuid()
        c.close()
        s.close()
        with pytest.raises(ShmshareTimeout, match="no peer connected"):
            lst.accept(timeout=0.05)
        made = os.path.dirname(lst.path)
    assert not os.path.exists(made)
    nested = tmp_path / "new" / "sock"
    with wire.Listener(nested):
        assert stat.S_IMODE(os.stat(nested.parent).st_mode) == 0o700
    with pytest.raises(OSError, match="no listener there"):
        wire.connect(tmp_path / "nothing", timeout=1)


def _connect_as_nobody(path, results):
    os.setgid(65534)
    os.setuid(65534)
    try:
        c = wire.connect(path, timeout=5, allow_uids=[0])  # the listener runs as root
        c.send({"from": "nobody"})
        results.send({"ok": True})
        c.close()
    except Exception as exc:  # noqa: BLE001 - report, don't hang the parent
        results.send({"ok": False, "error": repr(exc)})
    os._exit(0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer under another uid")
@pytest.mark.parametrize("allow", [False, True])
def test_peer_with_another_uid_is_refused_unless_allowed(allow):
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="shmshare-uidtest-")
    os.chmod(d, 0o777)  # let the other uid reach the socket: the check under test is SO_PEERCRED
    lst = wire.Listener(os.path.join(d, "sock"), allow_uids=[65534] if allow else [])
    os.chmod(lst.path, 0o777)
    res_parent, res_child = wire.pipe()
    try:
        with start_child(_connect_as_nobody, lst.path, res_child) as child:
            res_child.close()
            if allow:
                conn = lst.accept(timeout=10)
                assert conn.peer_cred.uid == 65534
                assert conn.recv(timeout=10)[0] == {"from": "nobody"}
                conn.close()
            else:
                with pytest.raises(PeerRefused, match=r"runs as uid 65534 and this process as "
                                                       r"uid 0; pass allow_uids=\[65534\]"):
                    lst.accept(timeout=10)
            report = res_parent.recv(timeout=10)[0]
            if allow:
                assert report == {"ok": True}
            assert child.join(10) == 0
    finally:
        res_parent.close()
        res_child.close()
        lst.close()
        shutil.rmtree(d, ignore_errors=True)


def _echo(conn):
    header, fds = conn.recv(timeout=30)
    with Segment.from_fd(fds[0]) as seg:
        header["sum"] = int(seg.view(np.uint8, seg.size).sum())
    for f in fds:
        f.close()
    conn.send(header)
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_end_handed_to_a_multiprocessing_child(method):
    a, b = wire.pipe()
    with start_child(_echo, b, method=method) as child:
        b.close()
        seg = Segment.create(4096)
        seg.view(np.uint8, 4096)[:] = 1
        a.send({"method": method}, fds=[seg])
        assert a.recv(timeout=60)[0] == {"method": method, "sum": 4096}
        assert a.peer_hello["pid"] == child.pid
        assert child.join(30) == 0
        seg.close()
    a.close()


def test_pickling_outside_a_child_start_is_refused(pair):
    import pickle

    with pytest.raises(TypeError, match="only to pass it to a multiprocessing child"):
        pickle.dumps(pair[0])


def test_a_peer_that_closes_with_frames_unread_still_delivers_what_it_sent():
    a, b = wire.pipe()
    b.send({"never": "read"})  # left in a's queue: closing a makes the kernel reset b
    for i in range(5):
        a.send({"i": i})
    a.close()
    got = []
    with pytest.raises(PeerDied, match="closed the connection"):
        while True:
            got.append(b.recv(timeout=5)[0]["i"])
    assert got == [0, 1, 2, 3, 4]
    b.close()


def test_an_empty_datagram_from_a_live_peer_is_not_end_of_stream(pair):
    a, b = pair
    a.send({"n": 1})
    a._sock.send(b"")  # a hostile or broken peer: zero bytes, still connected
    a.send({"n": 2})
    assert b.recv(timeout=5)[0] == {"n": 1}
    with pytest.raises(ProtocolError, match="empty datagram"):
        b.recv(timeout=5)
    assert b.recv(timeout=5)[0] == {"n": 2}  # nothing after it was lost
    a.close()
    with pytest.raises(PeerDied):
        b.recv(timeout=5)


def test_listener_creates_only_what_it_removes(tmp_path):
    path = tmp_path / "a" / "b" / "c" / "sock"
    lst = wire.Listener(path)
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    lst.close()
    assert os.listdir(tmp_path) == []


def test_listener_keeps_directories_that_others_filled(tmp_path):
    lst = wire.Listener(tmp_path / "a" / "b" / "sock")
    (tmp_path / "a" / "theirs").write_text("x")
    lst.close()
    assert sorted(os.listdir(tmp_path / "a")) == ["theirs"]


def test_accept_with_a_full_fd_table_is_fd_limit_error(tmp_path):
    lst = wire.Listener(tmp_path / "sock")
    peer = wire.connect(lst.path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with pytest.raises(OSError):
            while True:  # every slot taken, holes below the limit included
                filler.append(os.dup(0))
        with pytest.raises(FdLimitError, match=r"accept failed.*RLIMIT_NOFILE is \d+") as err:
            lst.accept(timeout=5)
        assert "-1 fds" not in str(err.value) and "are in use" in str(err.value)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    conn = lst.accept(timeout=5)  # the peer stayed queued
    conn.close()
    peer.close()
    lst.close()


def test_a_farewell_goes_out_whichever_finalizer_runs_first():
    import gc

    a, b = wire.pipe()
    a.send({"n": 1})
    a.set_farewell({"bye": True})
    cycle: list[object] = [a]
    cycle.append(cycle)  # a garbage cycle holding the connection
    del cycle, a
    gc.collect()
    assert b.recv(timeout=5)[0] == {"n": 1}
    assert b.recv(timeout=5)[0] == {"bye": True}
    with pytest.raises(PeerDied):
        b.recv(timeout=5)
    b.close()


def test_a_flood_of_control_frames_does_not_hold_recv_nowait():
    """A peer that keeps its socket full of HELLO frames (each a control frame, handled and
    dropped) held a recv_nowait() -- the store daemon's, serving one client at a time from one
    thread -- for as long as it kept writing (the hostile review of the ring fix). One call takes
    at most _CONTROLS_NOWAIT of them and answers None; the socket stays readable, and the next
    call goes on; the message behind them arrives."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn = wire.Connection(a)
    try:
        hello = msgpack.packb([0, _handshake.hello("x")])
        for _ in range(3 * wire._CONTROLS_NOWAIT):
            b.send(hello)
        b.send(msgpack.packb([1, {"n": 1}]))
        calls, got = 0, None
        while got is None:
            calls += 1
            assert calls <= 4, "more calls than the flood needs"
            got = conn.recv_nowait()
            if got is None:
                assert conn.poll(0), "None with frames queued, and the socket not readable"
        assert got[0] == {"n": 1} and calls == 4
    finally:
        conn.close()
        b.close()
