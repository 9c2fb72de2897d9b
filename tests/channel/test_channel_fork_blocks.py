"""A sender that forks while arrays from empty() are alive: the child maps those blocks through
its copy of the parent's mapping, so the parent must not hand them out again while the child lives
(Note [Blocks a child inherits], _plane/forks.py); and a dtype of 0 bytes an item is widened as
numpy's own empty() widens it, never sent as a batch the receiver must refuse.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from shmshare import channel
from shmshare.testing import kill, pattern, wait_exit

N = 1 << 14
WAIT = 30.0


def test_a_block_a_forked_child_still_maps_is_not_reused_until_the_child_is_gone():
    tx, rx = channel(limit=64 << 20)
    r, w = os.pipe()
    pid = 0
    try:
        warm = tx.empty(N, np.uint32)
        tx.send(warm, timeout=WAIT)
        del warm
        rx.recv(timeout=WAIT)
        a = tx.empty(N, np.uint32)
        a[:] = pattern(1, N)
        inherited = a.__array_interface__["data"][0]
        pid = os.fork()
        if pid == 0:  # the child: wait, then write into the array it inherited (its own, to it)
            try:
                os.read(r, 1)
                a[:] = 0xDEAD
            finally:
                os._exit(0)
        del a
        gc.collect()
        b = tx.empty(N, np.uint32)
        assert b.__array_interface__["data"][0] != inherited  # retired while the child lives
        b[:] = pattern(2, N)
        tx.send(b, timeout=WAIT)
        got = rx.recv(timeout=WAIT)
        os.write(w, b"x")
        assert wait_exit(pid, WAIT) == 0
        pid = 0
        assert np.array_equal(got, pattern(2, N))  # the child's write went to its own block
        del got, b
    finally:
        if pid:
            kill(pid)
        os.close(r)
        os.close(w)
        tx.close()
        rx.close()


@pytest.mark.parametrize("dtype", ["S0", "U0", ">U0"])
def test_a_zero_byte_string_dtype_is_widened_as_numpy_widens_it(dtype):
    tx, rx = channel()
    with tx, rx:
        a = tx.empty(4, dtype)
        assert a.dtype == np.empty(4, dtype).dtype or a.dtype.itemsize == np.dtype(dtype.replace("0", "1")).itemsize
        a[:] = "x"
        tx.send(a, timeout=WAIT)
        got = rx.recv(timeout=WAIT)
        assert list(got) == list(a)
        tx.send(np.arange(3), timeout=WAIT)  # the channel is still up
        assert list(rx.recv(timeout=WAIT)) == [0, 1, 2]


def test_a_view_dying_while_the_process_forks_keeps_its_block_until_it_is_marked():
    # Found by review: a thread letting go of an array between a fork of another thread and the
    # parent's marking freed the block unmarked, and empty() handed it out again while the child
    # wrote into its copy (150-370 arrays of 56k overwritten in 20 forks). Fix: no local view's
    # block is freed from the first "before" hook to the end of the parent's handlers (_fork.forking).
    # The fork's two halves are called here as os.fork() calls them, the death in between.
    from shmshare import _fork

    tx, rx = channel(limit=64 << 20)
    try:
        a = tx.empty(N, np.uint32)
        inherited = a.__array_interface__["data"][0]
        _fork._before()
        try:
            del a  # dies "during the fork": queued, not freed
            gc.collect()
            b = tx.empty(N, np.uint32)
            assert b.__array_interface__["data"][0] != inherited
            assert tx._pool.held[inherited].local  # still held for the marking
        finally:
            _fork._run_in_parent()
        del b
        tx.empty(N, np.uint32)  # after the fork: taken in now (no child was made: back to the pool)
        assert inherited not in tx._pool.held or not tx._pool.held[inherited].local
    finally:
        tx.close()
        rx.close()


def test_a_producer_thread_never_reuses_a_block_a_child_forked_from_another_thread_maps():
    """The race itself: a producer thread sends from a window of live arrays while the main thread
    forks children that overwrite the arrays they inherited; no array sent after a fork may show
    a child's bytes (those sent just before it may: the child wrote into what it was sent)."""
    import threading

    tx, rx = channel(limit=64 << 20)
    window: list = []
    sent, stop, bad, forks = [0], threading.Event(), [], []

    def produce() -> None:
        n = 0
        while not stop.is_set():
            a = tx.empty(4096, np.uint8)
            a[:] = n % 200 + 3
            tx.send({"i": n, "a": a}, timeout=WAIT)
            window.append(a)
            del a
            if len(window) > 4:
                window.pop(0)
            n += 1
            sent[0] = n

    def consume() -> None:
        while not stop.is_set():
            try:
                d = rx.recv(timeout=0.2)
            except Exception:  # noqa: BLE001 - a timeout, or the end
                continue
            if d["a"][0] == 0xEE and not any(n0 - 8 <= d["i"] <= n0 + 8 for n0 in forks):
                bad.append(d["i"])

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    pids = []
    try:
        for _ in range(6):
            forks.append(sent[0])
            pid = os.fork()
            if pid == 0:  # the child: overwrite what it inherited for a while
                try:
                    mine = list(window)
                    for _ in range(2000):
                        for arr in mine:
                            arr[:] = 0xEE
                finally:
                    os._exit(0)
            pids.append(pid)
            wait_exit(pid, WAIT)
        stop.set()
        for t in threads:
            t.join(WAIT)
        assert not bad, f"arrays sent after a fork carried a child's bytes: {bad[:5]}"
    finally:
        stop.set()
        kill(*pids)
        window.clear()
        tx.close()
        rx.close()


def test_a_retired_block_past_the_pool_goes_back_to_its_overflow(monkeypatch):
    # Found by review: once the child was gone, a retired block of the overflow (on_overflow) was
    # freed into the pool's own allocator: ValueError ("this allocator has not allocated") from
    # every later send. Fix: LendingPool.free_block gives a block back to the overflow it came from.
    from shmshare import wire
    from shmshare._plane import forks
    from shmshare.channel import Receiver, Sender

    monkeypatch.setattr(forks, "_SWEEP", 0.0)  # look at retired blocks' children at every free
    a, b = wire.pipe()
    tx, rx = Sender(a, limit=4 << 20, on_overflow=lambda n: None), Receiver([b])
    r, w = os.pipe()
    pid = 0
    try:
        x = tx.empty(2 << 20, np.uint8)
        tx.send(x)
        del x
        first = rx.recv(timeout=WAIT)
        over = tx.empty(2 << 20, np.uint8, timeout=WAIT)  # past the pool: the first is still held
        assert tx._pool.overflow.owns(over.__array_interface__["data"][0])
        tx.send(over)
        del over
        second = rx.recv(timeout=WAIT)
        pid = os.fork()
        if pid == 0:  # the child maps the overflow's block until told to go
            try:
                os.read(r, 1)
            finally:
                os._exit(0)
        del second
        gc.collect()
        rx.flush_releases()
        from shmshare.testing import wait_until

        wait_until(lambda: tx.poll_releases() == 1 and tx._forks._retired, "the block retired", WAIT)
        os.write(w, b"x")
        wait_exit(pid, WAIT)
        pid = 0
        monkeypatch.setattr(forks, "alive", lambda p: False)  # and any other child this process has
        del first
        gc.collect()
        rx.flush_releases()
        wait_until(lambda: tx.poll_releases() == 0 and not tx._forks._retired,
                   lambda: f"the block freed: {tx.poll_releases()} out, retired {tx._forks._retired}", WAIT)
        tx._pool.check_invariants()
        tx._pool.overflow.alloc.check_invariants()
        tx.send(np.ones(1 << 10), timeout=WAIT)  # sends still work
        rx.recv(timeout=WAIT)
    finally:
        if pid:
            kill(pid)
        os.close(r)
        os.close(w)
        tx.close()
        rx.close()


def test_a_fork_while_a_thread_waits_for_a_local_block_under_the_lock_does_not_deadlock(monkeypatch):
    # Found by review of the fix above: the parent's marking took the sender's lock, held by a
    # thread waiting in empty() for room that only a local view's death gives -- which no lender
    # frees while the process forks: the fork never ended. The marking takes no lock now (no block
    # stops being local while forking() is true). The fork's halves are called as os.fork() calls
    # them, by one "forking" thread, the death in between; every wait bounded.
    import threading

    from shmshare import _fork
    from shmshare._plane import forks
    from shmshare.testing import wait_until

    monkeypatch.setattr(forks, "_children", frozenset)  # the fork called by hand makes no child
    tx, rx = channel(limit=2 << 20)
    got: list = []
    began, died, ended = threading.Event(), threading.Event(), threading.Event()

    def forking() -> None:
        _fork._before()
        began.set()
        died.wait(WAIT)
        _fork._run_in_parent()  # the parent's handlers: the marking
        ended.set()

    try:
        a = tx.empty(1 << 20, np.uint8)
        b = tx.empty(1 << 20, np.uint8)  # the pool is full of local views
        forker = threading.Thread(target=forking, daemon=True)
        forker.start()
        assert began.wait(WAIT)
        waiter = threading.Thread(target=lambda: got.append(tx.empty(1 << 20, np.uint8, timeout=WAIT)),
                                  daemon=True)
        waiter.start()
        wait_until(lambda: tx._pool.local_done is not None and waiter.is_alive(), "the waiter", WAIT)
        del a  # dies "during the fork": queued, not freed
        gc.collect()
        died.set()
        assert ended.wait(WAIT), "the fork's parent handlers did not end"
        waiter.join(WAIT)
        assert got and got[0].nbytes == 1 << 20  # the queued block, once the fork was over
        del b
    finally:
        died.set()
        got.clear()
        tx.close()
        rx.close()


def test_two_forks_at_once_keep_blocks_held_until_both_have_marked_them():
    # Found by review: forking() was one flag, so the first fork's parent cleared it while the
    # second was still under way. It counts forks now. (The count alone: the "before" hooks also
    # take the locks held across a fork, which one thread cannot take twice; two threads forking
    # at once each take them in turn.)
    from shmshare import _fork

    _fork._count(1)
    _fork._count(1)
    try:
        _fork._run_in_parent()
        assert _fork.forking()
    finally:
        _fork._run_in_parent()
    assert not _fork.forking()


def test_a_view_dying_in_a_fork_of_a_closed_sender_does_not_spin():
    # Found by review: a closed sender's callback looped until drain_local emptied the queue,
    # which it never does while forking: os.fork() hung (the collector runs callbacks anywhere).
    import threading

    from shmshare import _fork

    tx, rx = channel()
    a = tx.empty(N, np.uint32)
    tx.close()
    rx.close()
    _fork._before()
    try:
        done = threading.Event()

        def drop() -> None:
            nonlocal a
            del a
            gc.collect()
            done.set()

        t = threading.Thread(target=drop, daemon=True)
        t.start()
        assert done.wait(WAIT), "the callback of a view dying during a fork did not return"
    finally:
        _fork._run_in_parent()
    tx._reap_closed()  # after the fork, the next look frees it
    assert not tx._pool.local_done
