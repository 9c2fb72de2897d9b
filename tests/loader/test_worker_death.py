"""A worker's death is reported at once, whatever the other workers are doing; they are stopped
after the error is raised (as torch's loader does), and none outlives the iterator."""

from __future__ import annotations

import gc
import os
import re

import pytest

import shmshare.loader as L
from shmshare.loader import _iters
from shmshare.testing import kill, pid_alive, wait_gone
from tests.loader.loader_datasets import DiesWhileAnotherSleeps

WAIT = 20.0  # s: the bound of every wait for a process to go


@pytest.mark.parametrize("drop", ["del", "next"])
def test_a_dead_worker_is_reported_while_another_sleeps_in_getitem(tmp_path, monkeypatch, drop):
    monkeypatch.setattr(_iters, "_JOIN_WAIT", 0.5)  # the sleeper is terminated after it: sooner
    dl = L.DataLoader(DiesWhileAnotherSleeps(str(tmp_path)), batch_size=1, num_workers=2,
                      collate_fn=L.numpy_collate, timeout=WAIT)
    it = iter(dl)
    dead, busy = (w.pid for w in it._workers)
    try:
        with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {dead}\) exited "
                                               "unexpectedly") as info:
            next(it)
        # the error came while worker 1 still sleeps in its __getitem__ (30 s), not after it
        # was joined or terminated
        assert pid_alive(busy) and os.path.exists(tmp_path / "started")
        assert not os.path.exists(tmp_path / "done")
        assert re.fullmatch(rf"DataLoader worker \(pid {dead}\) exited unexpectedly with exit code "
                            r"7\. .*", str(info.value.__cause__))
        del info
        if drop == "next":  # a later use raises the same error, and stops the workers first
            with pytest.raises(RuntimeError, match="exited unexpectedly"):
                next(it)
            assert not pid_alive(busy)
        del it, dl
        gc.collect()
        wait_gone([dead, busy], "the dead worker and the busy one to be gone", WAIT)
        assert not os.path.exists(tmp_path / "done")  # stopped, not left to finish its sleep
    finally:
        kill(dead, busy, reap=False)
