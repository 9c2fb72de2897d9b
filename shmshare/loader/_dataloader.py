"""``shmshare.DataLoader``: torch's DataLoader, constructor and behaviour, over shmshare workers.

Note [Two modes: torch's and numpy's]
    The loader behaves as torch's (torch's samplers, ``default_collate``,
    torch tensors out, torch's seeding and ``get_worker_info``) when torch is
    imported -- ``"torch" in sys.modules`` when the loader is made -- and as
    the same loader for numpy when it is not: shmshare's own samplers, a
    numpy ``default`` collate, numpy arrays out, and torch never imported. A
    program written for torch's loader imports torch anyway (its datasets
    make tensors); a JAX or numpy program is not made to pay for importing
    torch because it happens to be installed. ``collate_fn=numpy_collate``
    gives numpy batches in either mode. The mode is taken when the loader is
    made, but a loader made before ``import torch`` whose samples turn out
    to be torch tensors collates them with torch's ``default_collate`` all
    the same (``numpy_mode_collate``): the data decides, not import order.
    A loader made in torch's mode is also a ``torch.utils.data.DataLoader``
    (``__new__``; Note [A torch DataLoader when torch is imported] in
    ``_torch_loader.py``).
"""

from __future__ import annotations

import copy
import inspect
import math
import multiprocessing
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, Self, TypeVar, cast

from .._plane.pool import check_limit
from ..channel import DEFAULT_LIMIT
from . import _collate, _samplers
from ._device import parse_device
from ._iters import MultiProcessIter, SingleProcessIter
from ._progress import check_layout
from ._stats import LoaderStats

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)

_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


class _MapDataset(Protocol[T_co]):
    """What a map-style dataset offers (torch's ``Dataset[T]`` is one)."""

    def __getitem__(self, index: Any, /) -> T_co: ...


class _IterDataset(Protocol[T_co]):
    """What an iterable-style dataset offers (torch's ``IterableDataset[T]`` is one)."""

    def __iter__(self) -> Iterator[T_co]: ...


class DataLoader(Generic[T_co]):
    """Combine a dataset and a sampler; iterate over batches, loaded by worker processes.

    The constructor, its checks, its warnings and the iteration are those of
    ``torch.utils.data.DataLoader`` (torch 2.x; see its documentation). What
    differs is how a batch gets to the main process: each worker collates
    into a shared-memory pool of its own and the batch arrives as views of
    the pool's pages, which go back to the worker once every view is
    dropped. docs/loader.md lists where the behaviour differs from torch's.

    Beyond torch's arguments
    ------------------------
    pool_limit : int, optional (keyword)
        Bytes of shared memory each worker's pool holds (default 1 GiB).
        Batches the program keeps past it go in shared memory outside the
        pool, given back when dropped, with one warning (Note [Past the pool]).
    snapshot_every_n_steps : int or None, optional (keyword)
        torchdata's ``StatefulDataLoader`` keyword, accepted so that its
        scripts run as they are; shmshare takes a snapshot at every batch
        (Note [Resuming mid-epoch]).
    worker_start : {"one", "each"}, optional (keyword)
        Under spawn and forkserver, ``"one"`` (the default) starts one process
        that imports and unpickles the dataset once and forks every worker from
        it, so the first batch does not wait longer with each worker added
        (Note [Workers forked from one process]); ``"each"`` starts every
        worker with the context, as torch does. Under fork, or with one
        worker, it changes nothing.
    device : str or int, optional (keyword)
        ``"cuda"``, ``"cuda:N"`` or an ordinal: batches arrive in that
        device's memory (torch tensors, or ``shmshare.cuda.DeviceArray``s in
        numpy mode), copied on a side stream one batch ahead (``_device.py``).
        Needs shmshare's CUDA support (cuda-python).

    Made while torch is imported, the loader is also an instance of
    ``torch.utils.data.DataLoader``: ``type(loader)`` is a subclass of both
    (Note [A torch DataLoader when torch is imported]).
    """

    __initialized = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A user's subclass made while torch is imported gets its torch subclass now, not at its
        first loader: Lightning records constructor arguments only for the torch DataLoader
        subclasses that exist when it starts recording (inside ``train_dataloader()``, say)."""
        super().__init_subclass__(**kwargs)
        data = sys.modules.get("torch.utils.data")
        if data is not None and not issubclass(cls, data.DataLoader):  # (_torch_loader's own is one)
            from ._torch_loader import as_torch

            as_torch(cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Make the loader, as a ``torch.utils.data.DataLoader`` too when torch is imported."""
        if sys.modules.get("torch") is not None:  # the same test as __init__'s mode
            from ._torch_loader import as_torch

            return cast(Self, object.__new__(as_torch(cls)))
        return object.__new__(cls)

    def __init__(self, dataset: _MapDataset[T_co] | _IterDataset[T_co], batch_size: int | None = 1,
                 shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[Any], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True,
                 pool_limit: int | None = None, device: Any = None, worker_start: str = "one",
                 snapshot_every_n_steps: int | None = 1) -> None:
        use_torch = sys.modules.get("torch") is not None
        if num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to "
                             "disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                             "let num_workers > 0 to enable multiprocessing, otherwise set "
                             "prefetch_factor to None.")
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        elif prefetch_factor is not None and prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if pool_limit is not None:
            check_limit(pool_limit, "pool_limit")
        if snapshot_every_n_steps is not None and (type(snapshot_every_n_steps) is not int
                                                   or snapshot_every_n_steps < 0):
            raise ValueError("snapshot_every_n_steps (torchdata's keyword) must be an int >= 0 or None, not "
                             f"{snapshot_every_n_steps!r}; shmshare takes a snapshot at every batch whatever it is")
        if worker_start not in ("one", "each"):
            raise ValueError(f"worker_start must be 'one' (spawn and forkserver: one process started, the "
                             f"workers forked from it) or 'each' (every worker started alone), not {worker_start!r}")

        self._use_torch = use_torch
        self.dataset: Any = cast(Any, dataset)  # typed by its protocols above; used as torch uses it
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order
        # as given, under their own names, as torch keeps its arguments: code that re-creates a loader from the
        # attributes named like __init__'s parameters (Lightning's _update_dataloader) keeps them
        self.pool_limit = pool_limit
        self.device = device
        self.worker_start = worker_start
        self.snapshot_every_n_steps = snapshot_every_n_steps  # torchdata's: accepted; every batch is one here
        self._pool_limit = pool_limit or DEFAULT_LIMIT
        self._device = parse_device(device)
        if self._device is not None:
            _check_cuda(device)

        samplers: Any = _torch_samplers() if use_torch else _samplers
        self._iterable = _samplers.is_iterable_dataset(dataset)
        if self._iterable:
            if use_torch and shuffle is not None and _is_iter_datapipe(dataset):
                from torch.utils.data import graph_settings

                graph_settings.apply_shuffle_settings(self.dataset, shuffle=shuffle)  # in place, as torch
            elif shuffle not in {False, None}:
                raise ValueError("DataLoader with IterableDataset: expected unspecified shuffle "
                                 f"option, but got shuffle={shuffle}")
            if sampler is not None:
                raise ValueError("DataLoader with IterableDataset: expected unspecified sampler "
                                 f"option, but got sampler={sampler}")
            if batch_sampler is not None:
                raise ValueError("DataLoader with IterableDataset: expected unspecified "
                                 f"batch_sampler option, but got batch_sampler={batch_sampler}")
        else:
            shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last")
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        if sampler is None:
            if self._iterable:
                sampler = samplers._InfiniteConstantSampler()
            elif shuffle:
                sampler = samplers.RandomSampler(dataset, generator=generator)
            else:
                sampler = samplers.SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = samplers.BatchSampler(sampler, batch_size, drop_last)

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        if collate_fn is None:
            collate_fn = _default_collate(use_torch) if self._auto_collation else (
                _default_convert(use_torch))
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self.__initialized = True
        self._IterableDataset_len_called: int | None = None
        self._iterator: Any = None
        self._next_state: dict[str, Any] | None = None  # load_state_dict()'s, for the next iterator
        self._progress: Any = None  # the last iterator's (Note [Resuming mid-epoch] in _resume.py)
        self._initial_iter: Any = None  # one state_dict() made before iter(): iter() returns it
        self.check_worker_number_rationality()

    # -- torch's attributes ----------------------------------------------------------

    @property
    def multiprocessing_context(self) -> Any:
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        if context is not None:
            if self.num_workers <= 0:
                raise ValueError("multiprocessing_context can only be used with multi-process "
                                 f"loading (num_workers > 0), but got num_workers={self.num_workers}")
            if isinstance(context, str):
                valid = multiprocessing.get_all_start_methods()
                if context not in valid:
                    raise ValueError("multiprocessing_context option should specify a valid start "
                                     f"method in {valid!r}, but got multiprocessing_context="
                                     f"{context!r}")
                context = multiprocessing.get_context(context)
            if not isinstance(context, multiprocessing.context.BaseContext):
                raise TypeError("multiprocessing_context option should be a valid context object "
                                "or a string specifying the start method, but got "
                                f"multiprocessing_context={context}")
        self.__multiprocessing_context = context

    def __setattr__(self, attr: str, val: Any) -> None:
        if self.__initialized and attr in _FROZEN:
            raise ValueError(f"{attr} attribute should not be set after {self.__class__.__name__} "
                             "is initialized")
        super().__setattr__(attr, val)

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    # -- iterating ---------------------------------------------------------------------

    def _get_iterator(self) -> Any:
        state, self._next_state = self._next_state, None
        it: Any
        if self.num_workers == 0:
            it = SingleProcessIter(self, state)
        else:
            self.check_worker_number_rationality()
            it = MultiProcessIter(self, state)
        self._progress = it._progress
        return it

    def __iter__(self) -> Iterator[Any]:  # batches, collated: Any, as torch's
        persistent = self.persistent_workers and self.num_workers > 0
        it, self._initial_iter = self._initial_iter, None
        if it is None:
            if persistent and self._iterator is not None:
                self._iterator._reset(self)
                return self._iterator  # type: ignore[no-any-return]
            it = self._get_iterator()
        if persistent:
            self._iterator = it
        if it._progress.finished:  # a state saved at the end of an epoch: the next epoch
            if persistent:
                it._reset(self)
            else:
                _stop(it)
                it = self._get_iterator()
        return it  # type: ignore[no-any-return]

    # -- resuming (torchdata's StatefulDataLoader API: Note [Resuming mid-epoch] in _resume.py) ---------

    def state_dict(self) -> dict[str, Any]:
        """Return where the current epoch is: the state ``load_state_dict`` resumes from.

        The layout is torchdata's ``StatefulDataLoader`` (0.11): a loader of
        either kind loads the other's state (docs/loader.md says where the
        two differ). Called before the first ``iter()``, it starts the
        iterator that ``iter()`` then returns, as torchdata does; after a
        ``load_state_dict()`` and before ``iter()``, it returns that state.
        The dict is the caller's: later batches do not change it.
        """
        if self._next_state is not None:
            return copy.deepcopy(self._next_state)
        if not self.in_order and self.num_workers > 1:
            warnings.warn("state_dict() with in_order=False: batches come out of order, so a resumed run "
                          "yields again those that came before an earlier one still in flight (none is "
                          "lost). Use in_order=True for a resume that repeats nothing", stacklevel=2)
        if self._progress is None:
            self._initial_iter = self._get_iterator()
            if self.persistent_workers and self.num_workers > 0:
                self._iterator = self._initial_iter
        return self._progress.state_dict()  # type: ignore[no-any-return]

    def stats(self) -> LoaderStats | None:
        """Return where the current (or last) iterator's time went: per worker, seconds fetching,
        collating and sending (waiting for room); in this process, seconds waiting for batches and
        the bytes in flight (Note [Where the time goes]; docs/loader.md tells how to read them).
        None before the first ``iter()``."""
        return None if self._progress is None else self._progress.stats()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict` (from ``state_dict()``, this loader's or a torchdata
        ``StatefulDataLoader``'s) at the next ``iter()``: its batches are those the saved run would
        have yielded next. An empty dict means start afresh. Persistent workers are restarted.

        Raises
        ------
        TypeError
            If `state_dict` is not a dict.
        ValueError
            If it is no loader state, or was saved with another ``num_workers``.
        """
        if not isinstance(state_dict, dict):
            raise TypeError("load_state_dict() takes the dict state_dict() returned, not "
                            f"{type(state_dict).__name__}")
        if state_dict:
            check_layout(state_dict, self.num_workers)
        it, self._initial_iter = self._initial_iter, None
        if it is not None:
            _stop(it)
        self.close()  # persistent workers: the next iter() starts them from the state
        self._progress = None
        self._next_state = copy.deepcopy(state_dict) if state_dict else None

    def __len__(self) -> int:
        if self._iterable:
            length = self._IterableDataset_len_called = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(
                    length / self.batch_size)
            return length
        return len(self._index_sampler)

    def check_worker_number_rationality(self) -> None:
        """Warn, as torch's loader does, when there are more workers than usable CPUs."""
        if not self.num_workers:
            return
        suggest = _cpu_count(self._use_torch)
        checked = hasattr(os, "sched_getaffinity")
        if suggest is None or self.num_workers > suggest:
            if suggest is not None:
                hint = (f"Our suggested max number of worker in current system is {suggest}"
                        f"{'' if checked else ' (`cpuset` is not taken into account)'}, which is "
                        "smaller than what this DataLoader is going to create.")
            else:
                hint = ("DataLoader is not able to compute a suggested max number of worker in "
                        "current system.")
            warnings.warn(f"This DataLoader will create {self.num_workers} worker processes in "
                          f"total. {hint} Please be aware that excessive worker creation might get "
                          "DataLoader running slow or even freeze, lower the worker number to avoid "
                          "potential slowness/freeze if necessary.", stacklevel=2)

    def close(self) -> None:
        """Stop persistent workers now (they stop by themselves when the loader is collected)."""
        it, self._iterator = self._iterator, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def __repr__(self) -> str:
        return (f"<shmshare DataLoader num_workers={self.num_workers} batch_size={self.batch_size} "
                f"{'torch' if self._use_torch else 'numpy'}>")


# inspect.signature(DataLoader) and help() read a class's __new__ before its __init__: show __init__'s parameters
DataLoader.__new__.__signature__ = inspect.signature(DataLoader.__init__)  # type: ignore[attr-defined]


def _stop(it: Any) -> None:
    """Stop an iterator's workers now (one that will not be iterated)."""
    if hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def _is_iter_datapipe(dataset: Any) -> bool:
    from torch.utils.data import IterDataPipe

    return isinstance(dataset, IterDataPipe)


def _torch_samplers() -> Any:
    import torch.utils.data as tud
    from torch.utils.data import dataloader

    class _Samplers:
        RandomSampler = tud.RandomSampler
        SequentialSampler = tud.SequentialSampler
        BatchSampler = tud.BatchSampler
        _InfiniteConstantSampler = dataloader._InfiniteConstantSampler

    return _Samplers


def _default_collate(use_torch: bool) -> Callable[[Any], Any]:
    if use_torch:
        from torch.utils.data._utils.collate import default_collate

        return default_collate  # torch's own object; a worker swaps in the pooled one
    return _collate.numpy_mode_collate


def _default_convert(use_torch: bool) -> Callable[[Any], Any]:
    if use_torch:
        from torch.utils.data._utils.collate import default_convert

        return default_convert
    return _collate.numpy_convert


def _cpu_count(use_torch: bool) -> int | None:
    if use_torch:
        import torch

        return torch._utils.cpu_count()  # tests patch it
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _check_cuda(device: Any) -> None:
    """A loader told to copy batches to a GPU is refused now, where none can be used, not at iter()."""
    from .. import cuda

    why = cuda.why_unavailable()
    if why is not None:
        raise cuda.CudaUnavailable(f"device={device!r} copies batches to a CUDA GPU, and CUDA cannot be used "
                                   f"in this process: {why.rstrip('.')}. Leave device unset to keep batches on the CPU "
                                   "(move them yourself with batch.to(...)), or run where a GPU is")
