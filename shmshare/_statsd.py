"""The stats socket: an opt-in thread that tells ``shmshare stat`` what this process's pools hold.

Note [The stats socket]
    /proc shows what each process maps and holds (Note [Stat reads /proc,
    not the processes] in ``_stat.py``), not how its pools use it: reserved
    against allocated bytes, peaks, pinned and device memory (which /proc
    cannot see at all), leases out and how old the oldest is. A process
    that opts in (``SHMSHARE_STATS=1``: the first pool made starts it; or
    ``serve_stats()``) answers those on a socket of its own:
    ``$XDG_RUNTIME_DIR/shmshare/stats/<pid>.sock``, else
    ``/tmp/shmshare-<uid>/stats/<pid>.sock``; the file 0600, the
    directories 0700 and ours (checked, not assumed: ``/tmp`` is shared).
    One daemon thread serves it with ``wire`` frames, over a ``PollServer``
    (Note [One poll server]; out of fds, Note [Out of fds]); a peer of
    another uid (root excepted) is refused by ``wire.Connection``. A client
    sends one request and gets one reply (what ``_registry.reports()``
    gives, with totals per pool kind), then the connection is closed.

    It must never block or break the process. Reporters take no lock of
    the pools (Note [Reporters]). The reply is sent with ``timeout=0`` on a
    fresh socket sized for two frames, so it fits at once or the client is
    dropped; a client that has not asked within _CLIENT_WAIT is dropped;
    past _MAX_CLIENTS at once, newcomers are closed at accept; garbage,
    frames over ``MAX_FRAME`` and fds are ``wire`` errors, and the client
    is dropped. A reply over the frame limit is cut (``truncated`` says
    how many entries went; the totals are of all). Any error in the thread
    ends the server and removes the socket: stat then sees no socket, not
    one that never answers.

    A forked child does not inherit the thread (``fork`` copies only the
    caller's): it closes its copies and, if its parent served, starts its
    own on its own pid -- not at fork, but when it first registers a pool
    (or asks ``stats_socket()``): a child that execs (``subprocess``'s
    ``preexec_fn``) or leaves by ``os._exit`` binds nothing. At exit (``atexit``; multiprocessing's finalizers in
    its children, which leave through ``os._exit``) the socket is removed,
    and the directories if empty. A process killed leaves its socket: the
    next server to start removes those that refuse a connection -- by the
    socket, not the pid, which means nothing across pid namespaces -- and
    only sockets older than _YOUNG: a file, a directory or a socket bound
    just now at its own name makes a server take ``<pid>-<token>.sock``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import secrets
import stat
import threading
import time
import warnings
from typing import Any

import msgpack

from . import _fork, _registry, wire
from ._errors import ProtocolError
from ._listen import refused
from ._pollserver import PollServer

__all__ = ["serve_stats", "stop_stats", "stats_socket", "stats_dirs", "stats_sockets", "ask",
           "ENV_VAR", "VERSION", "TICK"]

ENV_VAR = "SHMSHARE_STATS"
VERSION = 1  # of the reply; a client reads the keys it knows
TICK = 0.5  # s between the reporters' notes (Note [The age of a lease, for nothing])
REQUEST, REPLY = "stats", "stats"
_CLIENT_WAIT = 1.0  # s a client has, from accept, to send its request
_MAX_CLIENTS = 8
_REPLY_BUDGET = wire.MAX_FRAME - 4096  # the reply's frame, with room for the wire's own bytes
_MAX_LOADERS = 16  # loaders' reports in one reply (Note [Where the time goes] in loader/_stats.py)
_YOUNG = 5.0  # s: a socket this new may be a server between its bind and its listen: not swept
_NAME = re.compile(r"[0-9]{1,10}(-[0-9a-f]{1,16})?\.sock\Z", re.ASCII)


def _layout() -> list[tuple[str, tuple[str, ...]]]:
    """(a base that must exist, the directories under it) of each place a stats socket may live."""
    out: list[tuple[str, tuple[str, ...]]] = []
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg) and os.path.isdir(xdg):
        out.append((xdg, ("shmshare", "stats")))
    out.append(("/tmp", (f"shmshare-{os.getuid()}", "stats")))
    return out


def stats_dirs() -> list[str]:
    """Where this user's stats sockets live: ``$XDG_RUNTIME_DIR/shmshare/stats`` (when set), then
    ``/tmp/shmshare-<uid>/stats``. A server uses the first."""
    return [os.path.join(base, *parts) for base, parts in _layout()]


def stats_sockets(all_users: bool = False) -> list[str]:
    """The stats sockets there are (of every user's directories too with `all_users`, for root)."""
    dirs = stats_dirs()
    if all_users:
        import glob

        dirs += glob.glob("/run/user/*/shmshare/stats") + glob.glob("/tmp/shmshare-*/stats")
    out: list[str] = []
    for d in dict.fromkeys(dirs):
        try:
            out += [os.path.join(d, n) for n in sorted(os.listdir(d)) if _NAME.match(n)]
        except OSError:
            continue  # none there, or not ours to read
    return out


def serve_stats(path: str | os.PathLike[str] | None = None) -> str:
    """Start answering ``shmshare stat`` on a stats socket (Note [The stats socket]); return its path.

    Idempotent. `path` None: ``<pid>.sock`` in the first of :func:`stats_dirs`, where ``stat``
    looks; another path is for callers that ask with :func:`ask` themselves. Forked children
    start their own. :func:`stop_stats` stops it; so does exit.
    """
    global _server, _wanted, _pending
    with _lock:
        _pending = False
        want = None if path is None else os.path.abspath(os.fspath(path))
        if _server is not None and _server.running() and want in (None, _server.path):
            _wanted = True
            return _server.path
        if _server is not None:
            _server.close()
            _server = None
        _server = _Server(want, sweep=True)
        _wanted = True
        _register_exit()
        return _server.path


def stop_stats() -> None:
    """Stop the stats socket (if any): the thread ends, the socket file goes. Idempotent."""
    global _server, _wanted, _pending
    with _lock:
        _wanted = _pending = False
        server, _server = _server, None
    if server is not None:
        server.close()


def stats_socket() -> str | None:
    """The path this process answers on, or None. In a forked child of a serving process that
    has not served yet, this starts its server (Note [The stats socket])."""
    if _server is None and _pending:
        _autostart()
    server = _server
    return server.path if server is not None and server.running() else None


def ask(path: str, timeout: float = 0.5, allow_uids: tuple[int, ...] = ()) -> tuple[int, dict[str, Any]]:
    """Ask the server at `path`; return (its pid as this process sees it, its reply).

    Each step (connect, send, the reply) waits at most `timeout` s. Raises OSError (nobody
    there), ShmshareTimeout (it did not answer: stopped, or busy) or ProtocolError.
    """
    conn = wire.connect(path, timeout=timeout, role="stat", allow_uids=allow_uids)
    try:
        conn.send({"k": REQUEST}, timeout=timeout)
        header, fds = conn.recv(timeout=timeout)
        for f in fds:
            f.close()
        pid = conn.peer_cred.pid  # in our pid namespace, whatever it calls itself
    finally:
        conn.close()
    if header.get("k") != REPLY:
        raise ProtocolError(f"the stats socket {path!r} answered {header!r:.200}")
    return pid, header


class _Server:
    """The socket and its thread (one per process at most), over a PollServer."""

    def __init__(self, path: str | None, sweep: bool) -> None:
        self.dir = None if path is not None else _make_dir()
        if self.dir is not None and sweep:
            _sweep(self.dir)
        listener = _listen(self.dir, path)
        self.path = listener.path
        self._pid = os.getpid()
        self._born = time.monotonic()
        self._closed = False
        self._next_tick = 0.0
        self._clients: dict[int, wire.Connection] = {}  # fd -> conn
        self._close_lock = threading.Lock()
        self._poll = PollServer(listener, self._took, max_clients=_MAX_CLIENTS, tick=self._tick)
        self._thread = threading.Thread(target=self._main, name="shmshare-stats", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (from any other thread) and remove the socket and empty directories."""
        self._poll.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            # Stuck in a reporter: its fds are its own to close when it ends (a number closed
            # under it could be someone else's by then); the file goes now, and only now.
            self._poll.listener.disown()  # its late close() must not unlink a newer server's file
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return
        self._shut()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies; the parent keeps serving."""
        self._closed = True
        for conn in self._clients.values():
            conn.close()
        self._clients = {}
        self._poll.close()  # the creator's pid only removes the file

    def _shut(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for conn in list(self._clients.values()):
            conn.close()
        self._clients = {}
        self._poll.close()
        if self.dir is not None and os.getpid() == self._pid:
            for d in (self.dir, os.path.dirname(self.dir)):
                try:
                    os.rmdir(d)
                except OSError:  # others' sockets there, or gone already: theirs to remove
                    break

    # -- the thread -----------------------------------------------------------

    def _main(self) -> None:
        try:
            self._poll.run()
        except BaseException:  # noqa: BLE001, S110 -- never the process's trouble: the socket goes
            pass
        finally:
            self._shut()  # stopped, or broken: no socket left that nobody answers

    def _tick(self, now: float) -> float:
        if now >= self._next_tick:
            _registry.tick(now)
            self._next_tick = now + TICK
        return self._next_tick

    def _took(self, conn: wire.Connection) -> None:
        fd = conn.fileno()
        self._clients[fd] = conn
        self._poll.add(fd, lambda: self._serve(fd), wait=_CLIENT_WAIT, late=lambda: self._drop(fd))

    def _serve(self, fd: int) -> bool:
        conn = self._clients[fd]
        try:
            got = conn.recv_nowait()
            if got is None:
                return False  # its HELLO alone, so far
            header, fds = got
            for f in fds:
                f.close()
            if header.get("k") == REQUEST:
                conn.send(self._reply(), timeout=0)  # a fresh socket holds it, or the client goes
            else:
                conn.send({"k": "error", "w": f"unknown request {header.get('k')!r:.40}"}, timeout=0)
        except Exception:  # noqa: BLE001, S110 -- broken, gone, or not reading: dropped below
            pass
        self._drop(fd)
        return False

    def _drop(self, fd: int) -> None:
        conn = self._clients.pop(fd)
        self._poll.remove(fd)
        conn.close()

    def _reply(self) -> dict[str, Any]:
        got = _registry.reports()
        reply: dict[str, Any] = {
            "k": REPLY, "v": VERSION, "pid": os.getpid(), "tick_s": TICK,
            "uptime_s": round(time.monotonic() - self._born, 3),
            "pools": got.get("pools", []), "senders": got.get("senders", []),
            "owners": got.get("owners", []), "loaders": got.get("loaders", [])[:_MAX_LOADERS],
            "truncated": 0,
        }
        reply["totals"] = totals(reply)
        return _fit(reply)


def totals(reply: dict[str, Any]) -> dict[str, Any]:
    """Per pool kind: pools, bytes now and at peak, leases out and the oldest; and over all."""
    kinds: dict[str, dict[str, Any]] = {}
    kind_of: dict[int, str] = {}
    for p in reply["pools"]:
        if "kind" not in p:
            continue  # a report that failed
        kind_of[p["id"]] = p["kind"]
        t = kinds.setdefault(p["kind"], {"pools": 0, "reserved_bytes": 0, "allocated_bytes": 0,
                                         "peak_reserved_bytes": 0, "peak_allocated_bytes": 0,
                                         "leases_out": 0, "oldest_lease_s": None})
        t["pools"] += 1
        for key in ("reserved_bytes", "allocated_bytes", "peak_reserved_bytes", "peak_allocated_bytes"):
            t[key] += int(p.get(key) or 0)
    out = 0
    oldest: float | None = None
    for holder in reply["senders"] + reply["owners"]:
        n = int(holder.get("leases_out", holder.get("handles_out", 0)) or 0)
        age = holder.get("oldest_lease_s", holder.get("oldest_handle_s"))
        out += n
        oldest = age if age is not None and (oldest is None or age > oldest) else oldest
        kt = kinds.get(kind_of.get(holder.get("pool", -1), ""))
        if kt is not None:
            kt["leases_out"] += n
            if age is not None and (kt["oldest_lease_s"] is None or age > kt["oldest_lease_s"]):
                kt["oldest_lease_s"] = age
    return {"by_kind": kinds, "leases_out": out, "oldest_lease_s": oldest}


def _fit(reply: dict[str, Any]) -> dict[str, Any]:
    """Cut the longest list in half until the reply packs within the frame (totals stay whole)."""
    while len(msgpack.packb(reply, use_bin_type=True)) > _REPLY_BUDGET:
        key = max(("pools", "senders", "owners", "loaders"), key=lambda k: len(reply.get(k) or ()))
        n = len(reply[key])
        if n == 0:
            reply["pools"] = reply["senders"] = reply["owners"] = reply["loaders"] = []
            reply["totals"] = {}
            break
        reply[key] = reply[key][: n // 2]
        reply["truncated"] += n - n // 2
    return reply


# -- the directory and the socket ------------------------------------------------


def _make_dir() -> str:
    """The stats directory, made 0700 where missing; each part ours and closed to others."""
    base, parts = _layout()[0]
    d = base
    for name in parts:
        d = os.path.join(d, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{d!r} is not a directory of uid {os.getuid()} closed to "
                                  f"others (mode {stat.filemode(st.st_mode)}, uid {st.st_uid}): "
                                  "remove it, or set XDG_RUNTIME_DIR")
    return d


def _listen(d: str | None, path: str | None) -> wire.Listener:
    """A Listener on `path`, or on ``<pid>.sock`` in `d` (``<pid>-<token>.sock`` if a live one of
    another pid namespace has that name)."""
    kw: dict[str, Any] = {"role": "stats", "allow_uids": (0,), "max_fds": 1}
    if path is not None:
        return wire.Listener(path, **kw)
    assert d is not None
    target = os.path.join(d, f"{os.getpid()}.sock")
    for attempt in range(4):
        try:
            return wire.Listener(target, **kw)
        except OSError as exc:
            if attempt == 3:
                raise
            if exc.errno == errno.EADDRINUSE:
                if _stale(target):
                    with contextlib.suppress(OSError):
                        os.unlink(target)  # a process of our pid that was killed: ours now
                else:  # a file, a directory, a live socket, one bound just now: not ours
                    target = os.path.join(d, f"{os.getpid()}-{secrets.token_hex(4)}.sock")
            elif exc.errno == errno.ENOENT:
                _make_dir()  # removed, empty, by a process that exited meanwhile
            else:
                raise
    raise AssertionError("unreachable")


def _sweep(d: str) -> int:
    """Remove the sockets in `d` that nobody listens on (processes killed); return how many."""
    n = 0
    try:
        names = [x for x in os.listdir(d) if _NAME.match(x)]
    except OSError:
        return 0
    for name in names:
        p = os.path.join(d, name)
        try:
            if _stale(p):
                os.unlink(p)
                n += 1
        except OSError:
            continue  # another server swept it first
    return n


def _stale(path: str) -> bool:
    """Whether `path` is a socket of ours, older than _YOUNG, that nobody listens on: the only
    thing at a stats socket's name that a server may remove (a killed process's)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid()
            and time.time() - st.st_mtime > _YOUNG and refused(path))


# -- process life ------------------------------------------------------------------

_server: _Server | None = None
_wanted = False  # this process serves (so its forked children do too)
_pending = False  # a forked child of a serving process, not serving yet: its first pool starts it
_lock = threading.Lock()
_exit_registered = False


def _autostart() -> None:
    """The first pool of a process with SHMSHARE_STATS set, or of a forked child of a serving
    process, starts the server (warning if it cannot)."""
    global _server, _pending
    if _server is not None:
        return
    if _pending:  # a forked child of a serving process: its parent swept the directory
        with _lock:
            if _server is None and _pending:
                _pending = False
                with contextlib.suppress(Exception):  # the child runs on, unseen by stat
                    _server = _Server(None, sweep=False)
        return
    if os.environ.get(ENV_VAR, "") in ("", "0"):
        return
    try:
        serve_stats()
    except Exception as exc:  # noqa: BLE001 -- a pool never fails for the stats socket's sake
        warnings.warn(f"{ENV_VAR} is set, but the stats socket did not start: {exc}",
                      RuntimeWarning, stacklevel=4)


def _at_exit() -> None:
    server = _server
    if server is not None and server._pid == os.getpid():
        server.close()


def _register_exit() -> None:
    """At exit, and in multiprocessing's children (which leave through os._exit), its finalizers."""
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True
    from multiprocessing import util

    atexit.register(_at_exit)
    util.Finalize(None, _at_exit, exitpriority=-30)
    # multiprocessing clears the finalizers in its children: put ours back there
    util.register_after_fork(_at_exit, lambda _: util.Finalize(None, _at_exit, exitpriority=-30))


def _after_fork_in_child() -> None:
    # Nothing is bound here: a child that execs (subprocess's preexec_fn) or leaves by os._exit
    # would leave its <pid>.sock behind. One that serves starts when it first makes a pool (or
    # asks stats_socket()): _autostart, armed again below.
    global _server, _lock, _pending
    _lock = threading.Lock()
    _pending = _wanted
    server, _server = _server, None
    if server is not None and server._pid != os.getpid():
        with contextlib.suppress(Exception):
            server.forget_in_child()
    _registry.rearm()


_registry.set_autostart(_autostart)
_fork.on_fork_in_child(2, _after_fork_in_child)
