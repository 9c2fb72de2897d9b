"""Small arrays by value (Note [Inline arrays] in tensors.py): what the sender would copy into its
pool anyway goes in the frame when small; it comes back exactly, as a copy of the receiver's own,
with no lease; past INLINE_BYTES a batch's arrays go by the pool; a hostile inline ext is refused
and drops its sender; an end that never sends still moves its peer onto the rings.
"""

from __future__ import annotations

import gc
import os

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmshare import ProtocolError, ShmshareError, channel, tensors, wire
from shmshare.channel import Receiver, _lane
from shmshare.channel._protocol import BATCH, KIND, TREE
from shmshare.channel._sender import INLINE_BYTES
from shmshare.testing import wait_until

from .test_fast_lane import _switched_pair

WAIT = 30.0


@pytest.fixture
def ends():
    """A channel() pair, closed after the test."""
    tx, rx = channel()
    yield tx, rx
    tx.close()
    rx.close()


def _padded() -> np.ndarray:
    dt = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8], "itemsize": 16})
    out = np.zeros(3, dt)
    out["a"], out["b"] = [1, 2, 3], [0.5, 1.5, 2.5]
    return out


def _padded_strided() -> np.ndarray:
    raw = np.arange(4 * 16, dtype=np.uint8)  # padding bytes that are not zero
    dt = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"], "offsets": [0, 8], "itemsize": 16})
    return raw.view(dt)[::2]


_SMALL = {
    "u8": np.arange(64, dtype=np.uint8),
    "f64-2d": np.arange(12.0).reshape(3, 4),
    "bool": np.array([True, False, True]),
    "c64": np.array([1 + 2j, 3 - 4j], np.complex64),
    "big-endian": np.arange(5, dtype=">i4"),
    "0-d": np.array(7.25),
    "unicode": np.array(["ab", "c"], "<U3"),
    "bytes": np.array([b"xy", b"z"], "S2"),
    "strided": np.arange(40, dtype=np.int16)[::3],
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
    "padded": _padded(),
    "padded-strided": _padded_strided(),  # found by review: numpy's tobytes() left the padding as heap
}


@pytest.mark.parametrize("name", list(_SMALL))
def test_a_small_array_goes_in_the_frame_and_comes_back_exactly(name, ends):
    arr = _SMALL[name]
    tx, rx = ends
    tx.send({"x": arr, "n": 1})
    got = rx.recv(timeout=WAIT)
    assert got["x"].dtype == arr.dtype and got["x"].shape == arr.shape
    whole = np.dtype((np.void, arr.dtype.itemsize))  # every byte, padding too
    assert got["x"].view(whole).tobytes() == np.ascontiguousarray(arr.view(whole)).tobytes()
    assert not got["x"].flags.writeable  # as the pool's pages of a read-only receiver
    st = tx.statistics()
    assert (st.arrays_inline, st.arrays_copied, st.leases_out, st.reserved_bytes) == (1, 0, 0, 0)


def test_one_small_array_alone_takes_the_fast_lane_and_a_writable_receiver_may_change_it():
    tx, rx = channel(writable=True)
    try:
        for i in range(300):  # past the ring's setup: the fast lane's frames from the third send on
            tx.send(np.full(8, i, np.int64))
            got = rx.recv(timeout=WAIT)
            assert got.tolist() == [i] * 8
            got[0] = -1  # its own copy: nothing of the sender's changes
        assert tx.statistics().arrays_inline == 300 and tx.statistics().leases_out == 0
        assert tx._conn._rings is not None and tx._conn._rings.writing  # by ring, not the socket
    finally:
        tx.close()
        rx.close()


def test_a_batch_inlines_up_to_inline_bytes_and_lends_the_rest_from_the_pool(ends):
    tx, rx = ends
    parts = [np.full(8, i, np.int64) for i in range(INLINE_BYTES // 64 + 3)]  # 64 bytes each
    tx.send(parts)
    got = rx.recv(timeout=WAIT)
    assert [g.tolist() for g in got] == [p.tolist() for p in parts]
    st = tx.statistics()
    assert st.arrays_inline == INLINE_BYTES // 64 and st.arrays_copied == 3 and st.leases_out == 3
    del got
    gc.collect()
    rx.flush_releases()
    wait_until(lambda: tx.poll_releases() == 0, "the pool's three leases back", WAIT)


def test_a_batch_too_large_with_its_small_arrays_by_value_sends_them_by_the_pool(ends):
    # Found by review: a batch near max_frame with a small array now failed (ProtocolError: a frame
    # exceeds max_frame) where it used to go, its array in the pool.
    tx, rx = ends
    big = np.arange(64.0)  # past INLINE_BYTES: by the pool either way, counted once
    batch = {"text": "x" * (wire.MAX_FRAME - 400), "a": np.arange(32.0), "big": big}
    tx.send(batch, timeout=WAIT)
    got = rx.recv(timeout=WAIT)
    assert got["text"] == batch["text"] and got["a"].tolist() == batch["a"].tolist()
    assert got["big"].tolist() == big.tolist()
    st = tx.statistics()
    assert (st.arrays_inline, st.arrays_copied, st.leases_out) == (0, 2, 2)


def test_a_receiver_that_breaks_the_ring_ends_a_sender_of_small_arrays_once(ends):
    # Found by review: the by-value fast lane let the raw BrokenRing out of send() and left the
    # sender open, every later send raising it again; the pool's lane closes it (ProtocolError).
    import ctypes

    from shmshare._procfs import shm_mappings

    tx, rx = ends
    for _ in range(5):
        tx.send(np.arange(4))
        rx.recv(timeout=WAIT)
    assert tx._conn._rings.writing
    base = min(m.start for m in shm_mappings(contains="shmshare-rings"))
    ctypes.c_uint64.from_address(base + 128).value = 1 << 40  # the head of the sender's direction
    with pytest.raises(ProtocolError, match="broke"):
        tx.send(np.arange(4))
    assert tx._conn.closed
    with pytest.raises(ProtocolError, match="broke"):
        tx.send(np.arange(4))


def test_a_torch_dtype_name_that_is_not_a_dtype_is_refused_without_importing_it():
    # Found by review: the name went to getattr(torch, name), which imports a submodule
    # (torch._dynamo: seconds and tens of MB) for a peer that names one.
    torch = pytest.importorskip("torch")
    _refused(tensors.pack_inline(b"<f4", (1,), 4, bytes(4), b"_dynamo").data)
    assert torch.float32 is vars(torch)["float32"]


def test_arrays_from_empty_stay_zero_copy_however_small(ends):
    tx, rx = ends
    a = tx.empty(4, np.uint8)
    a[:] = 9
    tx.send(a)
    got = rx.recv(timeout=WAIT)
    assert got.tolist() == [9] * 4
    st = tx.statistics()
    assert (st.arrays_inline, st.arrays_in_place, st.leases_out) == (0, 1, 1)


def test_a_small_torch_tensor_comes_back_a_writable_tensor(ends):
    torch = pytest.importorskip("torch")
    tx, rx = ends
    t = torch.arange(6, dtype=torch.bfloat16)
    tx.send(t)
    got = rx.recv(timeout=WAIT)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and torch.equal(got, t)
    got.add_(1)  # a tensor must be writable: torch has no read-only ones
    assert tx.statistics().arrays_inline == 1


def test_a_receiver_that_never_sends_still_takes_its_senders_frames_by_ring(ends):
    # Found while building this: the receiving end answered a ring offer only at its own first
    # send (a release), so a channel of small arrays or plain values stayed on the socket for good.
    tx, rx = ends
    for i in range(50):
        tx.send({"i": i, "name": "x"})
        assert rx.recv(timeout=WAIT) == {"i": i, "name": "x"}
    wait_until(lambda: tx.poll_releases() == 0 and tx._conn._rings.writing, "the sender on its ring", WAIT)
    tx.send({"i": 50})
    assert tx._conn._rings.ring.pending == 1  # in the ring, not on the socket
    assert rx.recv(timeout=WAIT) == {"i": 50}


# -- what a hostile sender may put in an inline ext ------------------------------------------------


def _inline_tree(payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(tensors.EXT_INLINE, payload), use_bin_type=True)


def _good_payload(arr: np.ndarray) -> bytes:
    return tensors.pack_inline(tensors.desc_dtype_bytes(arr.dtype), arr.shape, arr.dtype.itemsize,
                               arr.tobytes()).data


@pytest.mark.parametrize("payload", [
    b"",
    b"\x00" * 10,
    _good_payload(np.arange(4, dtype=np.int32))[:-1],  # a byte short
    _good_payload(np.arange(4, dtype=np.int32)) + b"\x00",  # a byte over
    tensors.pack_desc(1, 0, 0, b"<i4", (1,), (4,)).data + b"\x00" * 4,  # names a segment
    tensors.pack_desc(0, 0, 0, b"<i4", (2,), (8,)).data + b"\x00" * 8,  # not C order
    tensors.pack_desc(0, 0, 0, b"|O", (1,), (8,)).data + b"\x00" * 8,  # object references
    tensors.pack_desc(0, 0, 0, b"<i4", (-1,), (4,)).data,  # a negative dimension
    tensors.pack_desc(0, 0, 0, b"|V0", (1 << 40,), (0,)).data,  # a trillion items of nothing
    tensors.pack_desc(0, 0, 0, b"<i4", (0,), (4,)).data,  # empty: never sent by value
], ids=["empty", "short-head", "short", "long", "segment", "strided", "object", "negative", "void0",
        "no-items"])
def test_a_malformed_inline_array_is_a_protocol_error_and_drops_the_sender(payload):
    _refused(payload)


def _refused(payload: bytes) -> None:
    """A raw sender's batch of one inline ext of `payload`: ProtocolError, and the sender dropped."""
    a, b = wire.pipe()
    rx = Receiver([b])
    try:
        a.send({KIND: BATCH, TREE: _inline_tree(payload)})
        with pytest.raises(ProtocolError):
            rx.recv(timeout=WAIT)
        assert not rx._peers  # dropped
    finally:
        rx.close()
        a.close()


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_mutated_inline_frame_is_the_array_sent_or_a_protocol_error(data):
    arr = (np.arange(data.draw(st.integers(1, 24))) % 3).astype(data.draw(st.sampled_from(["<u2", "<f8", "|b1"])))
    good = bytearray(_lane.frame_by_value(tensors.desc_dtype_bytes(arr.dtype), arr))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(len(_lane.HEAD), len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    a, b = wire.pipe()
    rx = Receiver([b])
    try:
        a.send({KIND: BATCH, TREE: msgpack.packb(0)})  # the HELLO first, as any sender's
        assert rx.recv(timeout=WAIT) == 0
        a._send_frame(bytes(good), [], WAIT)
        try:
            got = rx.recv(timeout=WAIT)
        except ShmshareError:
            return  # refused, and the sender dropped
        assert isinstance(got, (np.ndarray, np.generic, int, float, bool, str, bytes, list, dict, tuple,
                                type(None)))
    finally:
        rx.close()
        a.close()


@pytest.mark.parametrize("name", list(_SMALL))
def test_the_fast_lane_frame_of_a_small_array_is_the_usual_frame(name):
    for arr in (_SMALL[name], np.array(np.flip(_SMALL[name]))):  # twice: the second from the kept head
        dt = tensors.desc_dtype_bytes(arr.dtype)
        usual = wire.message_frame({KIND: BATCH, TREE: tensors.encode(
            arr, lambda a, dt=dt: tensors.pack_inline(dt, a.shape, a.dtype.itemsize, tensors.c_bytes(a)))})
        assert _lane.frame_by_value(dt, arr) == usual
        payload = _lane.inline_of(usual)
        if payload is not None:  # the short form: the receiver's shortcut reads it back
            lay, data = tensors.parse_inline(payload)
            whole = np.dtype((np.void, arr.dtype.itemsize))
            assert _lane.by_value(lay, data, False).view(whole).tobytes() == \
                np.ascontiguousarray(arr.view(whole)).tobytes()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_mutated_inline_frame_in_the_ring_is_the_array_sent_or_a_protocol_error(data):
    arr = np.arange(data.draw(st.integers(1, 40)), dtype=np.uint16)
    good = bytearray(_lane.frame_by_value(b"<u2", arr))
    assert _lane.inline_of(bytes(good)) is not None
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(len(_lane.HEAD), len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        good = good[:data.draw(st.integers(len(_lane.HEAD), len(good)))]
    a, rx, fd, _ = _switched_pair()
    try:
        assert a.send_now(lambda: bytes(good))
        try:
            got = rx.recv(timeout=WAIT)
        except ShmshareError:
            return  # refused, and the sender dropped
        assert got is not None
    finally:
        os.close(fd)
        rx.close()
        a.close()
