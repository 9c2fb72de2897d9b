"""shmshare.DataLoader's own promises: fds, shared memory, pool errors, shutdown, numpy mode.

torch's behaviours, side by side with torch's loader, are in test_torch_parity.py.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import shmshare.loader as L
from shmshare.loader import _pool, _worker
from shmshare.testing import wait_gone
from tests.loader.loader_datasets import Arrays, Keys, Slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _pool_resident(pid: int) -> int:
    """Bytes of shmshare memfd pages that `pid` has touched: its pool, cache included."""
    total, in_pool = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                in_pool = "memfd:shmshare_" in line
            elif in_pool and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})


def test_every_sample_once_in_order_and_writable():
    dl = L.DataLoader(Arrays(50), batch_size=8, num_workers=2, collate_fn=L.numpy_collate)
    got = []
    pids = set()
    for b in dl:
        assert isinstance(b["x"], np.ndarray) and b["x"].flags.writeable
        b["x"] += 1  # users normalise in place
        got.extend(b["y"].tolist())
        pids.update(b["pid"].tolist())
    assert got == list(range(50))
    assert len(pids) == 2 and os.getpid() not in pids


def test_main_process_fds_are_two_per_worker_plus_a_constant_however_much_is_in_flight():
    base = _fds()
    for workers in (1, 4):
        dl = L.DataLoader(Arrays(400, (256,)), batch_size=2, num_workers=workers, prefetch_factor=8,
                          collate_fn=L.numpy_collate)
        it = iter(dl)
        peak = 0
        for _ in range(150):
            next(it)
            peak = max(peak, _fds() - base)
        assert peak <= 2 * workers + 4, (workers, peak)
        del it, dl
        gc.collect()


def test_shared_memory_in_flight_stays_within_the_prefetch_bound():
    batch_bytes = 8 * (1 << 20)  # 8 samples of 1 MiB
    workers, prefetch = 2, 2
    dl = L.DataLoader(Arrays(300, (1 << 18,)), batch_size=8, num_workers=workers,
                      prefetch_factor=prefetch, persistent_workers=True, collate_fn=L.numpy_collate)
    try:
        peak = 0
        for _ in range(2):
            for b in dl:
                pids = [w.pid for w in dl._iterator._workers]
                peak = max(peak, sum(_pool_resident(p) for p in pids))
                del b
        # the pages the workers' pools ever touched: batches in flight, cached blocks included
        bound = (prefetch * workers + 2) * batch_bytes
        # plus, per worker, what a pool segment rounds up: two 8 MiB blocks in 20 MiB (torch's
        # kLargeBuffer), and a page or two of small blocks (labels)
        assert batch_bytes <= peak <= bound + workers * (4 << 20) + (1 << 20), (peak, bound)
    finally:
        dl.close()


@pytest.mark.parametrize(("limit", "error", "match"), [
    (4096, ValueError, r"pool_limit=4096 bytes is less than the pool's smallest segment"),
    ("1G", TypeError, "pool_limit must be an int of bytes"), (0, ValueError, "pool_limit must be a positive"),
])
def test_a_pool_limit_no_batch_could_fit_is_refused_when_the_loader_is_made(limit, error, match):
    with pytest.raises(error, match=match):  # not in worker 0 at the first batch
        L.DataLoader(Arrays(8, (16,)), batch_size=4, num_workers=1, pool_limit=limit)


def test_a_batch_past_the_pool_limit_is_an_error_naming_the_worker():
    dl = L.DataLoader(Arrays(8, (1 << 20,)), batch_size=4, num_workers=1, pool_limit=4 << 20,
                      collate_fn=L.numpy_collate)
    with pytest.raises(Exception, match=r"in DataLoader worker process 0[\s\S]*pool of 4194304 bytes"):
        next(iter(dl))


def test_holding_every_batch_past_the_pool_limit_never_stalls(monkeypatch):
    """``list(loader)`` with a pool that holds a few batches: torch's loader keeps going, and so
    does ours, past the pool (Note [Past the pool]). It waited (60 s), then raised PoolExhausted."""
    monkeypatch.setattr(_pool, "POOL_WAIT", 0.5)  # forked workers inherit it: no long wait left
    dl = L.DataLoader(Arrays(64, (1 << 18,)), batch_size=1, num_workers=2, pool_limit=8 << 20,
                      collate_fn=L.numpy_collate, multiprocessing_context="fork")
    held = list(dl)  # 64 MiB of batches, kept
    assert [int(b["y"][0]) for b in held] == list(range(64))
    assert all(float(b["x"][0, -1]) == i for i, b in enumerate(held))
    again = list(dl)  # a second epoch, every batch of the first still held
    assert [int(b["y"][0]) for b in again] == list(range(64))
    del held, again
    gc.collect()
    dl.close()


def test_a_full_pool_that_must_wait_fails_in_bounded_time(monkeypatch):
    """The wait a host out of shared memory still makes (the pool cannot go past itself):
    bounded, and it names what the main process holds."""
    monkeypatch.setattr(_pool, "POOL_WAIT", 0.5)  # forked workers inherit it
    monkeypatch.setattr(_worker, "PAST_THE_POOL", False)
    dl = L.DataLoader(Arrays(64, (1 << 18,)), batch_size=1, num_workers=1, pool_limit=8 << 20,
                      collate_fn=L.numpy_collate, multiprocessing_context="fork")
    held = []  # a hang here is pytest-timeout's (pyproject) to catch: the worker waits 0.5 s
    with pytest.raises(Exception, match=r"PoolExhausted in DataLoader worker process 0[\s\S]*still "
                                        r"holds"):
        for b in dl:
            held.append(b)
    assert 4 <= len(held) < 64
    del held, dl
    gc.collect()


def test_a_worker_exception_keeps_its_type_and_iteration_goes_on():
    class Bad(Arrays):
        def __getitem__(self, i):
            if i == 5:
                raise KeyError("no sample five")
            return super().__getitem__(i)

    dl = L.DataLoader(Bad(12), batch_size=2, num_workers=2, collate_fn=L.numpy_collate)
    it = iter(dl)
    seen = [next(it)["y"].tolist(), next(it)["y"].tolist()]
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process 0") as info:
        next(it)
    assert "no sample five" in str(info.value) and "Original Traceback" in str(info.value)
    seen += [b["y"].tolist() for b in it]
    assert seen == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]


def test_indices_of_any_type_reach_the_dataset_as_they_were():
    keys = ["a", (1, 2), 3, 2**70]
    dl = L.DataLoader(Keys(), batch_size=None, sampler=keys, num_workers=2,
                      collate_fn=L.numpy_convert)
    assert [b[0] for b in dl] == [repr(k) for k in keys]


@pytest.mark.parametrize("how", ["break", "del", "persistent"])
def test_workers_exit_when_the_loop_is_left(how):
    dl = L.DataLoader(Slow(200), batch_size=2, num_workers=2, collate_fn=L.numpy_collate,
                      persistent_workers=how == "persistent")
    it = iter(dl)
    next(it)
    pids = [w.pid for w in it._workers]
    if how == "break":
        for _ in it:
            break
        del it
    else:
        del it, dl
    gc.collect()
    if how == "break":
        del dl
        gc.collect()
    wait_gone(pids, "the workers to exit", 10)


def test_a_worker_killed_is_reported_as_torch_reports_it_and_the_rest_stop():
    # timeout=: a death not seen within 10 s would end as "timed out", failing the match below
    dl = L.DataLoader(Slow(400), batch_size=2, num_workers=2, collate_fn=L.numpy_collate, timeout=10)
    it = iter(dl)
    next(it)
    victim, other = (w.pid for w in it._workers)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {victim}\) exited "
                                           "unexpectedly") as info:
        for _ in it:
            pass
    # torch's chain: the wait's error, caused by the SIGCHLD handler's
    assert re.fullmatch(rf"DataLoader worker \(pid {victim}\) is killed by signal: Killed\. ",
                        str(info.value.__cause__))
    wait_gone([other], "the other worker to exit", 10)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        next(it)  # the same error again, not a hang


def test_workers_go_when_the_interpreter_exits_with_persistent_workers_alive():
    r = _run("""
        import shmshare.loader as L
        from tests.loader.loader_datasets import Slow
        dl = L.DataLoader(Slow(100), batch_size=2, num_workers=2, persistent_workers=True,
                          collate_fn=L.numpy_collate)
        it = iter(dl); next(it)
        print(*[w.pid for w in it._workers])
    """)
    assert r.returncode == 0, r.stderr
    wait_gone([int(p) for p in r.stdout.split()], "the workers to exit with their interpreter", 10)


def test_workers_exit_when_the_main_process_is_killed():
    code = textwrap.dedent("""
        import sys, time
        import shmshare.loader as L
        from tests.loader.loader_datasets import Slow
        dl = L.DataLoader(Slow(10**6), batch_size=2, num_workers=2, collate_fn=L.numpy_collate)
        it = iter(dl); next(it)
        print(*[w.pid for w in it._workers], flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert p.stdout is not None
        pids = [int(x) for x in p.stdout.readline().split()]
        p.kill()
        p.wait(10)
        assert len(pids) == 2
        wait_gone(pids, "the workers to exit with their killed main process", 15)
    finally:
        p.kill()
        p.wait(10)
        if p.stdout:
            p.stdout.close()


def test_numpy_mode_needs_no_torch():
    r = _run("""
        import sys
        sys.modules["torch"] = None  # import torch fails from here on
        import numpy as np
        import shmshare.loader as L
        from tests.loader.loader_datasets import Arrays
        rng = np.random.default_rng(7)
        dl = L.DataLoader(Arrays(40), batch_size=4, shuffle=True, generator=rng, num_workers=2,
                          drop_last=True)
        ys = []
        for b in dl:
            assert type(b["x"]) is np.ndarray and b["x"].dtype == np.float32 and b["x"].shape == (4, 4, 5)
            assert b["y"].dtype == np.int64 and (b["x"][:, 0, 0] == b["y"]).all()
            ys += b["y"].tolist()
        assert sorted(ys) == list(range(40)) and ys != list(range(40))
        info = L.get_worker_info()
        print("ok", len(dl), info)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "10", "None"]


def test_pin_memory_without_an_accelerator_warns_and_gives_unpinned_batches():
    with pytest.warns(UserWarning, match="no accelerator is found"):
        batches = list(L.DataLoader(Arrays(4), batch_size=2, num_workers=1, pin_memory=True,
                                    collate_fn=L.numpy_collate))
    assert len(batches) == 2


def test_a_batch_of_indices_larger_than_a_frame_arrives_whole():
    n = 40_000  # ~360 KB of msgpack ints: three notes of parts, then the task
    dl = L.DataLoader(Keys(), batch_size=None, sampler=[list(range(n)), [f"k{i}" for i in range(n)]],
                      num_workers=1, collate_fn=lambda x: x)
    got = list(dl)
    assert got[0] == (repr(list(range(n))), "list")
    assert got[1] == (repr([f"k{i}" for i in range(n)]), "list")  # pickled, in parts too


def test_the_workers_process_objects_stay_usable_after_shutdown():
    it = iter(L.DataLoader(Arrays(8), batch_size=2, num_workers=2, collate_fn=L.numpy_collate))
    workers = it._workers
    assert len(list(it)) == 4
    for w in workers:  # torch's own tests join and look at them after the loader is gone
        w.join(5)
        assert not w.is_alive() and w.exitcode == 0


def test_nested_tensors_go_in_the_pickle():
    torch = pytest.importorskip("torch")
    nt = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    dl = L.DataLoader([nt, nt], batch_size=None, num_workers=1)
    got = list(dl)
    assert all(g.is_nested and torch.equal(g.unbind()[1], torch.arange(5.0)) for g in got)


def test_forkserver_workers_idle_between_epochs_are_not_taken_for_orphans():
    # a forkserver worker's parent is the forkserver, not the main process: it once took
    # that for its parent's death at the first idle second, and left
    dl = L.DataLoader(Arrays(8), batch_size=2, num_workers=2, persistent_workers=True,
                      collate_fn=L.numpy_collate, multiprocessing_context="forkserver")
    try:
        assert len(list(dl)) == 4
        time.sleep(1.5)  # past a worker's WATCH_INTERVAL (1 s) of waiting for a task
        assert len(list(dl)) == 4
    finally:
        dl.close()
