"""The one way releases go back: a borrower's flusher thread, under the channel's receiver, the
multiprocessing client and the store's client.

Note [One release path]
    A received view's last reference dies at any bytecode of any thread
    (the garbage collector runs its Lease callback). So the callback only
    appends to its service's queue and, unless the flusher is armed, arms
    it with one byte on a :class:`WakePipe` (:meth:`Waker.poke`); it takes
    no lock. The flusher, one thread per borrower, sleeps in ``poll()`` on
    the pipe and wakes every IDLE s for its service's idle work (the store
    reads the drop frames of an idle client; the multiprocessing client
    lets go of the links of owners gone). Armed, it waits MAX_AGE -- a
    request or a ``recv()`` may carry the releases sooner -- and flushes;
    while releases keep coming it flushes every MAX_AGE with no poke, no
    pipe read and no ``poll()`` for them; while a lender does not read (its
    socket full) it looks less often, doubling up to STUCK_MAX_AGE, and
    batches more. It disarms first, then looks at the queue again: a
    release racing with it re-arms (and an idle look that finds releases
    queued flushes them: a lost wake-up costs a second, never the releases).
    It ends when its borrower is collected
    or says it is done, and closes the pipe then. An error in a flush is
    said once, as a RuntimeWarning, and the flusher goes on: a dead flusher
    would strand every release after it.

    The services say what a flush is (:class:`Host`); the pacing, the
    arming and the thread's life are here once.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Protocol

from .wake import WakePipe

__all__ = ["MAX_AGE", "STUCK_MAX_AGE", "IDLE", "Waker", "Host", "start_flusher"]

MAX_AGE = 0.002  # s a release may wait before it is sent
STUCK_MAX_AGE = 0.1  # s: the flusher's longest pause while a lender's socket stays full
IDLE = 1.0  # s between an idle flusher's looks (its service's idle work)


class Waker:
    """The flusher's wake-up: its pipe, and whether it is armed (awake, and will look again)."""

    __slots__ = ("wake", "armed")

    def __init__(self) -> None:
        self.wake = WakePipe()
        self.armed = False

    def poke(self) -> None:
        """Arm the flusher unless it is (from a Lease callback: any bytecode, no lock)."""
        if not self.armed:
            self.armed = True
            self.wake.poke()


class Host(Protocol):
    """What a borrower tells its flusher (Note [One release path])."""

    def _flusher_flush(self) -> bool | None:
        """Send what is queued; False if a lender's socket was full (some stay queued); None
        if there was no need now (sent by another path just before: the pace stays)."""

    def _flusher_pending(self) -> bool:
        """Whether releases are queued still."""

    def _flusher_idle(self) -> None:
        """The service's work after IDLE s with no release."""

    def _flusher_done(self) -> bool:
        """Whether the flusher ends now (after a flush): the borrower closed for good."""


def start_flusher(host: Host, waker: Waker, name: str) -> threading.Thread:
    """Start `host`'s flusher thread, which holds `host` weakly while it waits."""
    thread = threading.Thread(target=_main, args=(weakref.ref(host), waker), name=name, daemon=True)
    thread.start()
    return thread


def _main(ref: Callable[[], Host | None], waker: Waker) -> None:
    wake = waker.wake
    poller = select.poll()
    poller.register(wake.r, select.POLLIN)  # closed by this thread only, at its end
    said = [False]
    try:
        while True:
            ready = poller.poll(IDLE * 1000)
            host = ref()
            if host is None:
                return  # collected unclosed: the pipe is ours to close
            if ready:
                _drain(wake)
            elif _call(host._flusher_idle, said) or _call(host._flusher_done, said):
                return
            # woken, or releases queued with no wake-up come (a second late, never lost)
            if (ready or _call(host._flusher_pending, said)) and _armed(host, waker, said):
                return
            del host
    finally:
        wake.close()


def _armed(host: Host, waker: Waker, said: list[bool]) -> bool:
    """Flush every MAX_AGE (backing off while stuck) until the queue stays empty; True: done."""
    pause = MAX_AGE
    while True:
        time.sleep(pause)
        sent = _call(host._flusher_flush, said, default=False, keep_none=True)
        if sent is not None:  # a lender that does not read: look less often (and batch more)
            pause = MAX_AGE if sent else min(2 * pause, STUCK_MAX_AGE)
        if _call(host._flusher_done, said):
            return True
        waker.armed = False  # disarm first, then look: a release racing with us re-arms
        if not _call(host._flusher_pending, said):
            return False
        waker.armed = True


def _call(fn: Callable[[], bool | None], said: list[bool], default: bool = False,
          keep_none: bool = False) -> bool | None:
    try:
        got = fn()
        return None if got is None and keep_none else bool(got)
    except Exception as exc:  # noqa: BLE001  (said once, then on: a dead flusher strands releases)
        if not said[0]:
            said[0] = True
            with contextlib.suppress(Exception):  # warnings as errors must not end the thread
                warnings.warn(f"shmshare's release flusher: {exc!r}; it goes on", RuntimeWarning,
                              stacklevel=1)
        time.sleep(STUCK_MAX_AGE)
        return default


def _drain(wake: WakePipe) -> None:
    try:
        while os.read(wake.r, 4096):
            pass
    except OSError:  # empty (EAGAIN)
        pass
