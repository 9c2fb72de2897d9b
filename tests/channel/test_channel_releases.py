"""Leases and release frames at the sender: an exception landing just after a frame went out
keeps its leases (the receiver has the arrays); a receiver flooding release frames stalls no
send, and one too large is a ProtocolError.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from shmshare import ProtocolError, channel, wire
from shmshare.channel._protocol import KIND, LEASES, RELEASE, RELEASE_CHUNK
from shmshare.testing import pattern

N = 4096
WAIT = 30.0


def test_an_exception_just_after_the_frame_went_keeps_its_leases():
    tx, rx = channel(limit=64 << 20)
    try:
        for _ in range(3):  # rings switched, the segment announced
            tx.send({"x": pattern(99, N)}, timeout=WAIT)
            rx.recv(timeout=WAIT)
        gc.collect()
        rx.flush_releases()
        real = tx._conn.send

        def sent_then_interrupted(*args, **kw):
            real(*args, **kw)  # the frame is out
            tx._conn.send = real
            raise KeyboardInterrupt  # as a SIGINT landing on the next bytecode

        tx._conn.send = sent_then_interrupted
        with pytest.raises(KeyboardInterrupt):
            tx.send({"x": pattern(1, N)}, timeout=WAIT)
        first = rx.recv(timeout=WAIT)
        assert tx.statistics().leases_out >= 1  # kept: the receiver may (and does) have it
        tx.send({"x": pattern(2, N)}, timeout=WAIT)
        second = rx.recv(timeout=WAIT)
        assert np.array_equal(first["x"], pattern(1, N))  # not overwritten by batch 2
        assert np.array_equal(second["x"], pattern(2, N))
        del first, second
    finally:
        tx.close()
        rx.close()


def _raw_receiver():
    """A sender and a raw connection posing as its receiver."""
    a, b = wire.pipe()
    from shmshare.channel import Sender

    tx = Sender(a)
    tx.send(np.arange(4), timeout=WAIT)  # its HELLO and first batch
    b.recv(timeout=WAIT)
    return tx, b


def test_a_release_frame_larger_than_a_receiver_sends_breaks_the_protocol():
    tx, b = _raw_receiver()
    try:
        b.send({KIND: RELEASE, LEASES: list(range(RELEASE_CHUNK + 1))}, timeout=WAIT)
        with pytest.raises(ProtocolError, match="a release frame of"):
            for _ in range(1000):
                tx.send(np.arange(4), timeout=WAIT)
                tx.poll_releases()
    finally:
        tx.close()
        b.close()


def test_a_drain_takes_in_a_bounded_number_of_frames(monkeypatch):
    monkeypatch.setenv("SHMSHARE_RINGS", "0")  # the raw receiver's frames on the socket: no ring to fill
    tx, b = _raw_receiver()
    try:
        for i in range(600):  # more frames than one drain takes in
            b.send({KIND: RELEASE, LEASES: [i]}, timeout=WAIT)
        calls = []
        real = tx._conn.recv_nowait

        def counted():
            calls.append(1)
            return real()

        tx._conn.recv_nowait = counted
        tx.poll_releases()
        assert 0 < len(calls) <= 257  # the rest wait for the next drain
        tx.poll_releases()
        tx.poll_releases()
        assert real() is None  # and all were taken in by then
    finally:
        tx.close()
        b.close()
