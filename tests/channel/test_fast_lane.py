"""The channel's fast lane (Note [Fast lane] in channel/_lane.py): the frames it builds are the
usual ones byte for byte, the receiver's shortcut takes exactly one-array trees, arrays from
``empty()`` go by it in order with everything else interleaved, a full ring falls back without
loss, and a hostile descriptor in a fast frame is refused as on the usual path.
"""

from __future__ import annotations

import os
import threading

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmshare import ProtocolError, ShmshareError, _native, channel, tensors, wire
from shmshare.channel import Receiver, _lane
from shmshare.channel._protocol import BATCH, KIND, NEW, TREE
from shmshare.testing.transport_contract import sealed_memfd

WAIT = 30.0
_DTYPES = [np.uint8, np.int16, np.float32, np.float64, np.complex64, np.bool_, ">i4", "<U3", "S5"]


def _usual_frame(arr: np.ndarray, seg: int, lease: int, off: int) -> bytes:
    """The frame Sender.send() builds for a batch of one array: the encoder, then the wire."""
    def place(a: np.ndarray) -> msgpack.ExtType:
        return tensors.pack_desc(seg, lease, off, tensors.desc_dtype_bytes(a.dtype), a.shape, a.strides)

    return wire.message_frame({KIND: BATCH, TREE: tensors.encode(arr, place)})


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(_DTYPES),
       shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
       order=st.sampled_from(["C", "F", "step"]),
       seg=st.integers(1, 2**64 - 1), lease=st.integers(0, 2**64 - 1), off=st.integers(-2**63, 2**63 - 1))
def test_the_fast_frame_is_the_usual_frame_byte_for_byte(dtype, shape, order, seg, lease, off):
    arr = np.zeros(shape, dtype, order="F" if order == "F" else "C")
    if order == "step" and arr.ndim:
        arr = np.zeros((*shape[:-1], 2 * shape[-1]), dtype)[..., ::2]
    dt = tensors.desc_dtype_bytes(arr.dtype)
    assert _lane.frame(seg, lease, off, dt, arr.shape, arr.strides) == _usual_frame(arr, seg, lease, off)


def test_a_descriptor_of_many_dimensions_takes_a_16_bit_ext_both_ways():
    arr = np.zeros((1,) * 20, np.uint8)  # 28 + 16 * 20 bytes of descriptor: past an ext8's 255
    dt = tensors.desc_dtype_bytes(arr.dtype)
    framed = _lane.frame(7, 8, 9, dt, arr.shape, arr.strides)
    assert framed == _usual_frame(arr, 7, 8, 9)
    tree = msgpack.unpackb(framed)[1][TREE]
    assert tree[0] == 0xC8
    assert _lane.one_array(tree) == tensors.pack_desc(7, 8, 9, dt, arr.shape, arr.strides).data


def _tree(obj, seg: int = 1, off: int = 3) -> bytes:
    return tensors.encode(obj, lambda a: tensors.pack_desc(seg, 2, off, b"|u1", a.shape, a.strides))


@pytest.mark.parametrize("obj", [[np.zeros(4, np.uint8)], (np.zeros(4, np.uint8),),
                                 {"x": np.zeros(4, np.uint8)}, np.float64(1.5), 3, b"\xc7", "x"],
                         ids=["list", "tuple", "dict", "scalar", "int", "bytes", "str"])
def test_only_a_tree_of_exactly_one_array_takes_the_shortcut(obj):
    assert _lane.one_array(_tree(obj)) is None
    assert _lane.one_array(_tree(np.zeros(4, np.uint8))) is not None


@pytest.mark.parametrize("cut", [-1, 1], ids=["short", "long"])
def test_an_ext_whose_length_byte_disagrees_with_the_tree_is_not_taken(cut):
    tree = bytearray(_tree(np.zeros(4, np.uint8)))
    tree[1] += cut
    assert _lane.one_array(bytes(tree)) is None  # the usual decoder then says it is malformed


def _counting(monkeypatch) -> list[int]:
    calls = [0]
    real = _lane.frame

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(_lane, "frame", counted)
    return calls


@pytest.mark.parametrize("rings", ["1", "0"])
def test_arrays_from_empty_go_by_the_fast_lane_in_order_among_other_batches(monkeypatch, rings):
    monkeypatch.setenv("SHMSHARE_RINGS", rings)
    calls = _counting(monkeypatch)
    tx, rx = channel(limit=16 << 20)
    plain = 0
    try:
        for start in range(0, 600, 100):  # within a ring's 256 slots: one thread sends and receives
            for i in range(start, start + 100):
                if i % 7 == 3:
                    tx.send({"i": i, "x": np.full(5, i, np.int64)}, timeout=WAIT)
                elif i % 11 == 5:
                    tx.send(np.full(3, i, np.int32), timeout=WAIT)  # not from empty(): copied in
                else:
                    a = tx.empty(64, np.int64)
                    a[:] = i
                    tx.send(a, timeout=WAIT)
                    plain += 1
            for i in range(start, start + 100):
                got = rx.recv(timeout=WAIT)
                if i % 7 == 3:
                    assert got["i"] == i and (got["x"] == i).all()
                else:
                    assert got.shape == ((3,) if i % 11 == 5 else (64,)) and (got == i).all()
                del got
        if rings == "1":
            assert calls[0] >= plain // 2  # most went by the lane (a send that drains may not)
        else:
            assert calls[0] == 0  # no ring: no lane
    finally:
        tx.close()
        rx.close()


def test_a_full_ring_sends_the_usual_way_and_loses_nothing(monkeypatch):
    calls = _counting(monkeypatch)
    tx, rx = channel(limit=64 << 20)
    start = threading.Event()
    got: list[int] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            start.wait(WAIT)
            for _ in range(2000):
                a = rx.recv(timeout=WAIT)
                got.append(int(a[0]))
                assert (a == a[0]).all()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    try:
        for i in range(2000):
            a = tx.empty(32, np.int64)
            a[:] = i
            tx.send(a, timeout=WAIT)
            if i == 600:
                start.set()  # the ring (256 slots) filled long ago: the rest waited the usual way
        t.join(WAIT)
        assert not t.is_alive() and not errors, errors
        assert got == list(range(2000))
        assert calls[0] > 0
    finally:
        start.set()
        tx.close()
        rx.close()
        t.join(WAIT)


@pytest.mark.parametrize("offset", [4096 - 3, -1, 2**62], ids=["past-the-end", "before", "far"])
def test_a_fast_frame_pointing_outside_its_segment_is_refused_and_drops_the_sender(offset):
    a, b = wire.pipe()
    rx = Receiver([b])
    fd = sealed_memfd(4096)
    seg = (os.getpid() << 32) | 77
    try:
        a.offer_ring()
        a.send({KIND: BATCH, NEW: [[seg, 4096, False]], TREE: _tree(np.zeros(4, np.uint8), seg)}, [fd])
        assert rx.recv(timeout=WAIT).shape == (4,)
        rx.flush_releases()  # its first frame: HELLO and ACCEPT go before it
        for _ in range(100):  # read the receiver's ACCEPT; the next send switches to the ring
            if a._rings.reading:
                break
            a.recv_nowait()  # the HELLO and ACCEPT on the socket, then the release
        assert a._rings.reading
        a.send({KIND: BATCH, TREE: _tree(np.zeros(4, np.uint8), seg)})
        assert rx.recv(timeout=WAIT).shape == (4,)
        assert a.send_now(_lane.frame, seg, 9, offset, b"|u1", (4,), (1,))  # by the ring, now
        with pytest.raises(ProtocolError, match=r"outside|offset"):
            rx.recv(timeout=WAIT)
        with pytest.raises(Exception):  # noqa: B017 - dropped: PeerDied, or no sender left
            rx.recv(timeout=0.5)
    finally:
        os.close(fd)
        rx.close()
        a.close()


def _switched_pair():
    """A raw sender `a` whose frames go by ring, a Receiver on the other end, and a segment."""
    a, b = wire.pipe()
    rx = Receiver([b])
    fd = sealed_memfd(4096)
    seg = (os.getpid() << 32) | 78
    a.offer_ring()
    a.send({KIND: BATCH, NEW: [[seg, 4096, False]], TREE: _tree(np.zeros(4, np.uint8), seg)}, [fd])
    assert rx.recv(timeout=WAIT).shape == (4,)
    rx.flush_releases()
    for _ in range(100):
        if a._rings.reading:
            break
        a.recv_nowait()
    a.send({KIND: BATCH, TREE: _tree(np.zeros(4, np.uint8), seg)})  # SWITCH: a writes by ring now
    assert rx.recv(timeout=WAIT).shape == (4,)
    return a, rx, fd, seg


@pytest.mark.parametrize("tail", [b"", b"\x05", b"\x05\xc7\x02\x01\x00\x00", b"\x03\xc7\x00\x01",
                                  b"\xff" + b"\x00" * 40, b"\x02\xc7\x00"],
                         ids=["nothing", "short-bin", "short-desc", "empty-desc", "long-bin", "cut-ext"])
def test_garbage_after_the_lane_head_is_a_protocol_error_and_drops_the_sender(tail):
    a, rx, fd, _ = _switched_pair()
    try:
        assert a.send_now(lambda: _lane.HEAD + tail)
        with pytest.raises(ProtocolError):
            rx.recv(timeout=WAIT)
    finally:
        os.close(fd)
        rx.close()
        a.close()


def test_a_lane_head_frame_of_another_tree_takes_the_usual_decoder():
    a, rx, fd, seg = _switched_pair()
    try:
        framed = wire.message_frame({KIND: BATCH, TREE: _tree({"x": np.zeros(3, np.uint8), "n": 7}, seg)})
        assert framed.startswith(_lane.HEAD) and _lane.desc_of(framed) is None
        assert a.send_now(lambda: framed)
        got = rx.recv(timeout=WAIT)
        assert got["n"] == 7 and got["x"].shape == (3,)
    finally:
        os.close(fd)
        rx.close()
        a.close()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_mutated_lane_frame_is_an_array_inside_its_segment_or_a_protocol_error(data):
    a, rx, fd, seg = _switched_pair()
    try:
        good = bytearray(_lane.frame(seg, 5, data.draw(st.integers(0, 4096)), b"<u4",
                                     (data.draw(st.integers(0, 1024)),), (4,)))
        for _ in range(data.draw(st.integers(1, 4))):  # flip bytes anywhere past the head
            i = data.draw(st.integers(len(_lane.HEAD), len(good) - 1))
            good[i] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            good = good[:data.draw(st.integers(len(_lane.HEAD), len(good)))]  # cut short
        assert a.send_now(lambda: bytes(good))
        try:
            got = rx.recv(timeout=WAIT)
        except ShmshareError:
            return  # refused, and the sender dropped
        mapped = rx._peers[0].segments[seg]
        ptr, lo, span = _native.extent(got)
        assert got.size == 0 or mapped.address <= ptr + lo <= ptr + lo + span <= mapped.address + mapped.size
    finally:
        os.close(fd)
        rx.close()
        a.close()
