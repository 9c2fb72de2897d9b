"""The way back of releases: a received array's last view dying, to a release frame.

Note [Releases]
    Each received array holds a ``_native.Lease`` whose callback runs when
    the array's last view dies -- at any bytecode of any thread (the garbage
    collector). The callback only appends ``(peer, lease)`` to a deque and,
    if the flusher is not armed, arms it with one byte on a wake-up pipe; it
    takes no lock. Releases go back in one frame per sender, from two places:
    ``recv`` sends them when enough have gathered (``BATCH`` of them, or
    ``BATCH_BYTES`` of pool memory) or the last batch is older
    than ``MAX_AGE``; the flusher thread (the plane's, Note [One release
    path]), once armed, wakes every ``MAX_AGE`` and sends what ``recv``
    left (a consumer that stopped calling ``recv``), and disarms when the
    queue is empty. So a sender
    blocked on a full pool never waits on releases that sit here for more
    than about ``MAX_AGE``, and a busy consumer pays one small frame per
    batch, not per array, with the flusher waking at most 1/MAX_AGE times
    a second.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _fork
from .._errors import PeerDied, ShmshareTimeout
from .._plane.flusher import MAX_AGE, Waker, start_flusher
from ._protocol import KIND, LEASES, RELEASE, RELEASE_CHUNK

if TYPE_CHECKING:
    from ._books import Peer
    from ._receiver import Receiver

__all__ = ["MAX_AGE", "BATCH", "BATCH_BYTES", "ReleaseQueue", "Release", "current_pid"]

BATCH = 64  # releases that make recv() send at once, ...
BATCH_BYTES = 1 << 20  # ... or bytes released: a sender's pool should not grow by a batch of them
_pid = os.getpid()  # releases are sent only by the process that received the arrays


class ReleaseQueue(Waker):
    """The releases a receiver owes its senders, its flusher's wake-up and thread (the host of
    the plane's flusher: Note [One release path])."""

    def __init__(self) -> None:
        super().__init__()
        self.items: collections.deque[tuple[Peer, int]] = collections.deque()  # (sender, lease)
        self.nbytes = 0  # about how many bytes the queued releases give back (a hint)
        self.last_flush = 0.0
        self.lock = threading.Lock()  # one flush at a time
        self.thread: threading.Thread | None = None
        self.rx: Callable[[], Receiver | None] = lambda: None

    def add(self, peer: Peer, lease: int, nbytes: int) -> None:
        """Queue one release (from a Lease callback: any bytecode, so no lock)."""
        self.items.append((peer, lease))
        self.nbytes += nbytes  # a race only blurs the hint
        self.poke()

    def due(self) -> bool:
        """Whether recv() sends now: enough gathered, or the oldest is MAX_AGE old."""
        return (len(self.items) >= BATCH or self.nbytes >= BATCH_BYTES
                or time.monotonic() - self.last_flush > MAX_AGE)

    def start(self, rx: Receiver) -> None:
        """Start the flusher (at the first batch received); it holds this queue weakly, and
        this queue the receiver."""
        if self.thread is None:
            self.rx = weakref.ref(rx)
            self.thread = start_flusher(self, self, "shmshare-releases")

    # -- the flusher's host (Note [One release path]) -----------------------------------------

    def _flusher_flush(self) -> bool | None:
        rx = self.rx()
        if rx is None or rx._closed:
            return True
        if time.monotonic() - self.last_flush < MAX_AGE:
            return None  # recv() flushed just now: the pace stays (backed off, if it was)
        return self.flush(rx._peers)

    def _flusher_pending(self) -> bool:
        return bool(self.items)

    def _flusher_idle(self) -> None:
        pass  # a receiver's releases all come by the pipe

    def _flusher_done(self) -> bool:
        rx = self.rx()
        return rx is None or rx._closed

    def flush(self, peers: list[Peer]) -> bool:
        """Send every queued release, one frame per sender (a sender not in `peers` is gone).

        Return False when a sender's socket was full: its releases stay queued
        for the next flush (never dropped: its pool would never get them back).
        """
        stuck = False
        with self.lock:
            self.last_flush = time.monotonic()
            q = self.items
            self.nbytes = 0
            if not q:
                return True
            by_peer: dict[Peer, list[int]] = {}
            while q:
                peer, lease = q.popleft()
                by_peer.setdefault(peer, []).append(lease)
            for peer, ids in by_peer.items():
                if peer not in peers:
                    continue  # its sender is gone: it took all its leases back
                # 9 bytes an id: a frame that fits a ring slot stays off the socket (Note [Rings])
                chunk = min(RELEASE_CHUNK, (peer.conn.frame_room() - 16) // 9)
                for i in range(0, len(ids), chunk):
                    try:  # never wait: a sender stuck on a full socket must not stall recv()
                        peer.conn.send({KIND: RELEASE, LEASES: ids[i:i + chunk]}, timeout=0)
                    except ShmshareTimeout:  # first: it is an OSError too
                        q.extend((peer, x) for x in ids[i:])  # its socket is full: next time
                        stuck = True
                        break
                    except (PeerDied, OSError, ValueError):
                        break  # it died: recv() reports that; its leases are void
        return not stuck


class Release:
    """on_release of one received array: queue its lease id (see Note [Releases]) in `q` (the
    receiver's ReleaseQueue, or a pinned receiver's Fences)."""

    __slots__ = ("q", "peer", "lease", "pid", "nbytes")

    def __init__(self, q: Any, peer: Peer, lease: int, nbytes: int) -> None:
        self.q, self.peer, self.lease, self.pid, self.nbytes = q, peer, lease, _pid, nbytes

    def __call__(self) -> None:
        if self.pid != _pid:
            return  # an array inherited by a forked child: the lease is its parent's
        q = self.q
        if type(q) is not ReleaseQueue:
            q.add(self.peer, self.lease, self.nbytes)
            return
        # ReleaseQueue.add, inlined: this runs once per array received
        q.items.append((self.peer, self.lease))
        q.nbytes += self.nbytes  # a race only blurs the hint
        if not q.armed:
            q.poke()


def current_pid() -> int:
    """This process's pid, as the releases know it (kept right across forks)."""
    return _pid


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


_fork.on_fork_in_child(5, _after_fork)
