"""A hostile user's and an exhausted host's tests of shmshare.DataLoader.

Tests whose comment says "Was a defect" failed on the code they were written
against (4b29a70..ceafe6c); each comment names the defect. The rest pin down
behaviour that held up.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import shmshare.loader as L
from shmshare.loader import _iters, _worker
from shmshare.testing import kill, wait_gone
from tests.loader.loader_datasets import Arrays, Slow

_JOINED = 30.0  # s shutdown waits for the workers here (only a failing test waits it out)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _socket_inodes(pid: int | str) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


class _Big:
    """Map-style: sample i is `size` bytes of i % 251 (batches that fill a pool fast)."""

    def __init__(self, n: int, size: int = 1 << 20) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.size, i % 251, np.uint8)


# -- defects ----------------------------------------------------------------------------


def test_prefetch_factor_zero_is_refused_not_an_empty_epoch():
    # Was a defect (fixed): prefetch_factor=0 with workers silently yields no batch at all (every sample
    # dropped); torch's _MultiProcessingDataLoaderIter asserts prefetch_factor > 0.
    dl = L.DataLoader(Arrays(10), batch_size=2, num_workers=2, prefetch_factor=0,
                      collate_fn=L.numpy_collate)
    with pytest.raises(AssertionError, match="prefetch_factor must be greater than 0"):
        list(dl)


def _sparse_collate(batch):
    import torch

    return torch.eye(64).to_sparse()


def test_sparse_batches_are_not_pinned_forever_by_torch():
    # Was a defect (fixed): a sparse tensor in a batch is unpickled with plain pickle.loads, and torch's
    # _rebuild_sparse_tensor appends every one to torch._utils._sparse_tensors_to_validate,
    # which only torch.load clears: each sparse batch (and the pool blocks of its indices and
    # values) stays alive forever in the main process. torch's own loader keeps none.
    torch = pytest.importorskip("torch")
    keep = list(torch._utils._sparse_tensors_to_validate)
    try:
        dl = L.DataLoader(Arrays(40), batch_size=2, num_workers=1, collate_fn=_sparse_collate)
        for b in dl:
            assert b.is_sparse
        del b
        gc.collect()
        assert len(torch._utils._sparse_tensors_to_validate) == len(keep)
    finally:
        torch._utils._sparse_tensors_to_validate[:] = keep
        gc.collect()


def test_forked_workers_do_not_hold_the_main_process_ends_of_their_sockets():
    # Was a defect (fixed): each worker is forked after its socket pair is made, and close_inherited() does
    # not know the pairs of the iterator being started (self._rx is still None), so worker i
    # keeps the main process's ends of sockets 0..i, its own included: closing them in the
    # main process never ends any worker's stream, and a worker waiting for pool room cannot
    # see the main process die (see the next two tests).
    dl = L.DataLoader(Arrays(100), batch_size=2, num_workers=3, collate_fn=L.numpy_collate,
                      multiprocessing_context="fork")
    it = iter(dl)
    next(it)
    mine = _socket_inodes("self")
    held = {w.pid: _socket_inodes(w.pid) & mine for w in it._workers}
    del it
    gc.collect()
    assert held == {p: set() for p in held}


def test_closing_the_loader_while_held_batches_fill_the_pool_is_prompt(monkeypatch):
    # Was a defect (fixed): a worker waiting in _pool.empty() for pool room (Sender._malloc) takes the "s"
    # note in but never looks at it, so shutdown waits the whole _JOIN_WAIT (5 s) and then
    # SIGTERMs it; every such close costs 5 s. (A full pool goes past itself now; the wait is
    # what a host out of shared memory still makes, kept here by PAST_THE_POOL.) So each worker
    # must end on its own, by the stop note or its socket's end: none is terminated, however
    # long a loaded machine takes (_JOIN_WAIT is raised to keep a slow exit from reading as one).
    monkeypatch.setattr(_worker, "PAST_THE_POOL", False)  # forked workers inherit it
    monkeypatch.setattr(_iters, "_JOIN_WAIT", _JOINED)
    dl = L.DataLoader(_Big(10**6), batch_size=4, num_workers=2, collate_fn=L.numpy_collate,
                      pool_limit=48 << 20, timeout=3)
    it = iter(dl)
    workers = list(it._workers)
    try:
        held = []
        with pytest.raises(RuntimeError, match="timed out"):
            for _ in range(200):
                held.append(next(it))
        assert 0 < len(held) < 200
        del it
        gc.collect()
        ok = bool((held[0][1] == 1).all())  # still readable
        del held
        assert ok
        codes = [w.exitcode for w in workers]
        assert codes == [0] * len(workers), (
            f"the workers' exit codes are {codes} (-{signal.SIGTERM.value}: terminated after "
            f"_JOIN_WAIT): a worker waiting for pool room did not end on the stop")
    finally:
        kill(*workers)


def test_workers_exit_promptly_when_the_main_process_is_killed_while_they_wait_for_pool_room():
    # Was a defect (fixed): with the main process SIGKILLed while it held the batches that filled the pools,
    # the workers stay alive (holding their pools' shared memory) for POOL_WAIT (60 s) and
    # more: their socket never ends (they hold its other end, see above) and getppid() is only
    # looked at while idle in recv_note.
    code = textwrap.dedent("""
        import sys, time
        import numpy as np
        import shmshare.loader as L
        from shmshare.loader import _worker
        from tests.loader.test_loader_hostile import _Big
        _worker.PAST_THE_POOL = False  # the wait for room a host out of memory still makes
        dl = L.DataLoader(_Big(10**6), batch_size=4, num_workers=2, collate_fn=L.numpy_collate,
                          pool_limit=48 << 20, timeout=3)
        it = iter(dl)
        held = []
        try:
            for _ in range(200):
                held.append(next(it))
        except RuntimeError:
            pass
        print(*[w.pid for w in it._workers], flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    pids: list[int] = []
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2
        p.kill()
        p.wait(10)
        wait_gone(pids, "the workers to exit with their killed main process", 10)
    finally:
        p.kill()
        p.wait(10)
        kill(*pids, reap=False)
        if p.stdout:
            p.stdout.close()


# -- what held up -----------------------------------------------------------------------


def test_persistent_workers_broken_mid_epoch_never_return_stale_batches():
    dl = L.DataLoader(Slow(40, 0.002), batch_size=2, num_workers=3, persistent_workers=True,
                      collate_fn=L.numpy_collate)
    full = [[2 * i, 2 * i + 1] for i in range(20)]
    try:
        for epoch in range(4):
            got = []
            for j, b in enumerate(dl):
                got.append(b["y"].tolist())
                if epoch % 2 == 0 and j == 3:
                    break
            assert got == (full[:4] if epoch % 2 == 0 else full)
    finally:
        dl.close()


def test_batches_stay_valid_and_writable_after_the_loader_and_its_workers_aregone():
    dl = L.DataLoader(Arrays(20), batch_size=2, num_workers=2, collate_fn=L.numpy_collate)
    it = iter(dl)
    batches = [next(it) for _ in range(5)]
    pids = [w.pid for w in it._workers]
    os.kill(pids[0], signal.SIGKILL)
    del it, dl
    gc.collect()
    wait_gone(pids, "the workers to exit", 10)
    for i, b in enumerate(batches):
        b["x"] += 1
        assert (b["x"][:, 0, 0] == b["y"] + 1).all() and b["y"].tolist() == [2 * i, 2 * i + 1]


def _exit0(i):
    os._exit(0)


def _exit3(i):
    sys.exit(3)


@pytest.mark.parametrize("fn, match", [
    (_exit0, r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"),
    (_exit3, r"exited unexpectedly with exit code 3"),
])
def test_a_worker_init_fn_that_exits_is_reported_and_nothing_hangs(fn, match):
    # timeout=: a death not seen within 10 s would end as "timed out", failing the match below
    dl = L.DataLoader(Arrays(20), batch_size=2, num_workers=2, worker_init_fn=fn,
                      collate_fn=L.numpy_collate, timeout=10)
    with pytest.raises(RuntimeError) as info:
        list(dl)
    chain = [str(info.value), str(info.value.__cause__)]  # torch's: the wait's error, then why
    assert any(re.search(match, m) for m in chain), chain


def test_a_stopped_worker_trips_the_timeout_and_close_still_ends_it():
    dl = L.DataLoader(Slow(40, 0.002), batch_size=2, num_workers=2, timeout=1,
                      persistent_workers=True, collate_fn=L.numpy_collate)
    it = iter(dl)
    next(it)
    pid = it._workers[1].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
            for _ in it:
                pass
    finally:
        os.kill(pid, signal.SIGCONT)
        del it
        dl.close()
    wait_gone([pid], "the worker to exit", 10)


def test_an_unpicklable_collate_fn_under_spawn_warns_errs_and_leaks_nothing():
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    dl = L.DataLoader(Arrays(4), batch_size=2, num_workers=2, collate_fn=lambda b: b,
                      multiprocessing_context="spawn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises((AttributeError, TypeError)):
            next(iter(dl))
    assert any("Got pickle error" in str(w.message) for w in caught)


class _Echo:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i):
        return f"{i!r}:{type(i).__name__}"


class _Seq:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


@pytest.mark.parametrize("items", [
    [np.int64(3), np.int64(-2)], [None, None], [-1, -5], [2**63, -(2**63) - 1, 2**200],
    [2**63 - 1, -(2**63)], [True, False], [b"\x00\xff", "s", (1, 2), float("nan")],
], ids=["np-int64", "none", "negative", "huge", "int64-edges", "bool", "other"])
def test_odd_sampler_indices_reach_the_dataset_as_they_were(items):
    got = list(L.DataLoader(_Echo(), sampler=_Seq(items), batch_size=2, num_workers=1,
                            collate_fn=lambda b: b))
    want = [[_Echo()[i] for i in items[k:k + 2]] for k in range(0, len(items), 2)]
    assert got == want
