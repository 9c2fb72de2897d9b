"""Finding the host's store daemons, and asking each what it holds (for ``shmshare stat``).

A daemon is a process whose command line runs ``shmshare serve``; its socket
is found from /proc, not guessed: the inode of each socket fd it holds,
looked up in ``/proc/net/unix``, gives the path it listens on. So a daemon
on any ``--socket`` is found, and a stale socket file is not taken for one.
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import ShmshareError
from ._client import Store

__all__ = ["find_daemons", "describe"]


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
    out: dict[int, str] = {}
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                parts = line.split()
                # Num RefCount Protocol Flags Type St Inode [Path]; Flags 00010000 = __SO_ACCEPTCON
                if len(parts) >= 8 and int(parts[3], 16) & 0x10000:
                    out[int(parts[6])] = parts[7]
    except (OSError, ValueError, StopIteration):
        pass
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


def describe(path: str, timeout: float = 1.0) -> dict[str, Any]:
    """What the daemon at `path` holds: its figures and its objects (or why not)."""
    try:
        with Store(path, timeout=timeout) as store:
            stats = store.stats()
            objects = [{"name": o.name, "size": o.size, "sealed": o.sealed, "refs": o.refs,
                        "holders": o.holders, "age": o.age, "kind": o.kind,
                        "write_seal": o.write_seal} for o in store.list()]
    except (ShmshareError, OSError) as exc:
        return {"path": path, "error": str(exc)}
    stats["connected"] -= 1  # not counting the connection that asked
    return {"path": path, "stats": stats, "objects": objects}
