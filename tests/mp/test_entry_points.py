"""Every multiprocessing entry point carries arrays as handles to the pickling process's pool,
not copies: Queue (fork, spawn), SimpleQueue, JoinableQueue, Pipe, Pool.map, Process arguments,
concurrent.futures.ProcessPoolExecutor; and the module is a drop-in for multiprocessing and
torch.multiprocessing."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import numpy as np
import pytest

import shmshare.multiprocessing as smp
from shmshare.testing import kill
from tests.mp import helpers
from tests.mp.helpers import WAIT, _mp_shutdown, close_queue, fingerprint  # noqa: F401

N = 2048  # float64 elements: 16 KiB, well above BY_VALUE_BELOW


def _delta(before: smp.OwnerStatistics, after: smp.OwnerStatistics, name: str) -> int:
    return getattr(after, name) - getattr(before, name)


# -- the drop-in -----------------------------------------------------------------------------------


def test_star_import_gives_multiprocessing_names_and_ours():
    ns: dict = {}
    exec("from shmshare.multiprocessing import *", ns)
    missing = [n for n in multiprocessing.__all__ if n not in ns]
    assert not missing
    for name in ["empty", "zeros", "statistics", "shutdown", "OwnerGone", "HandleError",
                 "OwnerStatistics", "BY_VALUE_BELOW", "init_reductions"]:
        assert ns[name] is getattr(smp, name)


def test_every_multiprocessing_name_is_multiprocessings_own_object():
    for name in multiprocessing.__all__:
        assert hasattr(smp, name), name
        assert getattr(smp, name) is getattr(multiprocessing, name), name
    assert smp.Process is multiprocessing.Process
    assert smp.Queue is multiprocessing.Queue
    assert smp.get_context is multiprocessing.get_context
    assert smp.Pipe is multiprocessing.Pipe
    assert smp.cpu_count is multiprocessing.cpu_count
    assert smp.get_context("spawn") is multiprocessing.get_context("spawn")
    assert smp.BY_VALUE_BELOW == 1024


def test_torch_extras_are_torch_multiprocessings():
    torch_mp = pytest.importorskip("torch.multiprocessing")
    for name in ["set_sharing_strategy", "get_sharing_strategy", "get_all_sharing_strategies",
                 "spawn", "start_processes", "ProcessContext", "ProcessRaisedException",
                 "ProcessExitedException"]:
        assert getattr(smp, name) is getattr(torch_mp, name), name
    assert smp.get_sharing_strategy() == torch_mp.get_sharing_strategy()
    assert "spawn" in dir(smp) and "set_sharing_strategy" in dir(smp)
    with pytest.raises(AttributeError, match="no_such_name"):
        smp.no_such_name  # noqa: B018


def test_torch_spawn_carries_handles():
    pytest.importorskip("torch.multiprocessing")
    arr = np.arange(N, dtype=np.float64)
    q = smp.get_context("spawn").Queue()
    before = smp.statistics()
    ctx = smp.spawn(helpers.torch_spawn_target, args=(arr, fingerprint(arr), q), nprocs=1,
                    join=False)
    try:
        assert q.get(timeout=WAIT) == (0, True, True)
        assert _delta(before, smp.statistics(), "handles_pickled") == 1
        for _ in range(int(WAIT)):
            if ctx.join(1):
                break
        assert all(p.exitcode == 0 for p in ctx.processes)
    finally:
        kill(*ctx.processes)
        close_queue(q)


# -- Queues ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queue_carries_a_handle_and_the_echo_comes_back_as_one(method):
    arr = np.arange(N, dtype=np.float64).reshape(32, 64)
    before = smp.statistics()
    with helpers.EchoChild(method) as child:
        (info, as_handle, writable), back = child.trip(arr)
        assert info == fingerprint(arr)
        assert as_handle and writable
        after = smp.statistics()
        assert _delta(before, after, "handles_pickled") == 1
        assert _delta(before, after, "arrays_copied") == 1
        assert after.handles_unclaimed == 0  # the child claimed it
        np.testing.assert_array_equal(back, arr)
        assert helpers.is_handle_view(back)  # the child's copy came back as its handle
        del back
    assert child.child_stats.handles_pickled == 1
    assert child.child_stats.pid == child.pid


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queue_from_empty_is_zero_copy_and_writes_are_shared(method):
    ctx = smp.get_context(method)
    inq, outq = ctx.Queue(), ctx.Queue()
    arr = smp.zeros((16, 128))
    before = smp.statistics()
    try:
        with helpers.child(helpers.write_into, inq, outq, method=method):
            inq.put(arr)
            total, as_handle, writable = outq.get(timeout=WAIT)
            assert (total, as_handle, writable) == (15.0, True, True)
            assert arr[0, 0] == 7 and arr[-1, -1] == 8  # the child wrote into our memory
            after = smp.statistics()
            assert _delta(before, after, "arrays_in_place") == 1
            assert _delta(before, after, "arrays_copied") == 0
    finally:
        close_queue(inq)
        close_queue(outq)


def test_view_of_a_pool_array_goes_in_place_with_its_strides():
    base = smp.zeros((64, 64), dtype=np.int32)
    view = base[4:60:3, ::-2]  # steps, a negative stride, an offset into the block
    view[...] = np.arange(view.size, dtype=np.int32).reshape(view.shape)
    before = smp.statistics()
    with helpers.EchoChild("fork") as child:
        (info, as_handle, _), back = child.trip(view)
        assert info == fingerprint(view) and as_handle
        assert _delta(before, smp.statistics(), "arrays_in_place") == 1
        np.testing.assert_array_equal(back, view)
        del back


def test_simple_queue_carries_a_handle():
    ctx = smp.get_context("fork")
    sq, outq = ctx.SimpleQueue(), ctx.Queue()
    arr = smp.zeros(N)
    before = smp.statistics()
    try:
        with helpers.child(helpers.write_into, sq, outq):
            sq.put(arr)  # SimpleQueue pickles in put(), on this thread
            assert _delta(before, smp.statistics(), "arrays_in_place") == 1
            assert outq.get(timeout=WAIT) == (15.0, True, True)
            assert arr[0] == 7 and arr[-1] == 8
    finally:
        close_queue(sq)
        close_queue(outq)


def test_simple_queue_copies_a_plain_array_in_once():
    ctx = smp.get_context("fork")
    sq, outq = ctx.SimpleQueue(), ctx.Queue()
    arr = np.ones(N)
    before = smp.statistics()
    try:
        with helpers.child(helpers.write_into, sq, outq):
            sq.put(arr)
            assert outq.get(timeout=WAIT) == (float(N - 2 + 15), True, True)
            assert arr[0] == 1  # a copy in the pool was written, not our array
            assert _delta(before, smp.statistics(), "arrays_copied") == 1
    finally:
        close_queue(sq)
        close_queue(outq)


def test_joinable_queue_carries_a_handle():
    ctx = smp.get_context("fork")
    jq, outq = ctx.JoinableQueue(), ctx.Queue()
    arr = smp.zeros(N)
    arr[:] = 2
    before = smp.statistics()
    try:
        with helpers.child(helpers.joinable_task, jq, outq):
            jq.put(arr)
            (info, as_handle, writable), total = outq.get(timeout=WAIT)
            assert info == fingerprint(np.full(N, 2.0)) and as_handle and writable
            assert total == 2.0 * N
            jq.join()  # the child called task_done() before it answered: returns at once
            assert arr[0] == -1
            assert _delta(before, smp.statistics(), "arrays_in_place") == 1
    finally:
        close_queue(jq)
        close_queue(outq)


# -- Pipe --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pipe_carries_handles_both_ways(method):
    mine, theirs = smp.Pipe()
    arr = smp.zeros(N)
    arr[:] = np.arange(N)
    expect = fingerprint(arr)
    before = smp.statistics()
    try:
        with helpers.child(helpers.pipe_peer, theirs, method=method) as proc:
            theirs.close()
            mine.send(arr)
            assert _delta(before, smp.statistics(), "arrays_in_place") == 1
            assert mine.poll(WAIT)
            (info, as_handle, writable), reply = mine.recv()
            assert info == expect and as_handle and writable
            assert arr[0] == 42.0  # written by the child, in place
            np.testing.assert_array_equal(reply, np.arange(N, dtype=np.float64) * 3)
            assert helpers.is_handle_view(reply)
            mine.send("ok")
            assert mine.poll(WAIT)
            child_stats = mine.recv()
            assert child_stats.pid == proc.pid
            assert child_stats.handles_pickled == 1 and child_stats.arrays_copied == 1
            assert child_stats.handles_unclaimed == 0  # we claimed its reply
            del reply
    finally:
        mine.close()
        theirs.close()


# -- Pool, Process, ProcessPoolExecutor ----------------------------------------------------------


def test_pool_map_arguments_and_results_are_handles():
    arrays = [np.full(N, float(i)) for i in range(4)]
    before = smp.statistics()
    with smp.get_context("fork").Pool(1) as pool:
        try:
            results = pool.map(helpers.triple_and_report, arrays, chunksize=1)
            for i, (out, arg_was_handle, _pid) in enumerate(results):
                np.testing.assert_array_equal(out, np.full(N, 3.0 * i))
                assert arg_was_handle
                assert helpers.is_handle_view(out)  # the result is a view of the worker's pool
            after = smp.statistics()
            assert _delta(before, after, "handles_pickled") == 4
            assert _delta(before, after, "arrays_copied") == 4
            worker = pool.apply(helpers.worker_statistics)
            assert worker.pid == results[0][2]
            assert worker.handles_pickled == 4 and worker.by_value == 0
            assert worker.handles_unclaimed == 0  # our result thread claimed them all
            del results, out
        finally:
            pool.terminate()
            pool.join()


def test_pool_map_plain_results_round_trip():
    arrays = [np.arange(N, dtype=np.int64) + i for i in range(6)]
    with smp.get_context("fork").Pool(2) as pool:
        try:
            results = pool.map(helpers.triple, arrays)
            for i, out in enumerate(results):
                np.testing.assert_array_equal(out, (np.arange(N, dtype=np.int64) + i) * 3)
                assert helpers.is_handle_view(out)
            del results, out
        finally:
            pool.terminate()
            pool.join()


def test_process_arguments_under_spawn_are_handles():
    ctx = smp.get_context("spawn")
    outq = ctx.Queue()
    arr = smp.zeros(N)
    arr[:] = 1.5
    before = smp.statistics()
    try:
        with helpers.child(helpers.check_args, arr, fingerprint(arr), outq, method="spawn") as proc:
            after = smp.statistics()
            assert _delta(before, after, "handles_pickled") == 1  # pickled by start()
            assert _delta(before, after, "arrays_in_place") == 1
            assert outq.get(timeout=WAIT) == (True, True, proc.pid)
            assert arr[0] == 5  # the child wrote into our array
    finally:
        close_queue(outq)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_process_pool_executor_arguments_and_results_are_handles(method):
    arrays = [np.full(N, float(i)) for i in range(3)]
    before = smp.statistics()
    ex = concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=smp.get_context(method))
    try:
        futures = [ex.submit(helpers.triple_and_report, a) for a in arrays]
        for i, f in enumerate(futures):
            out, arg_was_handle, _pid = f.result(timeout=WAIT)
            np.testing.assert_array_equal(out, np.full(N, 3.0 * i))
            assert arg_was_handle
            assert helpers.is_handle_view(out)
        assert _delta(before, smp.statistics(), "handles_pickled") == 3
        del futures, f, out
        ex.shutdown(wait=True)
    finally:
        helpers.kill_children()
        ex.shutdown(wait=False, cancel_futures=True)


# -- by value ----------------------------------------------------------------------------------------


def test_small_array_goes_by_value_and_arrives_right():
    small = np.arange(BYTES := smp.BY_VALUE_BELOW // 8 - 1, dtype=np.float64)
    assert small.nbytes < smp.BY_VALUE_BELOW and BYTES > 0
    before = smp.statistics()
    with helpers.EchoChild("fork") as child:
        (info, as_handle, _), back = child.trip(small)
        assert info == fingerprint(small)
        assert as_handle is False
        assert _delta(before, smp.statistics(), "handles_pickled") == 0
        np.testing.assert_array_equal(back, small)
        assert not helpers.is_handle_view(back)
    assert child.child_stats.handles_pickled == 0


def test_small_array_of_the_pool_goes_as_a_handle():
    small = smp.zeros(8, dtype=np.int32)  # 32 bytes, but in the pool already: no copy to save
    small[:] = np.arange(8)
    before = smp.statistics()
    with helpers.EchoChild("fork") as child:
        (info, as_handle, _), back = child.trip(small)
        assert info == fingerprint(small) and as_handle
        assert _delta(before, smp.statistics(), "arrays_in_place") == 1
        np.testing.assert_array_equal(back, small)
        del back
