"""Samplers and dataset base classes of ``torch.utils.data``, on numpy, for a loader without torch.

What: ``Sampler``, ``SequentialSampler``, ``RandomSampler``, ``SubsetRandomSampler``,
``WeightedRandomSampler``, ``BatchSampler``, ``DistributedSampler``, the ``Dataset`` and
``IterableDataset`` bases, ``_InfiniteConstantSampler`` (an iterable dataset's sampler) and
:func:`is_iterable_dataset`: the same names, constructor signatures, validation (exception types
and messages), ``__len__`` and behaviour as torch 2.x's, written on numpy.

Why: ``shmshare.DataLoader`` is a drop-in for torch's and must also run where torch is not
installed, on numpy datasets. Its users build these samplers themselves (``BatchSampler``,
``DistributedSampler``...), so they must read and fail as torch's do.

What differs, and why (Note [Sampler randomness]): torch's samplers draw from torch's RNG;
these draw from numpy's, so a shuffled ORDER is never torch's. Everything else matches: which
indices, how many, the grouping into batches, DistributedSampler's padding and rank partition.

* ``generator`` is ``None``, an ``int`` seed, a ``numpy.random.Generator`` or a
  ``torch.Generator``. ``None`` draws a fresh seed per iteration from numpy's global state
  (where torch's draw from torch's global RNG), so ``np.random.seed(...)`` makes runs
  reproducible. An ``int`` becomes ``numpy.random.default_rng(seed)`` once, at construction,
  and goes on from there: each epoch differs, the run repeats (as a seeded torch.Generator).
  A ``torch.Generator`` gives one 63-bit seed per iteration, so ``manual_seed`` reproduces
  the run. Anything else is a TypeError at construction (torch's fails at iteration).
* ``DistributedSampler`` shuffles with ``numpy.random.default_rng((seed + epoch) mod 2**64)``:
  the same order on every rank, a new one per epoch, as torch's with ``manual_seed``.
* ``WeightedRandomSampler`` keeps ``weights`` as a float64 numpy array (torch: a double
  tensor), accepts more than 2**24 categories (torch refuses them), and, drawing without
  replacement more samples than there are positive weights, gives the zero-weight indices
  last in ascending order (torch's order among them is an accident of its top-k).
* ``Dataset`` has no ``__add__`` (torch's makes a ``ConcatDataset``, which is not here).

Samplers draw lazily, at the first ``next()``, as torch's generator-function ``__iter__``
does: ``iter(sampler)`` draws nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import sys
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, Generic, TypeVar

import numpy as np

from ._seeding import GeneratorLike, global_numpy_draw, imported_torch, torch_draw

__all__ = [
    "Sampler", "SequentialSampler", "RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler",
    "BatchSampler", "DistributedSampler",
    "Dataset", "IterableDataset", "is_iterable_dataset",
]

_T_co = TypeVar("_T_co", covariant=True)


class Sampler(Generic[_T_co]):
    """Base class of all samplers: an iterable of dataset indices (or of batches of them).

    Subclasses provide ``__iter__`` and may provide ``__len__``. There is deliberately no
    default ``__len__``: ``list(sampler)`` falls back to plain iteration when it is missing,
    and a default that raised would break that.
    """

    def __iter__(self) -> Iterator[_T_co]:
        raise NotImplementedError


class SequentialSampler(Sampler[int]):
    """Yield ``0 .. len(data_source) - 1`` in order.

    Parameters
    ----------
    data_source
        What is sampled; only its ``len`` is read, at each iteration.
    """

    data_source: Sized

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)

    def _chunks(self) -> Iterator[Sequence[int]]:
        yield range(len(self.data_source))


class RandomSampler(Sampler[int]):
    """Yield indices of `data_source` in random order, or drawn with replacement.

    Parameters
    ----------
    data_source
        What is sampled; its ``len`` is read at each iteration.
    replacement
        Draw each index independently (``num_samples`` of them) if True; else yield whole
        permutations, then the start of one more, until ``num_samples``.
    num_samples
        How many indices an iteration yields; ``len(data_source)`` (read each time) if None.
    generator
        None (a fresh seed per iteration from numpy's global state, where torch's sampler
        draws from torch's global RNG), an int seed, a ``numpy.random.Generator`` or a
        ``torch.Generator``; see Note [Sampler randomness] at the top of this module.

    Raises
    ------
    TypeError
        If `replacement` is not a bool, or `generator` is of none of those kinds.
    ValueError
        If the number of samples is not a positive int.
    """

    data_source: Sized
    replacement: bool

    def __init__(self, data_source: Sized, replacement: bool = False, num_samples: int | None = None,
                 generator: GeneratorLike = None) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        self._rng = _RandomSource(generator)
        if not isinstance(self.replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={self.replacement}")
        # as torch's: a bool passes (it is an int), a float does not
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={self.num_samples}")

    @property
    def num_samples(self) -> int:
        """How many indices an iteration yields (the dataset's current length unless given)."""
        if self._num_samples is None:
            return len(self.data_source)
        return self._num_samples

    def __iter__(self) -> Iterator[int]:
        for chunk in self._chunks():
            yield from chunk

    def __len__(self) -> int:
        return self.num_samples

    def _chunks(self, rng: np.random.Generator | None = None) -> Iterator[list[int]]:
        n = len(self.data_source)
        count = self.num_samples
        rng = rng or self._rng.for_iteration()
        if self.replacement:  # in bounded chunks: num_samples may be far more than fits in memory
            for start in range(0, count, _CHUNK):
                yield rng.integers(0, n, size=min(_CHUNK, count - start), dtype=np.int64).tolist()
            return
        whole, rest = divmod(count, n)
        for _ in range(whole):
            yield rng.permutation(n).tolist()
        if rest:
            yield rng.permutation(n)[:rest].tolist()


class SubsetRandomSampler(Sampler[int]):
    """Yield the elements of `indices` in random order (without replacement).

    Parameters
    ----------
    indices
        The indices to yield; read at each iteration.
    generator
        As for :class:`RandomSampler`.
    """

    indices: Sequence[int]

    def __init__(self, indices: Sequence[int], generator: GeneratorLike = None) -> None:
        self.indices = indices
        self.generator = generator
        self._rng = _RandomSource(generator)

    def __iter__(self) -> Iterator[int]:
        for chunk in self._chunks():
            yield from chunk

    def __len__(self) -> int:
        return len(self.indices)

    def _chunks(self) -> Iterator[list[int]]:
        order = self._rng.for_iteration().permutation(len(self.indices)).tolist()
        indices = self.indices
        yield [indices[i] for i in order]


class WeightedRandomSampler(Sampler[int]):
    """Yield indices ``0 .. len(weights) - 1`` drawn with probabilities proportional to `weights`.

    Parameters
    ----------
    weights
        A 1-d sequence of non-negative weights (they need not sum to one).
    num_samples
        How many indices an iteration yields.
    replacement
        Draw independently if True; else never draw an index twice in one iteration.
    generator
        As for :class:`RandomSampler`.

    Raises
    ------
    ValueError
        At construction, if `num_samples` is not a positive int (bools refused), `replacement`
        is not a bool, or `weights` is not 1-d.
    RuntimeError
        At the first ``next()``, with torch's ``multinomial`` messages, if the weights cannot
        be sampled: negative, infinite or NaN entries, a zero sum, or (without replacement)
        more samples than weights.
    """

    weights: np.ndarray[Any, np.dtype[np.float64]]
    num_samples: int
    replacement: bool

    def __init__(self, weights: Sequence[float], num_samples: int, replacement: bool = True,
                 generator: GeneratorLike = None) -> None:
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples <= 0:
            raise ValueError(f"num_samples should be a positive integer value, but got num_samples={num_samples}")
        if not isinstance(replacement, bool):
            raise ValueError(f"replacement should be a boolean value, but got replacement={replacement}")
        weights_array = np.asarray(weights, dtype=np.float64)
        if weights_array.ndim != 1:
            raise ValueError(
                f"weights should be a 1d sequence but given weights have shape {tuple(weights_array.shape)}")
        self.weights = weights_array
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator
        self._rng = _RandomSource(generator)

    def __iter__(self) -> Iterator[int]:
        for chunk in self._chunks():
            yield from chunk

    def __len__(self) -> int:
        return self.num_samples

    def _chunks(self) -> Iterator[list[int]]:
        w, count = self.weights, self.num_samples
        _check_multinomial(w, count, self.replacement)
        rng = self._rng.for_iteration()
        top = w.max()
        p = w / top  # scaled first: a sum of huge finite weights must not overflow to inf
        p /= p.sum()
        if self.replacement:
            yield rng.choice(len(w), size=count, replace=True, p=p).tolist()
            return
        # Without replacement: the largest weight / Exp(1) keys (Efraimidis-Spirakis), which
        # like torch's lets zero weights be drawn, last, once the positive ones run out.
        keys = p / rng.exponential(size=len(w))
        yield np.argsort(-keys, kind="stable")[:count].tolist()


class BatchSampler(Sampler[list[int]]):
    """Group the indices of another sampler into lists of `batch_size`.

    Parameters
    ----------
    sampler
        Any iterable of indices (a Sampler, a range, a list...).
    batch_size
        The size of each batch but perhaps the last.
    drop_last
        Drop a last batch shorter than `batch_size` if True.

    Raises
    ------
    ValueError
        If `batch_size` is not a positive int (bools refused) or `drop_last` not a bool.

    Notes
    -----
    Fast path: where `sampler` is one of this module's finite samplers (with its own
    ``__iter__``, not a subclass's), a range or a list, its indices come in chunks (a
    permutation, a block of draws) that are sliced into batches: a list slice per batch, no
    Python step per index. Any other sampler is consumed index by index, as torch's is.
    """

    def __init__(self, sampler: Sampler[int] | Iterable[int], batch_size: int, drop_last: bool) -> None:
        # no isinstance check on sampler: an object with __getitem__ only is iterable too
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        chunks = _chunks_of(self.sampler)
        if chunks is not None:
            yield from _batches(chunks, self.batch_size, self.drop_last)
            return
        it = iter(self.sampler)
        if self.drop_last:  # zip over one iterator n times: n items per tuple, a short tail dropped
            for batch in zip(*([it] * self.batch_size), strict=False):
                yield list(batch)
            return
        while batch_list := list(itertools.islice(it, self.batch_size)):
            yield batch_list

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]  # as torch's: only for a sampler with a len
        if self.drop_last:
            return n // self.batch_size
        return (n + self.batch_size - 1) // self.batch_size


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of a dataset's indices: an equal share for every rank.

    The indices (shuffled alike on every rank when `shuffle`) are padded by repeating them from
    the start, or with `drop_last` cut, to a multiple of `num_replicas`; rank ``r`` takes every
    ``num_replicas``-th from ``r``. Call :meth:`set_epoch` before each epoch to reshuffle.

    Parameters
    ----------
    dataset
        What is sampled; its ``len`` is read at construction and at each iteration.
    num_replicas
        The number of ranks; torch.distributed's world size if None.
    rank
        This rank, in ``[0, num_replicas)``; torch.distributed's rank if None.
    shuffle
        Shuffle with ``numpy.random.default_rng((seed + epoch) mod 2**64)`` if True.
    seed
        The shuffle's seed; must be the same on every rank.
    drop_last
        Cut the tail to a multiple of `num_replicas` instead of padding.

    Raises
    ------
    RuntimeError
        If `num_replicas` or `rank` is None and torch.distributed is not available
        ("Requires distributed package to be available").
    ValueError
        If it is available (torch installed) but no process group is initialized (torch's own
        message, raised here without importing torch when torch is not imported yet: no
        process group can exist then), or if `rank` is outside ``[0, num_replicas - 1]``.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None:
            num_replicas = _distributed("get_world_size")
        if rank is None:
            rank = _distributed("get_rank")
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if drop_last and n % num_replicas != 0:  # the largest multiple of num_replicas below n
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which (with `seed`) decides the next iteration's shuffle.

        Parameters
        ----------
        epoch
            The epoch number; the same on every rank.
        """
        self.epoch = epoch

    def _chunks(self) -> Iterator[list[int]]:
        yield self._indices()

    def _indices(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng((self.seed + self.epoch) % 2**64).permutation(n)
        else:
            order = np.arange(n)
        total = self.total_size
        if self.drop_last:
            order = order[:total]
        elif total > n > 0:  # padded with the indices from the start, over again if need be
            order = np.resize(order, total)
        elif total < n:  # the dataset grew since construction: torch's arithmetic, and its error below
            order = np.concatenate([order, order[:total - n]])
        if len(order) != total:
            raise AssertionError(f"Number of indices ({len(order)}) does not match total_size ({total})")
        return order[self.rank:total:self.num_replicas].tolist()  # type: ignore[no-any-return]


class _InfiniteConstantSampler(Sampler[None]):
    """Yield None forever: the sampler of an iterable-style dataset (``itertools.repeat(None)``)."""

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)


class Dataset(Generic[_T_co]):
    """Base class of map-style datasets: ``__getitem__`` from keys to samples, usually ``__len__``.

    As torch's, without ``__add__`` (no ConcatDataset here).
    """

    def __getitem__(self, index: Any) -> _T_co:
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")


class IterableDataset(Dataset[_T_co], Iterable[_T_co]):
    """Base class of iterable-style datasets: subclasses provide ``__iter__`` over samples.

    With workers, each worker iterates its own copy; use the loader's ``get_worker_info()`` to
    split the work between them.
    """


def is_iterable_dataset(dataset: object) -> bool:
    """Return whether `dataset` is iterable-style: ours, or torch's where torch is imported.

    Parameters
    ----------
    dataset
        Any object.

    Returns
    -------
    bool
        True for an :class:`IterableDataset` and, if ``torch.utils.data`` is already in
        ``sys.modules`` (this never imports it), a ``torch.utils.data.IterableDataset``.
    """
    if isinstance(dataset, IterableDataset):
        return True
    torch_data = sys.modules.get("torch.utils.data")
    torch_iterable = getattr(torch_data, "IterableDataset", None)
    return isinstance(torch_iterable, type) and isinstance(dataset, torch_iterable)


# -- helpers --


class _RandomSource:
    """Where a sampler's randomness comes from: a numpy Generator for each iteration."""

    __slots__ = ("_rng", "_torch_generator")

    def __init__(self, generator: GeneratorLike) -> None:
        self._rng: np.random.Generator | None = None  # used across iterations (int seed or numpy Generator)
        self._torch_generator: Any = None  # a torch.Generator, drawn from once per iteration
        if generator is None:
            return
        if isinstance(generator, np.random.Generator):
            self._rng = generator
        elif isinstance(generator, int) and not isinstance(generator, bool):
            self._rng = np.random.default_rng(generator)
        elif _is_torch_generator(generator):
            self._torch_generator = generator
        else:
            raise TypeError(
                "generator should be None, an int seed, a numpy.random.Generator or a torch.Generator, "
                f"but got generator={generator!r}")

    def for_iteration(self) -> np.random.Generator:
        """Return the Generator for one iteration (a fresh one unless one lives across them)."""
        if self._rng is not None:
            return self._rng
        if self._torch_generator is not None:
            return np.random.default_rng(torch_draw(imported_torch(), self._torch_generator))
        return np.random.default_rng(global_numpy_draw())


def _is_torch_generator(obj: object) -> bool:
    torch = imported_torch()
    return torch is not None and isinstance(obj, torch.Generator)


_CHUNK = 1 << 16  # indices drawn at once where a sampler's epoch is unbounded (with replacement)
_CHUNKED_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler,
                     DistributedSampler)
# the __iter__s that just yield from _chunks(): a subclass overriding __iter__ must be iterated for real
_CHUNKED_ITERS = frozenset(cls.__iter__ for cls in _CHUNKED_SAMPLERS)


def _chunks_of(sampler: object) -> Iterator[Sequence[int]] | None:
    """Return `sampler`'s indices as an iterator of chunks where it is known to make them so, else None."""
    kind = type(sampler)
    if kind is list or kind is range:
        whole: Sequence[int] = sampler  # type: ignore[assignment]
        return iter((whole,))
    if getattr(kind, "__iter__", None) in _CHUNKED_ITERS:
        chunks: Iterator[Sequence[int]] = sampler._chunks()  # type: ignore[attr-defined]
        return chunks
    return None


def _batches(chunks: Iterator[Sequence[int]], size: int, drop_last: bool) -> Iterator[list[int]]:
    """Yield the indices of `chunks` in lists of `size` (and a shorter tail unless `drop_last`)."""
    carry: list[int] = []  # the start of a batch that spans two chunks
    for chunk in chunks:
        n = len(chunk)
        start = 0
        if carry:
            start = min(size - len(carry), n)
            carry += chunk[:start]
            if len(carry) < size:
                continue
            yield carry
            carry = []
        end = start + (n - start) // size * size
        items = chunk if isinstance(chunk, list) else list(chunk)  # a range: made a list at C speed
        # one list slice per batch, the loop over batches in C (map over slice objects)
        yield from map(items.__getitem__, map(slice, range(start, end, size), range(start + size, end + size, size)))
        carry = items[end:]
    if carry and not drop_last:
        yield carry


def _distributed(getter: str) -> int:
    """Return torch.distributed's world size or rank, failing as torch's DistributedSampler does."""
    if imported_torch() is None:
        if _torch_installed():  # installed, but not imported: no process group can exist yet
            raise ValueError(_NO_PROCESS_GROUP)
        raise RuntimeError("Requires distributed package to be available")
    dist = importlib.import_module("torch.distributed")  # cheap: torch is loaded already
    if not dist.is_available():
        raise RuntimeError("Requires distributed package to be available")
    value: int = getattr(dist, getter)()  # torch raises its own ValueError when not initialized
    return value


_NO_PROCESS_GROUP = "Default process group has not been initialized, please make sure to call init_process_group."


def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:  # sys.modules["torch"] is None: the program has blocked torch
        return False


def _check_multinomial(w: np.ndarray[Any, np.dtype[np.float64]], count: int, replacement: bool) -> None:
    """Refuse weights as torch's ``multinomial`` does, with its RuntimeError messages, in its order."""
    n = len(w)
    if not replacement and count > n:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if not replacement or count == 1:  # torch's fast path: one check over the whole tensor
        if n == 0:
            raise RuntimeError(
                "aminmax(): cannot compute aminmax over an empty dimension as the operation has no identity.")
        if not (w.max() < math.inf and w.min() >= 0):  # NaN fails both comparisons
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        if not w.any():  # all finite and >= 0 here: a zero sum is all zeros (and summing might overflow)
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return
    # torch's kernel with replacement: entry by entry, the first bad one decides the message
    bad = ~(w >= 0) | np.isinf(w)
    if bad.any():
        first = w[int(np.argmax(bad))]
        if not first >= 0:
            raise RuntimeError("invalid multinomial distribution (encountering probability entry < 0)")
        raise RuntimeError("invalid multinomial distribution (encountering probability entry = infinity or NaN)")
    if not w.any():
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
