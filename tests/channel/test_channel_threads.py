"""close() from another thread ends every wait on that end (Note [Closing from another thread])."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import shmshare
from shmshare import wire


def _in_thread(fn):
    """Run `fn` in a thread; return (thread, box) where box gets ("ok", value) or ("err", exc)."""
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            box.append(("err", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _closed_while_waiting(wait, close, match):
    t, box = _in_thread(wait)
    time.sleep(0.3)
    assert t.is_alive() and not box  # really waiting
    close()
    t.join(5)  # a bound, not a timing: the call returns within _CLOSE_CHECK (0.1 s)
    assert not t.is_alive(), "the waiting call did not return after close()"
    kind, exc = box[0]
    assert kind == "err" and isinstance(exc, ValueError), box
    assert match in str(exc)


def test_wire_recv_and_poll_end_when_the_connection_is_closed():
    a, b = wire.pipe()
    _closed_while_waiting(lambda: b.recv(), b.close, "closed while recv() waited")
    c, d = wire.pipe()
    _closed_while_waiting(lambda: d.poll(None), d.close, "closed while poll() waited")
    for x in (a, c):
        x.close()


def test_wire_send_on_a_full_socket_ends_when_closed():
    a, b = wire.pipe()
    while True:  # fill the socket: nobody reads b
        try:
            a.send({"x": b"\0" * 4096}, timeout=0)
        except shmshare.ShmshareTimeout:
            break
    _closed_while_waiting(lambda: a.send({"x": 1}), a.close, "closed while send() waited")
    b.close()


def test_receiver_recv_ends_when_closed_from_another_thread():
    tx, rx = shmshare.channel()
    _closed_while_waiting(lambda: rx.recv(), rx.close, "Receiver was closed while recv() waited")
    tx.close()


def test_listening_receiver_recv_and_poll_end_when_closed():
    rx = shmshare.listen()
    tx = shmshare.connect(rx.path, timeout=10)
    _closed_while_waiting(lambda: rx.recv(), rx.close, "Receiver was closed")
    tx.close()
    rx2 = shmshare.listen()
    _closed_while_waiting(lambda: rx2.poll(None), rx2.close, "Receiver was closed while poll()")


def test_send_waiting_for_pool_room_ends_when_the_sender_is_closed():
    tx, rx = shmshare.channel(limit=2 << 20)  # one small-pool segment: two 1 MiB blocks
    held = []
    for _ in range(2):
        tx.send(np.ones(1 << 20, np.uint8))
        held.append(rx.recv(timeout=5))  # the pool is full while we hold these
    _closed_while_waiting(lambda: tx.send(np.ones(1 << 20, np.uint8)), tx.close,
                          "Sender was closed while it waited for room in its pool")
    assert tx.statistics().leases_out == 0  # the failed send lent nothing; close took all back
    del held
    rx.close()


def test_a_closed_receiver_still_raises_valueerror_at_once():
    tx, rx = shmshare.channel()
    rx.close()
    with pytest.raises(ValueError, match="Receiver is closed"):
        rx.recv()
    tx.close()


def test_poll_while_another_thread_waits_in_recv():
    a, b = wire.pipe()
    t, box = _in_thread(lambda: b.recv(timeout=10))
    time.sleep(0.2)  # the thread waits on the connection's poll object
    assert b.poll(0.2) is False  # a poll of its own: not "concurrent poll() invocation"
    a.send({"x": 1})
    t.join(10)
    assert box == [("ok", ({"x": 1}, []))]
    a.close()
    b.close()


def test_recv_nowait_never_blocks_when_the_frame_it_saw_is_gone():
    # poll() said a frame was there, but another holder of the socket (a forked child) took
    # it first: the receive must not then block in the kernel for a frame that never comes.
    a, b = wire.pipe()
    a.send({"first": 1})
    assert b.recv(timeout=5) == ({"first": 1}, [])  # the handshake is done

    class SaidYes:
        def __init__(self, real):
            self.real, self.calls = real, 0

        def poll(self, ms):
            self.calls += 1
            return [(b.fileno(), 1)] if self.calls == 1 else self.real.poll(ms)

    b._pollin = SaidYes(b._pollin)
    t, box = _in_thread(b.recv_nowait)
    t.join(5)
    assert not t.is_alive() and box == [("ok", None)]
    a.close()
    b.close()


def test_listener_accept_ends_when_closed_from_another_thread():
    listener = wire.Listener()
    _closed_while_waiting(listener.accept, listener.close, "closed while accept() waited")
