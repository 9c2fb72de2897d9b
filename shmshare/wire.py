"""Frames over AF_UNIX / SOCK_SEQPACKET, with fds in SCM_RIGHTS.

One message is one msgpack frame (the socket keeps message boundaries, so
there is no length prefix to get wrong) plus up to ``max_fds`` fds in one
SCM_RIGHTS control message. Nothing is pickled: a header holds None, bool,
int, float, str, bytes, lists and dicts (tuples arrive as lists).

Elsewhere: Note [Handshake] in ``_handshake.py``, Note [Receiving fds safely] in
``_sockets.py``, and Note [Rings] (frames in shared memory beside the socket) in ``_ring.py``.

Note [Closing from another thread]
    Closing a socket does not wake a thread blocked in recvmsg/sendmsg/poll
    on it (the kernel keeps the file while the call runs), and shutdown()
    would cut every process's copy of the socket, a forked child's included.
    So no call here blocks in the kernel for long: sends and receives are
    MSG_DONTWAIT, and waits are poll() in slices of _CLOSE_CHECK that look at
    the state in between. ``close()`` from another thread makes a waiting
    call raise ValueError within _CLOSE_CHECK. A poll on a fd number that
    was closed and reused meanwhile only ends a slice early or late; the
    state is checked before the socket is touched again.
"""

from __future__ import annotations

import array
import errno
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from . import _ring
from ._errors import FdLimitError, PeerDied, ProtocolError, ShmshareTimeout, making_fds
from ._fd import Fd
from ._handshake import PROTOCOL_VERSION, PeerCred, State, check_hello, check_uid, hello, read_peer_cred
from ._lifetime import Closeable
from ._sockets import close_all as _close_all
from ._sockets import ctrunc_error as _ctrunc_error
from ._sockets import end_of_stream as _end_of_stream
from ._sockets import fdnum as _fdnum
from ._sockets import grow_buffers as _grow_buffers
from ._sockets import ms as _ms
from ._sockets import take_fds as _take_fds

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME",
    "MAX_FDS",
    "Fd",
    "State",
    "PeerCred",
    "Statistics",
    "Connection",
    "Listener",
    "pipe",
    "connect",
    "message_frame",
]

MAX_FRAME = 128 * 1024  # bytes in one frame; SEQPACKET messages must fit the socket buffer
MAX_FDS = 64  # fds in one message (the kernel's SCM_MAX_FD is 253)
_KIND_HELLO, _KIND_MSG = _ring.KIND_HELLO, _ring.KIND_MSG  # socket.MSG_*: plain ints below (IntFlag costs ~1 us)
_CLOSE_CHECK = 0.1  # s: how often a wait looks whether another thread closed the connection
_CONTROLS_NOWAIT = 64  # control frames one recv_nowait() takes at most (a selector calls again)
_NO_FDS: list[int] = []
_NO_ANC: list[Any] = []
_NOSIGNAL, _DONTWAIT, _CTRUNC, _TRUNC, _CMSG_CLOEXEC = map(int, (
    socket.MSG_NOSIGNAL, socket.MSG_DONTWAIT, socket.MSG_CTRUNC, socket.MSG_TRUNC,
    socket.MSG_CMSG_CLOEXEC))


@dataclass(frozen=True)
class Statistics:
    """Counters of one connection, for tests and for ``shmshare stat``."""

    frames_sent: int
    frames_received: int
    fds_sent: int
    fds_received: int
    bytes_sent: int
    bytes_received: int


class Connection(Closeable):
    """One end of a shmshare connection: ``send(header, fds)`` / ``recv()``.

    Build one with :func:`pipe`, :func:`connect` or :meth:`Listener.accept`.
    Thread-safe: sends are serialized, and so are receives.

    Parameters
    ----------
    sock : socket.socket
        A connected AF_UNIX SOCK_SEQPACKET socket; the connection owns it.
    role : str
        Told to the peer in the HELLO frame (``"sender"``, ``"receiver"``, ...).
    max_frame, max_fds : int
        Caps on one message's frame size and fd count, both directions.
    allow_uids : iterable of int, optional
        Other uids accepted as peers besides our own.
    """

    def __init__(self, sock: socket.socket, *, role: str = "peer", max_frame: int = MAX_FRAME,
                 max_fds: int = MAX_FDS, allow_uids: Iterable[int] = ()) -> None:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            raise ValueError(f"a Connection needs an AF_UNIX SOCK_SEQPACKET socket, got {sock!r}")
        if not 0 < max_fds <= 253:
            raise ValueError(f"max_fds must be 1..253 (the kernel's SCM_MAX_FD), got {max_fds}")
        if max_frame < 256:
            raise ValueError(f"max_frame must be at least 256 bytes, got {max_frame}")
        self._sock = sock
        self._role = role
        self._max_frame = max_frame
        self._max_fds = max_fds
        self._allow_uids = frozenset(allow_uids)
        self._cmsg_space = socket.CMSG_SPACE(max_fds * 4)
        # one spare byte so an oversize frame shows MSG_TRUNC, and room for what carrying a frame of
        # max_frame beside the rings adds (Note [Rings]); a ring slot at least
        self._buf = bytearray(max(max_frame + 1 + _ring.CARRIED_EXTRA, _ring.SLOT))
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._hello_sent = False
        self._farewell: bytes | None = None  # sent by the finalizer, if it can be without waiting
        self.state = State.NEW
        self.peer_hello: dict[str, Any] | None = None
        self._rings: _ring.RingLink | None = None  # Note [Rings] in _ring.py
        self._rings_of: int | None = None  # in a forked child: the parent pid whose rings these are
        self._forked = False  # a forked copy of an end that had rings: their frames are not ours
        self._shared = False  # this process forked while it was open: a child may read its socket too
        self._selected = False  # fileno() was asked for: a ring offered later is declined
        self._armed_reader = False  # _poll_fd() was asked for: rings stay armed when empty
        self._counts = [0, 0, 0, 0, 0, 0]
        _live.add(self)
        self._packer = msgpack.Packer(use_bin_type=True)  # used under the send lock
        self._pollin = select.poll()
        self._pollin.register(sock, select.POLLIN)
        self._pollout = select.poll()
        self._pollout.register(sock, select.POLLOUT)
        _open_socks[id(self)] = sock  # Note [Finalizers and goodbyes]
        try:
            self.peer_cred = read_peer_cred(sock)
            check_uid(self.peer_cred, self._allow_uids)
            _grow_buffers(sock, max_frame)
        except BaseException:
            _open_socks.pop(id(self), None)
            sock.close()
            raise

    # -- sending ------------------------------------------------------------

    def send(self, header: dict[Any, Any], fds: Iterable[Any] = (), timeout: float | None = None) -> None:
        """Send `header` (a msgpack-able dict) and `fds` (ints, Fd or objects with fileno()).

        The fds stay ours; the peer gets its own copies. Raises PeerDied when
        the peer is gone, ShmshareTimeout when the socket stays full past
        `timeout` seconds, and TypeError/ProtocolError for what cannot be sent.
        """
        if type(header) is not dict and not isinstance(header, dict):
            raise TypeError(f"header must be a dict, got {type(header).__name__}")
        fdnums = [_fdnum(f) for f in fds] if fds else _NO_FDS
        if len(fdnums) > self._max_fds:
            raise ProtocolError(f"{len(fdnums)} fds in one message exceed max_fds={self._max_fds}; "
                                "split them over several messages")
        self._take_send_lock(timeout)
        try:
            if self.state is State.CLOSED:
                self._check_open()
            try:
                frame = self._packer.pack([_KIND_MSG, header])
            except Exception as exc:
                self._packer.reset()
                _pack_error(exc)
                raise
            if len(frame) > self._max_frame:
                raise ProtocolError(f"a frame of {len(frame)} bytes exceeds max_frame="
                                    f"{self._max_frame}; send large data through shared memory, "
                                    "not in the header")
            if not self._hello_sent:
                self._say_hello(timeout)
            if self._rings is None:
                self._send_frame(frame, fdnums, timeout)
            else:
                self._rings.send(header, frame, fdnums, timeout)
            c = self._counts
            c[0] += 1
            c[2] += len(fdnums)
            c[4] += len(frame)
        finally:
            self._send_lock.release()

    def _say_hello(self, timeout: float | None) -> None:
        """Send our HELLO, in front of our first frame (the send lock held)."""
        self._send_frame(_pack([_KIND_HELLO, hello(self._role)]), [], timeout)
        self._hello_sent = True
        if self.state is State.NEW:
            self.state = State.HELLO_SENT

    def _take_send_lock(self, timeout: float | None) -> None:
        """Take the send lock within `timeout` (another thread's send may wait for room).

        In slices, so that a close() from another thread ends the wait (Note
        [Closing from another thread]); `timeout` 0 never waits.
        """
        if self._send_lock.acquire(blocking=False):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _CLOSE_CHECK if deadline is None else min(_CLOSE_CHECK, deadline - time.monotonic())
            if step <= 0:
                raise ShmshareTimeout("another thread's send on this connection is waiting for room "
                                      "on the socket")
            if self._send_lock.acquire(timeout=step):
                return
            if self.state is State.CLOSED:
                raise ValueError("this Connection was closed while send() waited")

    def _send_frame(self, frame: bytes, fds: list[int], timeout: float | None) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else _NO_ANC
        # Try first; compute a deadline and wait (in slices: Note [Closing from another
        # thread]) only when the socket is full.
        deadline = None
        while True:
            try:
                self._sock.sendmsg([frame], anc, _NOSIGNAL | _DONTWAIT)
                return
            except BlockingIOError:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                if not self._poll_until(self._pollout, deadline, "send()"):
                    raise ShmshareTimeout(f"send timed out after {timeout} s (peer "
                                          f"{self._peer_name()})") from None
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise PeerDied(f"the peer ({self._peer_name()}) closed the connection") from exc
            except OSError as exc:
                if self.state is State.CLOSED:
                    raise ValueError("this Connection was closed while send() waited") from exc
                if exc.errno == errno.ETOOMANYREFS:
                    raise FdLimitError(exc.errno, "too many fds are in flight on this socket "
                                       "(ETOOMANYREFS); let the peer receive before sending more") from exc
                if exc.errno == errno.EMSGSIZE:
                    raise ProtocolError(f"a frame of {len(frame)} bytes is larger than the socket "
                                        "buffer allows; lower max_frame") from exc
                if exc.errno == errno.EBADF and fds:
                    raise ValueError(f"one of the fds {fds} is not open") from exc
                raise

    # -- receiving ----------------------------------------------------------

    def recv(self, timeout: float | None = None) -> tuple[dict[Any, Any], list[Fd]]:
        """Receive one message: ``(header, fds)``; each fd is an owned :class:`Fd`.

        Raises PeerDied at end of stream (after every queued message was
        delivered), ShmshareTimeout after `timeout` seconds, ProtocolError on
        a malformed frame and FdLimitError when the kernel dropped fds.
        """
        got = self._recv(timeout)
        if got is None:
            raise ShmshareTimeout(f"recv timed out after {timeout} s (peer {self._peer_name()})")
        return got

    def recv_nowait(self) -> tuple[dict[Any, Any], list[Fd]] | None:
        """The next message if queued, else None, at once (None after 64 control frames too)."""
        return self._recv(0.0)

    def _recv(self, timeout: float | None) -> tuple[dict[Any, Any], list[Fd]] | None:
        with self._recv_lock:
            return self._recv_locked(timeout)

    def _recv_locked(self, timeout: float | None) -> tuple[dict[Any, Any], list[Fd]] | None:
        if self._rings_of is not None:
            raise ValueError(f"this connection's peer writes into rings that process {self._rings_of} "
                             "set up and reads; a forked copy cannot receive on it. Hand the end "
                             "to a child before the parent uses it, or connect anew in the child")
        deadline, controls = None if timeout is None else time.monotonic() + timeout, 0
        while True:
            if self.state is State.CLOSED:
                self._check_open()
            rings = self._rings
            if rings is not None and not rings.reading and rings.offered and rings.ring.readable() \
                    and not self._pollin.poll(0):
                rings.start_reading()  # its ACCEPT read by a forked copy of ours (Note [Rings])
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            frame = rings.next_frame(left) if rings is not None and rings.reading else self._recv_frame(left)
            if frame is None:
                return None
            kind, body, fds = frame
            if kind != _KIND_MSG:  # a flood of them must not outlast a timeout, nor hold a recv_nowait()
                self._control(kind, body, fds)
                controls += 1
                if (left == 0.0 and timeout != 0) or (timeout == 0 and controls >= _CONTROLS_NOWAIT):
                    return None
                continue
            if self.peer_hello is None and self._shared:  # a forked copy of ours read the HELLO
                self.peer_hello, self.state = _handover.stand_in_hello(self), State.READY
            if self.peer_hello is None:
                _close_all(fds)
                raise ProtocolError("the peer sent a message before its HELLO; it does not "
                                    "speak the shmshare protocol")
            if not isinstance(body, dict):
                _close_all(fds)
                raise ProtocolError(f"a message header must be a map, got {type(body).__name__}")
            c = self._counts
            c[1] += 1
            c[3] += len(fds)
            return body, fds

    def _recv_frame(self, timeout: float | None) -> tuple[int, Any, list[Fd]] | None:
        # Try first and wait only when nothing is queued (in slices: Note [Closing from
        # another thread]). MSG_CMSG_CLOEXEC: received fds must not leak into programs this
        # process execs.
        mode = _CMSG_CLOEXEC | _DONTWAIT
        if timeout is not None and timeout <= 0 and not self._pollin.poll(0):
            return None  # nothing queued: no exception raised and caught for it
        # Still MSG_DONTWAIT after a poll said yes: another holder of the socket (a forked
        # child) may take the frame first, and a blocking recvmsg would then wait for good.
        deadline = None  # computed when a wait is needed: most receives find a frame queued
        resets = 0
        while True:
            try:
                nbytes, anc, flags, _ = self._sock.recvmsg_into([self._buf], self._cmsg_space,
                                                                mode)
                break
            except BlockingIOError:
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                if not self._poll_until(self._pollin, deadline, "recv()"):
                    return None
            except ConnectionResetError as exc:
                # Note [Reset before the queue is empty]: a peer that closed with frames of
                # ours unread makes the kernel report ECONNRESET once -- ahead of frames it
                # had already queued for us. The error is consumed by reporting it, so read
                # on: what was sent comes first, then end of stream.
                resets += 1
                if resets > 1:
                    raise PeerDied(f"the peer ({self._peer_name()}) reset the connection") from exc
            except OSError as exc:
                if self.state is State.CLOSED:  # EBADF: closed by another thread
                    raise ValueError("this Connection was closed while recv() waited") from exc
                raise
        fds = _take_fds(anc) if anc else []
        if flags & _CTRUNC:
            _close_all(fds)
            # the frame itself arrived: err.header lets a caller undo what it stood for
            raise _ctrunc_error(len(fds), self._max_fds, memoryview(self._buf)[:nbytes])
        if nbytes == 0 and not fds:
            if _end_of_stream(self._sock):
                raise PeerDied(f"the peer ({self._peer_name()}) closed the connection")
            raise ProtocolError(f"the peer ({self._peer_name()}) sent an empty datagram; a "
                                "shmshare frame is never empty (it is not end of stream: the "
                                "peer is still connected)")
        if flags & _TRUNC:
            _close_all(fds)
            raise ProtocolError(f"a frame larger than max_frame={self._max_frame} bytes arrived; "
                                "the peer must use the same max_frame")
        self._counts[5] += nbytes
        try:
            msg = msgpack.unpackb(memoryview(self._buf)[:nbytes], raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types for bad input
            _close_all(fds)
            raise ProtocolError(f"a malformed frame of {nbytes} bytes arrived: {exc}") from exc
        if not (isinstance(msg, list) and len(msg) == 2 and msg[0] in _ring.SOCKET_KINDS):
            _close_all(fds)
            raise ProtocolError(f"a frame must be [kind, body] with kind 0..6, got {msg!r:.80}")
        return msg[0], msg[1], fds

    def _control(self, kind: int, body: Any, fds: list[Fd]) -> None:
        """A frame that is not a message: a HELLO, the rings' setup, a carried frame, a wake."""
        if kind == _KIND_HELLO:
            try:
                self.peer_hello = check_hello(body, len(fds))
            finally:
                _close_all(fds)
            self.state = State.READY
            if self._rings is not None:
                self._rings.hello_from(self.peer_hello.get("pid"))
        elif kind == _ring.KIND_OFFER and self._rings is None and self.peer_hello is not None:
            _ring.RingLink.accept(self, body, fds)  # sets self._rings before it answers
        elif self._rings is not None:
            self._rings.control(kind, body, fds)
        elif self._forked and kind in _ring.SOCKET_KINDS:  # the parent's rings: not this process's
            _close_all(fds)
        elif kind != _ring.KIND_WAKE or fds:  # a WAKE: an offer declined, or a forked parent's
            _close_all(fds)
            raise ProtocolError(f"the peer sent a frame of kind {kind} where none may be (Note [Rings])")

    def offer_ring(self, timeout: float | None = None) -> None:
        """Offer the peer rings in shared memory for this connection's frames (Note [Rings]).

        Frames move there once the peer has answered; until then, and for a peer that declines
        (its ``fileno()`` was given to a selector), they go on the socket as before."""
        self._take_send_lock(timeout)
        try:
            self._check_open()
            if self._rings is None and not self._forked and _ring.enabled():  # a fork's copy: the socket
                if not self._hello_sent:
                    self._say_hello(timeout)
                self._rings = _ring.RingLink.offer(self, timeout)
        finally:
            self._send_lock.release()

    @property
    def max_frame(self) -> int:
        """Bytes of the largest frame this connection sends or takes."""
        return self._max_frame

    def frame_room(self) -> int:
        """Bytes of the largest frame that goes without a detour: a ring slot's while rings carry
        this end's frames (a larger one is carried on the socket), else max_frame."""
        rings = self._rings
        return _ring.SLOT - 4 if rings is not None and rings.writing else self._max_frame

    def pending(self) -> bool:
        """Whether a message waits in this connection's ring (a selector does not see those)."""
        rings = self._rings
        return rings is not None and rings.reading and rings.pending()

    def send_now(self, make: Callable[..., bytes], *args: Any) -> bool:
        """Put ``make(*args)`` (:func:`message_frame`'s bytes) in the ring now if it has room; False: send() it."""
        rings = self._rings
        return rings is not None and rings.send_now(make, *args)

    def recv_now(self, raw: bytes = b"") -> dict[Any, Any] | bytes | None:
        """The next message if in the ring now: its frame if it starts with `raw`, else its header; None: recv()."""
        rings = self._rings
        return None if rings is None else rings.recv_now(raw)

    # -- misc ---------------------------------------------------------------

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Return whether a message (or end of stream) can be received within `timeout` s."""
        self._check_open()
        rings = self._rings
        if rings is not None and rings.reading:
            return rings.poll(timeout)
        # A poll object of its own: a thread waiting in recv() uses _pollin, and one poll
        # object refuses two callers at once ("concurrent poll() invocation").
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        if timeout is not None and timeout <= 0:
            return bool(poller.poll(0))
        return self._poll_until(poller, None if timeout is None else
                                time.monotonic() + timeout, "poll()")

    def fileno(self) -> int:
        """Return the socket's fd, for selectors (readable = a message is waiting).

        A connection whose fd was asked for declines rings offered later (Note [Rings]): its
        messages stay on the socket, where a selector sees them.
        """
        self._selected = True
        if self._rings is not None:
            self._rings.keep_armed()
        return self._sock.fileno()

    def _poll_fd(self) -> int:
        """The socket's fd for a selector that drains with ``recv_nowait()`` until None and asks
        ``pending()`` (the channel's fan-in): rings stay allowed, and armed whenever empty."""
        self._armed_reader = True
        if self._rings is not None:
            self._rings.keep_armed()
        return self._sock.fileno()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self.state is State.CLOSED

    def statistics(self) -> Statistics:
        """Return a frozen copy of this connection's counters."""
        return Statistics(*self._counts)

    def set_farewell(self, header: dict[Any, Any] | None) -> None:
        """Make `header` the message a finalizer sends before closing (None: nothing).

        Only the garbage collector sends it, and only if the socket has room
        at once: a graceful end sends its own goodbye and then ``close()``s.
        """
        self._farewell = None if header is None else self._packer.pack([_KIND_MSG, header])

    def close(self) -> None:
        """Close the socket. Idempotent; the peer's next recv raises PeerDied."""
        self.state = State.CLOSED
        self._farewell = None
        rings, self._rings = self._rings, None  # unmapped when the last call using it returns
        if rings is not None:
            rings.close()
        _open_socks.pop(id(self), None)
        self._sock.close()

    def close_nowait(self) -> None:
        """Send the farewell if the socket has room now (never waiting), then close. Idempotent."""
        farewell, self._farewell = self._farewell, None
        rings = self._rings
        if rings is not None and farewell is not None and rings.push_nowait(farewell):
            farewell = None  # after the frames before it, in the ring
        if farewell is not None and self.state is not State.CLOSED and self._hello_sent:
            try:
                self._sock.sendmsg([farewell], _NO_ANC, _NOSIGNAL | _DONTWAIT)
            except OSError:  # full or gone: the peer will see an end without a goodbye
                pass
        self.close()

    def _finalize(self) -> None:
        self.close_nowait()

    def __reduce__(self) -> Any:
        return _handover.reduce(self)  # to a multiprocessing child only (Note [An end in another process])

    def __repr__(self) -> str:
        return f"<Connection {self._role} fd={self._sock.fileno()} state={self.state.value}>"

    def _check_open(self) -> None:
        if self.state is State.CLOSED:
            raise ValueError("this Connection is closed")

    def _poll_until(self, poller: Any, deadline: float | None, what: str) -> bool:
        """Wait until `poller` fires (True) or `deadline` passes (False).

        Waits in slices of _CLOSE_CHECK and raises ValueError once the
        connection is closed (Note [Closing from another thread]).
        """
        while True:
            if self.state is State.CLOSED:
                raise ValueError(f"this Connection was closed while {what} waited")
            if deadline is None:
                step = _CLOSE_CHECK
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return bool(poller.poll(0))
                step = min(left, _CLOSE_CHECK)
            if poller.poll(_ms(step)):
                if self.state is State.CLOSED:  # type: ignore[comparison-overlap]  # close() from another thread: POLLNVAL, or a fd number someone reused
                    raise ValueError(f"this Connection was closed while {what} waited")
                return True

    def _peer_name(self) -> str:
        pid = self.peer_hello.get("pid") if self.peer_hello else self.peer_cred.pid
        return f"pid {pid}"


_live: weakref.WeakSet[Connection] = weakref.WeakSet()


# Note [Finalizers and goodbyes]
#     A Sender dropped in a garbage cycle together with its Connection used
#     to lose its goodbye: the collector finalizes a cycle's objects in any
#     order, and the socket's own finalizer could close it first, so the
#     receiver reported a clean exit as a death. Each open Connection's
#     socket is therefore held here, outside any cycle, until the Connection
#     itself closes it; and the goodbye is a farewell frame that the
#     Connection's own finalizer sends, without waiting, whichever of the two
#     objects is finalized first.
_open_socks: dict[int, socket.socket] = {}


def pipe(**conn_kw: Any) -> tuple[Connection, Connection]:
    """Return a connected pair of Connections, for a parent and its child."""
    a, b = making_fds("socketpair", socket.socketpair, socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return Connection(a, **conn_kw), Connection(b, **conn_kw)


def message_frame(header: dict[Any, Any]) -> bytes:
    """The bytes ``send(header)`` puts on the wire or in a ring slot, for :meth:`Connection.send_now`."""
    return _pack([_KIND_MSG, header])


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except Exception as exc:
        _pack_error(exc)
        raise


def _pack_error(exc: Exception) -> None:
    """Raise the TypeError that says why a header could not be packed (or return: not ours)."""
    if isinstance(exc, TypeError):
        raise TypeError(f"cannot send this header: {exc}. A header holds None, bool, int, float, "
                        "str, bytes, lists and dicts only (nothing is pickled)") from exc
    if isinstance(exc, (OverflowError, ValueError)):
        raise TypeError(f"cannot send this header: {exc}") from exc


from . import _handover  # noqa: E402  (fork and spawn: what an end does in another process)
from ._listen import Listener, connect  # noqa: E402  (it builds the Connections above: last)
