"""The way back of releases: a received array's last view dying, to a release frame.

Note [Releases]
    Each received array holds a ``_native.Lease`` whose callback runs when
    the array's last view dies -- at any bytecode of any thread (the garbage
    collector). The callback only appends ``(peer, lease)`` to a deque and,
    if the flusher is not armed, arms it with one byte on a wake-up pipe; it
    takes no lock. Releases go back in one frame per sender, from two places:
    ``recv`` sends them when enough have gathered (``_receiver._BATCH`` of them, or
    ``_BATCH_BYTES`` of pool memory) or the last batch is older
    than ``MAX_AGE``; the flusher thread, once armed, wakes every
    ``MAX_AGE`` and sends what ``recv`` left (a consumer that stopped
    calling ``recv``), and disarms when the queue is empty. So a sender
    blocked on a full pool never waits on releases that sit here for more
    than about ``MAX_AGE``, and a busy consumer pays one small frame per
    batch, not per array, with the flusher waking at most 1/MAX_AGE times
    a second.
"""

from __future__ import annotations

import os
import select
import time
import weakref
from typing import TYPE_CHECKING

from .. import _fork
from .._plane import WakePipe

if TYPE_CHECKING:
    from ._books import Peer
    from ._receiver import Receiver

__all__ = ["MAX_AGE", "Release", "flusher_main", "current_pid"]

MAX_AGE = 0.002  # s a release may wait before it is sent
_STUCK_MAX_AGE = 0.1  # s: the flusher's longest pause while a sender's socket stays full
_pid = os.getpid()  # releases are sent only by the process that received the arrays


class Release:
    """on_release of one received array: queue its lease id (see Note [Releases])."""

    __slots__ = ("rx", "peer", "lease", "pid", "nbytes")

    def __init__(self, rx: Receiver, peer: Peer, lease: int, nbytes: int) -> None:
        self.rx, self.peer, self.lease, self.pid, self.nbytes = rx, peer, lease, _pid, nbytes

    def __call__(self) -> None:
        if self.pid != _pid:
            return  # an array inherited by a forked child: the lease is its parent's
        rx = self.rx
        rx._released.append((self.peer, self.lease))
        rx._released_bytes += self.nbytes  # a hint for recv() (a race only blurs it)
        if not rx._armed:
            rx._armed = True
            rx._wake.poke()


def flusher_main(ref: weakref.ref[Receiver], wake: WakePipe) -> None:
    """The flusher thread: send what recv() left behind (Note [Releases])."""
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
            if time.monotonic() - rx._last_flush >= MAX_AGE:
                # a sender that does not read: look less often (and batch more) until it does
                pause = MAX_AGE if rx._flush() else min(2 * pause, _STUCK_MAX_AGE)
            rx._armed = False  # disarm first, then look: a release racing with us re-arms
            if rx._released:
                rx._armed = True
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
