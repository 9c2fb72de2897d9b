"""A wake-up pipe that a finalizer may poke: one byte, never blocking, never after close.

A release of a borrowed array can happen in a Lease callback, at any bytecode
of any thread (the garbage collector); the thread that sends releases sleeps
on this pipe. The channel's receiver, the multiprocessing link and the store
client each hold one (Note [Releases] in ``channel/_releases.py``).
"""

from __future__ import annotations

import os
import threading
import weakref

from .. import _fork
from .._errors import making_fds
from .._lifetime import Closeable

__all__ = ["WakePipe"]


class WakePipe(Closeable):
    """The flusher's wake-up pipe.

    ``poke`` runs in Lease callbacks, at any bytecode (the garbage collector):
    its lock is reentrant, so a poke (or a ``close``) interrupted by another
    poke on the same thread never deadlocks, and it never writes after
    ``close`` -- into a fd number that may belong to someone else by then.
    It waits for the lock held by another thread (only ever for a write or
    for ``close``'s swap of the fds): a poke that gave up when the lock was
    busy lost its wake-up whenever the holder's byte had been read already
    (a poke on another thread descheduled between its write and its
    release; releases of the multiprocessing client stranded for good).
    """

    __slots__ = ("r", "w", "lock", "__weakref__")

    def __init__(self) -> None:
        self.r, self.w = making_fds("pipe2", os.pipe2, os.O_NONBLOCK | os.O_CLOEXEC)
        self.lock = threading.RLock()
        _pipes.add(self)

    def poke(self) -> None:
        """Write one byte, unless the pipe is closed."""
        with self.lock:
            try:
                if self.w >= 0:
                    os.write(self.w, b"\0")
            except OSError:  # full: the flusher has bytes to read anyway
                pass

    def close(self) -> None:
        """Close both ends. Idempotent."""
        with self.lock:
            r, w, self.r, self.w = self.r, self.w, -1, -1  # forget first: never close twice
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)


_pipes: weakref.WeakSet[WakePipe] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """Each pipe's lock anew: one held by another thread of the parent at the fork would be
    held for good in the child, and a finalizer's poke there would wait on it forever."""
    for pipe in list(_pipes):
        pipe.lock = threading.RLock()


_fork.on_fork_in_child(4, _after_fork_in_child)
