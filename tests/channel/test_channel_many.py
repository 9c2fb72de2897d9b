"""send_many and recv_many: the same batches, in the same order, as send() and recv() in a loop;
recv_many waits only for its first batch and loses nothing when an error comes after it.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from shmshare import PeerDied, PoolExhausted, ProtocolError, ShmshareTimeout, channel, wire
from shmshare.channel import Receiver, Sender
from shmshare.testing import kill, pattern, wait_exit, wait_until

WAIT = 30.0


def _batch(tx, i: int):
    if i % 5 == 2:
        return {"i": i, "x": pattern(i, 7)}
    a = tx.empty(16, np.uint32)
    a[:] = pattern(i, 16)
    return a


def _check(got, i: int) -> None:
    if i % 5 == 2:
        assert got["i"] == i and np.array_equal(got["x"], pattern(i, 7))
    else:
        assert np.array_equal(got, pattern(i, 16))


@pytest.mark.parametrize("rings", ["1", "0"])
def test_many_at_a_time_keeps_every_batch_and_its_order(monkeypatch, rings):
    monkeypatch.setenv("SHMSHARE_RINGS", rings)
    tx, rx = channel(limit=16 << 20)
    with tx, rx:
        i = j = 0
        for size in (1, 3, 50, 100, 7):
            tx.send_many([_batch(tx, k) for k in range(i, i + size)], timeout=WAIT)
            i += size
            while j < i:
                got = rx.recv_many(max(1, size // 2 + 1), timeout=WAIT)
                assert 1 <= len(got) <= size // 2 + 1
                for g in got:
                    _check(g, j)
                    j += 1
                del got, g
        assert tx.poll_releases() >= 0


def test_recv_many_waits_only_for_its_first_batch():
    tx, rx = channel()
    with tx, rx:
        with pytest.raises(ShmshareTimeout):
            rx.recv_many(10, timeout=0.05)
        tx.send(np.arange(3))
        got = rx.recv_many(10, timeout=WAIT)
        assert len(got) == 1 and list(got[0]) == [0, 1, 2]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", None])
def test_recv_many_names_a_bad_count(bad):
    tx, rx = channel()
    with tx, rx, pytest.raises(ValueError, match="max_count must be a positive int"):
        rx.recv_many(bad)


def test_a_death_after_the_first_batches_is_raised_by_the_next_call_and_nothing_is_lost():
    tx, rx = channel()
    pid = os.fork()
    if pid == 0:  # the sender: three batches, then a death with nothing said
        try:
            rx.close()
            tx.send_many([np.full(4, k) for k in range(3)], timeout=WAIT)
            tx.poll_releases()
        finally:
            os._exit(0)  # no goodbye: the receiver sees a death
    tx.close()
    try:
        assert wait_exit(pid, WAIT) == 0
        got = rx.recv_many(10, timeout=WAIT)
        assert [int(g[0]) for g in got] == [0, 1, 2]  # all three, before the error
        with pytest.raises(PeerDied):
            rx.recv_many(10, timeout=WAIT)
    finally:
        kill(pid)
        rx.close()


def test_send_many_bounds_its_whole_call_and_what_went_before_a_failure_went():
    tx, rx = channel(limit=2 << 20)
    try:
        held = [tx.empty(1 << 20, np.uint8) for _ in range(1)]  # most of the pool stays local
        batches = [np.full(8, k) for k in range(3)] + [np.zeros(4 << 20, np.uint8)]  # the last cannot fit
        with pytest.raises(PoolExhausted):
            tx.send_many(batches, timeout=0.2)
        got = rx.recv_many(10, timeout=WAIT)
        assert [int(g[0]) for g in got] == [0, 1, 2]
        del held, got
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("one", [{"x": 1}, "abc", b"abc", np.zeros(3)], ids=["dict", "str", "bytes", "array"])
def test_send_many_refuses_one_batch_for_an_iterable_of_them(one):
    tx, rx = channel()
    with tx, rx, pytest.raises(TypeError, match=r"send_many takes an iterable of batches.*send\(\)"):
        tx.send_many(one)


@pytest.mark.parametrize(("shape", "want"), [(np.int64(4), (4,)), ([np.int32(2), 3], (2, 3)), ((), ())])
def test_empty_takes_shapes_as_numpy_does(shape, want):
    tx, rx = channel()
    with tx, rx:
        assert tx.empty(shape, np.uint8).shape == want == np.empty(shape, np.uint8).shape


@pytest.mark.parametrize("shape", ["12", (2.0, 3), b"12", [1, "2"]])
def test_empty_refuses_a_shape_numpy_refuses(shape):
    tx, rx = channel()
    with tx, rx, pytest.raises(TypeError, match="a shape is an int or a sequence of ints"):
        tx.empty(shape, np.uint8)


def test_statistics_take_in_the_releases_that_came():
    tx, rx = channel()
    with tx, rx:
        for _ in range(3):
            tx.send(np.arange(4), timeout=WAIT)
        got = [rx.recv(timeout=WAIT) for _ in range(3)]
        del got
        rx.flush_releases()
        wait_until(lambda: tx.statistics().leases_out == 0, "the releases counted by statistics()", WAIT)


def test_recv_many_returns_the_batch_before_a_broken_frame_and_drops_its_sender():
    a, b = wire.pipe()
    rx = Receiver([b])
    tx = None
    try:
        tx = Sender(a)
        for i in range(3):
            arr = tx.empty(16, np.uint8)
            arr[:] = i
            tx.send(arr, timeout=WAIT)
            del arr
        for _ in range(3):  # warm: rings switched
            rx.recv(timeout=WAIT)
        arr = tx.empty(16, np.uint8)
        arr[:] = 7
        tx.send(arr, timeout=WAIT)  # by the fast lane
        a._sock.sendmsg([b"\xc1\xc1\xc1"])  # then garbage on the socket
        got = rx.recv_many(10, timeout=WAIT)
        assert [int(g[0]) for g in got] == [7]
        with pytest.raises(ProtocolError):
            rx.recv_many(10, timeout=WAIT)
        assert not rx._peers  # dropped
        del got, arr
    finally:
        if tx is not None:
            tx.close()
        rx.close()


def test_the_error_recv_many_keeps_pins_none_of_the_batches_it_returned():
    tx, rx = channel()
    try:
        tx.send(np.arange(8), timeout=WAIT)
        tx.send(np.arange(8), timeout=WAIT)
        rx._later = None
        got = rx.recv_many(1, timeout=WAIT)
        tx._conn._sock.sendmsg([b"\xc1"])  # garbage after the second batch
        got += rx.recv_many(10, timeout=WAIT)
        assert rx._later is not None and rx._later.__traceback__ is None
        kept = [weakref.ref(g) for g in got]
        del got
        gc.collect()
        assert all(k() is None for k in kept)  # the kept error holds none of them
    finally:
        tx.close()
        rx.close()
