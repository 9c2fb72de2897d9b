"""What the store's daemon and its clients say to each other, and where they meet.

Note [The store's frames]
    One msgpack header per frame on a ``wire`` connection (never a pickle);
    the key ``"k"`` names the kind. A client sends a request and reads its
    reply before the next one (one connection, requests in order), except
    the one-way frames ``rel`` and ``unmapped``, which the daemon never
    answers. The daemon's only unsolicited frame is ``drop``: a segment the
    client maps is gone from the store, so the client may unmap it.

    =========  ===========================================  =================
    request    header (and fds)                             reply
    =========  ===========================================  =================
    room       n name, s size (>= LARGE), r replace         room: o id, i segment, off
                                                            (+ its read-write fd, n size,
                                                            the first time)
    put        n name, m meta, s size, t torch?, r replace  ok
               + o: the room it filled (a warm put), or
               the object's memfd (immutable), or
               st: bytes staged (smaller)
    stage      s size + the client's staging memfd          ok
    create     n, m, s, t; w warm (>= LARGE: as room        ok: o id (warm: i, off, and
               replies), or + its memfd (immutable)         the fd as room's)
    seal       n (+ st when small)                          ok, ws write seal
    get        n name                                       obj: o id, i segment, off, s,
                                                            m meta, p private? (+ fd)
    wait       n name, t seconds (a second connection)      ok, or err
    del        n                                            ok
    info       n                                            info: the entry
    list       a after (name), c count                      list: l entries, more
    stats      --                                           stats: the daemon's figures
    rel        o: object ids, one per get let go of         (none)
    unmapped   o: an object whose creator unmapped it,      (none)
               or a room given up before its put
    =========  ===========================================  =================

    A connection past the daemon's client cap gets one ``err`` frame, ``e``
    ``busy``, unasked, and is closed: the client reads it as the reply to its
    request (or, if its send met the close first, from what is queued).

    An ``err`` reply carries ``e`` (a code below) and ``w`` (the text, with
    the fix). Meta is the :func:`shmshare.tensors.encode` bytes of the
    value with every array's descriptor relative to the object's first
    byte (segment 1), so a getter needs no more than (segment, offset) and
    the meta to rebuild it.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass
from typing import Any

from .. import wire
from .._errors import ShmshareError, ShmshareTimeout

__all__ = ["ObjectInfo", "LARGE", "MAX_META", "MAX_NAME", "StoreError", "StoreFull", "StoreGone", "ObjectExists",
           "BadRequest", "StoreBusy", "ObjectNotFound", "BUSY", "default_path", "check_name", "check_dir", "raise_for",
           "connect", "refusal", "remove_stale"]

LARGE = 1 << 20  # bytes from which a put is written by its client, into the pool or its own memfd
MAX_META = 96 * 1024  # bytes of a value's description (its arrays' descriptors, plain values)
MAX_NAME = 1024  # bytes of a name, UTF-8
ALIGN = 64  # each array of an object starts on a 64-byte boundary

# error codes of an "err" reply (BUSY: sent unasked at accept, before the daemon closes a
# connection past its client cap)
NOT_FOUND, NOT_SEALED, EXISTS, FULL, BAD, TIMEOUT, ABORTED, NOT_YOURS, BUSY = (
    "not_found", "not_sealed", "exists", "full", "bad", "timeout", "aborted", "not_yours", "busy")


class StoreError(ShmshareError):
    """The store refused a request, or could not be reached."""


class StoreFull(StoreError, MemoryError):
    """An object does not fit in the store's ``--limit`` (and nothing could be evicted)."""


class StoreGone(StoreError, ConnectionError):
    """The store daemon went away (exited or was killed); objects it held are gone too."""


class StoreBusy(StoreError):
    """The daemon is alive and serving as many clients as it takes: this connection was refused
    (its objects are intact; not a ``StoreGone``)."""


class BadRequest(StoreError, ValueError):
    """The daemon refused a request as malformed: its name, size, meta or fd (a ValueError, as
    a bad argument is)."""


class ObjectExists(StoreError, KeyError):
    """A put or create named an object the store already has."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ObjectInfo:
    """What the store says of one object (``info()``, ``list()``)."""

    name: str
    size: int  # bytes of its arrays (with 64-byte alignment between them)
    sealed: bool
    refs: int  # gets not given back yet, all clients together
    age: float  # seconds since it was put or created
    kind: str  # "arena" (the daemon's pool), "memfd" (its own, sealed against writes), "empty"
    write_seal: str  # "full" (F_SEAL_WRITE), "future" (F_SEAL_FUTURE_WRITE), "none"
    holders: int  # clients holding views of it

    @classmethod
    def _of(cls, entry: list[Any]) -> ObjectInfo:
        name, size, sealed, refs, age, kind, ws, holders = entry
        return cls(name, size, sealed, refs, age, kind if size else "empty", ws, holders)


def raise_for(code: str, text: str) -> None:
    """Raise the exception an ``err`` reply of `code` means."""
    if code in (NOT_FOUND, NOT_SEALED, ABORTED, NOT_YOURS):
        raise ObjectNotFound(text)
    if code == EXISTS:
        raise ObjectExists(text)
    if code == BUSY:
        raise StoreBusy(text)
    if code == FULL:
        raise StoreFull(text)
    if code == TIMEOUT:
        from .._errors import ShmshareTimeout

        raise ShmshareTimeout(text)
    if code == BAD:
        raise BadRequest(text)
    raise StoreError(text)


class ObjectNotFound(StoreError, KeyError):
    """No sealed object of that name (KeyError, as a dict says it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def check_name(name: object) -> str:
    """Return `name` if it is a store name (a non-empty str of at most MAX_NAME bytes)."""
    if not isinstance(name, str):
        raise TypeError(f"a store name is a str, got {type(name).__name__} {name!r:.80}")
    if not name:
        raise ValueError("a store name cannot be empty")
    try:
        n = len(name.encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"a store name must be valid UTF-8 (lone surrogates are not): {exc}") from exc
    if n > MAX_NAME:
        raise ValueError(f"a store name is at most {MAX_NAME} bytes of UTF-8, got {n}")
    return name


def default_path() -> str:
    """The per-user socket: ``$XDG_RUNTIME_DIR/shmshare/store.sock``, else
    ``/tmp/shmshare-<uid>/store.sock`` (``SHMSHARE_STORE`` overrides both)."""
    env = os.environ.get("SHMSHARE_STORE")
    if env:
        return os.path.abspath(env)  # as --socket: `serve --detach` binds after chdir("/")
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run and os.path.isabs(run) and _owned_dir(run):
        return os.path.join(run, "shmshare", "store.sock")
    return os.path.join("/tmp", f"shmshare-{os.getuid()}", "store.sock")


def _owned_dir(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def check_dir(sock_path: str) -> None:
    """Refuse the default socket's directory if another user owns it or it is not private
    (someone could stand in for the store there): it must be ours and 0700, or not exist yet.
    A path given on purpose (``--socket``, ``$SHMSHARE_STORE``) is the user's choice; the peer
    uid is checked on both ends anyway."""
    d = os.path.dirname(os.path.abspath(sock_path))
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{d!r}, the store socket's directory, is not a directory (a symlink or "
                         "a file): remove it, or choose another --socket")
    if st.st_uid != os.getuid():
        raise StoreError(f"{d!r}, the store socket's directory, belongs to uid {st.st_uid}, not "
                         f"to us (uid {os.getuid()}): someone else may stand in for the store "
                         "there; remove it, or choose another --socket")
    if st.st_mode & 0o077:
        raise StoreError(f"{d!r}, the store socket's directory, has mode "
                         f"{stat.S_IMODE(st.st_mode):04o}, not 0700, and the default one must be "
                         "private: `chmod 700` it, or name a socket of your choice (--socket, "
                         "$SHMSHARE_STORE)")


def connect(path: str, timeout: float | None, role: str,
            gone: type[StoreError] = StoreError) -> wire.Connection:
    """A connection to the daemon at `path`; a StoreError that tells a daemon that is there but
    does not accept (never the advice to start another) from no daemon at all (`gone`)."""
    try:
        return wire.connect(path, timeout=timeout, role=role)
    except ShmshareTimeout as exc:  # a listener is there: starting another would lose its objects
        raise StoreError(f"the store daemon at {path!r} is there but did not accept us within "
                         f"{timeout} s ({exc}); it is stopped or overloaded: look at it with "
                         "`shmshare stat`, or pass a longer timeout") from exc
    except (OSError, ShmshareError) as exc:
        kind = _not_a_socket(path)
        if kind is not None:
            raise StoreError(f"{path!r} is {kind}, not a store daemon's socket: pass the socket "
                             "`shmshare serve` listens on (it prints it; default: "
                             f"{default_path()!r})") from exc
        raise gone(f"no store daemon answers at {path!r} ({exc}); start one with `shmshare "
                   "serve` (or `shmshare serve --detach`)") from exc


def _not_a_socket(path: str) -> str | None:
    """What is at `path` if it is there and no socket ("a directory", "a regular file"), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else \
        "not a socket"


def refusal(conn: wire.Connection) -> str | None:
    """The daemon's refusal at its client cap, if one is queued on `conn` (read once the
    connection has ended: a send that met the daemon's close never read it)."""
    try:
        got = conn.recv_nowait()
    except (ShmshareError, OSError, ValueError):
        return None
    if got is None:
        return None
    h, fds = got
    for f in fds:
        f.close()
    return str(h.get("w")) if h.get("k") == "err" and h.get("e") == BUSY else None


# Tracebacks and reprs name the public module these are exported from, not this private one.
for _cls in (StoreError, StoreFull, StoreGone, StoreBusy, BadRequest, ObjectExists, ObjectNotFound):
    _cls.__module__ = "shmshare.store"
del _cls


def socket_path(path: Any) -> str:
    """The daemon's socket path a Store was given (None: the default one)."""
    if path is None:
        return default_path()
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"Store(path=...) takes the daemon's socket path (a str or an "
                        f"os.PathLike) or None for the default one, got {path!r}")
    return os.fspath(path)


def remove_stale(path: str) -> None:
    """Remove a socket file nobody listens on (a killed daemon's); refuse a live one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StoreError(f"{path!r} is there and is not a socket: choose another --socket (a "
                         "store never removes what is not its own)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.settimeout(1.0)
        s.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # a socket nobody listens on: a killed daemon's
        return
    except OSError:
        return  # not a socket, or not ours: the listener's own error says what it is
    finally:
        s.close()
    raise StoreError(f"a store daemon already listens on {path!r}: stop it first (or choose "
                     "another --socket)")
