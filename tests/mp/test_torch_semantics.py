"""torch.multiprocessing's semantics for CPU tensors (Note [A tensor's storage moves into the
pool]): a tensor sent is shared, both ways, with every view of its storage; views sent together or
apart alias on the receiver; the sender gets its own storage back; is_shared() and
share_memory_() agree; and no fd is kept per tensor."""

from __future__ import annotations

import multiprocessing.resource_sharer
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import shmshare.multiprocessing as smp
from shmshare.multiprocessing import _reduce
from shmshare.testing import wait_until
from tests.mp import helpers
from tests.mp.helpers import WAIT


def _get(q):
    return q.get(timeout=WAIT) if hasattr(q, "get_nowait") else q.get()  # a SimpleQueue has no timeout


def _fill_and_report(inq, outq):
    data = _get(inq)
    data[0][:] = 4  # through the first tensor; the second is a view of the same storage
    outq.put((float(data[1].sum()), data[0].untyped_storage()._cdata == data[1].untyped_storage()._cdata,
              data[0].is_shared()))
    assert _get(inq) == "read"  # the parent wrote meanwhile
    outq.put(float(data[0][0, 0]))
    del data


@pytest.mark.parametrize("how", ["queue", "simple queue"])
def test_a_sent_tensor_is_shared_both_ways_with_every_view_of_it(how):
    x = torch.zeros(5, 5)
    kept = x[2:]  # a view made before the send, never sent: it follows its storage too
    ctx = smp.get_context("fork")
    inq = ctx.Queue() if how == "queue" else ctx.SimpleQueue()
    outq = ctx.Queue()
    try:
        with helpers.child(_fill_and_report, inq, outq):
            inq.put([x, x[:, 1]])
            col_sum, aliased, shared_there = outq.get(timeout=WAIT)
            assert (col_sum, aliased, shared_there) == (20.0, True, True)
            assert x.eq(4).all() and kept.eq(4).all()
            assert x.is_shared()
            x[0, 0] = 9  # and back: the child reads what we wrote
            inq.put("read")
            assert outq.get(timeout=WAIT) == 9.0
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)


def _simple_pool_fill(t):
    t.fill_(4)
    return t.add(1)


def test_pool_map_writes_into_its_arguments_as_torch_does():
    buffers = [torch.zeros(2, 2) for _ in range(4)]
    with smp.get_context("fork").Pool(2) as pool:
        results = pool.map(_simple_pool_fill, buffers, 1)
    assert all(torch.equal(r, torch.full((2, 2), 5.0)) for r in results)
    assert all(torch.equal(b, torch.full((2, 2), 4.0)) for b in buffers)


def test_the_sender_unpickles_its_own_storage_and_views_alias():
    """torch's test_fd_preserve_sharing: in the process that sent them, what comes back is the
    very storage it sent (its _cdata), and every view of it."""
    x = torch.randn(5, 5)
    data = [x.untyped_storage(), x, x[2], x[:, 1]]
    q = smp.get_context("fork").Queue()
    try:
        q.put(data)
        got = q.get(timeout=WAIT)
    finally:
        helpers.close_queue(q)
    assert got[0]._cdata == x.untyped_storage()._cdata
    assert all(t.untyped_storage()._cdata == x.untyped_storage()._cdata for t in got[1:])
    assert torch.equal(got[2], x[2]) and torch.equal(got[3], x[:, 1])


def _views_apart(inq, outq):
    a = inq.get(timeout=WAIT)
    b = inq.get(timeout=WAIT)  # a view of the same storage, in a later message
    b[0] = -3.0
    outq.put((a.untyped_storage()._cdata == b.untyped_storage()._cdata, float(a[1, 0])))
    del a, b


def test_views_sent_in_different_messages_alias_on_the_receiver():
    x = torch.arange(12.0).reshape(3, 4)
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_views_apart, inq, outq):
            inq.put(x)
            inq.put(x[1])
            assert outq.get(timeout=WAIT) == (True, -3.0)
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
    assert float(x[1, 0]) == -3.0


def test_share_memory_after_a_send_leaves_the_storage_in_the_pool():
    """Note [is_shared of our storages]: torch's share_memory_() would move it again, silently
    ending its sharing with every receiver."""
    x = torch.ones(64)
    ForkingPickler.dumps(x)  # what a Queue does: x's storage is in the pool now
    where = x.data_ptr()
    assert x.is_shared()
    assert x.share_memory_() is x and x.data_ptr() == where
    y = torch.ones(64)
    assert not y.is_shared()  # torch's answers for every other storage
    y.share_memory_()
    assert y.is_shared() and y.untyped_storage()._get_shared_fd() >= 0


def _keep_all(inq, outq, n):
    kept = [inq.get(timeout=WAIT) for _ in range(n)]
    outq.put((len(os.listdir("/proc/self/fd")), sum(float(t[0]) for t in kept)))
    assert inq.get(timeout=WAIT) == "bye"
    del kept


def test_no_fd_per_tensor_on_either_side():
    """torch's file_descriptor strategy keeps an fd per shared storage in the sender and in the
    receiver ("too many open files"); here the fds are the pool's segments, a few in all."""
    n = 300
    tensors = [torch.full((16,), float(i)) for i in range(n)]
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    mine_before = len(os.listdir("/proc/self/fd"))
    try:
        with helpers.child(_keep_all, inq, outq, n) as c:
            theirs_before = len(os.listdir(f"/proc/{c.pid}/fd"))
            for t in tensors:
                inq.put(t)
            theirs_after, total = outq.get(timeout=WAIT)
            mine_after = len(os.listdir("/proc/self/fd"))
            inq.put("bye")
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
    assert total == sum(range(n))
    assert all(t.is_shared() for t in tensors)
    assert mine_after - mine_before < 20, (mine_before, mine_after)
    assert theirs_after - theirs_before < 20, (theirs_before, theirs_after)


def test_hogwild_parameters_passed_to_a_spawned_process_are_shared():
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    ctx = smp.get_context("spawn")
    outq = ctx.Queue()
    try:
        with helpers.child(helpers.add_one_to_parameters, model, outq, method="spawn"):
            assert outq.get(timeout=WAIT) == [True, True]
    finally:
        helpers.close_queue(outq)
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old + 1)
        assert type(p) is torch.nn.Parameter and p.requires_grad


def _send_back_then_write(inq, outq):
    t = inq.get(timeout=WAIT)
    outq.put(t)  # received from the parent and sent on: the parent's own memory (Note [Lending on])
    assert inq.get(timeout=WAIT) == "write"
    t[0] = 8.0
    outq.put("written")
    del t


def test_a_received_tensor_sent_back_is_the_senders_own_storage():
    x = torch.arange(100.0)
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_send_back_then_write, inq, outq):
            inq.put(x)
            back = outq.get(timeout=WAIT)
            assert back.untyped_storage()._cdata == x.untyped_storage()._cdata
            inq.put("write")
            assert outq.get(timeout=WAIT) == "written"
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
    assert float(x[0]) == 8.0 and float(back[0]) == 8.0  # the child's write, after it sent t on


def _pass_on(inq, midq):
    t = inq.get(timeout=WAIT)
    midq.put(t[::2])  # a view of what it received, to a third process
    assert inq.get(timeout=WAIT) == "done"
    del t


def _write_at_the_end(midq, outq):
    v = midq.get(timeout=WAIT)
    v[:] = -1.0
    outq.put((v.is_shared(), float(v.sum())))
    del v


def test_a_tensor_passed_along_a_pipeline_stays_the_first_senders_memory():
    x = torch.zeros(10)
    ctx = smp.get_context("fork")
    inq, midq, outq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_pass_on, inq, midq), helpers.child(_write_at_the_end, midq, outq):
            inq.put(x)
            assert outq.get(timeout=WAIT) == (True, -5.0)
            inq.put("done")
    finally:
        for q in (inq, midq, outq):
            helpers.close_queue(q)
    assert x.tolist() == [-1.0, 0.0] * 5


def test_a_lend_request_for_a_lease_the_peer_does_not_hold_lends_nothing():
    from shmshare.multiprocessing import _client, _owner

    x = torch.ones(64)
    handle = ForkingPickler.dumps(x)  # a pending handle of ours: slot 0 or so, claimed by nobody
    ow = _owner.current_owner()
    assert ow is not None
    out_before = ow.statistics().handles_unclaimed
    link = _client.client().link(ow.pid, ow.token, ow.path)
    slot = next(iter(ow._slots))
    with pytest.raises(smp.HandleError, match="holds no lease"):
        link.lend_again(slot, ow.table.gens[slot])
    assert ow.statistics().handles_unclaimed == out_before
    got = ForkingPickler.loads(handle)
    assert got.untyped_storage()._cdata == x.untyped_storage()._cdata


def _resend_inherited(inq, outq, t):
    outq.put(t)  # a storage of the parent's pool, inherited at fork: sent as a copy
    assert inq.get(timeout=WAIT) == "write"  # the copy arrived: the write below is not in it
    t[1] = 6.0  # and t is still the parent's memory
    outq.put("written")
    del t


def test_a_forked_child_keeps_sharing_an_inherited_tensor_it_sends():
    x = torch.zeros(32)
    ForkingPickler.dumps(x)  # in the pool now, as after any send
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_resend_inherited, inq, outq, x):
            got = outq.get(timeout=WAIT)
            inq.put("write")
            assert outq.get(timeout=WAIT) == "written"
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
    assert torch.equal(got, torch.zeros(32))
    assert float(x[1]) == 6.0


def _put_and_exit(q):
    q.put(torch.arange(1000.0))


def test_a_tensor_stays_claimable_after_its_sender_exited():
    """Issue 21, item 5 for tensors: torch's fd sharer refuses once the producer is gone; here the
    keeper serves the storage's handle as it serves arrays'."""
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    try:
        with helpers.child(_put_and_exit, q) as c:
            assert c.join(WAIT) == 0
        got = q.get(timeout=WAIT)
    finally:
        helpers.close_queue(q)
    assert torch.equal(got, torch.arange(1000.0)) and got.is_shared()


def test_under_the_file_system_strategy_storages_are_torchs(monkeypatch):
    from torch.multiprocessing import reductions

    seen = []
    # torch's own would connect to its torch_shm_manager and name a file in /dev/shm: only
    # which reducer is called matters here
    monkeypatch.setattr(reductions, "reduce_storage", lambda st: seen.append(st) or (bytes, ()))
    prev = smp.get_sharing_strategy()
    smp.set_sharing_strategy("file_system")
    try:
        st = torch.ones(8).untyped_storage()
        assert _reduce.reduce_storage(st) == (bytes, ()) and seen == [st]
    finally:
        smp.set_sharing_strategy(prev)
    monkeypatch.undo()
    st = torch.ones(8).untyped_storage()
    fn, args = _reduce.reduce_storage(st)
    assert fn is _reduce.rebuild_storage
    assert pickle.loads(pickle.dumps(fn)) is fn and len(args) == 1


def test_an_empty_storage_goes_torchs_way():
    t = torch.tensor([])
    got = ForkingPickler.loads(ForkingPickler.dumps(t))
    assert got.shape == (0,) and smp.statistics().handles_pickled == 0


# -- what a hostile review found (each failed before its fix) ------------------------------------


def _write_ones(inq, outq, rounds):
    for _ in range(rounds):
        t = inq.get(timeout=WAIT)
        t.fill_(1.0)
        outq.put(True)
        del t


def test_share_memory_right_after_a_put_keeps_the_storage_shared():
    """The Queue's feeder moves the storage while the caller's share_memory_() looks at it: one
    lock (torch's, per storage) orders them, so the child's writes always reach the parent."""
    rounds = 20
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    lost = 0
    try:
        with helpers.child(_write_ones, inq, outq, rounds):
            for _ in range(rounds):
                t = torch.zeros(4096)
                inq.put(t)
                t.share_memory_()
                assert outq.get(timeout=WAIT)
                lost += float(t.sum()) != 4096.0
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)
    assert lost == 0, f"{lost} of {rounds} rounds lost the child's writes"


def _read_after(inq, outq, t):
    assert inq.get(timeout=WAIT) == "read"
    outq.put((float(t.sum()), t.is_shared()))
    del t


@pytest.mark.parametrize("made", ["moved by a send", "mp.empty"])
def test_a_forked_child_keeps_reading_what_it_inherited_after_the_parent_drops_it(made):
    """Note [Blocks a child inherits]: the parent's block is never reused under the child."""
    if made == "mp.empty":
        t = smp.empty(1024, torch.float32)
        t.fill_(1.0)
    else:
        t = torch.ones(1024)
        q = smp.get_context("fork").Queue()
        q.put(t)
        q.get(timeout=WAIT)  # moved, claimed and released: only t holds the block now
        helpers.close_queue(q)
    ctx = smp.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_read_after, inq, outq, t):
            del t  # the parent lets go; its next blocks of that size must come from elsewhere
            others = [smp.zeros(1024, torch.float32) for _ in range(4)]
            for o in others:
                o.fill_(-7.0)
            inq.put("read")
            assert outq.get(timeout=WAIT) == (1024.0, True)
    finally:
        helpers.close_queue(inq)
        helpers.close_queue(outq)


def _share_inherited(outq, t):
    before = (t.is_shared(), t.data_ptr())
    t.share_memory_()
    t[0] = 3.0
    outq.put((before[0], t.data_ptr() == before[1]))
    del t


def test_in_a_forked_child_an_inherited_tensor_is_shared_and_stays_so():
    x = torch.zeros(64)
    ForkingPickler.dumps(x)
    outq = smp.get_context("fork").Queue()
    try:
        with helpers.child(_share_inherited, outq, x):
            assert outq.get(timeout=WAIT) == (True, True)
    finally:
        helpers.close_queue(outq)
    assert float(x[0]) == 3.0


def test_a_full_lease_table_raises_for_a_shared_storage_and_never_moves_it(monkeypatch):
    from shmshare.multiprocessing import _owner, _table

    smp.shutdown()
    monkeypatch.setattr(_owner, "LeaseTable", lambda: _table.LeaseTable(8))
    x = torch.ones(16)
    pickles = [ForkingPickler.dumps(x) for _ in range(8)]  # every slot out, unclaimed
    where = x.data_ptr()
    with pytest.raises(smp.PoolExhausted, match="storage is shared already"):
        ForkingPickler.dumps(x)
    assert x.data_ptr() == where and x.is_shared()  # not moved by torch's reducer
    y = torch.ones(16)  # not shared yet: torch's own reducer shares it, with a warning
    monkeypatch.setattr(_reduce, "_warned", False)
    with pytest.warns(ResourceWarning, match="no room"):
        theirs = ForkingPickler.dumps(y)
    del pickles, theirs, y
    smp.shutdown()
    multiprocessing.resource_sharer.stop(timeout=10)  # torch's reducer started its fd sharer


def test_a_storage_handle_whose_shape_was_changed_is_refused():
    st = torch.arange(64.0).untyped_storage()
    fn, (handle,) = _reduce.reduce_storage(st)
    bad = (*handle[:12], (handle[6] // 2,), *handle[13:])
    with pytest.raises(smp.HandleError, match="malformed storage handle"):
        fn(bad)
    got = fn(handle)  # the true one still arrives
    assert got._cdata == st._cdata


def test_a_tensor_mapped_from_a_file_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(64))
    t = torch.from_file(str(path), shared=True, size=16, dtype=torch.float32)
    with pytest.raises(smp.Unshareable, match="file_system"):
        ForkingPickler.dumps(t)
    del t


def test_a_moved_tensor_counts_as_copied_and_a_pool_tensor_as_in_place():
    before = smp.statistics()
    ForkingPickler.dumps(torch.ones(32))
    ForkingPickler.dumps(smp.zeros(32, torch.float32))
    after = smp.statistics()
    assert (after.arrays_copied - before.arrays_copied, after.arrays_in_place - before.arrays_in_place) \
        == (1, 1)


def _forward_and_exit(inq):
    t = inq.get(timeout=WAIT)
    ForkingPickler.dumps(t)  # a lend on the owner's block, for a handle nobody will unpickle
    del t


def test_the_lends_of_a_process_that_died_are_given_back():
    """Note [Lends and who asked]: a lend nobody claimed, asked for by a process that is gone,
    pins nothing once the owner sees it gone."""
    x = torch.ones(256)
    ctx = smp.get_context("fork")
    inq = ctx.Queue()
    try:
        with helpers.child(_forward_and_exit, inq):
            inq.put(x)
    finally:
        helpers.close_queue(inq)
    wait_until(lambda: smp.statistics().handles_unclaimed == 0,
               lambda: f"every handle claimed (statistics: {smp.statistics()})", WAIT)


def _exit_quickly():
    pass


def test_blocks_in_use_at_a_fork_come_back_once_the_children_are_gone():
    """Note [Blocks a child inherits]: retired, not reused, while a child of that fork lives;
    back to the pool after, so a process forking per epoch does not grow."""
    from shmshare.multiprocessing import _owner

    ctx = smp.get_context("fork")
    reserved = []
    for _ in range(4):
        t = smp.empty(1 << 20, torch.uint8)
        p = ctx.Process(target=_exit_quickly)
        p.start()
        p.join(WAIT)
        assert p.exitcode == 0
        p.close()
        del t
        ow = _owner.current_owner()
        with ow._lock:
            ow._forks._swept = 0.0  # sweep now, not within the second
            for block in ow._forks.free_now():
                ow._alloc.free(block)
        reserved.append(smp.statistics().reserved_bytes)
    assert reserved[-1] == reserved[0], reserved


def _send_two_and_exit(q):
    smp.set_exit_linger(1.0)
    q.put(torch.full((64,), 5.0))
    q.put(torch.zeros(64))  # never taken: its keeper serves for 1 s


def _late_reader(q, outq):
    import time

    time.sleep(2.0)  # past the first sender's linger: what we read must not depend on it
    t = q.get(timeout=WAIT)
    outq.put(float(t.sum()))
    del t


def test_a_tensor_sent_on_after_its_first_sender_exited_outlives_that_senders_linger():
    ctx = smp.get_context("fork")
    q, q2, outq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    try:
        with helpers.child(_send_two_and_exit, q) as a:
            x = q.get(timeout=WAIT)
            assert a.join(WAIT) == 0
        with helpers.child(_late_reader, q2, outq):
            q2.put(x)  # its owner has exited: sent as a copy of ours, not a lend on its keeper
            assert outq.get(timeout=WAIT) == 320.0
    finally:
        for qq in (q, q2, outq):
            helpers.close_queue(qq)
