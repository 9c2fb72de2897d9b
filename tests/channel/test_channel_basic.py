"""The channel in one process: structure, dtypes, leases, release and reuse, errors."""

from __future__ import annotations

import gc
import itertools
import os
import selectors

import msgpack
import numpy as np
import pytest

import shmshare
from shmshare import PeerDied, PoolExhausted, ProtocolError, wire
from shmshare.channel import Receiver, Sender
from tests.test_tensors import DTYPES


@pytest.fixture(params=["memfd", "posix"])
def chan(request):
    tx, rx = shmshare.channel(limit=64 << 20, backend=request.param)
    yield tx, rx
    tx.close()
    rx.close()


def settle(tx, want_leases=0, rounds=200):
    """Collect garbage and let releases travel until `want_leases` are out (bounded)."""
    import time

    for _ in range(rounds):
        gc.collect()
        if tx.poll_releases() == want_leases:
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(chan, dtype):
    tx, rx = chan
    dt = np.dtype(dtype)
    raw = np.random.default_rng(1).integers(0, 256, dt.itemsize * 12, dtype=np.uint8).tobytes()
    arr = np.frombuffer(raw, dtype=dt).reshape(3, 4)
    tx.send(arr)
    got = rx.recv(timeout=5)
    assert got.dtype == dt and got.shape == (3, 4)
    if dt.names:
        assert all(got[n].tobytes() == arr[n].tobytes() for n in dt.names)
    else:
        assert got.tobytes() == arr.tobytes()


def test_nested_batch_with_strides_and_empties(chan):
    tx, rx = chan
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    batch = {"img": base[::2, ::-3], "t": (base.T, "label", 3), "empty": np.zeros((0, 4)),
             "scalar": np.float32(2.5), "meta": {"ids": [1, 2], "ok": True, "none": None}}
    tx.send(batch)
    got = rx.recv(timeout=5)
    np.testing.assert_array_equal(got["img"], base[::2, ::-3])
    assert isinstance(got["t"], tuple) and got["t"][1:] == ("label", 3)
    np.testing.assert_array_equal(got["t"][0], base.T)
    assert got["empty"].shape == (0, 4)
    assert got["scalar"] == np.float32(2.5) and got["meta"] == batch["meta"]


def test_received_arrays_are_read_only_unless_asked(chan):
    tx, rx = chan
    tx.send(np.ones(4))
    got = rx.recv(timeout=5)
    assert not got.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        got[0] = 2
    tx.send([np.ones((7, 0, 3)), tx.empty((0,), np.uint8)])  # empty arrays too (they share no memory)
    assert not any(a.flags.writeable for a in rx.recv(timeout=5))
    tx2, rx2 = shmshare.channel(writable=True)
    tx2.send(np.ones(4))
    w = rx2.recv(timeout=5)
    w[0] = 7
    assert w[0] == 7
    tx2.send(np.ones((7, 0, 3)))
    assert rx2.recv(timeout=5).flags.writeable
    del w, got
    tx2.close()
    rx2.close()


def test_in_place_arrays_are_sent_without_copy_and_see_later_writes(chan):
    tx, rx = chan
    arr = tx.empty((256,), np.int64)
    arr[:] = 5
    tx.send({"a": arr, "view": arr[10:20]})
    got = rx.recv(timeout=5)
    st = tx.statistics()
    assert st.arrays_in_place == 2 and st.arrays_copied == 0
    arr[10] = 99  # one set of pages: the receiver sees the producer's memory
    assert got["a"][10] == 99 and got["view"][0] == 99
    zeros = tx.zeros((3, 3), np.float32)
    assert zeros.sum() == 0


def test_release_and_reuse_keeps_reserved_bytes_flat(chan):
    tx, rx = chan
    reserved = set()
    for i in range(10_000):
        tx.send({"i": i, "x": np.full(1024, i, dtype=np.int32)})
        got = rx.recv(timeout=5)
        assert got["i"] == i and got["x"][0] == i
        del got
        if i % 500 == 0:
            reserved.add(tx.memory_stats()["reserved_bytes.all.current"])
    assert reserved == {2 << 20}  # one small-pool segment, reused 10,000 times
    assert settle(tx)
    assert tx.statistics().segments_announced == 1
    tx._pool.check_invariants()  # its books, and its allocator's


def test_spare_blocks_skip_the_allocator_and_give_way_when_room_is_short():
    limit = 16 << 20
    tx, rx = shmshare.channel(limit=limit)
    for i in range(300):
        a = tx.empty(4096, np.uint8)
        a.fill(i & 0xFF)
        tx.send({"x": a})
        del a
        assert rx.recv(timeout=5)["x"][4095] == i & 0xFF  # dropped at once: released
    assert settle(tx)
    st = tx.statistics()
    assert 0 < st.spare_bytes <= limit // 8
    assert tx.memory_stats()["allocation.all.allocated"] < 150  # most came from spares
    held = []
    for _ in range(14):  # 1 MiB blocks, all held by the receiver, then all released
        tx.send(np.ones(1 << 20, np.uint8))
        held.append(rx.recv(timeout=5))
    del held
    assert settle(tx)
    assert 0 < tx.statistics().spare_bytes <= limit // 8
    big = tx.empty(15 << 20, np.uint8, timeout=5)  # needs every byte, the spares' included
    assert tx.statistics().spare_bytes == 0
    del big
    tx._pool.check_invariants()  # its books, and its allocator's
    tx.close()
    rx.close()


def test_zero_byte_items_round_trip(chan):
    tx, rx = chan
    tx.send({"v": np.empty((3, 2), "V0"), "s": np.empty(4, np.dtype([]))})
    got = rx.recv(timeout=5)
    assert got["v"].shape == (3, 2) and got["v"].dtype == np.dtype("V0")
    assert got["s"].shape == (4,) and got["s"].dtype.itemsize == 0


def test_a_send_from_inside_a_send_is_refused_clearly(chan):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    tx, rx = chan
    calls = []

    class Chatty(torch.Tensor):  # user code that runs while the outer send packs its batch
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if not calls:
                calls.append(func)
                tx.send({"inner": 1})
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.arange(4.0).as_subclass(Chatty)
    with pytest.raises(RuntimeError, match=r"send\(\) was called while this thread's send"):
        tx.send({"outer": t})
    assert calls and tx.statistics().leases_out == 0
    tx.send({"after": 2})  # the sender is fine, and nothing of the failed sends went out
    assert rx.recv(timeout=5) == {"after": 2}


def test_a_batch_of_many_fixed_sizes_and_one_changing_keeps_its_spares(chan):
    tx, rx = chan
    images = [1024 + 512 * k for k in range(70)]  # 70 fixed sizes, more than _SPARE_IDLE
    mallocs = []
    for step in range(20):
        batch = {"ragged": np.ones(100_000 + 4096 * step, np.uint8),  # a new size every batch
                 "label": np.ones(300, np.int64),
                 "images": [tx.empty(n, np.uint8) for n in images]}
        tx.send(batch)
        del batch
        rx.recv(timeout=5)  # dropped at once
        assert settle(tx)
        mallocs.append(tx.memory_stats()["allocation.all.allocated"])
    # once warm, each batch asks the allocator for its one new size only: the fixed sizes are
    # asked for in every send, so their spares never count as idle
    assert [b - a for a, b in itertools.pairwise(mallocs[4:])] == [1] * 15


def test_ever_changing_sizes_do_not_grow_the_pool(chan):
    import random

    tx, rx = chan
    rng = random.Random(0)
    for _ in range(3000):
        tx.send(np.ones(rng.randrange(1000, 300_000), np.uint8))
        rx.recv(timeout=5)
    # spares of sizes no longer asked for go back (Note [Spare blocks]): without that, this
    # held ~68 MiB (every spare distinct, none reused) where the allocator alone needs ~10
    assert tx.memory_stats()["reserved_bytes.all.peak"] <= 24 << 20
    assert len(tx._pool.spares) <= 2 * 64


def test_large_releases_go_back_at_once_so_the_pool_stays_small(chan):
    tx, rx = chan
    for i in range(200):
        a = tx.empty(1 << 20, np.uint8)
        a[::4096] = i & 0xFF
        tx.send(a)
        del a
        assert rx.recv(timeout=5)[4096] == i & 0xFF  # dropped at once: 1 MiB released
    # Releases of 1 MiB or more are sent by the next recv(), not kept for a batch of 64
    # (64 MiB of pool), and the sender takes them in before it asks for a fresh block.
    assert tx.memory_stats()["reserved_bytes.all.peak"] <= 8 << 20


def test_block_is_not_reused_while_the_receiver_holds_it(chan):
    tx, rx = chan
    tx.send(np.full(1000, 1, dtype=np.int32))
    held = rx.recv(timeout=5)
    for k in range(50):
        tx.send(np.full(1000, k + 2, dtype=np.int32))
        rx.recv(timeout=5)  # dropped at once: its block is free again
    assert np.all(held == 1)  # never overwritten
    del held
    assert settle(tx)


def test_back_pressure_waits_then_raises_pool_exhausted(chan):
    tx, rx = shmshare.channel(limit=8 << 20)
    kept = []
    with pytest.raises(PoolExhausted, match=r"the receiver still holds \d+ bytes in \d+ arrays"):
        for _ in range(100):
            tx.send(np.ones(1 << 20, dtype=np.uint8), timeout=0.3)
            kept.append(rx.recv(timeout=5))
    assert 2 <= len(kept) <= 8
    kept.clear()  # the receiver lets go: the sender can go on
    gc.collect()
    rx._flush()
    tx.send(np.ones(1 << 20, dtype=np.uint8), timeout=5)
    assert rx.recv(timeout=5).sum() == 1 << 20
    with pytest.raises(PoolExhausted, match="cannot fit in this sender's pool"):
        tx.send(np.ones(16 << 20, dtype=np.uint8))
    tx.close()
    rx.close()


def test_failed_send_lends_nothing(chan):
    tx, rx = chan
    with pytest.raises(TypeError, match="object references"):
        tx.send({"ok": np.ones(10), "bad": np.array([object()])})
    st = tx.statistics()
    assert st.leases_out == 0
    assert tx.memory_stats()["allocated_bytes.all.current"] == st.spare_bytes  # kept for reuse
    tx.empty_cache()
    assert tx.statistics().spare_bytes == 0
    assert tx.memory_stats()["allocated_bytes.all.current"] == 0
    tx.send({"after": np.arange(3)})
    np.testing.assert_array_equal(rx.recv(timeout=5)["after"], np.arange(3))


def test_arrays_outlive_a_closed_sender(chan):
    tx, rx = chan
    tx.send({"x": np.arange(100_000)})
    got = rx.recv(timeout=5)
    tx.close()
    with pytest.raises(PeerDied, match="closed the channel"):
        rx.recv(timeout=5)
    assert got["x"].sum() == sum(range(100_000))


def test_iteration_ends_when_the_sender_closes():
    tx, rx = shmshare.channel()
    for i in range(3):
        tx.send(i)
    tx.close()
    assert list(rx) == [0, 1, 2]
    rx.close()


def test_send_after_receiver_closed_is_peer_died(chan):
    tx, rx = chan
    tx.send(np.ones(3))
    rx.close()
    with pytest.raises(PeerDied):
        for _ in range(100):
            tx.send(np.ones(3))
    assert tx.statistics().leases_out == 0  # all reclaimed at once


def test_poll_and_selector(chan):
    tx, rx = chan
    assert not rx.poll(0)
    tx.send(1)
    with selectors.DefaultSelector() as sel:
        sel.register(rx, selectors.EVENT_READ)
        assert sel.select(5)
    assert rx.recv(timeout=5) == 1


def test_torch_tensors_come_back_as_tensors():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    tx, rx = shmshare.channel()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bf = torch.linspace(0, 1, 8, dtype=torch.bfloat16)
    tx.send({"t": t.t(), "bf": bf, "in_pool": tx.zeros((2, 2), torch.float16)})
    got = rx.recv(timeout=5)
    assert isinstance(got["t"], torch.Tensor) and torch.equal(got["t"], t.t())
    assert got["bf"].dtype == torch.bfloat16 and torch.equal(got["bf"], bf)
    assert got["in_pool"].dtype == torch.float16 and got["in_pool"].sum() == 0
    del got
    tx.close()
    rx.close()


def test_expandable_pool_announces_growth_not_new_fds():
    tx, rx = shmshare.channel(config="expandable_segments:True")
    sizes = [1 << 20, 3 << 20, 9 << 20, 17 << 20, 33 << 20]
    held = []
    for k, n in enumerate(sizes):
        tx.send({"k": k, "x": np.full(n, k + 1, dtype=np.uint8)})
        held.append(rx.recv(timeout=10))
    for k, got in enumerate(held):
        assert got["x"].size == sizes[k] and int(got["x"][-1]) == k + 1
    st = tx.statistics()
    assert st.segments_announced <= 2  # one small, one large expandable segment
    del held, got
    tx._pool.check_invariants()  # its books, and its allocator's
    tx.close()
    rx.close()


def _raw_sender():
    a, b = wire.pipe()
    return a, Receiver([b])


def _bad_batches(seg, unsealed):
    from shmshare.tensors import ArrayDesc

    def tree(x):
        return msgpack.packb(x)

    yield ({"k": "m", "b": tree(ArrayDesc(77, 1, 0, "<f4", (4,), (4,)).pack())}, [],
           "segment 77, which it never announced")
    yield {"k": "zz"}, [], "unexpected message kind 'zz'"
    yield ({"k": "m", "s": [[5, 4096, False]],
            "b": tree(ArrayDesc(5, 1, 4000, "<f8", (100,), (8,)).pack())}, [seg],
           "outside the mapped part of segment 5")
    yield {"k": "m", "s": [[6, 4096, False]], "b": None}, [], "1 new segments were announced with 0"
    yield ({"k": "m", "s": [[5, 4096, False]], "b": tree(ArrayDesc(5, 1, 0, "|O", (4,), (8,)).pack())},
           [seg], "holds object references")
    yield ({"k": "m", "b": tree(ArrayDesc(0, 0, 0, "<f8", (1 << 30,), (8,)).pack())}, [],
           "without memory has shape")
    yield {"k": "m", "s": [[7, 4096, False]], "b": None}, [unsealed], "not a memfd sealed"
    yield ({"k": "m", "s": [[8, 1 << 20, True]], "g": [[8, 0, 8192]], "b": None}, [seg],
           "of 4096 bytes was announced as 8192 bytes")
    yield {"k": "m", "b": tree(msgpack.ExtType(1, b"short"))}, [], "malformed array descriptor"
    yield {"k": "m", "b": [1, 2]}, [], "must carry its packed tree as bytes, got list"
    yield ({"k": "m", "s": [[5, 4096, False]],
            "b": tree(ArrayDesc(5, 1, 0, "|S0", (-1,), (0,)).pack())}, [seg], "none negative")


@pytest.mark.parametrize("case", range(11))
def test_a_bad_batch_drops_the_connection_and_says_why(case):
    seg = shmshare.Segment.create(4096)
    unsealed = os.memfd_create("shmshare_unsealed")
    os.ftruncate(unsealed, 4096)
    header, fds, match = list(_bad_batches(seg, unsealed))[case]
    a, rx = _raw_sender()
    a.send(header, fds=fds)
    seg.close()
    os.close(unsealed)
    with pytest.raises(ProtocolError, match=match) as err:
        rx.recv(timeout=5)
    assert any("connection to the sender" in n for n in err.value.__notes__)
    with pytest.raises(PeerDied):
        rx.recv(timeout=5)  # the receiver let go of the connection...
    with pytest.raises(PeerDied):
        for _ in range(100):
            a.send({"k": "m", "b": 1})  # ...so its sender learns it at once
    a.close()
    rx.close()


def test_segments_the_sender_gives_back_are_unmapped_by_the_receiver(chan):
    from shmshare._procfs import shm_mappings

    tx, rx = chan
    tag = f"shmshare_{os.getpid()}_"
    tx.send(np.ones(3 << 20, dtype=np.uint8))  # a 20 MiB large-pool segment
    got = rx.recv(timeout=5)
    both = len(shm_mappings(contains=tag))  # the sender's mapping and the receiver's
    del got
    assert settle(tx)
    tx.empty_cache()  # the sender gives the segment back to the host...
    assert len(shm_mappings(contains=tag)) == both - 1
    tx.send(1)  # ...and says so with its next message
    assert rx.recv(timeout=5) == 1
    assert len(shm_mappings(contains=tag)) == both - 2


@pytest.mark.parametrize("how", ["sender closes", "receiver closes"])
def test_expandable_pages_a_receiver_holds_survive_the_channel_closing(how):
    tx, rx = shmshare.channel(config="expandable_segments:True")
    tx.send(np.full(7 << 20, 1, dtype=np.uint8))
    got = rx.recv(timeout=5)
    if how == "sender closes":
        tx.close()
    else:
        rx.close()
        tx.poll_releases()  # the sender sees the receiver go and takes every lease back
    tx.empty_cache()  # unmaps the pages on the sender's side: they must not be hole-punched
    assert int(got.sum()) == 7 << 20
    del got
    tx.close()
    rx.close()


def test_arrays_dying_after_close_write_nowhere():
    tx, rx = shmshare.channel()
    tx.send(np.ones(10))
    got = rx.recv(timeout=5)
    rx.close()
    r, w = os.pipe()  # likely to reuse the wake-up pipe's fd numbers
    try:
        del got
        gc.collect()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # nothing was written into the new pipe
    finally:
        os.close(r)
        os.close(w)
    tx.close()


def test_a_request_larger_than_an_empty_pool_fails_at_once():
    tx, rx = shmshare.channel(limit=2 << 20)
    with pytest.raises(PoolExhausted, match=r"even when it is empty.*create it with a limit= of \d+ bytes or more"):
        tx.send(np.ones((1 << 20) + 1, np.uint8))  # past 1 MiB: the large pool's segment is 20 MiB
    tx.close()
    rx.close()


def test_received_fds_are_close_on_exec():
    import fcntl

    a, b = wire.pipe()
    seg = shmshare.Segment.create(4096)
    a.send({}, fds=[seg])
    _, fds = b.recv(timeout=5)
    assert fcntl.fcntl(fds[0].fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    fds[0].close()
    seg.close()
    a.close()
    b.close()


def test_lease_ids_are_unique_per_process(chan):
    tx, rx = chan
    tx.send(np.ones(64))  # past INLINE_BYTES: a pool block, lent
    (lease,) = tx._leases
    assert lease >> 32 == os.getpid()  # a forked child's ids never collide with its parent's
    del rx


@pytest.mark.parametrize(("limit", "error", "match"), [
    ("1G", TypeError, "limit must be an int of bytes"),
    (1.5, TypeError, "limit must be an int of bytes"),
    (0, ValueError, "limit must be a positive number of bytes"),
    (True, ValueError, "limit must be a positive number of bytes"),
    (1 << 20, ValueError, r"less than the pool's smallest segment \(2097152 bytes, 2 MiB\): no array would ever "
                          r"fit. Pass limit=2097152 or more"),
])
def test_a_limit_that_is_not_a_number_of_bytes_is_refused_at_once(limit, error, match):
    with pytest.raises(error, match=match):
        shmshare.channel(limit=limit)
    a, b = wire.pipe()
    try:
        with pytest.raises(error, match=match):  # a Sender made by hand too
            Sender(a, limit=limit)
    finally:
        a.close()
        b.close()


def test_a_shape_of_more_bytes_than_an_address_space_is_a_value_error(chan):
    tx, _ = chan
    for shape in [(1 << 62, 1 << 62), [1 << 40, 1 << 40], 1 << 63]:
        with pytest.raises(ValueError, match="more than this process can address: the shape is wrong"):
            tx.empty(shape, np.uint16)


@pytest.mark.parametrize("bad", [-1, float("nan"), "1", True, [1], 10**400, np.float64("nan")])
def test_a_timeout_that_is_not_seconds_is_refused_by_every_call_that_waits(chan, bad):
    tx, rx = chan
    for what, call in [("send", lambda: tx.send(np.ones(64), timeout=bad)),
                       ("send", lambda: tx.send(np.ones(4), timeout=bad)),  # by value, the fast lane
                       ("send_many", lambda: tx.send_many([np.ones(4)], timeout=bad)),
                       ("empty", lambda: tx.empty(4, timeout=bad)),
                       ("recv_note", lambda: tx.recv_note(timeout=bad)),
                       ("recv", lambda: rx.recv(timeout=bad)),
                       ("recv", lambda: rx.recv_many(4, timeout=bad)),
                       ("recv", lambda: rx.recv_from(timeout=bad)),
                       ("poll", lambda: rx.poll(bad)),
                       ("tell", lambda: rx.tell(0, "x", timeout=bad)),
                       ("connect", lambda: shmshare.connect("/nonexistent/x.sock", timeout=bad))]:
        with pytest.raises(ValueError, match=rf"^{what}\(timeout=\.\.\.\) takes None or seconds >= 0, got"):
            call()
    assert tx.statistics().messages_sent == 0  # nothing went
    tx.send(np.ones(4), timeout=0)  # 0: no wait
    assert rx.recv(timeout=0.0).shape == (4,)


@pytest.mark.parametrize(("name", "value", "match"), [
    ("SHMSHARE_RINGS", "2", "must be 1"),
    ("SHMSHARE_SPIN_US", "abc", "is not a number of microseconds"),
])
def test_ring_settings_are_checked_when_the_channel_is_made(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)  # not at the first send of a child, where only its stderr says so
    with pytest.raises(ValueError, match=match):
        shmshare.channel()


def test_a_socket_path_too_long_says_so(tmp_path):
    path = str(tmp_path / ("d" * 120) / "s.sock")
    with pytest.raises(OSError, match="holds at most 107 bytes"):
        shmshare.listen(path)
    with pytest.raises(OSError, match="holds at most 107 bytes"):
        shmshare.connect(str(tmp_path / ("e" * 120)))
