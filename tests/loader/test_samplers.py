"""The numpy samplers side by side with torch's: same validation, lengths, batches, partitions.

Shuffled orders differ by design (numpy's RNG, not torch's); everything else is compared with
``torch.utils.data`` directly. The last test runs the module where ``import torch`` fails.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmshare.loader import _samplers as ours

torch = pytest.importorskip("torch")
tud = torch.utils.data

BOTH = pytest.mark.parametrize("impl", [ours, tud], ids=["shmshare", "torch"])


# -- validation: one regex, both implementations --

_CONSTRUCTION_ERRORS: list[tuple[str, tuple[Any, ...], dict[str, Any], type[Exception], str | None]] = [
    ("RandomSampler", (range(3),), {"replacement": 1}, TypeError,
     "replacement should be a boolean value, but got replacement=1"),
    ("RandomSampler", (range(3),), {"num_samples": 0}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=0"),
    ("RandomSampler", (range(3),), {"num_samples": -2}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=-2"),
    ("RandomSampler", (range(3),), {"num_samples": 2.0}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=2.0"),
    ("RandomSampler", ([],), {}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=0"),
    ("WeightedRandomSampler", ([1, 2], True), {}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=True"),
    ("WeightedRandomSampler", ([1, 2], 0), {}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=0"),
    ("WeightedRandomSampler", ([1, 2], 2.0), {}, ValueError,
     "num_samples should be a positive integer value, but got num_samples=2.0"),
    ("WeightedRandomSampler", ([1, 2], 2), {"replacement": 1}, ValueError,
     "replacement should be a boolean value, but got replacement=1"),
    ("WeightedRandomSampler", ([[1, 2], [3, 4]], 2), {}, ValueError,
     "weights should be a 1d sequence but given weights have shape (2, 2)"),
    ("WeightedRandomSampler", (3.0, 2), {}, ValueError,
     "weights should be a 1d sequence but given weights have shape ()"),
    ("WeightedRandomSampler", (np.ones((1, 1)), 2), {}, ValueError,
     "weights should be a 1d sequence but given weights have shape (1, 1)"),
    ("WeightedRandomSampler", ([[1, 2], [3]], 2), {}, ValueError, None),  # ragged: the texts differ
    ("WeightedRandomSampler", (["a", "b"], 2), {}, ValueError, None),  # strings: the texts differ
    ("BatchSampler", (range(3), 0, False), {}, ValueError,
     "batch_size should be a positive integer value, but got batch_size=0"),
    ("BatchSampler", (range(3), True, False), {}, ValueError,
     "batch_size should be a positive integer value, but got batch_size=True"),
    ("BatchSampler", (range(3), 1.5, False), {}, ValueError,
     "batch_size should be a positive integer value, but got batch_size=1.5"),
    ("BatchSampler", (range(3), 2, 1), {}, ValueError, "drop_last should be a boolean value, but got drop_last=1"),
    ("BatchSampler", (range(3), 2, None), {}, ValueError,
     "drop_last should be a boolean value, but got drop_last=None"),
    ("DistributedSampler", (range(10), 2, 2), {}, ValueError,
     "Invalid rank 2, rank should be in the interval [0, 1]"),
    ("DistributedSampler", (range(10), 2, -1), {}, ValueError,
     "Invalid rank -1, rank should be in the interval [0, 1]"),
    ("DistributedSampler", (range(10), 0, 0), {}, ValueError,
     "Invalid rank 0, rank should be in the interval [0, -1]"),
    # torch is installed but no process group is initialized: torch's ValueError, from both
    ("DistributedSampler", (range(10),), {}, ValueError,
     "Default process group has not been initialized, please make sure to call init_process_group."),
    ("DistributedSampler", (range(10), 2), {}, ValueError, "Default process group has not been initialized"),
]


@BOTH
@pytest.mark.parametrize(("name", "args", "kwargs", "exc", "message"), _CONSTRUCTION_ERRORS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(_CONSTRUCTION_ERRORS)])
def test_construction_errors_match_torch(impl: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                                         exc: type[Exception], message: str | None) -> None:
    with pytest.raises(exc, match=None if message is None else re.escape(message)):
        getattr(impl, name)(*args, **kwargs)


_INF, _NAN = float("inf"), float("nan")
_MULTINOMIAL_CASES = [
    ([0, 0, 0], 2, True), ([-1, 2, 3], 2, True), ([_NAN, 2, 3], 2, True), ([_INF, 2, 3], 2, True),
    ([2, _INF, -1], 2, True), ([2, -1, _INF], 2, True), ([], 2, True), ([], 1, True),
    ([-1, 2, 3], 1, True), ([-1, _INF], 1, True), ([_NAN], 1, True), ([0, 0], 1, True),
    ([1, 2, 3], 5, False), ([], 1, False), ([0, 0], 2, False), ([0], 1, False), ([1, -1], 1, False),
    ([1, _INF], 2, False), ([_NAN, 1], 1, False),
]


@pytest.mark.parametrize(("weights", "count", "replacement"), _MULTINOMIAL_CASES)
def test_weighted_sampling_errors_are_torchs_multinomial_errors(weights: list[float], count: int,
                                                                replacement: bool) -> None:
    with pytest.raises(RuntimeError) as theirs:
        next(iter(tud.WeightedRandomSampler(weights, count, replacement)))
    sampler = ours.WeightedRandomSampler(weights, count, replacement)
    it = iter(sampler)  # lazily, as torch's: the error comes with the first index
    with pytest.raises(RuntimeError) as mine:
        next(it)
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize(("weights", "count", "replacement"),
                         [([1e-320, 0], 1, True), ([1e308, 1e308], 3, True), ([1e308, 1e308], 2, False),
                          ([-0.0, 1], 1, True), ([True, False], 2, True), ([0, 1], 1, False), ([1, 0, 3], 3, False)])
def test_weights_torch_accepts_are_accepted(weights: list[float], count: int, replacement: bool) -> None:
    theirs = list(tud.WeightedRandomSampler(weights, count, replacement))
    mine = list(ours.WeightedRandomSampler(weights, count, replacement))
    assert len(mine) == len(theirs) == count
    assert all(0 <= i < len(weights) for i in mine)


# -- lengths and batches --

_SIZES = [0, 1, 2, 3, 7, 10, 31, 32, 33, 100]
_BATCHES = [1, 2, 3, 7, 32, 64, 150]


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_equal_torchs_over_sequential_samplers(drop_last: bool) -> None:
    for n, size in itertools.product(_SIZES, _BATCHES):
        mine = ours.BatchSampler(ours.SequentialSampler(range(n)), size, drop_last)
        theirs = tud.BatchSampler(tud.SequentialSampler(range(n)), size, drop_last)
        assert list(mine) == list(theirs), (n, size)
        assert len(mine) == len(theirs), (n, size)


def _plain_iter(n: int) -> Iterator[int]:
    yield from range(n)


class _Reversed(ours.SequentialSampler):
    """A subclass with its own __iter__: the batches must come from it, not the fast path."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source) - 1, -1, -1))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", ["list", "range", "ndarray", "generator", "subclass"])
def test_batches_equal_torchs_over_any_iterable(kind: str, drop_last: bool) -> None:
    make = {"list": lambda n: list(range(n)), "range": range, "ndarray": np.arange, "generator": _plain_iter,
            "subclass": lambda n: _Reversed(range(n))}[kind]
    for n, size in itertools.product(_SIZES, [1, 3, 32]):
        mine = list(ours.BatchSampler(make(n), size, drop_last))
        theirs = list(tud.BatchSampler(make(n), size, drop_last))
        assert mine == theirs, (kind, n, size)
        assert [type(i) for b in mine for i in b] == [type(i) for b in theirs for i in b]


def _random_samplers(n: int) -> list[tuple[Any, Any]]:
    """Pairs (ours, torch's) of every shuffling sampler over n items, their lengths equal."""
    return [
        (ours.RandomSampler(range(n)), tud.RandomSampler(range(n))),
        (ours.RandomSampler(range(n), num_samples=2 * n + 3), tud.RandomSampler(range(n), num_samples=2 * n + 3)),
        (ours.RandomSampler(range(n), replacement=True, num_samples=3 * n + 1),
         tud.RandomSampler(range(n), replacement=True, num_samples=3 * n + 1)),
        (ours.SubsetRandomSampler(list(range(5, 5 + n))), tud.SubsetRandomSampler(list(range(5, 5 + n)))),
        (ours.WeightedRandomSampler([1.0] * n, 2 * n), tud.WeightedRandomSampler([1.0] * n, 2 * n)),
        (ours.WeightedRandomSampler([1.0] * n, n, False), tud.WeightedRandomSampler([1.0] * n, n, False)),
        (ours.DistributedSampler(range(n), 3, 1), tud.DistributedSampler(range(n), 3, 1)),
    ]


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_shapes_equal_torchs_over_shuffling_samplers(drop_last: bool) -> None:
    for n, size in itertools.product([1, 2, 7, 32, 33, 100], [1, 3, 32, 64]):
        for mine_s, theirs_s in _random_samplers(n):
            assert len(mine_s) == len(theirs_s)
            mine = list(ours.BatchSampler(mine_s, size, drop_last))
            theirs = list(tud.BatchSampler(theirs_s, size, drop_last))
            assert [len(b) for b in mine] == [len(b) for b in theirs], (type(mine_s).__name__, n, size)
            assert len(mine) == len(ours.BatchSampler(mine_s, size, drop_last))
            if not drop_last:
                assert all(type(i) is int for b in mine for i in b)


def test_batches_span_chunks_of_a_long_replacement_run() -> None:
    count = 3 * ours._CHUNK + 17  # several chunks, with batches across their edges
    sampler = ours.RandomSampler(range(10), replacement=True, num_samples=count, generator=3)
    batches = list(ours.BatchSampler(sampler, 1000, False))
    assert [len(b) for b in batches] == [1000] * (count // 1000) + [count % 1000]
    again = ours.RandomSampler(range(10), replacement=True, num_samples=count, generator=3)
    assert [i for b in batches for i in b] == list(again)  # batching changes nothing but the grouping


# -- the samplers' own behaviour --


def test_sequential_sampler_reads_the_length_each_time() -> None:
    data = [1, 2, 3]
    s = ours.SequentialSampler(data)
    assert list(s) == [0, 1, 2] and len(s) == 3
    data.append(4)
    assert list(s) == [0, 1, 2, 3] and len(s) == 4


def test_random_sampler_without_replacement_repeats_whole_permutations() -> None:
    s = ours.RandomSampler(range(10), num_samples=25)
    out = list(s)
    assert len(out) == len(s) == 25
    assert sorted(out[:10]) == sorted(out[10:20]) == list(range(10))
    assert len(set(out[20:])) == 5
    assert sorted(ours.RandomSampler(range(10))) == list(range(10))


def test_random_sampler_with_replacement_stays_in_range() -> None:
    out = list(ours.RandomSampler(range(7), replacement=True, num_samples=1000))
    assert len(out) == 1000 and set(out) == set(range(7))


def test_none_generator_follows_numpys_global_seed() -> None:
    state = np.random.get_state()
    try:
        np.random.seed(1234)
        first = [list(ours.RandomSampler(range(50))), list(ours.SubsetRandomSampler(range(50)))]
        np.random.seed(1234)
        assert [list(ours.RandomSampler(range(50))), list(ours.SubsetRandomSampler(range(50)))] == first
        s = ours.RandomSampler(range(50))
        np.random.seed(1234)
        it = iter(s)  # draws nothing yet
        np.random.seed(1234)
        assert list(it) == first[0]
    finally:
        np.random.set_state(state)


@pytest.mark.parametrize("make", [lambda: 42, lambda: np.random.default_rng(42),
                                  lambda: torch.Generator().manual_seed(42)], ids=["int", "numpy", "torch"])
def test_seeded_generators_vary_by_epoch_and_repeat_by_run(make: Any) -> None:
    def run() -> list[list[int]]:
        s = ours.RandomSampler(range(100), generator=make())
        return [list(s), list(s)]

    first = run()
    assert first[0] != first[1]
    assert run() == first


@pytest.mark.parametrize("bad", ["seed", 1.5, True, object()])
def test_other_generators_are_refused(bad: Any) -> None:
    with pytest.raises(TypeError, match="generator should be None, an int seed"):
        ours.RandomSampler(range(3), generator=bad)


def test_subset_random_sampler_permutes_its_indices() -> None:
    idx = [3, 9, 27, 81, 243]
    s = ours.SubsetRandomSampler(idx, generator=0)
    assert len(s) == 5 and sorted(s) == idx


def test_weighted_sampler_draws_in_proportion_and_never_zeros() -> None:
    s = ours.WeightedRandomSampler([1, 0, 3, 0], 40000, generator=1)
    assert s.weights.dtype == np.float64 and len(s) == 40000
    counts = Counter(s)
    assert set(counts) == {0, 2}
    assert 2.8 < counts[2] / counts[0] < 3.2


def test_weighted_sampler_without_replacement_gives_zeros_last() -> None:
    for seed in range(20):
        out = list(ours.WeightedRandomSampler([1, 0, 0, 3, 0], 5, replacement=False, generator=seed))
        assert sorted(out[:2]) == [0, 3] and out[2:] == [1, 2, 4]
        assert sorted(list(tud.WeightedRandomSampler([1, 0, 0, 3, 0], 5, replacement=False))[:2]) == [0, 3]


# -- DistributedSampler --


def test_distributed_partitions_equal_torchs_unshuffled() -> None:
    for n, replicas, drop_last in itertools.product([0, 1, 2, 5, 10, 11, 17], [1, 2, 3, 4, 8], [False, True]):
        for rank in range(replicas):
            mine = ours.DistributedSampler(range(n), replicas, rank, shuffle=False, drop_last=drop_last)
            theirs = tud.DistributedSampler(range(n), replicas, rank, shuffle=False, drop_last=drop_last)
            assert list(mine) == list(theirs), (n, replicas, rank, drop_last)
            assert (len(mine), mine.num_samples, mine.total_size) == (len(theirs), theirs.num_samples,
                                                                      theirs.total_size)


def test_distributed_shuffle_covers_each_index_once_per_epoch() -> None:
    for n, replicas in itertools.product([1, 6, 10, 11, 17], [1, 2, 3, 4]):
        ranks = [ours.DistributedSampler(range(n), replicas, r, seed=5) for r in range(replicas)]
        dropped = [ours.DistributedSampler(range(n), replicas, r, seed=5, drop_last=True) for r in range(replicas)]
        orders = []
        for epoch in range(3):
            for s in ranks + dropped:
                s.set_epoch(epoch)
            got = [list(s) for s in ranks]
            assert all(len(g) == len(ranks[0]) for g in got)
            everything = Counter(i for g in got for i in g)
            assert set(everything) == set(range(n)) and sum(everything.values()) == ranks[0].total_size
            assert max(everything.values()) - min(everything.values()) <= 1  # padding repeats some once
            kept = [i for s in dropped for i in s]
            assert len(kept) == len(set(kept)) == dropped[0].total_size  # no index twice
            orders.append(got)
        if n > 2:
            assert orders[0] != orders[1]


def test_distributed_shuffle_is_decided_by_seed_plus_epoch() -> None:
    a = ours.DistributedSampler(range(50), 2, 0, seed=3)
    b = ours.DistributedSampler(range(50), 2, 0, seed=1)
    b.set_epoch(2)
    assert list(a) == list(b)  # 3 + 0 == 1 + 2
    assert list(a) == list(a)  # no set_epoch: the same order again
    neg = ours.DistributedSampler(range(50), 2, 1, seed=-7)
    assert sorted(neg) == sorted(set(neg))


def test_a_dataset_grown_since_construction_fails_as_torchs() -> None:
    for impl in (ours, tud):
        data = list(range(10))
        s = impl.DistributedSampler(data, 2, 0, shuffle=False)
        data.extend(range(3))
        with pytest.raises(AssertionError, match=re.escape("Number of indices (23) does not match total_size (10)")):
            list(s)


# -- datasets --


@BOTH
def test_dataset_bases_behave_alike(impl: Any) -> None:
    with pytest.raises(NotImplementedError, match=re.escape("Subclasses of Dataset should implement __getitem__.")):
        impl.Dataset()[0]
    with pytest.raises(TypeError, match="abstract"):
        impl.IterableDataset()


def test_is_iterable_dataset_knows_both_kinds() -> None:
    class Mine(ours.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    class Theirs(tud.IterableDataset):  # type: ignore[misc]
        def __iter__(self) -> Iterator[int]:
            return iter(range(3))

    assert ours.is_iterable_dataset(Mine()) and ours.is_iterable_dataset(Theirs())
    assert not ours.is_iterable_dataset([1, 2]) and not ours.is_iterable_dataset(tud.TensorDataset(torch.ones(2)))


def test_infinite_constant_sampler_yields_none() -> None:
    assert list(itertools.islice(ours._InfiniteConstantSampler(), 5)) == [None] * 5


# -- without torch --

_NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` now fails: ImportError
import numpy as np
from shmshare.loader import _samplers as s, _seeding
assert list(s.BatchSampler(s.SequentialSampler(range(5)), 2, False)) == [[0, 1], [2, 3], [4]]
np.random.seed(0)
a = [list(s.RandomSampler(range(20))), list(s.WeightedRandomSampler([1, 2, 3], 9)), _seeding.draw_base_seed(None)]
np.random.seed(0)
assert a == [list(s.RandomSampler(range(20))), list(s.WeightedRandomSampler([1, 2, 3], 9)),
             _seeding.draw_base_seed(None)]
assert sorted(s.SubsetRandomSampler([4, 5, 6], generator=1)) == [4, 5, 6]
assert list(s.DistributedSampler(range(5), 2, 1, shuffle=False)) == [1, 3, 0]
for kwargs in ({}, {"num_replicas": 2}, {"rank": 0}):
    try:
        s.DistributedSampler(range(5), **kwargs)
    except RuntimeError as e:
        assert str(e) == "Requires distributed package to be available", e
    else:
        raise AssertionError("no error")
assert _seeding.seed_worker(5, 1) == 6
assert s.is_iterable_dataset(type("D", (s.IterableDataset,), {"__iter__": lambda self: iter(())})())
assert sys.modules["torch"] is None
print("ok")
"""


def test_the_module_runs_where_torch_cannot_be_imported() -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_NO_TORCH)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_importing_the_module_does_not_import_torch() -> None:
    code = "import sys; import shmshare.loader._samplers, shmshare.loader._seeding; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
