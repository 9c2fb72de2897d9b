"""How workers start under spawn and forkserver: together, each without waiting for the one before it
(Note [The spec beside the start pipe] in shmshare/loader/_worker.py)."""

from __future__ import annotations

import numpy as np
import pytest

import shmshare.loader as L
from shmshare.testing import wait_gone
from tests.loader.loader_datasets import Gated


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_a_worker_starts_without_the_main_process_waiting_for_it_to_read_its_dataset(tmp_path, start):
    # Unpickling Gated waits for `go` before it reads the payload (1 MiB, more than a pipe holds), and `go` is
    # made only once iter() has returned: a start() that waits for the worker to read its dataset never
    # returns, and the worker gives up after the gate's wait (the start then fails with a broken pipe).
    go = tmp_path / "go"
    ds = Gated(8, str(go))
    dl = L.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=L.numpy_collate,
                      multiprocessing_context=start, worker_start="each")  # (a zygote waits for its dataset)
    it = iter(dl)
    pids = [w.pid for w in it._workers]
    try:
        go.touch()
        batches = list(it)
        assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        got = np.concatenate([b["x"] for b in batches])
        assert np.array_equal(got, ds.payload[:32].reshape(8, 4))
    finally:
        del it
        dl.close()
        wait_gone(pids, "the workers to exit once the loader was closed", 10)
