"""What a peer can offer as rings: memfds not sealed, of the wrong size, not writable, not memfds
at all, floods of offers and foreign accepts. Each is a ProtocolError or declined, and the peer
dropped; nothing crashes, hangs or leaks (Note [Rings]).
"""

from __future__ import annotations

import fcntl
import os
import socket

import msgpack
import pytest

from shmshare import ProtocolError, ShmshareTimeout, _ring, channel, listen, wire

from .helpers import (
    HELLO,
    WAIT,
    _nfds,
    _offer_hostile,
    _put,
    _ring_maps,
    _send,
    _unwritable_memfd,
)


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


# DEFECT 1. A Connection with a max_frame below 511 (256 is allowed) cannot read its ring at all:
# its receive buffer is bytearray(max_frame + 1), and Ring.pop_into refuses a buffer smaller than
# a slot (512), so the first ring frame raises "ValueError: Ring.pop_into: the buffer holds 257
# bytes, less than a slot (512)" -- and every recv after it does too: the connection is dead.
# Where: wire.Connection.__init__ (self._buf) against RingLink.next_frame (ring.pop_into(buf)).
# Fix: size the buffer max(max_frame + 1, SLOT), and treat a ring frame longer than max_frame as
# the socket path does (or decline rings when max_frame < SLOT - 4).


@pytest.mark.parametrize("how", ["seal-write", "seal-future-write", "read-only"])
def test_an_offer_that_cannot_be_mapped_writable_is_a_protocol_error(how):
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    victim = wire.Connection(s1)
    fd, memfd = _unwritable_memfd(how)
    try:
        _send(s2, HELLO)
        _send(s2, [_ring.KIND_OFFER, 1], [fd])
        with pytest.raises(ProtocolError):
            victim.recv(timeout=WAIT)
    finally:
        os.close(fd)
        if memfd != fd:
            os.close(memfd)
        victim.close()
        s2.close()


# DEFECT 3, as a listening Receiver sees it: the hostile sender's OFFER makes rx.recv() raise a
# bare PermissionError to the user (a `for batch in rx` server dies), and the sender is not
# dropped. Expected: ProtocolError naming the dropped peer, and the honest sender's batch next.


def test_a_listening_receiver_drops_a_sender_whose_rings_cannot_be_mapped(tmp_path):
    rx = listen(str(tmp_path / "s.sock"))
    hostile = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd, _ = _unwritable_memfd("seal-write")  # the memfd itself
    tx = None
    try:
        hostile.connect(rx.path)
        _send(hostile, [0, {"version": wire.PROTOCOL_VERSION, "pid": 1, "role": "sender"}])
        _send(hostile, [_ring.KIND_OFFER, 1], [fd])
        with pytest.raises(ProtocolError):
            rx.recv(timeout=WAIT)  # PermissionError: [Errno 1] ... "mmap (a connection's rings)"
        tx = channel.__globals__["connect"](rx.path, timeout=WAIT)
        tx.send({"honest": 1})
        assert rx.recv(timeout=WAIT) == {"honest": 1}
    finally:
        os.close(fd)
        hostile.close()
        if tx is not None:
            tx.close()
        rx.close()


# DEFECT 10. A hostile peer parks 4096 of its fds in the victim, out of the application's sight:
# carried frames without markers are kept "read ahead" up to MAX_CARRIED = 64, each with up to
# MAX_FDS = 64 fds, under any number not yet reached (10**15 included, which no marker can ever
# name). An honest writer is never more than one carried frame ahead: it sends CARRIED and
# pushes its marker under its send lock, and the reader reads the socket only when its ring is
# empty. With a soft RLIMIT_NOFILE of 1024 (the common default) that is the victim's whole fd
# table: every later fd it receives from an honest peer is cut (MSG_CTRUNC -> FdLimitError, and
# the channel drops that honest peer), every open() fails. Without rings the same fds would stay
# in the kernel's queue, charged to the sender (too_many_unix_fds), until the victim reads them.
# Where: RingLink.take_carried (and the MAX_CARRIED bound). Fix: a carried frame must carry the
# next number in order (next_in + len(carried) + len(lost)), and at most one or two may be ahead.


@pytest.mark.parametrize("what", ["o_path", "dev_zero", "dev_shm_file", "holes", "huge"])
def test_offers_of_what_is_not_a_sealed_memfd_are_refused(what, tmp_path):
    size = _ring.nbytes()
    if what == "o_path":
        real = _ring.make_memfd()
        fd = os.open(f"/proc/self/fd/{real}", os.O_PATH | os.O_CLOEXEC)
        os.close(real)
    elif what == "dev_zero":
        fd = os.open("/dev/zero", os.O_RDWR | os.O_CLOEXEC)
    elif what == "dev_shm_file":
        path = f"/dev/shm/shmshare_attack_{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(path)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    else:
        fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, size if what == "holes" else 1 << 40)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    victim = wire.Connection(s1)
    try:
        nfds, maps = _nfds(), _ring_maps()
        _send(s2, HELLO)
        _send(s2, [_ring.KIND_OFFER, 1], [fd])
        with pytest.raises(ProtocolError):
            victim.recv(timeout=WAIT)
        assert (_nfds(), _ring_maps()) == (nfds, maps)
    finally:
        os.close(fd)
        victim.close()
        s2.close()


# HELD. OFFER floods: a thousand further OFFERs (with memfds), after the rings are up, and
# ACCEPTs of a wrong token, are declined and their fds closed; the rings go on working.


def test_offer_floods_and_foreign_accepts_are_declined_without_leaks():
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    victim = wire.Connection(s1)
    m = _offer_hostile(s2)
    extra = _ring.make_memfd()
    try:
        _send(s2, [1, {"n": 0}])
        assert victim.recv(timeout=WAIT)[0] == {"n": 0}
        nfds, maps = _nfds(), _ring_maps()
        for i in range(1000):
            _send(s2, [_ring.KIND_OFFER, i], [extra])
            if i % 100 == 0:
                _send(s2, [_ring.KIND_WAKE, None])
                with pytest.raises(ShmshareTimeout):
                    victim.recv(timeout=0.01)  # reads what is queued
        with pytest.raises(ShmshareTimeout):
            victim.recv(timeout=0.05)
        assert (_nfds(), _ring_maps()) == (nfds, maps)
        _put(m, 0, msgpack.packb([1, {"n": 1}]))
        assert victim.recv(timeout=WAIT)[0] == {"n": 1}
    finally:
        os.close(extra)
        victim.close()
        s2.close()
        m.close()


# HELD. A hostile peer that rewrites its tail, slot lengths (0, 508, 509, 2**32 - 1) and slot
# bytes as fast as it can while the victim reads (the length is read once, then the frame copied
# out: ring.c), and the victim's own outgoing indices: the victim, in a child process, sees
# messages, ProtocolErrors or nothing -- no crash, no hang.
