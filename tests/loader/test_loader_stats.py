"""loader.stats() and the loaders' part of shmshare stat (Note [Where the time goes])."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import Dataset

import shmshare
from shmshare import _stat


class Rows(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((256,), i, dtype=torch.float32)


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_stats_say_where_each_workers_time_went(start):
    dl = shmshare.DataLoader(Rows(), batch_size=4, num_workers=2, multiprocessing_context=start,
                             persistent_workers=True)
    assert dl.stats() is None
    try:
        held = [b for b in dl]
        s = dl.stats()
        assert (s.num_workers, s.batches, len(s.workers)) == (2, 6, 2)
        assert sum(w.batches for w in s.workers) == 6
        assert [w.pid for w in s.workers] == [w.pid for w in dl._iterator._workers]
        assert all(w.fetch_s > 0 and w.collate_s > 0 and w.send_s >= 0 for w in s.workers)
        assert s.wait_fraction == s.wait_s / s.elapsed_s  # (what it is, not how long anything took)
        assert s.bytes_in_flight > 0  # the program holds every batch
        for w in s.workers:
            names = [name for name, _ in w.startup]
            assert names[0] == "process" and names[-1] == "first sample"
            if start != "fork":
                assert names == ["process", "imports", "dataset", "fork", "first sample"]
            times = [t for _, t in w.startup]
            assert times == sorted(times)
        json.dumps(s.as_dict())
        del held
    finally:
        dl.close()


def test_each_epoch_of_persistent_workers_starts_its_figures_afresh():
    dl = shmshare.DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        list(dl)
        list(dl)
        s = dl.stats()
        assert s.batches == 6 and s.start_s == 0 and sum(w.batches for w in s.workers) == 6
    finally:
        dl.close()


def test_no_workers_counts_the_fetches_as_waiting():
    dl = shmshare.DataLoader(Rows(), batch_size=4)
    list(dl)
    s = dl.stats()
    assert (s.num_workers, s.batches, s.workers) == (0, 6, ())
    assert s.wait_s > 0


def _report(loaders):
    stats = {"loaders": loaders, "pools": [], "senders": [], "owners": [], "totals": {}}
    proc = _stat.Process(pid=42, command="python train.py", mapped_bytes=0, resident_bytes=0, fds=0,
                         segments=set(), shares_with=set(), stats=stats)
    return _stat.Report([proc], [], 0, [], [], None)


def test_stat_shows_a_loader_and_survives_a_hostile_one():
    good = {"batches": 10, "elapsed_s": 2.0, "wait_s": 1.5, "wait_fraction": 0.75, "start_s": 0.5,
            "bytes_in_flight": 4096, "workers": [{"pid": 7, "worker_id": 0, "batches": 10, "fetch_s": 1.9,
                                                  "collate_s": 0.1, "send_s": 0.0, "bytes_held": 4096,
                                                  "startup": [["process", 0.01], ["first sample", 0.2]]}]}
    text = _stat.render(_report([good]), width=120)
    assert "DataLoader in pid 42: 10 batches" in text and "input-bound" in text
    assert "0.20s" in text
    text = _stat.render(_report([{"workers": "nope", "elapsed_s": "x"}]), width=120)
    assert "a DataLoader report stat cannot read" in text
