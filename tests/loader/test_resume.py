"""state_dict() / load_state_dict(): resuming inside an epoch (Note [Resuming mid-epoch]), side by side with
torchdata's StatefulDataLoader, whose layout the states share."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import shmshare

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata.StatefulDataLoader

ROOT = Path(__file__).resolve().parents[2]


class Augmented(Dataset):
    """Each sample draws from random, numpy and torch in the worker, as augmentations do."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> tuple[int, float, float, float]:
        return i, random.random(), float(np.random.rand()), float(torch.rand(()))


class Plain(Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> int:
        return i


class Shards(IterableDataset):
    """A worker yields every num_workers-th item from its id on; no state of its own."""

    def __init__(self, n: int = 31, draw: bool = False) -> None:
        self.n, self.draw = n, draw

    def __iter__(self):
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        for j in range(w, self.n, nw):
            yield (j, random.random()) if self.draw else j


class StatefulShards(Shards):
    """The same, saying where it is (state_dict / load_state_dict), as torchdata's tests' datasets do."""

    def __init__(self, n: int = 31) -> None:
        super().__init__(n)
        self.next: int | None = None

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]

    def __iter__(self):
        info = get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        for j in range(w if self.next is None else self.next, self.n, nw):
            self.next = j + nw
            yield j


class CountingSampler:
    """A sampler whose iterator keeps its own state."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return _CountingIter(self.n)


class _CountingIter:
    def __init__(self, n: int) -> None:
        self.n, self.i = n, 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return (self.i * 7) % self.n

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def _loader(cls, dataset, num_workers, *, shuffle=False, persistent=False, **kw):
    torch.manual_seed(0)  # each run starts where the last did: the global RNG draws alike
    random.seed(0)
    np.random.seed(0)
    if shuffle:
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(5))
    return cls(dataset, batch_size=3, num_workers=num_workers, persistent_workers=persistent, **kw)


def _plain(batch):
    return [x.tolist() if hasattr(x, "tolist") else x for x in batch] if isinstance(batch, list) else (
        batch.tolist() if hasattr(batch, "tolist") else batch)


_saved_rng: list[torch.Tensor] = []  # torch's global RNG when the last state was taken, as a program saves it


def _interrupted(cls, dataset, num_workers, k, *, epochs_before=0, **kw):
    """Take k batches, save (with torch's global RNG, as a training loop's checkpoint does); return
    (state, the rest of the epoch, the next epoch)."""
    dl = _loader(cls, dataset, num_workers, **kw)
    try:
        for _ in range(epochs_before):
            list(dl)
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = dl.state_dict()
        _saved_rng[:] = [torch.get_rng_state()]
        rest = [_plain(b) for b in it]
        return state, rest, [_plain(b) for b in dl]
    finally:
        getattr(dl, "close", lambda: None)()


def _resumed(cls, dataset, num_workers, state, **kw):
    """Load `state` into a new loader (torch's global RNG restored as it was saved): (the rest of the
    epoch, the next epoch)."""
    dl = _loader(cls, dataset, num_workers, **kw)
    if _saved_rng:
        torch.set_rng_state(_saved_rng[0])
    try:
        dl.load_state_dict(state)
        return [_plain(b) for b in dl], [_plain(b) for b in dl]
    finally:
        getattr(dl, "close", lambda: None)()


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("k", [0, 1, 5, 8])
@pytest.mark.parametrize("persistent", [False, True])
def test_resuming_yields_what_the_uninterrupted_run_would_have_random_draws_too(num_workers, k, persistent):
    state, rest, after = _interrupted(shmshare.DataLoader, Augmented(), num_workers, k, shuffle=True,
                                      persistent=persistent)
    got, got_after = _resumed(shmshare.DataLoader, Augmented(), num_workers, state, shuffle=True,
                              persistent=persistent)
    assert len(rest) == 8 - k
    assert got == rest  # indices, and every random, numpy and torch draw the workers made
    assert got_after == after  # and the epoch after: the generators moved as they did


def test_resuming_a_later_epoch_of_persistent_workers():
    state, rest, after = _interrupted(shmshare.DataLoader, Augmented(), 2, 3, shuffle=True, persistent=True,
                                      epochs_before=2)
    got, got_after = _resumed(shmshare.DataLoader, Augmented(), 2, state, shuffle=True, persistent=True)
    assert got == rest and got_after == after


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("dataset", [Shards, StatefulShards, CountingSampler], ids=lambda c: c.__name__)
def test_iterable_datasets_and_stateful_samplers_resume(num_workers, dataset):
    kw = {}
    if dataset is CountingSampler:
        ds, kw = Plain(), {"sampler": CountingSampler(23)}
    else:
        ds = dataset()
    state, rest, after = _interrupted(shmshare.DataLoader, ds, num_workers, 4, **kw)
    if dataset is CountingSampler:
        assert state.get("_sampler_iter_state") or state["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]
    got, got_after = _resumed(shmshare.DataLoader, dataset() if dataset is not CountingSampler else ds,
                              num_workers, state, **kw)
    assert got == rest and got_after == after


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffling_without_a_generator_resumes_later_epochs_too(num_workers):
    """generator=None: the sampler draws from torch's global RNG, which the program saves with the state."""
    def loader():
        return shmshare.DataLoader(Plain(), batch_size=3, num_workers=num_workers, shuffle=True)

    torch.manual_seed(0)
    dl = loader()
    it = iter(dl)
    next(it)
    next(it)
    state, rng = dl.state_dict(), torch.get_rng_state()
    want = [[_plain(b) for b in it]] + [[_plain(b) for b in dl] for _ in range(2)]
    torch.manual_seed(123)  # another process
    dl = loader()
    torch.set_rng_state(rng)
    dl.load_state_dict(state)
    assert [[_plain(b) for b in dl] for _ in range(3)] == want


def test_torchdatas_keyword_is_taken():
    dl = shmshare.DataLoader(Plain(), batch_size=3, snapshot_every_n_steps=5)
    assert dl.snapshot_every_n_steps == 5 and len(list(dl)) == 8
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        shmshare.DataLoader(Plain(), snapshot_every_n_steps=-1)


def test_without_workers_the_indices_resume():
    """With no workers the dataset draws from the program's own RNG, which the program saves (as torchdata)."""
    for shuffle in (False, True):
        state, rest, after = _interrupted(shmshare.DataLoader, Plain(), 0, 3, shuffle=shuffle)
        assert sorted(state) == sorted(["_index_sampler_state", "_sampler_iter_state", "_sampler_iter_yielded",
                                        "_num_yielded", "_IterableDataset_len_called", "_shared_seed",
                                        "fetcher_state", "dataset_state", "_iterator_finished"])
        assert _resumed(shmshare.DataLoader, Plain(), 0, state, shuffle=shuffle) == (rest, after)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("dataset", "shuffle"), [(Plain, False), (Plain, True), (Shards, False),
                                                   (StatefulShards, False)],
                         ids=["map", "map-shuffle", "iterable", "iterable-stateful"])
@pytest.mark.parametrize("direction", ["torchdata->shmshare", "shmshare->torchdata"])
def test_a_state_saved_by_one_is_resumed_by_the_other(num_workers, dataset, shuffle, direction):
    saver, loader = ((StatefulDataLoader, shmshare.DataLoader) if direction.startswith("torchdata")
                     else (shmshare.DataLoader, StatefulDataLoader))
    state, rest, _ = _interrupted(saver, dataset(), num_workers, 4, shuffle=shuffle)
    got, _ = _resumed(loader, dataset(), num_workers, state, shuffle=shuffle)
    assert got == rest


def test_the_layout_is_torchdatas():
    state, _, _ = _interrupted(shmshare.DataLoader, Plain(), 2, 3, shuffle=True)
    theirs, _, _ = _interrupted(StatefulDataLoader, Plain(), 2, 3, shuffle=True)
    assert sorted(state) == sorted(theirs)
    snap, their_snap = state["_snapshot"], theirs["_snapshot"]
    assert sorted(snap) == sorted(their_snap)
    assert sorted(snap["_main_snapshot"]) == sorted(their_snap["_main_snapshot"])
    assert sorted(snap["_worker_snapshots"]) == ["worker_0", "worker_1"]
    ours_w = snap["_worker_snapshots"]["worker_0"]
    assert set(their_snap["_worker_snapshots"]["worker_0"]) <= set(ours_w)  # plus our RNG and batches
    assert (snap["_snapshot_step"], snap["_last_yielded_worker_id"], state["_steps_since_snapshot"]) == (3, 0, 0)
    assert sorted(snap["_main_snapshot"]["_sampler_iter_state"]) == ["sampler_iter_state", "samples_yielded"]


def test_states_are_plain_data_json_and_torch_save_take_them():
    state, rest, _ = _interrupted(shmshare.DataLoader, Augmented(), 2, 2)
    back = json.loads(json.dumps(state))  # no tensor without a shuffling generator
    assert _resumed(shmshare.DataLoader, Augmented(), 2, back)[0] == rest
    state, rest, _ = _interrupted(shmshare.DataLoader, Augmented(), 2, 2, shuffle=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert _resumed(shmshare.DataLoader, Augmented(), 2, back, shuffle=True)[0] == rest


def test_a_state_handed_out_is_not_changed_by_later_batches():
    dl = _loader(shmshare.DataLoader, StatefulShards(), 2)
    try:
        it = iter(dl)
        next(it)
        state = dl.state_dict()
        frozen = json.dumps(state, sort_keys=True)
        next(it)
        next(it)
        assert json.dumps(state, sort_keys=True) == frozen
        assert dl.state_dict() != state
    finally:
        dl.close()


def test_state_dict_before_iter_starts_the_iterator_iter_then_returns():
    dl = _loader(shmshare.DataLoader, Plain(), 2)
    try:
        state = dl.state_dict()
        assert state["_snapshot"]["_snapshot_step"] == 0
        assert state["_snapshot"]["_last_yielded_worker_id"] == 1
        first = dl._initial_iter
        assert iter(dl) is first
        whole = [_plain(b) for b in first]
        dl.load_state_dict(state)
        assert dl.state_dict() == state  # a loaded state, before iter(), is the state
        assert [_plain(b) for b in dl] == whole
    finally:
        dl.close()


def test_a_state_from_the_end_of_an_epoch_starts_the_next():
    dl = _loader(shmshare.DataLoader, Augmented(), 2, shuffle=True)
    list(dl)
    end = dl.state_dict()
    assert end["_iterator_finished"] is True
    nxt = [_plain(b) for b in dl]
    got, _ = _resumed(shmshare.DataLoader, Augmented(), 2, end, shuffle=True)
    assert got == nxt


def test_an_empty_state_starts_afresh():
    dl = _loader(shmshare.DataLoader, Plain(), 2)
    try:
        whole = [_plain(b) for b in dl]
        it = iter(dl)
        next(it)
        del it
        dl.load_state_dict({})
        assert [_plain(b) for b in dl] == whole
    finally:
        dl.close()


@pytest.mark.parametrize(("saved", "loading", "match"), [
    (0, 2, "saved by a loader with num_workers=0; this loader has num_workers=2"),
    (2, 0, "saved by a loader with num_workers=2; this loader has num_workers=0"),
    (2, 3, "make the loader with num_workers=2"),
])
def test_another_number_of_workers_is_refused_with_the_fix(saved, loading, match):
    state, _, _ = _interrupted(shmshare.DataLoader, Plain(), saved, 1)
    dl = _loader(shmshare.DataLoader, Plain(), loading)
    with pytest.raises(ValueError, match=match):
        dl.load_state_dict(state)


@pytest.mark.parametrize(("state", "error", "match"), [
    ([1, 2], TypeError, "takes the dict state_dict"),
    ({"x": 1}, ValueError, "not a loader state"),
    ({"_snapshot": {"_main_snapshot": {}}}, ValueError, "lacks"),
])
def test_what_is_no_state_is_refused(state, error, match):
    dl = _loader(shmshare.DataLoader, Plain(), 2)
    with pytest.raises(error, match=match):
        dl.load_state_dict(state)


def test_numpy_mode_resumes_with_a_numpy_generator():
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        import numpy as np
        import shmshare.loader as L

        class DS:
            def __len__(self): return 29
            def __getitem__(self, i): return np.array([i, np.random.randint(1 << 30)])

        def run(state=None, k=4):
            dl = L.DataLoader(DS(), batch_size=4, shuffle=True, generator=np.random.default_rng(3),
                              num_workers=2)
            if state is not None:
                dl.load_state_dict(state)
                return [b.tolist() for b in dl], [b.tolist() for b in dl]
            it = iter(dl)
            for _ in range(k):
                next(it)
            s = dl.state_dict()
            return s, [b.tolist() for b in it], [b.tolist() for b in dl]

        state, rest, after = run()
        got, got_after = run(state)
        assert got == rest and got_after == after, (got, rest)
        print("ok", len(rest))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "4"]


# -- what the hostile review found --------------------------------------------------------------------------


class SelfSkippingSampler:
    """A sampler that keeps its position itself (as torchdata's StatefulDistributedSampler does)."""

    def __init__(self, n: int) -> None:
        self.n, self.start, self.yielded = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        begin, self.start, self.yielded = self.start, 0, self.start
        for i in range(begin, self.n):
            self.yielded += 1
            yield i

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self.start = state["yielded"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_that_keeps_its_own_position_is_not_skipped_twice(num_workers):
    state, rest, _ = _interrupted(shmshare.DataLoader, Plain(), num_workers, 3, sampler=SelfSkippingSampler(23))
    got, _ = _resumed(shmshare.DataLoader, Plain(), num_workers, state, sampler=SelfSkippingSampler(23))
    assert got == rest and rest[0] == [9, 10, 11]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_taken_at_a_later_epochs_start_resumes_that_epoch(num_workers, persistent):
    if persistent and not num_workers:
        pytest.skip("persistent workers need workers")
    dl = _loader(shmshare.DataLoader, Plain(), num_workers, shuffle=True, persistent=persistent)
    try:
        list(dl)
        it = iter(dl)
        state = dl.state_dict()  # epoch 1, before its first batch
        epoch1 = [_plain(b) for b in it]
    finally:
        dl.close()
    got, _ = _resumed(shmshare.DataLoader, Plain(), num_workers, state, shuffle=True, persistent=persistent)
    assert got == epoch1


class BigState(Plain):
    """A dataset whose state is more than a frame holds."""

    def state_dict(self):
        return {"table": list(range(50_000))}

    def load_state_dict(self, state):
        assert len(state["table"]) == 50_000


class BrokenState(Plain):
    def state_dict(self):
        raise RuntimeError("no state today")

    def load_state_dict(self, state):
        pass


def test_a_big_dataset_state_travels_through_the_pool():
    state, rest, _ = _interrupted(shmshare.DataLoader, BigState(), 2, 3)
    assert len(state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["table"]) == 50_000
    assert _resumed(shmshare.DataLoader, BigState(), 2, state)[0] == rest


def test_a_dataset_state_that_cannot_be_taken_fails_state_dict_not_the_batches():
    dl = _loader(shmshare.DataLoader, BrokenState(), 2)
    try:
        it = iter(dl)
        assert _plain(next(it)) == [0, 1, 2]
        with pytest.raises(RuntimeError, match=r"could not take its dataset's state .* no state today"):
            dl.state_dict()
        assert len([b for b in it]) == 7
    finally:
        dl.close()


def test_out_of_order_loses_nothing_on_resume():
    dl = _loader(shmshare.DataLoader, Plain(), 2, in_order=False)
    try:
        it = iter(dl)
        seen = [v for _ in range(3) for v in _plain(next(it))]
        with pytest.warns(UserWarning, match="in_order=False"):
            state = dl.state_dict()
    finally:
        dl.close()
    got, _ = _resumed(shmshare.DataLoader, Plain(), 2, state, in_order=False)
    assert set(seen) | {v for b in got for v in b} == set(range(23))


@pytest.mark.parametrize(("path", "value", "match"), [
    (("_snapshot", "_main_snapshot", "_base_seed"), 1 << 70, "not a 64-bit seed"),
    (("_snapshot", "_last_yielded_worker_id"), 5, "not a count below 2"),
    (("_snapshot", "_worker_snapshots", "worker_0"), None, "snapshot is a NoneType"),
    (("_snapshot", "_worker_snapshots", "worker_0", "_shmshare_rng", "numpy", "key"), "AAAA",
     "wrong sizes"),
    (("_snapshot", "_main_snapshot", "_num_workers"), "2", "not an int"),
])
def test_a_damaged_state_is_refused_before_any_worker_starts(path, value, match):
    state, _, _ = _interrupted(shmshare.DataLoader, Augmented(), 2, 2)
    d = state
    for key in path[:-1]:
        d = d[key]
    d[path[-1]] = value
    dl = _loader(shmshare.DataLoader, Augmented(), 2)
    with pytest.raises(ValueError, match=match):
        dl.load_state_dict(state)
