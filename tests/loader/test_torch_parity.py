"""shmshare.DataLoader against torch.utils.data.DataLoader, side by side.

Every test runs twice, on torch's loader ("torch") and on ours ("shmshare"), with the same assertions: torch's
behaviour is the spec. Where the result is deterministic, the test also runs torch's loader as the reference
and compares the two outputs directly (for the "torch" run that checks torch against itself, which keeps the
test honest about what is deterministic).
"""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import re
import warnings
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

from . import parity_datasets as pd  # noqa: E402
from .parity_common import (  # noqa: E402
    TorchDataLoader,
    describe,
    drain,
    loader_cls_param,
    run,
    torch_base_seed,
)

pytestmark = [loader_cls_param]


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
