"""What this process's pools and lease holders say about themselves, for the stats socket.

Note [Reporters]
    Every pool (``CachingAllocator``, ``CachingHostAllocator``), every
    channel sender and the multiprocessing owner registers here once, when
    it is made, with a *reporter*: a callable that turns the object into a
    small JSON-able dict. The object is held by weak reference only, so
    registering keeps nothing alive, and nothing is done per malloc, send or
    lease: the books are read only when someone asks (``_statsd.py``, on
    ``SHMSHARE_STATS=1`` or ``serve_stats()``). A reporter may also have a
    ``tick(obj, now)`` method, which the stats thread calls about twice a
    second while it runs, to note what the books cannot tell later (when a
    lease was made: ``channel/_report.py``).

    Reporters run on the stats thread, beside the threads that use the
    objects, and take none of their locks: a process whose pool lock is
    held for long (a sender waiting for room) still answers. They read
    plain ints, and copy a dict with ``list()`` (one C call, no bytecode in
    between, so no other thread runs meanwhile) before walking it. A figure
    can therefore be off by what one call in flight changes, never torn
    beyond that. This module is rank 0 and imports nothing of shmshare: the
    server above reads it, and nothing here calls up.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["register", "reports", "tick", "set_autostart", "rearm", "entries"]

Reporter = Callable[[Any], dict[str, Any] | None]  # None: nothing to say (closed, inherited)

# id(obj) -> (group, weak reference, reporter); registering an object again replaces its entry
_entries: dict[int, tuple[str, weakref.ref[Any], Reporter]] = {}
_autostart: Callable[[], None] | None = None
_armed = False  # the autostart hook ran in this process


def register(group: str, obj: Any, reporter: Reporter) -> None:
    """Report `obj` under `group` ("pools", "senders", "owners") with `reporter`, while it lives."""
    global _armed
    key = id(obj)

    def gone(ref: weakref.ref[Any], key: int = key) -> None:
        got = _entries.get(key)
        if got is not None and got[1] is ref:  # not a newer object that took the same id
            del _entries[key]

    _entries[key] = (group, weakref.ref(obj, gone), reporter)
    if not _armed and _autostart is not None:
        _armed = True
        try:
            _autostart()
        except Exception:  # noqa: BLE001, S110 -- making a pool never fails because of the stats socket
            pass


def entries() -> list[tuple[str, Any, Reporter]]:
    """(group, object, reporter) of every registered object still alive."""
    out = []
    for group, ref, reporter in list(_entries.values()):
        obj = ref()
        if obj is not None:
            out.append((group, obj, reporter))
    return out


def reports() -> dict[str, list[dict[str, Any]]]:
    """Every live object's report, by group; a reporter that fails says why instead."""
    out: dict[str, list[dict[str, Any]]] = {}
    for group, obj, reporter in entries():
        try:
            got = reporter(obj)
        except Exception as exc:  # noqa: BLE001 -- one broken report must not hide the others
            got = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        if got is not None:
            out.setdefault(group, []).append(got)
    return out


def tick(now: float) -> None:
    """Let each reporter that keeps notes of its own take them (the stats thread, ~2/s)."""
    for _, obj, reporter in entries():
        note = getattr(reporter, "tick", None)
        if note is not None:
            try:
                note(obj, now)
            except Exception:  # noqa: BLE001, S110 -- a note missed is a figure less precise, no more
                pass


def rearm() -> None:
    """Call the autostart hook again at the next registration (in a forked child)."""
    global _armed
    _armed = False


def set_autostart(hook: Callable[[], None] | None) -> None:
    """Call `hook` once, at the first registration (the stats server's ``SHMSHARE_STATS``)."""
    global _autostart
    _autostart = hook

