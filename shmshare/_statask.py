"""``shmshare stat``'s side of the stats sockets: asking all of them at once, and checking answers.

Note [Asking every stats socket at once]
    Any process of the user can make stats sockets that listen and never
    accept (and for root, any user's ``/tmp/shmshare-*/stats`` counts), so
    their number is the asker's cost, not theirs: they are all asked in one
    poll loop, over non-blocking sockets, against one deadline. Connecting
    does not wait (a full backlog is tried again every few milliseconds),
    the request is sent with ``timeout=0`` on a fresh socket, and the
    replies are read as they come. Fifty silent sockets then cost one
    ASK_TIMEOUT, as one does. At most _AT_ONCE are open together, so the
    fds stat holds stay bounded; what could not be asked by the deadline is
    listed as such.

Note [An answer is hostile]
    The socket may be anyone's of the same uid (root asks every user's), so
    an answer is kept only as far as stat knows it: the top-level keys of
    the reply's VERSION (others are dropped: a newer server may add some),
    each of the type it should be, and, under ``pools``, ``senders``,
    ``owners`` and ``loaders``, plain JSON values only (None, bools, finite numbers, strings
    cut to _TEXT, lists and dicts of them, _DEPTH deep and _ITEMS long at
    most). Anything else -- bytes, a string where a number goes, totals that
    are not a dict -- makes the socket one that did not answer, with why:
    the table and ``--json`` then never meet a value they cannot print.

Note [Only the directory owner's sockets]
    Root asks every user's stats directory, and a user owns what is in
    theirs: a symlink there (or the directory itself a link, or a link
    above it: ``/tmp/shmshare-<uid>`` is anyone's name to take) would have
    root connect to any socket it points at, root's own daemons' included,
    and send them a request. So a socket is asked only if it is one (not a
    link), and its owner is its directory's owner; that uid alone (and our
    own, as ``wire`` always does) is accepted as the peer. Nothing is
    followed on the way: the directory is opened O_PATH|O_NOFOLLOW and,
    for root, its real path (``/proc/self/fd``) must be the one listed; the
    socket is opened O_PATH|O_NOFOLLOW beside it and checked with fstat;
    and the connect goes to ``/proc/self/fd/<that fd>``, the very inode
    checked, so swapping the name for a link after the check changes
    nothing. Only root pays for the real-path rule (a root whose
    ``$XDG_RUNTIME_DIR`` lies under a link is not asked its own socket):
    another user's stat may follow links, since nothing it reaches is more
    than that user's. What is refused is listed as "not asked", with why.
"""

from __future__ import annotations

import collections
import math
import os
import select
import socket
import stat
import time
from typing import Any

from . import _statsd, wire
from ._errors import ProtocolError

__all__ = ["ask_all", "check_reply", "Malformed"]

_AT_ONCE = 128  # sockets open together at most
_RETRY = 0.01  # s between connects to a socket whose backlog is full
_NOFOLLOW = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC  # a link is opened as itself, not followed
_DEPTH = 6  # levels of lists and dicts kept in a reporter's entry
_ITEMS = 10_000  # entries kept of one list or dict
_TEXT = 500  # characters kept of a string
_NUMBERS = ("pid", "uptime_s", "tick_s", "truncated")
_LISTS = ("pools", "senders", "owners", "loaders")
_KIND_FIGURES = ("pools", "reserved_bytes", "allocated_bytes", "peak_reserved_bytes",
                 "peak_allocated_bytes", "leases_out")

Outcome = tuple[int, "dict[str, Any] | None", "str | None"]  # (peer pid or 0, reply, why not)


class Malformed(ProtocolError):
    """A stats reply with a value that is not what it should be."""


class _NotAsked(Exception):
    """A stats socket that stat does not connect to (Note [Only the directory owner's sockets])."""


def ask_all(paths: list[str], timeout: float) -> dict[str, Outcome]:
    """Ask every stats socket in `paths` at once, all within `timeout` s (Note [Asking every
    stats socket at once]); return {path: (peer pid, its checked reply, None) or (pid or 0, None,
    why not) or (0, None, None): nobody listens there (a process killed)}."""
    deadline = time.monotonic() + timeout
    out: dict[str, Outcome] = {}
    queue = collections.deque(paths)
    retry: collections.deque[str] = collections.deque()  # backlog full: connect again
    active: dict[int, tuple[str, wire.Connection]] = {}
    poller = select.poll()
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            for _ in range(len(retry)):
                _start(retry.popleft(), active, retry, out, poller)
            while queue and len(active) < _AT_ONCE:
                _start(queue.popleft(), active, retry, out, poller)
            if not active and not retry and not queue:
                break
            wait = deadline - time.monotonic()
            if retry:
                wait = min(wait, _RETRY)
            for fd, _ in poller.poll(max(0, math.ceil(wait * 1000))):
                if fd in active:
                    _read(fd, active, out, poller)
    finally:
        for path, conn in active.values():
            conn.close()
            out[path] = (conn.peer_cred.pid, None, f"no answer within {timeout} s (stopped, or busy)")
        for path in retry:
            out[path] = (0, None, f"no answer within {timeout} s (its backlog stayed full)")
        for path in queue:
            out[path] = (0, None, f"not asked: {len(paths)} stats sockets, {_AT_ONCE} asked at once, "
                                  f"and {timeout} s in all")
    return out


def _start(path: str, active: dict[int, tuple[str, wire.Connection]], retry: collections.deque[str],
           out: dict[str, Outcome], poller: Any) -> None:
    """Connect to `path` and send the request, without waiting for either."""
    try:
        fd, uid = _open_checked(path)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK
                                 | socket.SOCK_CLOEXEC)
            try:
                sock.connect(f"/proc/self/fd/{fd}")  # the inode checked, whatever the name is now
            except BaseException:
                sock.close()
                raise
        finally:
            os.close(fd)
        # the Connection owns the socket from here, and closes it if it refuses the peer
        conn = wire.Connection(sock, role="stat", allow_uids=(uid,), max_fds=1)
    except _NotAsked as exc:
        out[path] = (0, None, f"not asked: {exc}")
        return
    except (ConnectionRefusedError, FileNotFoundError):
        out[path] = (0, None, None)  # nobody listens (the next server removes it), or gone
        return
    except BlockingIOError:
        retry.append(path)  # a full backlog: someone listens, and may yet accept
        return
    except Exception as exc:  # noqa: BLE001 -- whatever one socket does, stat asks the rest
        out[path] = (0, None, f"{type(exc).__name__}: {exc}"[:200])
        return
    try:
        conn.send({"k": _statsd.REQUEST}, timeout=0)  # a fresh socket has room for it
        poller.register(conn.fileno(), select.POLLIN)
    except Exception as exc:  # noqa: BLE001
        conn.close()
        out[path] = (conn.peer_cred.pid, None, f"{type(exc).__name__}: {exc}"[:200])
        return
    active[conn.fileno()] = (path, conn)


def _open_checked(path: str) -> tuple[int, int]:
    """Return an O_PATH fd of the socket at `path` and its owner's uid, once it is a socket of
    its directory's owner, reached through no link (Note [Only the directory owner's sockets]);
    raise _NotAsked saying why not."""
    where, name = os.path.split(os.path.abspath(path))
    dfd = os.open(where, _NOFOLLOW)
    try:
        dst = os.fstat(dfd)
        if not stat.S_ISDIR(dst.st_mode):
            raise _NotAsked(f"its directory {where!r} is a {_kind(dst.st_mode)}")
        if os.getuid() == 0:
            real = os.readlink(f"/proc/self/fd/{dfd}")
            if real != where:
                raise _NotAsked(f"its directory {where!r} is reached through a symlink (it is "
                                f"{real!r})")
        fd = os.open(name, _NOFOLLOW, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode):
            raise _NotAsked(f"a {_kind(st.st_mode)}, not a socket")
        if st.st_uid != dst.st_uid:
            raise _NotAsked(f"the socket is uid {st.st_uid}'s and its directory uid "
                            f"{dst.st_uid}'s")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_uid


def _kind(mode: int) -> str:
    return ("symlink" if stat.S_ISLNK(mode) else "directory" if stat.S_ISDIR(mode)
            else "socket" if stat.S_ISSOCK(mode) else "file")


def _read(fd: int, active: dict[int, tuple[str, wire.Connection]], out: dict[str, Outcome],
          poller: Any) -> None:
    """Take the reply waiting on `fd` (or, with only the server's HELLO in, wait on)."""
    path, conn = active[fd]
    pid = conn.peer_cred.pid  # in our pid namespace, whatever it calls itself
    try:
        got = conn.recv_nowait()
        if got is None:
            return  # its HELLO alone, so far
        header, fds = got
        for f in fds:
            f.close()
        if header.get("k") != _statsd.REPLY:
            raise ProtocolError(f"it answered {header!r:.200}")
        outcome: Outcome = (pid, check_reply(header), None)
    except Malformed as exc:
        outcome = (pid, None, f"a malformed answer: {exc}"[:200])
    except Exception as exc:  # noqa: BLE001 -- gone, garbage: said, and the rest asked on
        outcome = (pid, None, f"{type(exc).__name__}: {exc}"[:200])
    del active[fd]
    poller.unregister(fd)
    conn.close()
    out[path] = outcome


def check_reply(reply: dict[Any, Any]) -> dict[str, Any]:
    """What stat keeps of a stats reply (Note [An answer is hostile]); Malformed if a value it
    keeps is not what it should be."""
    out: dict[str, Any] = {}
    for key in _NUMBERS:
        if key in reply:
            out[key] = _number(reply[key], key)
    for key in _LISTS:
        if key in reply:
            entries = reply[key]
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise Malformed(f"{key} is not a list of dicts")
            out[key] = _plain(entries[:_ITEMS], key, 0)
    if "totals" in reply:
        out["totals"] = _totals(reply["totals"])
    return out


def _totals(totals: Any) -> dict[str, Any]:
    if not isinstance(totals, dict):
        raise Malformed(f"totals is a {type(totals).__name__}, not a dict")
    out: dict[str, Any] = {}
    if "by_kind" in totals:
        by_kind = totals["by_kind"]
        if not isinstance(by_kind, dict) or len(by_kind) > _ITEMS:
            raise Malformed("totals.by_kind is not a dict")
        out["by_kind"] = kinds = {}
        for kind, t in by_kind.items():
            where = f"totals.by_kind[{kind!r:.40}]"
            if not isinstance(kind, str) or not isinstance(t, dict):
                raise Malformed(f"{where} is not a str's dict")
            row = {k: _number(t[k], f"{where}.{k}") for k in _KIND_FIGURES if k in t}
            if "oldest_lease_s" in t:
                row["oldest_lease_s"] = _number(t["oldest_lease_s"], f"{where}.oldest_lease_s", True)
            kinds[kind[:_TEXT]] = row
    if "leases_out" in totals:
        out["leases_out"] = _number(totals["leases_out"], "totals.leases_out")
    if "oldest_lease_s" in totals:
        out["oldest_lease_s"] = _number(totals["oldest_lease_s"], "totals.oldest_lease_s", True)
    return out


def _number(value: Any, where: str, none: bool = False) -> int | float | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Malformed(f"{where} is {value!r:.40}, not a number")
    return value


def _plain(value: Any, where: str, depth: int) -> Any:
    """`value` if it is plain JSON, bounded (Note [An answer is hostile]); else Malformed."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:_TEXT]
    if depth >= _DEPTH:
        raise Malformed(f"{where} is nested deeper than {_DEPTH}")
    if isinstance(value, list):
        return [_plain(v, where, depth + 1) for v in value[:_ITEMS]]
    if isinstance(value, dict):
        out = {}
        for k, v in list(value.items())[:_ITEMS]:
            if not isinstance(k, str):
                raise Malformed(f"{where} has a key {k!r:.40}, not a str")
            out[k[:_TEXT]] = _plain(v, f"{where}.{k:.40}", depth + 1)
        return out
    raise Malformed(f"{where} holds a {type(value).__name__}")
