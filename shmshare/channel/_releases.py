"""The way back of releases: a received array's last view dying, to a release frame.

Note [Releases]
    Each received array holds a ``_native.Lease`` whose callback runs when
    the array's last view dies -- at any bytecode of any thread (the garbage
    collector). The callback only appends ``(peer, lease)`` to a deque and,
    if the flusher is not armed, arms it with one byte on a wake-up pipe; it
    takes no lock. Releases go back in one frame per sender, from two places:
    ``recv`` sends them when enough have gathered (``BATCH`` of them, or
    ``BATCH_BYTES`` of pool memory) or the last batch is older
    than ``MAX_AGE``; the flusher thread, once armed, wakes every
    ``MAX_AGE`` and sends what ``recv`` left (a consumer that stopped
    calling ``recv``), and disarms when the queue is empty. So a sender
    blocked on a full pool never waits on releases that sit here for more
    than about ``MAX_AGE``, and a busy consumer pays one small frame per
    batch, not per array, with the flusher waking at most 1/MAX_AGE times
    a second.
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .. import _fork
from .._errors import PeerDied, ShmshareTimeout
from .._plane import WakePipe
from ._protocol import KIND, LEASES, RELEASE, RELEASE_CHUNK

if TYPE_CHECKING:
    from ._books import Peer
    from ._receiver import Receiver

__all__ = ["MAX_AGE", "BATCH", "BATCH_BYTES", "ReleaseQueue", "Release", "flusher_main", "current_pid"]

MAX_AGE = 0.002  # s a release may wait before it is sent
BATCH = 64  # releases that make recv() send at once, ...
BATCH_BYTES = 1 << 20  # ... or bytes released: a sender's pool should not grow by a batch of them
_STUCK_MAX_AGE = 0.1  # s: the flusher's longest pause while a sender's socket stays full
_pid = os.getpid()  # releases are sent only by the process that received the arrays


class ReleaseQueue:
    """The releases a receiver owes its senders, its flusher's wake-up pipe and thread."""

    def __init__(self) -> None:
        self.items: collections.deque[tuple[Peer, int]] = collections.deque()  # (sender, lease)
        self.nbytes = 0  # about how many bytes the queued releases give back (a hint)
        self.wake = WakePipe()
        self.armed = False  # the flusher is awake and will look at the queue again
        self.last_flush = 0.0
        self.lock = threading.Lock()  # one flush at a time
        self.thread: threading.Thread | None = None

    def add(self, peer: Peer, lease: int, nbytes: int) -> None:
        """Queue one release (from a Lease callback: any bytecode, so no lock)."""
        self.items.append((peer, lease))
        self.nbytes += nbytes  # a race only blurs the hint
        if not self.armed:
            self.armed = True
            self.wake.poke()

    def due(self) -> bool:
        """Whether recv() sends now: enough gathered, or the oldest is MAX_AGE old."""
        return (len(self.items) >= BATCH or self.nbytes >= BATCH_BYTES
                or time.monotonic() - self.last_flush > MAX_AGE)

    def start(self, rx: Receiver) -> None:
        """Start the flusher (at the first batch received)."""
        if self.thread is None:
            self.thread = threading.Thread(target=flusher_main, args=(weakref.ref(rx), self),
                                           name="shmshare-releases", daemon=True)
            self.thread.start()

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
        self.q.add(self.peer, self.lease, self.nbytes)


def flusher_main(ref: weakref.ref[Receiver], q: ReleaseQueue) -> None:
    """The flusher thread: send what recv() left behind (Note [Releases])."""
    wake = q.wake
    wake_r = wake.r  # the receiver closes the pipe only after this thread has returned
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    while True:
        poller.poll(1000)  # disarmed: sleep until a release arms us (or a second passes)
        rx = ref()
        if rx is None or rx._closed:
            wake.close()  # a finalized receiver leaves its pipe to us; close() joined us first
            return
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        pause = MAX_AGE
        while True:  # armed: look every MAX_AGE until the queue stays empty
            time.sleep(pause)
            if rx._closed:
                wake.close()
                return
            if time.monotonic() - q.last_flush >= MAX_AGE:
                # a sender that does not read: look less often (and batch more) until it does
                pause = MAX_AGE if q.flush(rx._peers) else min(2 * pause, _STUCK_MAX_AGE)
            q.armed = False  # disarm first, then look: a release racing with us re-arms
            if q.items:
                q.armed = True
                continue
            break
        del rx


def current_pid() -> int:
    """This process's pid, as the releases know it (kept right across forks)."""
    return _pid


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


_fork.on_fork_in_child(5, _after_fork)
