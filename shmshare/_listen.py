"""Listener and connect: unrelated processes meet on a Unix socket path (part of ``wire``).

``wire.Listener`` and ``wire.connect`` are these; they live here to keep ``wire.py``
about one connection (frames, the handshake, the states, the rings). Imported by
``wire`` last, once ``Connection`` is defined.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import socket
import stat
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from ._errors import FD_EXHAUSTED, FdLimitError, ShmshareTimeout, making_fds
from ._lifetime import Closeable
from ._sockets import connect as _connect
from ._sockets import ms as _ms
from .wire import _CLOSE_CHECK, MAX_FDS, Connection

__all__ = ["Listener", "connect", "refused", "check_room", "ACCEPT_PAUSE"]

ACCEPT_PAUSE = 0.2  # s a listener stops accepting when no connection can be taken (Note [Out of fds])

_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, less its final NUL)


class Listener(Closeable):
    """Accept connections from unrelated processes on a Unix socket path.

    The socket file is 0600. With `path` None it lives in a fresh 0700
    directory; missing directories above a given path are created 0700, one
    by one. ``close()`` removes the socket file and every directory it made.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, backlog: int = 64,
                 allow_uids: Iterable[int] = (), **conn_kw: Any) -> None:
        self._made_dirs: list[str] = []  # innermost last: removed in reverse by close()
        if path is None:
            self._made_dirs.append(tempfile.mkdtemp(prefix="shmshare-"))  # mode 0700
            path = os.path.join(self._made_dirs[0], "sock")
        self.path = os.fspath(path)
        self._pid = os.getpid()  # only this process removes the socket file
        try:
            self._make_parents(os.path.dirname(os.path.abspath(self.path)))
        except OSError as exc:
            self._remove_dirs()
            raise OSError(exc.errno, f"cannot create the directory for {self.path!r}: "
                          f"{exc.strerror}") from exc
        self._allow_uids = tuple(allow_uids)
        self._conn_kw = conn_kw
        try:
            self._sock = making_fds("socket", socket.socket, socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError:
            self._remove_dirs()
            raise
        try:
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self._sock.listen(backlog)
            self._sock.setblocking(False)  # accept() waits in slices (Note [Closing from another thread])
        except OSError as exc:
            self._sock.close()
            self._remove_dirs()
            hint = ""
            if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
                raise OSError(errno.ENAMETOOLONG, f"cannot listen on {self.path!r}: a Unix socket path holds "
                              f"at most {_SUN_PATH_MAX} bytes and this one has {len(os.fsencode(self.path))}: "
                              "choose a shorter path") from exc
            if exc.errno == errno.EADDRINUSE:
                hint = (" (a socket file is there: another listener, or a stale one to remove)"
                        if _is_socket_or_gone(self.path) else
                        " (something that is not a socket is there: choose another path)")
            raise OSError(exc.errno, f"cannot listen on {self.path!r}: {exc.strerror}{hint}") from exc

    def accept(self, timeout: float | None = None) -> Connection:
        """Wait for a peer and return its Connection (refused if its uid is not allowed).

        ``close()`` from another thread ends the wait with ValueError.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        while True:
            if self._sock.fileno() < 0:
                raise ValueError(f"the listener on {self.path!r} was closed while accept() waited")
            try:
                sock, _ = self._sock.accept()
                break
            except BlockingIOError:
                pass  # nobody waiting, or another process took the peer first
            except (ConnectionAbortedError, InterruptedError):
                continue  # that peer gave up before we took it: look for the next
            except OSError as exc:
                if exc.errno in FD_EXHAUSTED:
                    raise FdLimitError.exhausted(
                        "accept", exc, "the peer stays queued until a fd is free") from exc
                raise
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ShmshareTimeout(f"no peer connected to {self.path!r} within {timeout} s")
            poller.poll(_ms(_CLOSE_CHECK if left is None else min(left, _CLOSE_CHECK)))
        sock.setblocking(True)  # a Connection sets its own flags per call
        return Connection(sock, allow_uids=self._allow_uids, **self._conn_kw)

    @property
    def max_fds(self) -> int:
        """The most fds one message of an accepted connection may carry."""
        got = self._conn_kw.get("max_fds", MAX_FDS)
        return got if isinstance(got, int) else MAX_FDS

    def adopt(self) -> None:
        """This process takes the socket over (a child forked to serve on after its parent
        exits): its ``close()`` removes the socket file from now on."""
        self._pid = os.getpid()

    def disown(self) -> None:
        """Another process serves this socket now: our ``close()`` leaves the file alone."""
        self._pid = -1

    def fileno(self) -> int:
        """Return the listening socket's fd (readable = a peer is waiting)."""
        return self._sock.fileno()

    def close(self) -> None:
        """Stop listening and remove the socket file (and every directory made for it)."""
        if self._sock.fileno() < 0:
            return
        self._sock.close()
        if os.getpid() != self._pid:
            return  # a forked child's copy: the listener lives on in its parent
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # removed by someone else: the goal is met
        self._remove_dirs()

    def _make_parents(self, parent: str) -> None:
        """Create the missing directories down to `parent`, each 0700, remembering them."""
        missing = []
        while not os.path.isdir(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            os.mkdir(d, 0o700)
            self._made_dirs.append(d)

    def _remove_dirs(self) -> None:
        dirs, self._made_dirs = self._made_dirs, []
        for d in reversed(dirs):
            try:
                os.rmdir(d)
            except OSError:  # someone put files there: theirs to remove, and so are the parents
                break


def _is_socket_or_gone(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:  # gone meanwhile: say what EADDRINUSE usually means
        return True


def refused(path: str) -> bool:
    """Whether connecting to `path` is refused: nobody listens there any more (a dead
    listener's socket file, safe to remove; a full backlog or another error says nothing)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # EAGAIN (a full backlog: alive), EACCES, ...: leave it
    finally:
        s.close()
    return False


def connect(path: str | os.PathLike[str], timeout: float | None = None, **conn_kw: Any) -> Connection:
    """Connect to a :class:`Listener` at `path` and return the Connection.

    Waits up to `timeout` s (None: as long as it takes) for room in the listener's backlog, and
    raises ShmshareTimeout when it stays full (Note [A full backlog] in ``_sockets.py``).
    """
    sock = making_fds("socket", socket.socket, socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        _connect(sock, os.fspath(path), timeout)
    except BaseException:  # a timeout, an OSError, or a signal's exception during the wait
        sock.close()
        raise
    return Connection(sock, **conn_kw)


def check_room(want: int, why: str) -> None:
    """Raise FdLimitError unless `want` fds (or an eighth of a table too small for that, and at
    least 2) stay free once a connection is accepted; `why` says what needs them. The one room
    rule of every listener: the poll servers' and a ``listen()`` receiver's (Note [Out of fds]
    in ``_pollserver.py``)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        nopen = len(os.listdir("/proc/self/fd"))
    except OSError as exc:  # EMFILE: no fd even to list them
        raise FdLimitError.exhausted("accept", exc) from exc
    need = min(want, max(2, soft // 8))  # a tiny table still takes peers
    if soft - nopen < need:
        raise FdLimitError.exhausted(
            "accept", errno.EMFILE, f"a new peer is not accepted while fewer than {need} fds are "
            f"free: {why}", cause=f"accept: only {soft - nopen} fds are free")
