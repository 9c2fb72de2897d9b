"""The per-message path of a handle: its signature with a key hashed once, the checks of a
layout kept per layout (whatever a peer sent before), a storage's bytes moved either side of the
small-copy threshold, a tensor that is all of its storage on the receiver, and releases sent by
the flusher whether it was idle or busy."""

from __future__ import annotations

import gc
import os
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import shmshare.multiprocessing as smp
from shmshare.multiprocessing import _client, _layouts, _owner, _reduce, _storages, _table
from shmshare.testing import pattern, wait_until
from tests.mp import helpers
from tests.mp.helpers import WAIT


@pytest.mark.parametrize("fields", [
    (1, 4096, 0, 4096, 0, 0, 1, False),
    ((1 << 40) + 3, 1 << 21, 8192, 64, -56, 131071, 0xFFFFFFFF, True),
    (1, 1 << 63, 0, 8, 0, 0, 1, False),  # past what the fields hold: no signature at all
    (1, 4096, 0, 8, 0, -1 << 64, 1, False),
])
def test_a_signer_signs_as_sign_does(fields):
    secret = os.urandom(16)
    want = _table.sign(secret, *fields)
    assert _table.Signer(secret)(*fields) == want
    if want:  # another key, another signature
        assert _table.Signer(os.urandom(16))(*fields) != want


def test_claimed_reads_the_word_as_state_does():
    table = _table.LeaseTable(4)
    try:
        slot, gen = table.take()
        assert not table.claimed(slot, gen)  # PENDING
        table.words[slot] = _table.word(gen, _table.CLAIMED, 1234)
        assert table.claimed(slot, gen) and not table.claimed(slot, gen + 1)
        table.words[slot] = _table.word(gen + 1, _table.CLAIMED, 1234)
        assert not table.claimed(slot, gen)
        table.words[slot] = (1 << 64) - 1  # anything a peer may write
        assert table.claimed(slot, 0xFFFFFFFF) == (table.state(slot)[:2] == (0xFFFFFFFF, _table.CLAIMED))
    finally:
        table.close()


def _signed_args(ow: _owner.Owner, **change: object) -> dict[str, object]:
    seg_id, size, start, span, lo, strides, slot, gen = ow.place(np.ones(1 << 9))
    args: dict[str, object] = dict(pid=ow.pid, token=ow.token, path=ow.path, seg_id=seg_id, size=size,
                                   start=start, span=span, lo=lo, strides=strides, slot=slot, gen=gen,
                                   dtype="<f8", shape=(1 << 9,))
    args.update(change)
    # signed as the owner signs (a peer holding its key): the checks behind the signature hold
    args["mac"] = _table.sign(ow.secret, args["seg_id"], args["size"], args["start"], args["span"],
                              args["lo"], args["slot"], args["gen"], False)
    return args


@pytest.mark.parametrize("shape,strides", [
    ((1 << 10,), (8,)),  # more than the span
    ((1 << 9, 1), (8,)),  # a stride short
    ((-1,), (8,)),  # a negative size
    ((1,) * 65, (8,) * 65),  # more dimensions than numpy has
])
def test_a_malformed_layout_is_refused_the_first_time_and_every_time_after(shape, strides):
    ForkingPickler.dumps(np.ones(1 << 12))  # a server to talk to
    ow = _owner.current_owner()
    assert ow is not None
    for _ in range(3):  # the second and third find the layout kept
        with pytest.raises(smp.HandleError, match="malformed handle"):
            _client.rebuild_array(**_signed_args(ow, shape=shape, strides=strides))


def test_a_layout_a_peer_sent_as_lists_or_floats_changes_nothing_for_the_next_handle():
    ForkingPickler.dumps(np.ones(1 << 12))
    ow = _owner.current_owner()
    assert ow is not None
    # lists: checked as tuples are, and never kept (a list cannot be a key)
    got = _client.rebuild_array(**_signed_args(ow, shape=[1 << 9], strides=[8]))
    assert got.shape == (1 << 9,) and float(got.sum()) == 1 << 9
    assert not any(isinstance(k[1], list) for k in _layouts._extents)
    with pytest.raises(smp.HandleError):  # floats: numpy refuses them; kept, they equal the ints
        _client.rebuild_array(**_signed_args(ow, shape=(float(1 << 9),), strides=(8.0,)))
    got2 = _client.rebuild_array(**_signed_args(ow))
    assert got2.shape == (1 << 9,) and float(got2.sum()) == 1 << 9
    del got, got2


def test_the_layouts_kept_stay_bounded(monkeypatch):
    monkeypatch.setattr(_layouts, "_extents", {})
    monkeypatch.setattr(_layouts, "_reaches", {})
    for n in range(1, 3000):  # a peer sending ever new shapes
        assert _layouts.extent(1, (n,), (1,)) == (0, n)
        assert _layouts.reach((n,), (1,)) == n - 1
    assert len(_layouts._extents) <= 1025 and len(_layouts._reaches) <= 1025


def test_a_tensor_handle_with_no_torch_dtype_is_refused():
    st = torch.arange(64.0).untyped_storage()
    for name in ("Tensor", "no_such_dtype", 3, None):
        _fn, (handle,) = _reduce.reduce_storage(st)
        with pytest.raises(smp.HandleError, match="no torch dtype"):
            _reduce.rebuild_tensor(handle, name, 0, (64,), (1,), False, False)
    del st


def test_a_tensor_handle_past_its_storage_is_refused_after_a_good_one_of_its_layout():
    t = torch.arange(64.0)
    fn, args = _reduce.reduce_tensor(t)
    got = fn(*args)
    assert torch.equal(got, t)
    _handle, name, _offset, size, stride, rg, param = args
    _fn, (handle2,) = _reduce.reduce_storage(t.untyped_storage())
    with pytest.raises(smp.HandleError, match="reaches past"):  # the same layout, one further
        fn(handle2, name, 1, size, stride, rg, param)
    _fn, (handle3,) = _reduce.reduce_storage(t.untyped_storage())
    with pytest.raises(smp.HandleError, match="reaches past"):  # a negative stride
        fn(handle3, name, 63, size, (-1,), rg, param)
    del got


@pytest.mark.parametrize("nbytes", [
    1, 4095, 4096, 4097,
    _storages._SMALL_COPY - 1, _storages._SMALL_COPY, _storages._SMALL_COPY + 4097,
])
def test_a_storage_moves_into_the_pool_with_every_byte_either_side_of_the_small_copy_threshold(nbytes):
    want = torch.from_numpy(pattern(nbytes, nbytes, np.uint8))
    t = want.clone()
    kept = t[nbytes // 2:]  # a view never sent: it follows the storage
    where = t.data_ptr()
    before = smp.statistics().arrays_copied
    data = ForkingPickler.dumps(t)
    assert t.data_ptr() != where and t.is_shared() and _storages.is_ours(t.untyped_storage())
    assert smp.statistics().arrays_copied == before + 1
    assert torch.equal(t, want) and torch.equal(kept, want[nbytes // 2:])
    got = ForkingPickler.loads(data)  # the sender's own storage, as torch gives it back
    assert got.untyped_storage()._cdata == t.untyped_storage()._cdata and torch.equal(got, want)
    del got, t, kept


def test_place_bytes_leases_bytes_of_a_pool_block_and_nothing_else():
    a = smp.empty((4096,), np.uint8)
    a[:] = pattern(5, 4096, np.uint8)
    ow = _owner.current_owner()
    assert ow is not None
    assert ow.place_bytes(np.zeros(64, np.uint8).ctypes.data, 64) == (False, None)  # not ours
    before = smp.statistics()
    inside, got = ow.place_bytes(a.ctypes.data + 100, 200)  # bytes inside the block
    assert inside and got is not None
    seg_id, size, start, span, lo, strides, slot, gen = got
    assert (span, lo, strides) == (200, 0, (1,)) and ow.table.state(slot)[:2] == (gen, _table.PENDING)
    after = smp.statistics()
    assert (after.arrays_in_place, after.arrays_copied) == (before.arrays_in_place + 1, before.arrays_copied)
    view = _client.rebuild_array(ow.pid, ow.token, ow.path, seg_id, size, start, span, lo, strides, slot,
                                 gen, "|u1", (200,), False, ow.sign(got, False))
    assert bytes(view) == bytes(a[100:300])
    block = ow.pool.find(a.ctypes.data, 1).block
    assert ow.place_bytes(block.address + block.size - 100, 200) == (False, None)  # past its end
    del view, a


def test_a_storage_moved_while_its_sender_waited_for_its_lock_is_not_moved_again():
    """share() found the bytes outside the pool, then another thread moved the storage before
    _share() had its lock: _share() looks again (the address changed) and leases it in place."""
    t = torch.arange(1024, dtype=torch.uint8)
    missed = t.data_ptr()
    ow = _owner.owner()
    first = _storages.share(t.untyped_storage())  # the other thread's move
    moved_to = t.data_ptr()
    assert moved_to != missed
    before = smp.statistics()
    again = _storages._share(t.untyped_storage(), ow, missed)
    after = smp.statistics()
    assert t.data_ptr() == moved_to and again is not None and again[3:6] == first[3:6]  # segment, start
    assert (after.arrays_in_place, after.arrays_copied) == (before.arrays_in_place + 1, before.arrays_copied)
    del t


def _describe(inq, outq) -> None:
    got = inq.get(timeout=WAIT)
    outq.put([(str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset(), t._is_view(),
               t.requires_grad, type(t).__name__, bool(t.is_shared()), t.untyped_storage()._cdata,
               helpers.tensor_is_handle_view(t), helpers.fingerprint(t)) for t in got])
    got[0].fill_(7)  # through a tensor made over all of its storage: the sender sees it
    outq.put("written")
    del got


def test_a_tensor_over_all_of_its_storage_arrives_as_any_other():
    """On the receiver, the tensor that a storage is made from is the tensor that arrives, when it
    is all of that storage (Note [A tensor's storage moves into the pool]): the same dtype,
    shape, strides, sharing and aliasing as a tensor set_() on the storage, and not a view."""
    base = torch.arange(256, dtype=torch.float32)
    sent = [base, base[3:17], torch.ones(64, dtype=torch.bool), torch.arange(5, dtype=torch.int64),
            torch.arange(8, dtype=torch.bfloat16),  # no numpy dtype: set_() on the storage
            torch.arange(4.0).requires_grad_(), torch.nn.Parameter(torch.ones(3)),
            torch.arange(12, dtype=torch.int16).reshape(3, 4),  # 2-D: set_()
            torch.arange(6.0).to(torch.complex64)]
    want = [helpers.fingerprint(t) for t in sent]
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_describe, inq, outq):
            inq.put(sent)
            got = outq.get(timeout=WAIT)
            assert outq.get(timeout=WAIT) == "written"
        assert [g[-1] for g in got] == want
        for (dtype, shape, stride, offset, is_view, rg, cls, shared, _cd, handle_view, _fp), t in zip(
                got, sent, strict=True):
            assert (dtype, shape, stride, offset) == (str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset())
            assert not is_view and rg == t.requires_grad and cls == type(t).__name__ and shared and handle_view
        assert got[0][8] == got[1][8]  # a storage and a view of it, sent together: one storage there
        assert base.eq(7).all()  # written there through the whole-storage tensor
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)


def _drop_and_count(how_many: int) -> None:
    arrays = [ForkingPickler.loads(ForkingPickler.dumps(np.full(1 << 10, k % 256, np.uint8)))
              for k in range(how_many)]
    assert [int(a[0]) for a in arrays] == [k % 256 for k in range(how_many)]
    del arrays
    gc.collect()
    wait_until(lambda: smp.statistics().handles_claimed == 0,
               lambda: f"every release back ({smp.statistics().handles_claimed} claimed)", WAIT)


def test_releases_go_back_whether_the_flusher_was_idle_or_sending():
    _drop_and_count(1)  # an idle flusher, woken
    _drop_and_count(300)  # many at once
    c = _client.client()
    wait_until(lambda: not c.waker.armed, "the flusher back in poll(), disarmed", WAIT)
    _drop_and_count(1)  # idle again: the next release must still wake it
    # a stream: each release while the flusher sleeps between sends
    held = [ForkingPickler.loads(ForkingPickler.dumps(np.full(1 << 10, k, np.uint8))) for k in range(64)]
    while held:
        held.pop()
        if len(held) % 8 == 0:
            wait_until(lambda: smp.statistics().handles_claimed == len(held),
                       lambda: f"{len(held)} claimed ({smp.statistics().handles_claimed})", WAIT)
    assert smp.statistics().handles_claimed == 0
