"""The plane's release flusher (_plane/flusher.py, Note [One release path]): the one thread that
sends a borrower's releases, under the channel's receiver, the multiprocessing client and the
store's client. Driven here by a host of the test's own."""

from __future__ import annotations

import collections
import gc
import os
import threading
import warnings

import pytest

from shmshare._plane import flusher
from shmshare.testing import wait_exit, wait_until


class _Host:
    def __init__(self, waker: flusher.Waker) -> None:
        self.waker = waker
        self.queue: collections.deque[int] = collections.deque()
        self.sent: list[int] = []
        self.idle = 0
        self.done = False
        self.fail = 0  # flushes to fail with an error
        self.full = 0  # flushes that find the lender's socket full

    def release(self, item: int) -> None:  # what a Lease callback does
        self.queue.append(item)
        self.waker.poke()

    def _flusher_flush(self) -> bool:
        if self.fail:
            self.fail -= 1
            raise OSError("a flush that failed")
        if self.full:
            self.full -= 1
            return False
        while self.queue:
            self.sent.append(self.queue.popleft())
        return True

    def _flusher_pending(self) -> bool:
        return bool(self.queue)

    def _flusher_idle(self) -> None:
        self.idle += 1

    def _flusher_done(self) -> bool:
        return self.done


@pytest.fixture
def host():
    waker = flusher.Waker()
    h = _Host(waker)
    thread = flusher.start_flusher(h, waker, "test-flusher")
    yield h, thread
    h.done = True
    waker.wake.poke()
    thread.join(10)
    assert not thread.is_alive()


def test_releases_are_sent_and_the_flusher_disarms_once_the_queue_is_empty(host):
    h, _ = host
    for i in range(100):
        h.release(i)
    wait_until(lambda: h.sent == list(range(100)) and not h.waker.armed, "every release sent, "
               "the flusher disarmed", 10)


def test_a_full_socket_keeps_releases_queued_until_it_takes_them(host):
    h, _ = host
    h.full = 5
    h.release(1)
    wait_until(lambda: h.sent == [1], "the release sent once the socket took it", 10)


def test_an_error_in_a_flush_is_said_once_and_the_flusher_goes_on(host):
    h, thread = host
    h.fail = 3
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        h.release(7)
        wait_until(lambda: h.sent == [7], "the release sent after the failed flushes", 10)
    ours = [w for w in said if "release flusher" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning), [str(w.message) for w in said]
    assert "a flush that failed" in str(ours[0].message) and thread.is_alive()


def test_done_ends_the_thread_and_closes_its_pipe(host):
    h, thread = host
    h.release(1)
    wait_until(lambda: h.sent == [1], "sent", 10)
    h.done = True
    h.waker.wake.poke()
    thread.join(10)
    assert not thread.is_alive() and h.waker.wake.r < 0 and h.waker.wake.w < 0


def test_a_host_collected_unclosed_ends_its_flusher():
    waker = flusher.Waker()
    h = _Host(waker)
    thread = flusher.start_flusher(h, waker, "test-flusher")
    del h
    gc.collect()
    waker.wake.poke()
    thread.join(10)
    assert not thread.is_alive() and waker.wake.r < 0


def test_an_idle_flusher_does_its_hosts_idle_work(monkeypatch, host):
    h, _ = host
    monkeypatch.setattr(flusher, "IDLE", 0.01)
    h.waker.wake.poke()  # its poll() of IDLE s starts anew with the new value
    wait_until(lambda: h.idle >= 2, "the idle work done", 10)


def test_a_poke_while_another_thread_holds_the_pipes_lock_is_not_lost():
    """A poke on another thread holds the lock between its write and its release; the flusher
    reads that byte meanwhile; a second poke then came to a busy lock and gave up: the flusher
    slept with releases queued and armed set, for good (the multiprocessing client's releases
    stranded, 5 runs in 12 of eight threads pickling at once)."""
    pipe = flusher.Waker().wake
    try:
        pipe.lock.acquire()  # the first poke, descheduled after its write (read already)
        second = threading.Thread(target=pipe.poke)
        second.start()
        second.join(0.2)  # it waits for the lock (the old poke returned at once, writing nothing)
        pipe.lock.release()
        second.join(10)
        assert not second.is_alive()
        assert os.read(pipe.r, 16) == b"\0", "the second poke's byte"
    finally:
        pipe.close()


def test_a_poke_from_a_finalizer_inside_a_poke_on_the_same_thread_does_not_deadlock():
    pipe = flusher.Waker().wake
    try:
        with pipe.lock:  # a poke or a close of this thread, interrupted by a Lease callback
            pipe.poke()
        assert os.read(pipe.r, 16) == b"\0"
    finally:
        pipe.close()


def test_a_fork_while_another_thread_holds_a_pipes_lock_leaves_the_child_a_lock_it_can_take():
    """A forked child inherits the lock as the fork found it: held by a thread of the parent that
    the child does not have, it would be held for good, and a finalizer's poke in the child
    would wait on it forever."""
    pipe = flusher.Waker().wake
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with pipe.lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: its poke must take the lock and write
            code = 1
            try:
                pipe.poke()
                code = 0
            finally:
                os._exit(code)
        assert wait_exit(pid, 30) == 0
    finally:
        release.set()
        t.join(30)
        pipe.close()


def test_releases_queued_with_no_wake_up_go_at_the_next_idle_look(monkeypatch, host):
    """Whatever loses a wake-up (a bug of a service's, a poke that failed) costs a second, not
    the releases: the idle look flushes what it finds queued."""
    h, _ = host
    monkeypatch.setattr(flusher, "IDLE", 0.01)
    h.waker.wake.poke()  # its poll() of IDLE s starts anew with the new value
    wait_until(lambda: h.idle >= 1, "an idle look", 10)
    h.queue.append(5)  # queued, never poked
    wait_until(lambda: h.sent == [5], "the release found at an idle look and sent", 10)
