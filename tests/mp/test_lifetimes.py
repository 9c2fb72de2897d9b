"""The lifetimes a user can rely on (docs/multiprocessing.md), each shown with real processes."""

from __future__ import annotations

import gc
import glob
import os
import signal
import tempfile
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import shmshare.multiprocessing as smp
from shmshare.testing import kill, wait_exit, wait_until

WAIT = 30.0


def _put_and_return(q, n: int, fill: float) -> None:
    q.put(np.full(n, fill, np.float32))


def _put_then(q, how: str) -> None:
    q.put(np.full(4096, 7.0, np.float32))
    q.close()
    q.join_thread()  # the handle is in the pipe now
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "_exit":
        os._exit(0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_put_and_return_works_after_the_owner_exits(method):
    """The child puts its result and returns at once; the parent joins it first, then gets."""
    ctx = smp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_put_and_return, args=(q, 1 << 18, 3.0))
    p.start()
    try:
        # the child's exit lingers until its handle is claimed (Note [Exit linger]); the
        # stdlib's Queue flushes at exit the same way
        got = q.get(timeout=WAIT)
        assert got.shape == (1 << 18,) and float(got[0]) == 3.0 and float(got[-1]) == 3.0
        assert wait_exit(p) == 0
        assert float(got.sum()) == 3.0 * (1 << 18)  # still valid: the owner is gone
    finally:
        kill(p)
        q.close()
        q.join_thread()


def test_join_before_get_works_within_the_linger():
    """The classic "join before get" pattern works for handles as for small pickles."""
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_put_and_return, args=(q, 1 << 16, 5.0))
    p.start()
    try:
        time.sleep(0.5)  # the child is in its exit linger by now, serving the handle
        got = q.get(timeout=WAIT)
        assert float(got[0]) == 5.0
        assert wait_exit(p) == 0
    finally:
        kill(p)


@pytest.mark.parametrize("how", ["kill", "_exit"])
def test_data_received_stays_valid_and_late_handles_name_the_dead_owner(how):
    ctx = smp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_put_then, args=(q, how))
    p.start()
    try:
        code = wait_exit(p)
        assert code == (-signal.SIGKILL if how == "kill" else 0)
        with pytest.raises(smp.OwnerGone, match=f"pid {p.pid}"):
            q.get(timeout=WAIT)
    finally:
        kill(p)


def _two_then_die(q, ready) -> None:
    q.put(np.full(1 << 16, 1.0))
    q.put(np.full(1 << 16, 2.0))
    q.close()
    q.join_thread()
    ready.get(timeout=WAIT)
    os.kill(os.getpid(), signal.SIGKILL)


def test_an_array_received_before_the_owner_was_killed_stays_valid():
    ctx = smp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_two_then_die, args=(q, ready))
    p.start()
    try:
        first = q.get(timeout=WAIT)
        ready.put(None)
        assert wait_exit(p) == -signal.SIGKILL
        assert float(first.sum()) == float(1 << 16)
        first[:] = 5.0  # writable, and ours alone now
        assert float(first[-1]) == 5.0
        with pytest.raises(smp.OwnerGone, match=f"pid {p.pid}"):
            q.get(timeout=WAIT)
    finally:
        kill(p)


def test_past_the_linger_a_handle_names_its_owner(monkeypatch):
    monkeypatch.setenv("SHMSHARE_MP_LINGER", "0.3")
    ctx = smp.get_context("spawn")  # the child reads the bound from its environment
    q = ctx.Queue()
    p = ctx.Process(target=_put_and_return, args=(q, 1 << 16, 1.0))
    p.start()
    try:
        code = wait_exit(p)  # at once: its keeper serves the handle for 0.3 s (Note [A keeper after exit])
        assert code == 0
        # the keeper removes the socket's directory as it leaves, nobody having claimed the handle
        wait_until(lambda: not glob.glob(os.path.join(tempfile.gettempdir(), f"shmshare-mp-{p.pid}-*")),
                   "the keeper to remove the socket's directory", between=gc.collect)
        with pytest.raises(smp.OwnerGone, match=f"pid {p.pid}"):
            q.get(timeout=WAIT)
    finally:
        kill(p)


def test_a_handle_pickled_but_never_unpickled_pins_its_block_and_is_counted():
    a = np.arange(1 << 16, dtype=np.float64)
    data = ForkingPickler.dumps(a)
    s = smp.statistics()
    assert (s.handles_pickled, s.handles_unclaimed, s.handles_claimed) == (1, 1, 0)
    assert s.bytes_leased >= a.nbytes
    got = ForkingPickler.loads(data)  # claimed now: no longer unclaimed
    s = smp.statistics()
    assert (s.handles_unclaimed, s.handles_claimed) == (0, 1)
    assert np.array_equal(got, a)
    del got
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every handle released", between=gc.collect)
    assert smp.statistics().bytes_leased == 0


def test_the_same_pickle_unpickled_twice_is_a_clear_error_here():
    a = np.ones(1 << 12)
    data = ForkingPickler.dumps(a)
    first = ForkingPickler.loads(data)
    with pytest.raises(smp.HandleError, match="already unpickled by this process"):
        ForkingPickler.loads(data)
    assert float(first.sum()) == float(1 << 12)


def _loads_in_child(data: bytes, out) -> None:
    try:
        got = ForkingPickler.loads(data)
        out.put(("ok", float(got.sum())))
    except Exception as exc:  # noqa: BLE001  (the test looks at which)
        out.put((type(exc).__name__, str(exc)))


def test_the_same_pickle_unpickled_in_another_process_too_is_a_clear_error():
    a = np.ones(1 << 12)
    data = ForkingPickler.dumps(a)
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    first = ForkingPickler.loads(data)
    p = ctx.Process(target=_loads_in_child, args=(data, out))
    p.start()
    try:
        kind, msg = out.get(timeout=WAIT)
        assert kind == "HandleError" and f"already unpickled by pid {os.getpid()}" in msg
        assert wait_exit(p) == 0
    finally:
        kill(p)
    del first


def test_a_released_handle_unpickled_again_is_stale():
    data = ForkingPickler.dumps(np.ones(1 << 12))
    got = ForkingPickler.loads(data)
    del got
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every handle released", between=gc.collect)
    with pytest.raises(smp.HandleError, match="stale"):
        ForkingPickler.loads(data)


def _child_pickles(arr, out) -> None:
    data = bytes(ForkingPickler.dumps(arr))
    st = smp.statistics()
    out.put((st.pid, st.arrays_copied, st.arrays_in_place, data))
    out.close()
    out.join_thread()
    time.sleep(0.2)  # stays alive until the parent has looked


def test_fork_children_never_reuse_the_parents_blocks():
    mine = smp.empty(1 << 14, np.float64)
    mine[:] = 1.0
    pending = ForkingPickler.dumps(np.zeros(1 << 14))  # a block of ours, leased but unclaimed
    before = smp.statistics()
    ctx = smp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_child_pickles, args=(mine, out))
    p.start()
    try:
        pid, copied, in_place, data = out.get(timeout=WAIT)
        assert pid == p.pid != os.getpid()
        # the parent's pool array is, in the child, memory of no pool of its own: copied
        assert (copied, in_place) == (1, 0)
        got = ForkingPickler.loads(data)
        assert float(got[0]) == 1.0
        del got
        assert wait_exit(p) == 0
    finally:
        kill(p)
    after = smp.statistics()
    assert after.handles_pickled == before.handles_pickled and after.handles_unclaimed == 1
    ForkingPickler.loads(pending)


def _hold_inherited_then_drop(out) -> None:
    global _inherited
    del _inherited
    gc.collect()
    time.sleep(0.3)  # a flusher would have sent a release by now
    out.put("dropped")


_inherited = None


def _owner_reports(q, cmd, stats) -> None:
    q.put(np.full(1 << 16, 9.0))
    while True:
        what = cmd.get(timeout=WAIT)
        if what == "stats":
            stats.put(smp.statistics())
        else:
            return


def test_a_forked_child_never_releases_its_parents_received_arrays():
    global _inherited
    ctx = smp.get_context("fork")
    q, cmd, stats = ctx.Queue(), ctx.Queue(), ctx.Queue()
    owner = ctx.Process(target=_owner_reports, args=(q, cmd, stats))
    owner.start()
    try:
        _inherited = q.get(timeout=WAIT)
        out = ctx.Queue()
        child = ctx.Process(target=_hold_inherited_then_drop, args=(out,))
        child.start()
        assert out.get(timeout=WAIT) == "dropped"
        assert wait_exit(child) == 0
        cmd.put("stats")
        assert stats.get(timeout=WAIT).handles_claimed == 1  # still ours: the child sent nothing
        assert float(_inherited[0]) == 9.0
        _inherited = None
        gc.collect()
        def released() -> bool:
            cmd.put("stats")
            return stats.get(timeout=WAIT).handles_claimed == 0

        wait_until(released, "the parent's release to reach the owner", between=gc.collect)
        cmd.put("stop")
        assert wait_exit(owner) == 0
    finally:
        _inherited = None
        kill(owner)


def _claim_and_die(q, ready) -> None:
    got = q.get(timeout=WAIT)
    ready.put(float(got[0]))
    time.sleep(WAIT)


def test_a_receiver_killed_holding_arrays_gives_them_back():
    ctx = smp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_claim_and_die, args=(q, ready))
    p.start()
    try:
        q.put(np.full(1 << 16, 4.0))
        assert ready.get(timeout=WAIT) == 4.0
        assert smp.statistics().handles_claimed == 1
        os.kill(p.pid, signal.SIGKILL)
        wait_exit(p)
        wait_until(lambda: smp.statistics().handles_claimed == 0, "every handle released", between=gc.collect)
        s = smp.statistics()
        assert s.reclaimed == 1 and s.bytes_leased == 0
    finally:
        kill(p)


def test_blocks_come_back_and_are_reused():
    a = np.arange(1 << 15, dtype=np.float64)
    for _ in range(12):
        got = ForkingPickler.loads(ForkingPickler.dumps(a))
        assert got[-1] == a[-1]
        del got
        wait_until(lambda: smp.statistics().handles_claimed == 0, "every handle released",
                   between=gc.collect)  # released: its block is free
    s = smp.statistics()
    assert s.handles_pickled == 12 and s.segments_sent == 1  # one segment, its blocks reused
    assert s.reserved_bytes <= 4 << 20


def test_the_flushers_sweep_of_gone_owners_runs_beside_unpickles():
    """The flusher looks at each link (a poll) to let go of gone owners while other threads
    unpickle through the same link: one poll object, one caller at a time (a concurrent
    poll() raised in the flusher and killed it, stranding every release after)."""
    import threading

    from shmshare.multiprocessing import _client

    a = np.ones(1 << 12)
    ForkingPickler.loads(ForkingPickler.dumps(a))
    c = _client.client()
    errors: list[BaseException] = []
    stop = threading.Event()

    def sweep() -> None:
        while not stop.is_set():
            try:
                c._forget_the_dead()
            except BaseException as exc:  # noqa: BLE001  (the test reports it)
                errors.append(exc)
                return

    t = threading.Thread(target=sweep, daemon=True)
    t.start()
    try:
        for _ in range(1500):
            got = ForkingPickler.loads(ForkingPickler.dumps(a))
            del got
            if errors:
                break
    finally:
        stop.set()
        t.join(WAIT)
    assert not errors, f"the sweep beside unpickles raised {errors[0]!r}"
    wait_until(lambda: smp.statistics().handles_claimed == 0, "every release back",
               between=gc.collect)
