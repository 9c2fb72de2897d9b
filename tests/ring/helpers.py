"""Helpers of the ring tests: connected pairs, a hostile peer speaking the protocol, counts (kills and
bounded waits: shmshare.testing's kill, wait_exit and wait_until).
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import socket
import struct
import threading

import msgpack
import numpy as np

from shmshare import PeerDied, ProtocolError, ShmshareTimeout, _native, _ring, wire
from shmshare._procfs import shm_mappings
from shmshare.store import Store

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


def _scribble(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, _ring.nbytes())


def _ringed_pair(**kw) -> tuple[wire.Connection, wire.Connection]:
    """a offered, b accepted, and both switched: every later frame of each goes by ring."""
    a, b = wire.pipe(**kw)
    a.offer_ring()
    a.send({"n": -1})
    assert b.recv(timeout=WAIT)[0] == {"n": -1}
    b.send({"n": -2})
    assert a.recv(timeout=WAIT)[0] == {"n": -2}
    a.send({"n": -3})
    assert b.recv(timeout=WAIT)[0] == {"n": -3}
    assert a._rings.reading and a._rings.writing and b._rings.reading and b._rings.writing
    return a, b


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


HELLO = [0, {"version": wire.PROTOCOL_VERSION, "pid": 1, "role": "hostile"}]


F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _ring_maps() -> int:
    return len(shm_mappings(contains="shmshare-rings"))


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _offer_hostile(peer: socket.socket) -> mmap.mmap:
    """Offer the victim rings this (hostile) end keeps mapped, and switch: its next frames are read
    from the ring. Returns the hostile mapping (our outgoing direction is its first half)."""
    fd = _ring.make_memfd()
    try:
        m = mmap.mmap(fd, _ring.nbytes())
        _send(peer, HELLO)
        _send(peer, [_ring.KIND_OFFER, 42], [fd])
    finally:
        os.close(fd)
    _send(peer, [_ring.KIND_SWITCH, None])
    return m


def _frame_of(n: int) -> dict:
    """A header whose [KIND_MSG, header] frame is exactly n bytes."""
    pad = n - len(msgpack.packb([1, {"p": b""}], use_bin_type=True)) - 4
    header = {"p": b"x" * pad}
    header = {"p": b"x" * (pad - (len(msgpack.packb([1, header], use_bin_type=True)) - n))}
    assert len(msgpack.packb([1, header], use_bin_type=True)) == n
    return header


class _SwitchAfterRelease:
    """A lock that, the first time the thread `who` releases it, runs `then` in another thread to
    its end before `who` goes on: the thread switch the GIL may make at that point, made sure."""

    def __init__(self, then) -> None:
        self._lock = threading.Lock()
        self.who = threading.current_thread()
        self.then = then
        self.fired = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()
        if threading.current_thread() is self.who and not self.fired:
            self.fired = True
            t = threading.Thread(target=self.then)
            t.start()
            t.join(WAIT)

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# DEFECT 3. An OFFER whose memfd cannot be mapped writable -- sealed F_SEAL_WRITE or
# F_SEAL_FUTURE_WRITE, or a memfd reopened O_RDONLY through /proc -- passes check_memfd (a regular
# file of the size, sealed against shrink/grow/seal, every page allocated), and then mmap(PROT_WRITE,
# MAP_SHARED) fails: a bare PermissionError (EPERM/EACCES "mmap (a connection's rings)") escapes
# recv(), not a ProtocolError. The channel's listening Receiver only drops a peer on ProtocolError,
# FdLimitError and PeerRefused, so the hostile peer's OSError reaches the user's recv() loop and
# the peer stays connected (see the next test).
# Where: _ring.check_memfd (no check of F_SEAL_WRITE/F_SEAL_FUTURE_WRITE, nor of the fd's access
# mode) and RingLink.accept (the Ring() OSError is not turned into a ProtocolError).
# Fix: refuse seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE) and fcntl(F_GETFL) & O_ACCMODE != O_RDWR
# in check_memfd, and wrap an OSError of _native.Ring(...) as ProtocolError.
def _unwritable_memfd(how: str) -> tuple[int, int]:
    """(the fd to send, the memfd to close after)."""
    size = _ring.nbytes()
    fd = os.memfd_create("hostile-rings", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    if how == "seal-write":
        seals |= fcntl.F_SEAL_WRITE
    elif how == "seal-future-write":
        seals |= F_SEAL_FUTURE_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    if how == "read-only":
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), fd
    return fd, fd


def _victim_reads_until(sock_fd: int, frames: int) -> None:  # pragma: no cover - in a child
    """A victim in a child process: read `frames` times; exit 0 unless something other than a
    message or a clear error came (a crash shows as the signal that killed it)."""
    code = 0
    try:
        victim = wire.Connection(socket.socket(fileno=sock_fd))
        for _ in range(frames):
            try:
                victim.recv(timeout=0.01)
            except (ProtocolError, ShmshareTimeout):
                pass
            except PeerDied:
                break
        victim.send({"done": True}, timeout=1)  # by ring, into memory being scribbled
    except (ProtocolError, ShmshareTimeout, PeerDied):
        pass
    except BaseException:  # noqa: BLE001
        code = 9
    finally:
        os._exit(code)


def _fork_run(fn) -> int:
    """Fork a child that runs fn() and exits 0 (or 9 on any exception); its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001
            code = 9
        os._exit(code)
    return pid


def _number(rx) -> int:
    return rx._peers[0].number


BIG_NOTE = {"big": b"x" * 2000}  # a note too large for a slot: CARRIED on the socket, a marker in the ring


def _ringed_raw(path: str) -> wire.Connection:
    """A raw client of the daemon whose requests go by ring (offered, accepted, switched)."""
    conn = wire.connect(path, timeout=WAIT, role="raw")
    conn.offer_ring(timeout=WAIT)
    conn.send({"k": "info", "n": "nothing-here"}, timeout=WAIT)
    assert conn.recv(timeout=WAIT)[0]["k"] == "err"  # reads the ACCEPT: switch at the next send
    conn.send({"k": "info", "n": "nothing-here"}, timeout=WAIT)
    assert conn.recv(timeout=WAIT)[0]["k"] == "err"
    assert conn._rings is not None and conn._rings.writing and conn._rings.reading
    return conn


def _served(path: str) -> None:
    with Store(path, timeout=WAIT) as s:
        s.put("probe", np.arange(5), replace=True)
        assert np.array_equal(s.get("probe"), np.arange(5))
        s.delete("probe")
