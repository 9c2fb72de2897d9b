"""A reader of ``fileno()`` (a selector, as the store daemon and a channel's fan-in have) and its
wake-ups (Note [Rings]): after ``recv_nowait()`` says nothing came, a frame in the ring is always
announced on the socket, however the wake-ups and the pushes interleave."""

from __future__ import annotations

import pytest

from shmshare import _ring

from .helpers import _ringed_pair


@pytest.mark.parametrize("wakes_before", [0, 1, 3])
def test_a_frame_pushed_while_the_reader_takes_a_wake_up_is_announced(monkeypatch, wakes_before):
    """The push lands between the reader's look at its empty ring and its read of the WAKE that
    push sent: past the wake-ups' deadline the reader used to answer None with the frame in its
    ring, its flag taken and its socket empty -- a store daemon then never served that client
    again (a get timed out after 10 s: CI at stop 29, and 2 runs in 14 of the store's thread
    tests here). With more wake-ups queued, None is right as long as the socket says more."""
    a, b = _ringed_pair()
    b._poll_fd()  # a selector reads b: armed whenever its ring is empty
    for i in range(wakes_before + 1):  # each push finds b armed: one WAKE each, left queued
        a.send({"n": i})
        assert b.recv_nowait()[0] == {"n": i}
    real = _ring.RingLink._socket_frame
    calls = []

    def socket_frame(link):
        calls.append(1)
        if len(calls) == 2 and link is b._rings:  # b found its ring empty after a first WAKE
            a.send({"n": "late"})  # b's flag is taken and a WAKE sent, behind those queued
        return real(link)

    monkeypatch.setattr(_ring.RingLink, "_socket_frame", socket_frame)
    got = b.recv_nowait()
    monkeypatch.setattr(_ring.RingLink, "_socket_frame", real)
    if got is None:
        assert b._pollin.poll(0) or not b._rings.ring.readable(), (
            "recv_nowait() said nothing came, the ring holds a frame and the socket is silent: "
            "a selector would never look again")
        got = b.recv_nowait()
    assert got is not None and got[0] == {"n": "late"}
    a.close()
    b.close()
