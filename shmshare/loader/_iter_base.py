"""The loader's iterators' common part (epochs, resuming, device copies) and the one with no workers.

``_iters.py`` has the one over workers. Both follow torch's
``_BaseDataLoaderIter`` and ``_SingleProcessDataLoaderIter``
(``torch/utils/data/dataloader.py``) in what a program can observe.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

from . import _resume as r
from ._batch import pack, unpack
from ._device import DeviceCopier
from ._pin import choose, pin_by_copy
from ._progress import Progress, check_layout
from ._seeding import draw_base_seed

__all__ = ["BaseIter", "SingleProcessIter", "replay_index"]


class BaseIter:
    def __init__(self, loader: Any, state: dict[str, Any] | None = None) -> None:
        self._dataset = loader.dataset
        self._iterable = loader._iterable
        self._len_called = loader._IterableDataset_len_called
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._num_workers = loader.num_workers
        self._use_torch = loader._use_torch
        self._pin_how, self._pinner = choose(loader, stacklevel=5)
        self._pin_memory = self._pin_how == "copy"  # pinned by torch's copy
        self._timeout = loader.timeout
        self._collate_fn = loader.collate_fn
        if state is not None:
            check_layout(state, loader.num_workers)
        self._sampler_iter = r.sampler_iter(self._index_sampler)  # resumable (Note [Resuming mid-epoch])
        self._drawn = 0  # indices (batches) drawn from it this epoch
        # resuming: drawn from a generator given (so it moves as it did), never from the global RNG
        self._base_seed = 0 if state is not None and loader.generator is None else draw_base_seed(loader.generator)
        self._persistent_workers = loader.persistent_workers
        self._num_yielded = 0
        self._progress = Progress(loader.num_workers, self._base_seed, self._len_called)
        self._pending: tuple[Any, ...] | None = None  # the progress the batch being returned makes
        self._copier = None if loader._device is None else DeviceCopier(loader._device,
                                                                        self._use_torch)
        self._staged: tuple[str, Any, Any] | None = None  # device=: the next batch, copy started

    def __iter__(self) -> BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __getstate__(self) -> Any:
        raise NotImplementedError("{} cannot be pickled", self.__class__.__name__)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        self._staged = None  # a batch of the last epoch copied ahead: dropped
        if not first_iter:
            self._sampler_iter = r.sampler_iter(self._index_sampler)
            self._drawn = 0
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called

    def _next_index(self) -> Any:
        index = next(self._sampler_iter)
        self._drawn += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch is, in torchdata's layout (Note [Resuming mid-epoch] in ``_resume.py``)."""
        return self._progress.state_dict()

    def _next_data(self) -> Any:
        raise NotImplementedError

    def __next__(self) -> Any:
        try:
            if self._copier is None:
                data = self._next_data()
                pending, self._pending = self._pending, None
            else:
                data, pending = self._next_on_device()
        except StopIteration:
            self._progress.finished = True
            raise
        self._num_yielded += 1
        if pending is not None:
            if pending[0] == "single":  # no workers, device=: the state as that batch left it
                self._progress.single = pending[1]
            else:
                self._progress.yielded(*pending)
        self._progress.num_yielded = self._num_yielded
        if self._iterable and self._len_called is not None and self._num_yielded > self._len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                   f"(when accessing len(dataloader)), but {self._num_yielded} samples have been "
                   "fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly "
                        "configuring the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                        "for examples.")
            warnings.warn(msg, stacklevel=2)
        return data


    def _next_on_device(self) -> tuple[Any, Any]:
        """device=: return the batch whose copy started last time (and its progress), and start the next one's."""
        staged, self._staged = self._staged or self._stage(), None
        kind, value, pending = staged
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise value
        self._staged = self._stage()  # one batch ahead: its copy overlaps the program's work
        return value, pending

    def _stage(self) -> tuple[str, Any, Any]:
        try:
            data = self._next_data()
            pending, self._pending = self._pending, None
            return "batch", data, pending
        except StopIteration:
            return "end", None, None
        except Exception as exc:  # noqa: BLE001 - raised in its turn, after the batch before it
            return "error", exc, None

    def _on_device(self, payload: bytes, arrays: list[Any]) -> Any:
        assert self._copier is not None
        return unpack(payload, self._copier.copy(arrays))


class SingleProcessIter(BaseIter):
    """``num_workers=0``: fetch and collate in this process (no shared memory involved)."""

    def __init__(self, loader: Any, state: dict[str, Any] | None = None) -> None:
        if loader.timeout != 0:  # before anything that holds resources is made
            raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
        super().__init__(loader, state)
        from ._fetch import make_fetcher

        make = functools.partial(make_fetcher, self._iterable, self._dataset, self._auto_collation,
                                 self._collate_fn, self._drop_last)
        if state is None:
            self._fetcher = make()
        else:
            self._sampler_iter, self._drawn = r.restore_sampler(self._index_sampler, state)
            n = int(state[r.NUM_YIELDED])
            self._fetcher = r.restore_fetcher(state, self._dataset, make, self._iterable,
                                              replay_index(loader), n)
            self._num_yielded = self._progress.num_yielded = n
            self._len_called = self._progress.len_called = state.get(r.LEN_CALLED)
            self._progress.finished = bool(state.get(r.ITERATOR_FINISHED))
        self._progress.drawn = self._drawn
        self._progress.live = functools.partial(r.single_state, self._progress, self._index_sampler,
                                                self._sampler_iter, self._fetcher, self._dataset,
                                                self._iterable)

    def _next_index(self) -> Any:
        index = super()._next_index()
        self._progress.drawn = self._drawn
        return index

    def _next_data(self) -> Any:
        began = time.perf_counter()  # no workers: the program waits for every fetch
        try:
            index = self._next_index()
            data = self._fetcher.fetch(index)
        finally:
            self._progress.wait_s += time.perf_counter() - began
        if self._copier is not None:  # copied a batch ahead: the live state would be one batch on
            self._pending = ("single", self._progress.live())
        if self._copier is not None:
            return self._on_device(*pack(data))
        return pin_by_copy(data) if self._pin_memory else data

    def __del__(self) -> None:
        copier = getattr(self, "_copier", None)
        if copier is not None:
            copier.close()


def replay_index(loader: Any) -> Any:
    """One task's index for an iterable dataset: what replaying one of its batches fetches with."""
    if not (loader._iterable and loader._auto_collation and isinstance(loader.batch_size, int)):
        return None
    return [None] * loader.batch_size
