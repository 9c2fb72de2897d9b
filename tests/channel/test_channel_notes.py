"""A receiver of several connections: batches from whichever is ready, and notes back to one."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shmshare import PeerDied, ShmshareTimeout, wire
from shmshare.channel import Receiver, Sender


def _pairs(n: int) -> tuple[list[Sender], Receiver]:
    ends = [wire.pipe() for _ in range(n)]
    senders = [Sender(a) for a, _ in ends]
    return senders, Receiver([b for _, b in ends], writable=True)


def test_batches_come_from_whichever_sender_is_ready_and_name_it():
    txs, rx = _pairs(3)
    try:
        txs[2].send({"who": 2, "x": np.arange(4)})  # the last one first: no waiting on sender 0
        n, batch = rx.recv_from(timeout=5)
        assert (n, batch["who"]) == (2, 2)
        txs[0].send({"who": 0})
        txs[1].send({"who": 1})
        got = {rx.recv_from(timeout=5)[0] for _ in range(2)}
        assert got == {0, 1}
    finally:
        for tx in txs:
            tx.close()
        rx.close()


def test_notes_reach_the_named_sender_only_and_in_order():
    txs, rx = _pairs(2)
    try:
        for i in range(5):
            rx.tell(1, ["task", i])
        with pytest.raises(ShmshareTimeout):
            txs[0].recv_note(timeout=0.05)
        assert [txs[1].recv_note(timeout=5) for _ in range(5)] == [["task", i] for i in range(5)]
    finally:
        for tx in txs:
            tx.close()
        rx.close()


def test_notes_and_releases_share_the_socket_without_losing_either():
    txs, rx = _pairs(2)
    try:
        for i in range(50):
            txs[0].send(np.full(1000, i))
            n, arr = rx.recv_from(timeout=5)
            assert n == 0 and arr[0] == i
            del arr
            rx.tell(0, i)
        rx._flush()
        assert [txs[0].recv_note(timeout=5) for _ in range(50)] == list(range(50))
        assert txs[0].poll_releases() == 0  # every array came back
    finally:
        for tx in txs:
            tx.close()
        rx.close()


def test_recv_note_waits_until_a_note_comes_from_another_thread():
    txs, rx = _pairs(2)
    try:
        timer = threading.Timer(0.2, rx.tell, (0, "late"))
        timer.start()
        assert txs[0].recv_note(timeout=10) == "late"
        timer.join()
    finally:
        for tx in txs:
            tx.close()
        rx.close()


def test_a_dead_sender_is_named_and_the_others_go_on():
    a0, b0 = wire.pipe()
    a1, b1 = wire.pipe()
    tx = Sender(a0)
    rx = Receiver([b0, b1], writable=True)
    try:
        a1.close()  # sender 1 dies without a goodbye
        with pytest.raises(PeerDied) as info:
            rx.recv_from(timeout=5)
        assert info.value.sender == 1
        with pytest.raises(PeerDied, match="sender 1 is gone"):
            rx.tell(1, "anyone?")
        tx.send({"still": 0})
        assert rx.recv_from(timeout=5)[0] == 0
    finally:
        tx.close()
        rx.close()


def test_recv_note_after_the_receiver_closed_raises_peer_died():
    txs, rx = _pairs(2)
    rx.tell(0, "last words")
    rx.close()
    try:
        assert txs[0].recv_note(timeout=5) == "last words"  # what was sent before is read first
        with pytest.raises(PeerDied):
            txs[0].recv_note(timeout=5)
    finally:
        for tx in txs:
            tx.close()


def test_every_sender_closing_ends_iteration_of_a_many_sender_receiver():
    txs, rx = _pairs(2)
    try:
        txs[0].send(1)
        txs[1].send(2)
        for tx in txs:
            tx.close()
        assert sorted(rx) == [1, 2]
    finally:
        rx.close()


def test_a_receiver_that_closes_keeps_its_arrays_while_the_sender_waits_for_room():
    # A sender waiting for pool room when its receiver closed used to get every leased block
    # back at once and hand one out again: the receiver's arrays changed under it.
    a, b = wire.pipe()
    tx = Sender(a, limit=48 << 20)
    rx = Receiver([b], writable=True)
    try:
        held = []
        for i in range(4):
            tx.send(np.full(12 << 20, i, np.uint8))  # four 12 MiB arrays fill a 48 MiB pool
            held.append(rx.recv(timeout=5))
        timer = threading.Timer(0.3, rx.close)
        timer.start()
        with pytest.raises(PeerDied):
            while True:  # the pool is full: this waits until the receiver closes
                tx.send(np.full(12 << 20, 9, np.uint8), timeout=10)
        timer.join()
        intact = [int(h.min()) for h in held] == [0, 1, 2, 3] == [int(h.max()) for h in held]
        assert intact, "a received array was overwritten by the sender"
        with pytest.raises(PeerDied):
            tx.empty(1 << 20, np.uint8)  # nothing more comes from this pool
    finally:
        tx.close()
        rx.close()
    del held
