"""The client's flusher: what a Store sends and reads when no request is in flight.

Releases of views that died (Note [A client's mappings]), notices that a created object's
writable mapping is gone, ``drop`` frames, and the replies of requests given up on (Note
[Replies owed]) all queue here; a thread per Store (the plane's flusher, Note [One release
path]) sends and reads them within milliseconds when the client is idle, and requests carry
them sooner when it is not.
"""

from __future__ import annotations

import collections
import os
import weakref
from typing import TYPE_CHECKING, Any

from .. import _fork
from .._errors import FdLimitError, PeerDied, ShmshareError
from .._fd import Fd

if TYPE_CHECKING:
    from ._client import Store

__all__ = ["Queued", "flush", "Flushing", "late", "late_lost"]

IDLE_POLL = 1.0  # s a flush waits for a request in flight to end
_pid = os.getpid()  # the process whose views queue releases (a forked child's do not)


class Queued:
    """on_release of a lease: queue `oid` for the flusher (any bytecode: no lock). A get's
    views going queue a release; a created object's writable mapping going, an unmapped."""

    __slots__ = ("store", "queue", "oid", "pid")

    def __init__(self, store: Store, queue: collections.deque[int], oid: int) -> None:
        self.store, self.queue, self.oid, self.pid = store, queue, oid, _pid

    def __call__(self) -> None:
        if self.pid != _pid:
            return  # a view a forked child inherited: the reference is its parent's
        self.queue.append(self.oid)
        self.store._waker.poke()


def flush(self: Store) -> None:
    """Send what waits (releases, unmapped notices), read drop frames and owed replies."""
    self._fastgets.take_back()  # counts held for forked children, once copied (no lock: waits)
    gone: list[Any] = []  # mappings to let go of, outside the lock
    try:
        _flush_locked(self, gone)
    finally:
        del gone  # unmapped here (unless a view still holds one)

def _drain_drops(self: Store, gone: list[Any]) -> None:
    """Forget the segments the daemon dropped; their roots go to `gone` (unmapped after)."""
    while self._drops:
        seg = self._drops.popleft()
        for segs in (self._segs, self._wsegs):
            root = segs.drop(seg)
            if root is not None:
                gone.append(root)


def _flush_locked(self: Store, gone: list[Any]) -> None:
    if not self._lock.acquire(timeout=IDLE_POLL):
        return
    try:
        if self._gone is not None:
            self._released.clear()
            self._unmapped.clear()
            _drain_drops(self, gone)  # (a drop read just before the end: its mapping goes too)
            return
        conn = self._conn
        if self._released:
            rel = {"k": "rel", "rl": self._take_released()}
            try:
                conn.send({"k": "rel", "o": rel["rl"]}, timeout=self.timeout)
            except BaseException:
                self._unsent(rel)  # a full socket: they go with the next flush
                raise
        while self._unmapped:
            oid = self._unmapped.popleft()
            try:
                conn.send({"k": "unmapped", "o": oid}, timeout=self.timeout)
            except BaseException:
                self._unmapped.appendleft(oid)  # the next flush tries again
                raise
        while conn.poll(0):
            try:
                got = conn.recv_nowait()
            except FdLimitError as exc:
                self._late_lost(exc)
                continue
            if got is None:
                break
            h, fds = got
            if h.get("k") == "drop":
                self._dropped(h.get("i"))
                for f in fds:
                    f.close()
            elif self._owed:
                self._owed -= 1
                self._late(h, fds)  # what a given-up request got is given back
            else:
                for f in fds:
                    f.close()
        _drain_drops(self, gone)
    except PeerDied as exc:
        self._died(exc)
    except (ShmshareError, OSError, ValueError):
        pass  # a full socket: the next flush tries again
    finally:
        self._lock.release()


class Flushing:
    """The host of a Store's flusher (Note [One release path] in ``_plane/flusher.py``): it
    holds the Store weakly, and the Store holds it; a Store collected unclosed takes it along,
    and the flusher then ends."""

    __slots__ = ("ref", "__weakref__")

    def __init__(self, store: Store) -> None:
        self.ref = weakref.ref(store)

    def _flusher_flush(self) -> bool:
        store = self.ref()
        if store is None:
            return True
        flush(store)
        return not (store._released or store._unmapped)  # else its socket was full

    def _flusher_pending(self) -> bool:
        store = self.ref()
        return store is not None and bool(store._released or store._unmapped or store._drops
                                          or store._fastgets.fork_holds)

    def _flusher_idle(self) -> None:
        store = self.ref()
        if store is not None:
            flush(store)  # the drop frames an idle client was sent

    def _flusher_done(self) -> bool:
        store = self.ref()
        return store is None or (store._closed and store._idle() and store._shutdown())


def late_lost(self: Store, exc: FdLimitError) -> None:
    """A frame read whose fds our table had no room for: what it stood for is undone."""
    lost: Any = getattr(exc, "header", None)
    if isinstance(lost, dict) and lost.get("k") == "drop":
        self._dropped(lost.get("i"))
    elif self._owed:
        self._owed -= 1
        if isinstance(lost, dict):
            self._late(lost, [])


def late(self: Store, h: dict[Any, Any], got: list[Fd]) -> None:
    """A reply of a request given up on (Note [Replies owed]): what it gave is given back."""
    for f in got:
        f.close()
    self._check_busy(h)
    self._waker.poke()  # what it gives back goes with the next flush
    drops = h.get("d")
    if isinstance(drops, list):
        for seg in drops:
            self._dropped(seg)
    if h.get("k") == "room" or (h.get("k") == "ok" and "off" in h):
        # a warm put's room, or a warm create (with its reference): given back
        oid, seg = h.get("o"), h.get("i")
        if type(oid) is int:
            if h.get("k") == "room":
                self._abandon(oid)
            else:
                self._out += 1
                self._released.append(oid)
        if "n" in h and type(seg) is int and seg not in self._wsegs:
            self._wforget.append(seg)
    if h.get("k") == "obj":
        oid = h.get("o")
        if type(oid) is int:
            self._out += 1
            self._released.append(oid)  # the reference the get took
        seg = h.get("i")
        # "n": the reply carried the segment's fd (which we did not map, or never got)
        if "n" in h and h.get("p") is not True and type(seg) is int and seg not in self._segs:
            self._forget.append(seg)  # not mapped: the daemon must send it again


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


_fork.on_fork_in_child(6, _after_fork_in_child)
