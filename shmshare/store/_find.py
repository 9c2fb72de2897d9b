"""Finding the host's store daemons, and asking each what it holds (for ``shmshare stat``).

A daemon is a process whose command line runs ``shmshare serve``; its socket
is found from /proc, not guessed: the inode of each socket fd it holds,
looked up in ``/proc/net/unix``, gives the path it listens on. So a daemon
on any ``--socket`` is found, and a stale socket file is not taken for one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._errors import ProtocolError, ShmshareError, ShmshareTimeout
from ._client import Store

__all__ = ["find_daemons", "describe", "LIST_MAX"]

LIST_MAX = 100_000  # objects listed from one daemon at most: one that pages forever stops here
_TEXT = 1000  # characters kept of a string the daemon says
# an entry of a list reply: [name, size, sealed, refs, age, kind, write_seal, holders]
_ENTRY: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("name", str), ("size", int), ("sealed", bool), ("refs", int), ("age", (int, float)),
    ("kind", str), ("write_seal", str), ("holders", int))


def _is_daemon(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    for i, a in enumerate(argv):
        if a == b"serve" and i > 0 and (argv[i - 1] == b"shmshare" or argv[i - 1].endswith(
                b"/shmshare")):
            return True
    return False


def _listening_paths() -> dict[int, str]:
    """inode -> path of every listening Unix socket bound to a path."""
    try:
        with open("/proc/net/unix", errors="replace") as f:
            return _parse_unix(f)
    except OSError:
        return {}


def _parse_unix(lines: Iterable[str]) -> dict[int, str]:
    """inode -> path of the listening sockets in the lines of /proc/net/unix (header first)."""
    out: dict[int, str] = {}
    it = iter(lines)
    next(it, None)
    for line in it:
        # Num RefCount Protocol Flags Type St Inode [Path]; Flags 00010000 = __SO_ACCEPTCON.
        # The path is the rest of the line (it may hold spaces).
        parts = line.rstrip("\n").split(None, 7)
        try:
            if len(parts) == 8 and int(parts[3], 16) & 0x10000:
                out[int(parts[6])] = parts[7]
        except ValueError:
            continue  # a line we cannot read says nothing of the others
    return out


def find_daemons(pids: list[int] | None = None) -> list[tuple[int, str]]:
    """(pid, socket path) of each store daemon of the host we may look at."""
    listening = _listening_paths()
    found: list[tuple[int, str]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if (pids is not None and pid not in pids) or not _is_daemon(pid):
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                path = listening.get(int(target[8:-1]))
                if path is not None and path.startswith("/"):
                    found.append((pid, path))
    return sorted(found)


def describe(path: str, timeout: float = 1.0, deadline: float | None = None,
             max_objects: int = LIST_MAX) -> dict[str, Any]:
    """What the daemon at `path` holds: its figures and its objects (or why not).

    Each request waits at most `timeout` s, and none past `deadline` (``time.monotonic()``).
    Listing stops there, or at `max_objects`, and ``"unlisted"`` then says why. The daemon is
    checked as hostile: whatever it answers, this returns, a failure as the entry's ``"error"``.
    """
    end = math.inf if deadline is None else deadline

    def wait() -> float:
        left = min(timeout, end - time.monotonic())
        if left <= 0:
            raise ShmshareTimeout(f"stat's time for the store daemons ran out before {path!r} answered")
        return left

    try:
        with Store(path, timeout=wait()) as store:
            store.timeout = wait()
            stats = _figures(store.stats())
            objects, unlisted = _list(store, wait, max_objects)
    except (ShmshareError, OSError) as exc:
        return {"path": path, "error": str(exc)[:_TEXT] or type(exc).__name__}
    except Exception as exc:  # noqa: BLE001 -- a malformed answer: this daemon's entry says so
        return {"path": path, "error": f"a malformed answer ({type(exc).__name__}: {exc})"[:_TEXT]}
    if isinstance(stats.get("connected"), int):
        stats["connected"] -= 1  # not counting the connection that asked
    out: dict[str, Any] = {"path": path, "stats": stats, "objects": objects}
    if unlisted:
        out["unlisted"] = unlisted
    return out


def _list(store: Store, wait: Callable[[], float], most: int) -> tuple[list[dict[str, Any]], str]:
    """The daemon's objects, a page at a time: at most `most`, and none past the deadline
    (``wait`` raises then); and why the listing stopped early ("" if it did not)."""
    objects: list[dict[str, Any]] = []
    after: str | None = None
    while len(objects) < most:
        try:
            store.timeout = wait()
        except ShmshareTimeout:
            return objects, "stat's time ran out"
        h, _ = store._call({"k": "list", "a": after})
        page = h["l"]
        if not isinstance(page, list):
            raise ProtocolError(f"a list reply's entries are a {type(page).__name__}")
        for entry in page[: most - len(objects)]:
            objects.append(_entry(entry))
        if not h.get("more") or not page:
            return objects, ""
        last = objects[-1]["name"]
        if after is not None and last <= after:
            raise ProtocolError(f"the daemon paged back, from {after!r:.80} to {last!r:.80}")
        after = last
    return objects, f"more than {most} objects"


def _entry(entry: Any) -> dict[str, Any]:
    """One object of a list reply, its fields checked to be what they should."""
    if not isinstance(entry, list) or len(entry) != len(_ENTRY):
        raise ProtocolError(f"a list entry is {entry!r:.120}")
    out: dict[str, Any] = {}
    for (key, kind), value in zip(_ENTRY, entry, strict=True):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ProtocolError(f"a list entry's {key} is {value!r:.80}")
        out[key] = value[:_TEXT] if isinstance(value, str) else value
    if not out["size"]:
        out["kind"] = "empty"
    return out


def _figures(stats: dict[str, Any]) -> dict[str, Any]:
    """The daemon's figures, keeping only plain ones (numbers, short strings, None)."""
    out: dict[str, Any] = {}
    for key, value in list(stats.items())[:256]:
        if not isinstance(key, str):
            continue
        if isinstance(value, str):
            value = value[:_TEXT]
        elif isinstance(value, float) and not math.isfinite(value):
            value = None
        elif value is not None and not isinstance(value, (bool, int, float)):
            raise ProtocolError(f"the daemon's figure {key!r:.80} is a {type(value).__name__}")
        out[key[:_TEXT]] = value
    return out
