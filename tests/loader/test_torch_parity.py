"""shmshare.DataLoader against torch.utils.data.DataLoader, side by side.

Every test runs twice, on torch's loader ("torch") and on ours ("shmshare"), with the same assertions: torch's
behaviour is the spec. Where the result is deterministic, the test also runs torch's loader as the reference
and compares the two outputs directly (for the "torch" run that checks torch against itself, which keeps the
test honest about what is deterministic).
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the parity tests compare against torch.utils.data.DataLoader")
np = pytest.importorskip("numpy")

import psutil  # noqa: E402
from torch.utils.data import (  # noqa: E402
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import shmshare  # noqa: E402

from . import parity_datasets as pd  # noqa: E402

TorchDataLoader = torch.utils.data.DataLoader
REPO = Path(__file__).resolve().parents[2]

loader_cls_param = pytest.mark.parametrize(
    "loader_cls",
    [
        pytest.param(TorchDataLoader, id="torch"),
        pytest.param(
            getattr(shmshare, "DataLoader", None),
            id="shmshare",
            marks=pytest.mark.skipif(not hasattr(shmshare, "DataLoader"), reason="shmshare.DataLoader not built yet"),
        ),
    ],
)
pytestmark = [loader_cls_param]


@pytest.fixture(scope="module", autouse=True)
def forkserver_running():
    """Start multiprocessing's forkserver (a process-wide singleton, as the resource tracker) before any leak
    check, so the first forkserver test does not count its fds as a leak."""
    from multiprocessing import forkserver

    forkserver.ensure_running()
    yield


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """Move what is alive now (torch, numpy, pytest) out of the collector's sight: the leak checker and these
    tests collect garbage a few times per test, and a full collection of that heap costs ~0.1 s each time.
    Garbage made by the tests themselves is still collected."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


# -- helpers ----------------------------------------------------------------------------------------------------


def run(loader_cls: type, dataset: Any, **kwargs: Any) -> list:
    """Iterate a fresh loader to exhaustion (which shuts its workers down) and return the batches."""
    loader = loader_cls(dataset, **kwargs)
    out = list(loader)
    del loader
    return out


def describe(obj: Any) -> Any:
    """A comparable picture of a batch: every container's type and every leaf's type, dtype, shape and value."""
    if isinstance(obj, torch.Tensor):
        return ("Tensor", type(obj).__name__, str(obj.dtype), tuple(obj.shape), obj.is_contiguous(), obj.tolist())
    if isinstance(obj, np.ndarray):
        return ("ndarray", str(obj.dtype), obj.shape, obj.tolist())
    if isinstance(obj, dict):
        return (type(obj).__name__, {k: describe(v) for k, v in obj.items()})
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, [describe(v) for v in obj])
    return (type(obj).__name__, obj)


def alive(pid: int) -> bool:
    """True while `pid` is a running (not yet exited) process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: set[int], within: float) -> set[int]:
    """Wait up to `within` s for every pid to exit; return those still running."""
    deadline = time.monotonic() + within
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torch_base_seed(seed: int) -> int:
    """The base seed torch's loader draws first from `generator=torch.Generator().manual_seed(seed)`."""
    return torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(seed)).item()


# -- construction: validation, attributes, len(), warnings -----------------------------------------------------


def _validation_cases() -> list:
    ds = pd.RangeDataset(4)
    it = pd.ShardedIterable(4)
    sampler = SequentialSampler(ds)
    batches = BatchSampler(sampler, 2, False)
    methods = mp.get_all_start_methods()
    exclusive = "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
    cases = [
        ("num_workers", dict(dataset=ds, num_workers=-1), ValueError,
         "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."),
        ("num_workers_before_timeout", dict(dataset=ds, num_workers=-1, timeout=-1), ValueError,
         "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."),
        ("timeout", dict(dataset=ds, timeout=-1), ValueError, "timeout option should be non-negative"),
        ("prefetch_without_workers", dict(dataset=ds, prefetch_factor=2), ValueError,
         "prefetch_factor option could only be specified in multiprocessing.let num_workers > 0 to enable "
         "multiprocessing, otherwise set prefetch_factor to None."),
        ("prefetch_negative", dict(dataset=ds, num_workers=2, prefetch_factor=-1), ValueError,
         "prefetch_factor option should be non-negative"),
        ("persistent_without_workers", dict(dataset=ds, persistent_workers=True), ValueError,
         "persistent_workers option needs num_workers > 0"),
        ("iterable_shuffle", dict(dataset=it, shuffle=True), ValueError,
         "DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle=True"),
        ("iterable_sampler", dict(dataset=it, sampler=sampler), ValueError,
         f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"),
        ("iterable_batch_sampler", dict(dataset=it, batch_sampler=batches), ValueError,
         "DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
         f"batch_sampler={batches}"),
        ("sampler_and_shuffle", dict(dataset=ds, sampler=sampler, shuffle=True), ValueError,
         "sampler option is mutually exclusive with shuffle"),
        ("batch_sampler_and_batch_size", dict(dataset=ds, batch_sampler=batches, batch_size=2), ValueError, exclusive),
        ("batch_sampler_and_shuffle", dict(dataset=ds, batch_sampler=batches, shuffle=True), ValueError, exclusive),
        ("batch_sampler_and_sampler", dict(dataset=ds, batch_sampler=batches, sampler=sampler), ValueError, exclusive),
        ("batch_sampler_and_drop_last", dict(dataset=ds, batch_sampler=batches, drop_last=True), ValueError, exclusive),
        ("no_batching_and_drop_last", dict(dataset=ds, batch_size=None, drop_last=True), ValueError,
         "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"),
        ("context_bad_name", dict(dataset=ds, num_workers=2, multiprocessing_context="bogus"), ValueError,
         f"multiprocessing_context option should specify a valid start method in {methods!r}, but got "
         "multiprocessing_context='bogus'"),
        ("context_bad_type", dict(dataset=ds, num_workers=2, multiprocessing_context=123), TypeError,
         "multiprocessing_context option should be a valid context object or a string specifying the start "
         "method, but got multiprocessing_context=123"),
        ("context_without_workers", dict(dataset=ds, multiprocessing_context="fork"), ValueError,
         "multiprocessing_context can only be used with multi-process loading (num_workers > 0), but got "
         "num_workers=0"),
    ]
    return [pytest.param(kw, exc, msg, id=name) for name, kw, exc, msg in cases]


@pytest.mark.parametrize(("kwargs", "exc_type", "message"), _validation_cases())
def test_validation_message(loader_cls, kwargs, exc_type, message):
    with pytest.raises(exc_type) as info:
        loader_cls(**kwargs)
    assert type(info.value) is exc_type
    assert str(info.value) == message


@pytest.mark.parametrize("attr", ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                                  "persistent_workers"])
def test_attribute_frozen_after_init(loader_cls, attr):
    loader = loader_cls(pd.RangeDataset(4))
    with pytest.raises(ValueError) as info:
        setattr(loader, attr, getattr(loader, attr))
    assert str(info.value) == f"{attr} attribute should not be set after DataLoader is initialized"


def test_attributes_as_torch(loader_cls):
    ds = pd.RangeDataset(5)
    ctx = mp.get_context("spawn")
    ours = loader_cls(ds, batch_size=2, num_workers=2, timeout=3, multiprocessing_context=ctx, drop_last=True)
    ref = TorchDataLoader(ds, batch_size=2, num_workers=2, timeout=3, multiprocessing_context=ctx, drop_last=True)
    for name in ("batch_size", "num_workers", "timeout", "drop_last", "prefetch_factor", "pin_memory",
                 "persistent_workers", "in_order", "generator", "worker_init_fn", "pin_memory_device"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.dataset is ds
    assert ours.multiprocessing_context is ctx
    assert type(ours.sampler) is SequentialSampler
    assert type(ours.batch_sampler) is BatchSampler
    assert ours.collate_fn is torch.utils.data.default_collate
    assert loader_cls(ds, batch_size=None).collate_fn is torch.utils.data.default_convert
    assert type(loader_cls(ds, shuffle=True).sampler) is RandomSampler
    assert loader_cls(ds).prefetch_factor is None
    named = loader_cls(ds, num_workers=1, multiprocessing_context="fork").multiprocessing_context
    assert named.get_start_method() == "fork"


def _len_cases() -> list:
    ds = pd.RangeDataset(10)
    cases = [
        ("map_bs3", ds, dict(batch_size=3), 4),
        ("map_bs3_drop_last", ds, dict(batch_size=3, drop_last=True), 3),
        ("map_no_batching", ds, dict(batch_size=None), 10),
        ("map_sampler", ds, dict(sampler=SubsetRandomSampler([1, 2, 3]), batch_size=2), 2),
        ("map_batch_sampler", ds, dict(batch_sampler=BatchSampler(SequentialSampler(range(7)), 2, True)), 3),
        ("iterable_sized_bs3", pd.SizedIterable(10, 10), dict(batch_size=3), 4),
        ("iterable_sized_bs3_drop_last", pd.SizedIterable(10, 10), dict(batch_size=3, drop_last=True), 3),
        ("iterable_sized_no_batching", pd.SizedIterable(10, 10), dict(batch_size=None), 10),
        ("iterable_sized_workers", pd.SizedIterable(10, 7), dict(batch_size=2, num_workers=2), 4),
    ]
    return [pytest.param(d, kw, n, id=name) for name, d, kw, n in cases]


@pytest.mark.parametrize(("dataset", "kwargs", "expected"), _len_cases())
def test_len(loader_cls, dataset, kwargs, expected):
    assert len(loader_cls(dataset, **kwargs)) == expected
    assert len(TorchDataLoader(dataset, **kwargs)) == expected


def test_len_of_unsized_iterable_raises_type_error(loader_cls):
    loader = loader_cls(pd.ShardedIterable(4), batch_size=2)
    with pytest.raises(TypeError):
        len(loader)


def test_len_of_iterator(loader_cls):
    it = iter(loader_cls(pd.RangeDataset(10), batch_size=4))
    assert len(it) == 3
    assert [b.tolist() for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def _patch_cpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch._utils, "cpu_count", lambda: n)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
    monkeypatch.setattr(os, "cpu_count", lambda: n)
    monkeypatch.setattr(mp, "cpu_count", lambda: n)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: n)


def test_warns_excessive_workers(loader_cls, monkeypatch):
    _patch_cpus(monkeypatch, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader_cls(pd.RangeDataset(4), num_workers=2)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert messages == [
        "This DataLoader will create 2 worker processes in total. Our suggested max number of worker in current "
        "system is 1, which is smaller than what this DataLoader is going to create. Please be aware that "
        "excessive worker creation might get DataLoader running slow or even freeze, lower the worker number to "
        "avoid potential slowness/freeze if necessary."
    ]


def test_no_warning_for_rational_workers(loader_cls, monkeypatch):
    _patch_cpus(monkeypatch, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader_cls(pd.RangeDataset(4), num_workers=2)
        loader_cls(pd.RangeDataset(4), num_workers=0)


def test_warns_pin_memory_without_accelerator(loader_cls):
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: pin_memory is honoured, no warning")
    loader = loader_cls(pd.RangeDataset(4), batch_size=2, pin_memory=True)
    with pytest.warns(UserWarning) as caught:
        batches = list(loader)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3]]
    assert not batches[0].is_pinned()
    assert "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't " \
           "be used." in [str(w.message) for w in caught]


def test_warns_pin_memory_device_deprecated(loader_cls):
    loader = loader_cls(pd.RangeDataset(2), pin_memory=True, pin_memory_device="cuda")
    with pytest.warns(UserWarning) as caught:
        assert [b.tolist() for b in loader] == [[0], [1]]
    assert "pin_memory_device is deprecated, the current accelerator will be used as the device,ignore " \
           "pin_memory_device='cuda'." in [str(w.message) for w in caught]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_warns_iterable_longer_than_len(loader_cls, num_workers):
    loader = loader_cls(pd.SizedIterable(4, 3), batch_size=None, num_workers=num_workers)
    assert len(loader) == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(loader)
    assert len(items) == 4 * max(num_workers, 1)
    messages = [str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)]
    assert messages, [str(w.message) for w in caught]
    assert re.match(r"Length of IterableDataset .* was reported to be 3\(when accessing len\(dataloader\)\), "
                    r"but 4 samples have been fetched\. ", messages[0])
    assert ("For multiprocessing data-loading" in messages[0]) == (num_workers > 0)
    del loader
    gc.collect()


def test_generic_subscript(loader_cls):
    alias = loader_cls[int]
    loader = alias(pd.RangeDataset(3), batch_size=None)
    assert isinstance(loader, loader_cls)
    assert list(loader) == [0, 1, 2]


# -- results: ordering, samplers, seeds -------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sequential_batches(loader_cls, num_workers):
    out = run(loader_cls, pd.RangeDataset(10), batch_size=3, num_workers=num_workers)
    assert [type(b) for b in out] == [torch.Tensor] * 4
    assert [b.dtype for b in out] == [torch.int64] * 4
    assert [b.tolist() for b in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_with_generator_same_order_as_torch(loader_cls, num_workers):
    ds = pd.RangeDataset(20)

    def kw(seed):
        return dict(batch_size=4, shuffle=True, num_workers=num_workers, generator=torch.Generator().manual_seed(seed))

    ref = [b.tolist() for b in run(TorchDataLoader, ds, **kw(7))]
    ours = [b.tolist() for b in run(loader_cls, ds, **kw(7))]
    assert ours == ref
    assert sorted(x for b in ours for x in b) == list(range(20))
    assert [b.tolist() for b in run(loader_cls, ds, **kw(8))] != ours  # the seed matters


def test_shuffle_follows_global_seed_as_torch(loader_cls):
    ds = pd.RangeDataset(20)
    torch.manual_seed(11)
    ref = [b.tolist() for b in run(TorchDataLoader, ds, batch_size=5, shuffle=True)]
    torch.manual_seed(11)
    assert [b.tolist() for b in run(loader_cls, ds, batch_size=5, shuffle=True)] == ref


@pytest.mark.parametrize("num_workers", [0, 2])
def test_global_rng_consumed_as_torch(loader_cls, num_workers):
    """Without a generator the base seed and the shuffle draw from torch's global RNG: same draws, same state."""
    ds = pd.RangeDataset(10)
    torch.manual_seed(4)
    ref = [b.tolist() for b in run(TorchDataLoader, ds, batch_size=5, shuffle=True, num_workers=num_workers)]
    ref_state = torch.get_rng_state()
    torch.manual_seed(4)
    assert [b.tolist() for b in run(loader_cls, ds, batch_size=5, shuffle=True, num_workers=num_workers)] == ref
    assert torch.equal(torch.get_rng_state(), ref_state)


def test_shuffle_epochs_as_torch(loader_cls):
    """One loader, one generator, three epochs: each epoch reshuffles, in torch's sequence."""
    def epochs(cls):
        loader = cls(pd.RangeDataset(12), batch_size=4, shuffle=True, num_workers=2,
                     generator=torch.Generator().manual_seed(1))
        return [[b.tolist() for b in loader] for _ in range(3)]

    ours = epochs(loader_cls)
    assert ours == epochs(TorchDataLoader)
    assert ours[0] != ours[1] != ours[2]


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_seeds_across_epochs_as_torch(loader_cls, persistent):
    """Non-persistent workers are seeded afresh each epoch (a new base seed drawn); persistent ones once."""
    def epochs(cls):
        loader = cls(pd.SeedDataset(4), batch_size=None, num_workers=2, worker_init_fn=pd.record_seeds,
                     persistent_workers=persistent, generator=torch.Generator().manual_seed(12))
        out = [sorted((rec["worker_id"], rec["info_seed"]) for _, rec in loader) for _ in range(2)]
        del loader
        gc.collect()
        return out

    ours = epochs(loader_cls)
    assert ours == epochs(TorchDataLoader)
    assert (ours[0] == ours[1]) == persistent


def _sampler_cases() -> list:
    def gen():
        return torch.Generator().manual_seed(3)

    return [
        pytest.param(lambda ds: dict(sampler=RandomSampler(ds, generator=gen()), batch_size=3), id="RandomSampler"),
        pytest.param(lambda ds: dict(sampler=RandomSampler(ds, replacement=True, num_samples=7, generator=gen())),
                     id="RandomSampler_replacement"),
        pytest.param(lambda ds: dict(batch_sampler=BatchSampler(SequentialSampler(ds), 3, drop_last=True)),
                     id="BatchSampler"),
        pytest.param(lambda ds: dict(batch_sampler=BatchSampler(RandomSampler(ds, generator=gen()), 4, False)),
                     id="BatchSampler_random"),
        pytest.param(lambda ds: dict(sampler=SubsetRandomSampler([1, 3, 5, 7, 9], generator=gen()), batch_size=2),
                     id="SubsetRandomSampler"),
        pytest.param(lambda ds: dict(sampler=WeightedRandomSampler([0.1] * 5 + [1.0] * 5, 8, generator=gen()),
                                     batch_size=4), id="WeightedRandomSampler"),
        pytest.param(lambda ds: dict(sampler=[9, 8, 7], batch_size=2), id="plain_iterable_sampler"),
        pytest.param(lambda ds: dict(batch_sampler=[[0, 1], [5], [2, 3, 4]]), id="plain_batch_sampler"),
    ]


@pytest.mark.parametrize("make_kwargs", _sampler_cases())
def test_torch_samplers_accepted(loader_cls, make_kwargs):
    ds = pd.RangeDataset(10)
    ref = [b.tolist() for b in run(TorchDataLoader, ds, num_workers=2, **make_kwargs(ds))]
    ours = [b.tolist() for b in run(loader_cls, ds, num_workers=2, **make_kwargs(ds))]
    assert ours == ref


def _seeds(loader_cls: type, **kwargs: Any) -> dict[int, dict]:
    """The seeds record_seeds saw in each worker, by worker id."""
    out = run(loader_cls, pd.SeedDataset(8), batch_size=None, num_workers=2, worker_init_fn=pd.record_seeds, **kwargs)
    assert [i for i, _ in out] == list(range(8))
    return {rec["worker_id"]: rec for _, rec in out}


def test_worker_seeds_as_torch_with_generator(loader_cls):
    seeds = _seeds(loader_cls, generator=torch.Generator().manual_seed(5))
    ref = _seeds(TorchDataLoader, generator=torch.Generator().manual_seed(5))
    assert seeds == ref
    base = torch_base_seed(5)
    for wid in (0, 1):
        assert seeds[wid]["info_id"] == wid
        assert seeds[wid]["info_seed"] == seeds[wid]["torch_initial_seed"] == base + wid
    assert seeds[0]["random"] != seeds[1]["random"]
    assert seeds[0]["numpy"] != seeds[1]["numpy"]
    # reproducible run to run
    assert _seeds(loader_cls, generator=torch.Generator().manual_seed(5)) == seeds
    assert _seeds(loader_cls, generator=torch.Generator().manual_seed(6)) != seeds


def test_worker_seeds_as_torch_with_global_seed(loader_cls):
    torch.manual_seed(21)
    ref = _seeds(TorchDataLoader)
    torch.manual_seed(21)
    assert _seeds(loader_cls) == ref


def test_shuffle_and_worker_seeds_together_as_torch(loader_cls):
    """The base seed and the shuffle both come from `generator`: in torch's order, the base seed first."""
    def go(cls):
        out = run(cls, pd.SeedDataset(8), batch_size=None, shuffle=True, num_workers=2,
                  worker_init_fn=pd.record_seeds, generator=torch.Generator().manual_seed(9))
        return [i for i, _ in out], {rec["worker_id"]: rec for _, rec in out}

    assert go(loader_cls) == go(TorchDataLoader)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_batch_i_from_worker_i_mod_n(loader_cls):
    ds = pd.WorkerQueueDataset(24)
    out = run(loader_cls, ds, batch_size=3, num_workers=3, worker_init_fn=ds.worker_init_fn)
    assert len(out) == 8
    for i, (worker_ids, items) in enumerate(out):
        assert worker_ids.tolist() == [i % 3] * 3, i
        assert items.tolist() == [3 * i, 3 * i + 1, 3 * i + 2]


def test_worker_info_in_workers(loader_cls):
    ds = pd.WorkerInfoIterable()
    out = run(loader_cls, ds, batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(2))
    base = torch_base_seed(2)
    assert sorted(out, key=lambda r: r["id"]) == [
        {"id": 0, "num_workers": 2, "seed": base, "dataset_is_self": True},
        {"id": 1, "num_workers": 2, "seed": base + 1, "dataset_is_self": True},
    ]
    assert torch.utils.data.get_worker_info() is None  # not in a worker here


def test_worker_info_none_without_workers(loader_cls):
    # default_convert turns a sample's tuple into a list (torch: "backwards compatibility")
    assert run(loader_cls, pd.PidDataset(2), batch_size=None) == [[0, -1, os.getpid()], [1, -1, os.getpid()]]


def test_in_order_false_returns_fast_batches_first(loader_cls):
    ds = pd.SlowFirstDataset(12, delay=0.5)
    out = run(loader_cls, ds, batch_size=None, num_workers=2, in_order=False)
    assert sorted(out) == list(range(12))
    assert out[0] != 0, out
    assert out.index(0) > 0


def test_in_order_true_waits_for_slow_batch(loader_cls):
    ds = pd.SlowFirstDataset(6, delay=0.3)
    assert run(loader_cls, ds, batch_size=None, num_workers=2, in_order=True) == list(range(6))


@pytest.mark.parametrize("batch_size", [None, 3])
def test_iterable_sharded_every_item_once(loader_cls, batch_size):
    out = run(loader_cls, pd.ShardedIterable(20), batch_size=batch_size, num_workers=2)
    items = out if batch_size is None else [x for b in out for x in b.tolist()]
    assert sorted(items) == list(range(20))
    ref = run(TorchDataLoader, pd.ShardedIterable(20), batch_size=batch_size, num_workers=2)
    assert describe(out) == describe(ref)


def test_iterable_unsharded_duplicated_per_worker(loader_cls):
    out = run(loader_cls, pd.UnshardedIterable(5), batch_size=None, num_workers=2)
    assert sorted(out) == sorted(list(range(5)) * 2)


def test_iterable_drop_last_per_worker(loader_cls):
    """Each worker batches its own shard: with drop_last each drops its own remainder."""
    out = run(loader_cls, pd.ShardedIterable(10), batch_size=2, drop_last=True, num_workers=2)
    ref = run(TorchDataLoader, pd.ShardedIterable(10), batch_size=2, drop_last=True, num_workers=2)
    assert [b.tolist() for b in out] == [b.tolist() for b in ref]


# -- collate ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collate_types_as_torch(loader_cls, num_workers):
    ds = pd.MixedDataset(5)
    batches = run(loader_cls, ds, batch_size=2, num_workers=num_workers)
    first = batches[0]
    checks = (first["int"].dtype, first["float"].dtype, first["str"], type(first["point"]), type(first["array"]))
    ours = describe(batches)
    del batches, first  # a failing assert then holds no batch (no mapping) past the test
    ref = describe(run(TorchDataLoader, ds, batch_size=2, num_workers=0))
    assert ours == ref
    assert checks == (torch.int64, torch.float64, ["s0", "s1"], pd.Point, torch.Tensor)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_convert_without_batching_as_torch(loader_cls, num_workers):
    ds = pd.MixedDataset(3)
    # only the descriptions are kept: a failing assert then holds no batch (no mapping) past the test
    ours = describe(run(loader_cls, ds, batch_size=None, num_workers=num_workers))
    ref = describe(run(TorchDataLoader, ds, batch_size=None, num_workers=0))
    assert ours == ref


def _collate_error_cases() -> list:
    none_msg = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; "
                "found <class 'NoneType'>")
    return [
        pytest.param(None, TypeError, none_msg, id="None"),
        pytest.param([1, 2, 3], RuntimeError, "each element in list of batch should be of equal size",
                     id="unequal_lists"),
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("sample", "exc_type", "message"), _collate_error_cases())
def test_collate_error_as_torch(loader_cls, sample, exc_type, message, num_workers):
    loader = loader_cls(pd.BadSampleDataset(4, bad=0, sample=sample), batch_size=2, num_workers=num_workers)
    out = drain(loader, 4)
    exc, msg = out[0]
    assert exc is exc_type
    if num_workers == 0:
        assert msg == message
    else:
        assert msg.startswith(f"Caught {exc_type.__name__} in DataLoader worker process 0.\nOriginal Traceback")
        assert msg.rstrip().endswith(f"{exc_type.__name__}: {message}"), msg
    assert [b.tolist() for b in out[1]] == [[2, 3], [2, 3]]
    del loader
    gc.collect()


def test_big_batches_stay_valid_while_held(loader_cls):
    """Hold every batch of two epochs past the loader's end: none is overwritten by a later one, and each stays
    writable on its own."""
    loader = loader_cls(pd.BigDataset(8, (64, 1024)), batch_size=2, num_workers=2)
    held = [b for _ in range(2) for b in loader]
    del loader
    gc.collect()
    assert len(held) == 8
    for n, (t, a) in enumerate(held):
        first = 2 * (n % 4)
        assert t.shape == (2, 64, 1024) and t.dtype == torch.float32
        assert a.shape == (2, 64, 1024) and a.dtype == torch.int32
        assert t[:, 0, 0].tolist() == [first, first + 1] and bool((t[1] == first + 1).all())
        assert bool((a[0] == first).all()) and bool((a[1] == first + 1).all())
        t += 100
    assert [float(t[0, 0, 0]) for t, _ in held] == [100.0, 102.0, 104.0, 106.0] * 2


def test_custom_collate_fn(loader_cls):
    out = run(loader_cls, pd.RangeDataset(5), batch_size=2, num_workers=2, collate_fn=pd.identity_collate)
    assert out == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_writable(loader_cls, num_workers):
    out = run(loader_cls, pd.MixedDataset(4), batch_size=2, num_workers=num_workers)
    for batch in out:
        before = batch["tensor"].clone()
        batch["tensor"] += 1
        batch["array"] += 1
        batch["int"] += 1
        assert torch.equal(batch["tensor"], before + 1)
    assert out[0]["int"].tolist() == [1, 2]
    assert out[1]["array"][0].tolist() == [3.0, 4.0, 5.0, 6.0]


# -- errors in workers, timeouts, killed workers -----------------------------------------------------------------


def drain(loader: Any, limit: int) -> list:
    """Iterate `loader` once to the end, keeping going after exceptions (at most `limit` steps): each item,
    or ``(type, message)`` for each exception. Only strings are kept of an exception, not the object: torch's
    reraise leaves a reference cycle through its traceback, and an iterator held by it shuts down only at
    garbage collection (in torch's case with a 5 s join per worker)."""
    it = iter(loader)
    out: list = []
    for _ in range(limit):
        try:
            out.append(next(it))
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - the test compares what was raised
            out.append((type(e), str(e)))
    del it
    gc.collect()
    return out


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
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        next(it)
    elapsed = time.monotonic() - t0
    assert str(info.value) == "DataLoader timed out after 0.5 seconds"
    assert 0.4 < elapsed < 1.4, elapsed
    del it, loader, info
    gc.collect()


def _run_driver(module: str, *args: str, within: float) -> dict:
    """Run `python -m module args` in its own process group; kill the group if it passes `within` seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{module} {args} did not finish within {within} s (killed); stderr: {err[-2000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind (its workers share its group)
        except ProcessLookupError:
            pass
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}; stdout: {out[-2000:]}; stderr: {err[-2000:]}"
    return json.loads(lines[-1])


def test_killed_worker_raises_runtime_error(loader_cls):
    which = "torch" if loader_cls is TorchDataLoader else "shmshare"
    result = _run_driver("tests.loader.parity_kill_driver", which, within=40)
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
    left = wait_gone(pids_per_epoch[0], within=15)
    kill_all(left)
    assert not left, f"persistent workers {left} still running 15 s after the loader was deleted"


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
    left = wait_gone(pids, within=15)
    kill_all(left)
    assert not left


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
    assert not wait_gone(first, within=15)  # an exhausted epoch shuts its workers down
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
    left = wait_gone(pids, within=15)
    kill_all(left)
    assert not left, f"workers {left} still running 15 s after the loop was left"
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
    elif method == "spawn":
        assert parents == {os.getpid()} and marks == {"unset"}
    else:  # the fork server's children
        assert os.getpid() not in parents and marks == {"unset"}
    assert not wait_gone(pids, within=15)


def test_interpreter_exit_with_live_workers(loader_cls):
    """A script that leaves a loader mid-epoch (persistent or not) and exits: it ends, and its workers too."""
    which = "torch" if loader_cls is TorchDataLoader else "shmshare"
    result = _run_driver("tests.loader.parity_exit_driver", which, within=40)
    left = wait_gone(set(result["pids"]), within=15)
    kill_all(left)
    assert not left, f"workers {left} outlived their interpreter by 15 s"


def test_math_len_batches_agree(loader_cls):
    """len() and the number of batches agree for a map-style dataset, with and without drop_last."""
    ds = pd.RangeDataset(11)
    for drop_last in (False, True):
        loader = loader_cls(ds, batch_size=4, drop_last=drop_last, num_workers=2)
        n = len(loader)
        assert n == (11 // 4 if drop_last else math.ceil(11 / 4))
        assert len(list(loader)) == n
        del loader
        gc.collect()
