"""Under spawn and forkserver the workers are forked from one process that took the dataset once
(Note [Workers forked from one process] in shmshare/loader/_zygote.py). Most tests use forkserver: the loader
tests' server has imported torch (tests/loader/conftest.py), where a spawned zygote imports it again."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import Dataset

import shmshare
from shmshare.testing import wait_gone


class Where(Dataset):
    """Says which process unpickled it, and which process serves each sample (and its parent)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n
        self.unpickled_in = os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.unpickled_in = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid(), os.getppid(), self.unpickled_in])


class BreaksWhenUnpickled(Where):
    def __setstate__(self, state):
        raise RuntimeError("this dataset cannot be unpickled")


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_one_process_takes_the_dataset_and_forks_every_worker(start):
    dl = shmshare.DataLoader(Where(), batch_size=2, num_workers=3, multiprocessing_context=start,
                             persistent_workers=True)
    try:
        rows = [r for _ in range(2) for b in dl for r in b.tolist()]
        it = dl._iterator
        zygote = it._zygote.process.pid
        assert sorted(r[0] for r in rows) == sorted(list(range(8)) * 2)
        assert len({r[1] for r in rows}) == 3  # three workers
        assert {r[2] for r in rows} == {zygote}  # all forked by one process, not the main one
        assert {r[3] for r in rows} == {zygote}  # which unpickled the dataset, once
        workers = list(it._workers)
        assert [w.pid for w in workers] == sorted({r[1] for r in rows}, key=[w.pid for w in workers].index)
        assert all(w.is_alive() for w in workers)
    finally:
        dl.close()
    assert [w.exitcode for w in workers] == [0, 0, 0]
    assert not any(w.is_alive() for w in workers)
    wait_gone([w.pid for w in workers] + [zygote], "the workers and their zygote to exit", 10)


def test_each_starts_every_worker_alone():
    dl = shmshare.DataLoader(Where(), batch_size=4, num_workers=2, multiprocessing_context="forkserver",
                             worker_start="each")
    rows = [r for b in dl for r in b.tolist()]
    assert {r[3] for r in rows} == {r[1] for r in rows}  # each worker unpickled its own


def test_a_killed_worker_is_reported_as_torch_reports_it():
    dl = shmshare.DataLoader(Where(64), batch_size=2, num_workers=2, multiprocessing_context="forkserver")
    it = iter(dl)
    next(it)
    victim = it._workers[1]
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"exited unexpectedly") as info:
        for _ in it:
            pass
    assert "killed by signal: Killed" in str(info.value.__cause__)
    assert victim.exitcode == -signal.SIGKILL
    pids = [w.pid for w in it._workers]
    del it
    wait_gone(pids, "the other worker to exit", 10)


def test_a_dataset_the_zygote_cannot_unpickle_fails_iter_with_the_reason(capfd):
    dl = shmshare.DataLoader(BreaksWhenUnpickled(), batch_size=2, num_workers=2,
                             multiprocessing_context="spawn")  # (a spawned zygote's stderr is ours)
    with pytest.raises(RuntimeError, match=r"zygote .* exited with code 1 before it forked its workers"):
        iter(dl)
    assert "this dataset cannot be unpickled" in capfd.readouterr().err


def test_a_killed_zygote_takes_its_workers_with_it():
    dl = shmshare.DataLoader(Where(64), batch_size=2, num_workers=2, multiprocessing_context="forkserver",
                             persistent_workers=True)
    it = iter(dl)  # (the zygote killed at once: a worker may not have looked at its parent yet)
    pids = [w.pid for w in it._workers]
    os.kill(it._zygote.process.pid, signal.SIGKILL)
    wait_gone(pids, "the workers to exit once their zygote died", 15)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _ in it:
            pass
    dl.close()


def test_worker_start_is_checked():
    with pytest.raises(ValueError, match="worker_start must be 'one'"):
        shmshare.DataLoader(Where(), num_workers=2, worker_start="all")


def test_resuming_works_with_forked_workers():
    def run(state=None, k=3):
        torch.manual_seed(0)
        dl = shmshare.DataLoader(Where(20), batch_size=2, num_workers=2, multiprocessing_context="forkserver",
                                 shuffle=True, generator=torch.Generator().manual_seed(1))
        if state is not None:
            dl.load_state_dict(state)
            return [b[:, 0].tolist() for b in dl]
        it = iter(dl)
        for _ in range(k):
            next(it)
        s = dl.state_dict()
        return s, [b[:, 0].tolist() for b in it]

    state, rest = run()
    assert run(state) == rest
