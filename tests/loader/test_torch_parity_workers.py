"""shmshare.DataLoader against torch's, side by side: errors in workers, timeouts, kills, worker lifetime.

The other half (construction, results, collate) and what both halves do is in test_torch_parity.py.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re

import pytest

torch = pytest.importorskip("torch", reason="the parity tests compare against torch.utils.data.DataLoader")
np = pytest.importorskip("numpy")

from shmshare.testing import wait_gone  # noqa: E402

from . import parity_datasets as pd  # noqa: E402
from .parity_common import (  # noqa: E402
    TorchDataLoader,
    drain,
    loader_cls_param,
    run,
    run_driver,
)

pytestmark = [loader_cls_param]


# -- errors in workers, timeouts, killed workers -----------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_exception_type_message_and_continue(loader_cls, num_workers):
    """torch re-raises a worker's exception in the main process and the same iterator goes on after it."""
    loader = loader_cls(pd.ErrorDataset(8, bad=3), batch_size=None, num_workers=num_workers)
    out = drain(loader, 12)
    assert [x if isinstance(x, int) else x[0] for x in out] == [0, 1, 2, ValueError, 4, 5, 6, 7]
    msg = out[3][1]
    if num_workers == 0:
        assert msg == "bad index 3"
    else:
        assert msg.startswith("Caught ValueError in DataLoader worker process 1.\nOriginal Traceback"), msg
        assert "ValueError: bad index 3" in msg
        assert "parity_datasets.py" in msg  # the worker's traceback, where it was raised
    del loader
    gc.collect()


def test_worker_exception_user_type(loader_cls):
    loader = loader_cls(pd.ErrorDataset(4, bad=0, exc_type=pd.BadItemError), batch_size=None, num_workers=2)
    out = drain(loader, 6)
    assert out[1:] == [1, 2, 3]
    exc_type, msg = out[0]
    assert exc_type is pd.BadItemError
    assert msg.startswith("Caught BadItemError in DataLoader worker process 0.\nOriginal Traceback"), msg
    assert "BadItemError: bad index 0" in msg
    del loader
    gc.collect()


def test_worker_key_error_readable(loader_cls):
    loader = loader_cls(pd.ErrorDataset(4, bad=1, exc_type=KeyError), batch_size=None, num_workers=2)
    out = drain(loader, 6)
    assert [x if isinstance(x, int) else x[0] for x in out] == [0, KeyError, 2, 3]
    msg = out[1][1]
    assert msg.startswith("Caught KeyError in DataLoader worker process 1.\nOriginal Traceback"), msg
    assert "\\n" not in msg  # torch's KeyErrorMessage: the traceback is not repr()-escaped
    del loader
    gc.collect()


def test_worker_exception_not_constructible_from_message(loader_cls):
    """torch re-raises an exception type that cannot be made from one message as RuntimeError."""
    loader = loader_cls(pd.ErrorDataset(4, bad=2, exc_type=pd.TwoArgError), batch_size=None, num_workers=2)
    out = drain(loader, 6)
    assert [x if isinstance(x, int) else x[0] for x in out] == [0, 1, RuntimeError, 3]
    msg = out[2][1]
    assert msg.startswith("Caught TwoArgError in DataLoader worker process 0.\nOriginal Traceback"), msg
    assert "TwoArgError: bad index and 2" in msg
    del loader
    gc.collect()


def test_worker_init_fn_exception(loader_cls):
    loader = loader_cls(pd.RangeDataset(6), batch_size=None, num_workers=2, worker_init_fn=pd.failing_init)
    out = drain(loader, 8)
    exc, msg = out[0]
    assert exc is ValueError
    assert msg.startswith("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback"), msg
    assert "ValueError: init failed in worker 0" in msg
    assert [x for x in out if isinstance(x, int)] == [1, 3, 5]  # worker 1 serves its share
    del loader
    gc.collect()


def test_timeout_message(loader_cls):
    loader = loader_cls(pd.SlowFirstDataset(4, delay=1.0), batch_size=None, num_workers=2, timeout=0.5)
    it = iter(loader)
    with pytest.raises(RuntimeError) as info:
        next(it)  # the first sample takes 1 s: the 0.5 s timeout, not the batch, comes first
    assert str(info.value) == "DataLoader timed out after 0.5 seconds"
    del it, loader, info
    gc.collect()


def test_killed_worker_raises_runtime_error(loader_cls):
    which = "torch" if loader_cls is TorchDataLoader else "shmshare"
    result = run_driver("tests.loader.parity_kill_driver", which, within=40)
    assert result["type"] == "RuntimeError", result
    pattern = rf"DataLoader worker \(pid {result['victim']}\) is killed by signal: Killed"
    assert any(re.search(pattern, c["message"]) for c in result["chain"]), result
    assert result["after_s"] < 20, result


# -- worker lifetime: persistent workers, break, contexts --------------------------------------------------------


def test_persistent_workers_same_pids_across_epochs(loader_cls):
    loader = loader_cls(pd.PidDataset(8), batch_size=2, num_workers=2, persistent_workers=True)
    pids_per_epoch = []
    for _ in range(3):
        items, pids = [], set()
        for idx, _wid, pid in loader:
            items += idx.tolist()
            pids |= set(pid.tolist())
        assert items == list(range(8))
        pids_per_epoch.append(pids)
    assert len(pids_per_epoch[0]) == 2
    assert pids_per_epoch[0] == pids_per_epoch[1] == pids_per_epoch[2]
    assert os.getpid() not in pids_per_epoch[0]
    del loader
    gc.collect()
    wait_gone(pids_per_epoch[0], "the persistent workers to exit once the loader was deleted", 15)


def test_persistent_workers_break_then_full_epoch(loader_cls):
    loader = loader_cls(pd.PidDataset(8), batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    first, pids = next(it), set()
    pids |= set(first[2].tolist())
    assert iter(loader) is it  # torch keeps one iterator for persistent workers
    for _ in range(2):
        items = []
        for idx, _, pid in loader:
            items += idx.tolist()
            pids |= set(pid.tolist())
        assert items == list(range(8))
    assert len(pids) == 2
    del it, loader
    gc.collect()
    wait_gone(pids, "the persistent workers to exit once the loader and its iterator were deleted", 15)


def test_persistent_workers_iterable_epochs(loader_cls):
    loader = loader_cls(pd.ShardedIterable(10), batch_size=3, num_workers=2, persistent_workers=True)
    for _ in range(3):
        assert sorted(x for b in loader for x in b.tolist()) == list(range(10))
    del loader
    gc.collect()


def test_two_iterators_of_one_loader(loader_cls):
    loader = loader_cls(pd.RangeDataset(6), batch_size=None, num_workers=2)
    a, b = iter(loader), iter(loader)
    got_a, got_b = [], []
    for _ in range(6):
        got_a.append(next(a))
        got_b.append(next(b))
    assert got_a == got_b == list(range(6))
    with pytest.raises(StopIteration):
        next(a)
    with pytest.raises(StopIteration):
        next(b)
    del a, b, loader
    gc.collect()


def test_non_persistent_workers_new_each_epoch(loader_cls):
    loader = loader_cls(pd.PidDataset(4), batch_size=2, num_workers=2)
    first = {p for _, _, pids in loader for p in pids.tolist()}
    wait_gone(first, "an exhausted epoch's workers to exit", 15)  # an exhausted epoch shuts its workers down
    second = {p for _, _, pids in loader for p in pids.tolist()}
    assert first.isdisjoint(second)
    del loader
    gc.collect()


def test_break_then_workers_exit(loader_cls):
    loader = loader_cls(pd.PidDataset(40, delay=0.01), batch_size=2, num_workers=2)
    pids: set[int] = set()
    for n, (_, _, pid) in enumerate(loader):
        pids |= set(pid.tolist())
        if n == 3:
            break
    assert pids and os.getpid() not in pids
    gc.collect()  # the abandoned iterator is garbage now
    wait_gone(pids, "the workers to exit once the loop was left", 15)
    del loader
    gc.collect()


@pytest.mark.parametrize(
    ("context", "num_workers"),
    [
        pytest.param("fork", 2, id="fork-name"),
        pytest.param("spawn", 2, id="spawn-name"),
        pytest.param("forkserver", 2, id="forkserver-name"),
        # one worker for the objects: a spawned worker imports torch afresh, seconds on this machine
        pytest.param(mp.get_context("fork"), 1, id="fork-object"),
        pytest.param(mp.get_context("spawn"), 1, id="spawn-object"),
        pytest.param(mp.get_context("forkserver"), 1, id="forkserver-object"),
    ],
)
def test_multiprocessing_context(loader_cls, context, num_workers, monkeypatch):
    method = context if isinstance(context, str) else context.get_start_method()
    monkeypatch.setattr(pd, "MARK", "set in the loader's process")
    out = run(loader_cls, pd.ContextDataset(4), batch_size=2, num_workers=num_workers,
              multiprocessing_context=context)
    assert [idx.tolist() for idx, *_ in out] == [[0, 1], [2, 3]]
    assert [wid.tolist() for _, wid, *_ in out] == ([[0, 0], [1, 1]] if num_workers == 2 else [[0, 0], [0, 0]])
    pids = {p for _, _, pid, _, _ in out for p in pid.tolist()}
    assert len(pids) == num_workers and os.getpid() not in pids
    parents = {p for _, _, _, ppid, _ in out for p in ppid.tolist()}
    marks = {m for *_, mark in out for m in mark}
    if method == "fork":
        assert parents == {os.getpid()} and marks == {"set in the loader's process"}
    elif method == "spawn" and (loader_cls is TorchDataLoader or num_workers == 1):  # (one: started alone)
        assert parents == {os.getpid()} and marks == {"unset"}
    elif method == "spawn":  # one spawned process forks them all (Note [Workers forked from one process])
        assert len(parents) == 1 and os.getpid() not in parents and marks == {"unset"}
    else:  # the fork server's children (torch's), or the zygote's the fork server made (ours)
        assert os.getpid() not in parents and marks == {"unset"}
    wait_gone(pids, "the workers to exit", 15)


def test_interpreter_exit_with_live_workers(loader_cls):
    """A script that leaves a loader mid-epoch (persistent or not) and exits: it ends, and its workers too."""
    which = "torch" if loader_cls is TorchDataLoader else "shmshare"
    result = run_driver("tests.loader.parity_exit_driver", which, within=40)
    wait_gone(result["pids"], "the workers to exit with their interpreter", 15)
