"""The kernel side of ``wire``: SCM_RIGHTS control data, SO_PEERCRED, buffer sizes, poll timeouts.

Small functions with no state and no protocol in them, so that ``wire``
holds only the protocol: frames, the handshake, the connection's states.

Note [Receiving fds safely]
    The kernel installs received fds into our table before we see them, and
    drops them silently (setting MSG_CTRUNC) when the table is full or the
    control buffer too small -- the cause of PyTorch's "received 0 items of
    ancdata". So every fd is wrapped in an owning :class:`Fd` at once, every
    error path closes them, and MSG_CTRUNC is an :class:`FdLimitError` that
    names RLIMIT_NOFILE and the fds open, never a silently lost tensor.
    EINTR is retried by Python itself (PEP 475) for recvmsg, sendmsg and poll.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import select
import socket
import struct
import sys
import termios
import time
from typing import Any

import msgpack

from ._errors import FdLimitError, ProtocolError, ShmshareTimeout
from ._fd import Fd

__all__ = ["ms", "fdnum", "take_fds", "close_all", "ctrunc_error", "peer_cred", "grow_buffers",
           "connect", "end_of_stream", "queued_bytes"]

_PEERCRED = struct.Struct("3i")
_RETRY_FIRST, _RETRY_MOST = 0.001, 0.02  # s: the first and the longest pause between connects
_HINTS = {errno.ENOENT: "no listener there", errno.ECONNREFUSED: "nobody is accepting",
          errno.EACCES: "permission denied: the listener belongs to another user"}


def ms(timeout: float) -> int:
    """Return a poll(2) timeout in ms, rounded up so that a short timeout still waits."""
    return max(0, -int(-timeout * 1000 // 1))


def fdnum(f: Any) -> int:
    """Return the fd number of an int or of an object with ``fileno()`` (TypeError otherwise)."""
    n = f.fileno() if hasattr(f, "fileno") else f
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(f"an fd must be a non-negative int or have fileno(), got {f!r}")
    return n


def take_fds(anc: list[tuple[int, int, bytes]]) -> list[Fd]:
    """Own every fd of recvmsg's ancillary data at once (Note [Receiving fds safely])."""
    fds: list[Fd] = []
    bad = None
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(Fd(n) for n in arr)
        else:
            bad = (level, kind)
    if bad is not None:
        close_all(fds)
        raise ProtocolError(f"unexpected control message (level {bad[0]}, type {bad[1]})")
    return fds


def close_all(fds: list[Fd]) -> None:
    """Close every fd of a message that will not be delivered."""
    for f in fds:
        f.close()


def ctrunc_error(got: int, max_fds: int, frame: memoryview | None = None) -> FdLimitError:
    """Say why the kernel dropped fds (MSG_CTRUNC) and what to do about it.

    The frame itself arrived: its header, as ``err.header`` (None when it
    cannot be read), lets a caller undo what the message stood for; a frame
    carried beside a ring (Note [Rings]) also gives its number, ``err.carried``.
    """
    err = FdLimitError.exhausted(
        "recvmsg", errno.EMFILE,
        f"or the peer sent more than max_fds={max_fds} in one message",
        cause=f"fds sent with a message were dropped by the kernel (MSG_CTRUNC; {got} arrived)")
    err.header, err.carried = (None, None) if frame is None else _header_of(frame)  # type: ignore[attr-defined]
    return err


def _header_of(frame: memoryview) -> tuple[dict[Any, Any] | None, int | None]:
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - best effort: a frame whose fds were lost
        return None, None
    if isinstance(msg, list) and len(msg) == 2 and msg[0] == 1 and isinstance(msg[1], dict):
        return msg[1], None  # [_KIND_MSG, header] (wire.py)
    if (isinstance(msg, list) and len(msg) == 2 and msg[0] == 5 and isinstance(msg[1], list)
            and len(msg[1]) == 2 and type(msg[1][0]) is int and isinstance(msg[1][1], dict)):
        return msg[1][1], msg[1][0]  # [_ring.KIND_CARRIED, [number, header]]
    return None, None


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """Return (pid, uid, gid) of the process at the other end of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def grow_buffers(sock: socket.socket, max_frame: int) -> None:
    """Make the socket's buffers hold two frames of `max_frame`, as far as the host allows."""
    want = 2 * max_frame + 4096
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        if sock.getsockopt(socket.SOL_SOCKET, opt) < want:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, want)
            except OSError:
                pass  # capped by net.core.{w,r}mem_max: send() reports an oversize frame


def connect(sock: socket.socket, path: str, timeout: float | None) -> None:
    """Connect the AF_UNIX `sock` to `path`, waiting up to `timeout` s (None: as long as it
    takes) for room in the listener's backlog; leave `sock` blocking (Connection sets its own
    flags per call).

    Note [A full backlog]
        A listener that is alive but does not accept (stopped, hung, busy) keeps connects
        queued in its backlog. Once that is full, a blocking AF_UNIX connect sleeps in the
        kernel, where no close() or deadline of ours reaches it, and a non-blocking one fails
        at once with EAGAIN -- not EINPROGRESS, so Python's own socket timeout does not wait
        either (it raised a bare BlockingIOError after 0.0 s). Nor does poll() say when room
        frees up: the socket is not connected to anything yet. So the connect is non-blocking
        and tried again, after pauses growing from _RETRY_FIRST to _RETRY_MOST, until the
        deadline; then ShmshareTimeout says the backlog stayed full. A signal's exception
        (ctrl-C's KeyboardInterrupt) ends the wait in a pause.

    Raises ShmshareTimeout when the backlog stays full past `timeout` (0: one try), and an
    OSError naming the path and what its errno usually means otherwise.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = _RETRY_FIRST
    sock.setblocking(False)
    while True:
        try:
            sock.connect(path)
            break
        except BlockingIOError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ShmshareTimeout(
                    f"connect to {path!r} timed out after {timeout} s: the listener's backlog is "
                    "full (connect returned EAGAIN): it is alive but not accepting (stopped, hung "
                    "or busy); wait longer, or see why that process does not accept") from None
            time.sleep(pause if left is None else min(pause, left))
            pause = min(2 * pause, _RETRY_MOST)
        except OSError as exc:
            if len(os.fsencode(path)) > 107:  # sockaddr_un.sun_path, less its final NUL
                raise OSError(errno.ENAMETOOLONG, f"cannot connect to {path!r}: a Unix socket path holds "
                              f"at most 107 bytes and this one has {len(os.fsencode(path))}") from exc
            raise OSError(exc.errno, f"cannot connect to {path!r}: {exc.strerror} "
                          f"({_HINTS.get(exc.errno or 0, 'see errno')})") from exc
    sock.setblocking(True)


def end_of_stream(sock: socket.socket) -> bool:
    """After a 0-byte read of `sock` (SEQPACKET): whether it was end of stream rather than an
    empty datagram. Both read as 0 bytes. Only a closed peer sets POLLHUP; and with it set, a
    frame still queued behind the empty one shows in a peek."""
    poller = select.poll()
    poller.register(sock, select.POLLHUP | select.POLLRDHUP)
    if not poller.poll(0):
        return False
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # BlockingIOError, ECONNRESET: hung up with nothing queued
        return True


def queued_bytes(sock: socket.socket) -> int:
    """Bytes of every frame queued on the (SEQPACKET) socket now (FIONREAD); 0 once it is closed."""
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)), sys.byteorder,
                              signed=True)
    except OSError:
        return 0  # closed meanwhile: the next read says so
