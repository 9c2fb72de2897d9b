"""Datasets and worker_init_fns for the torch-parity tests, importable by spawn and forkserver workers.

Everything here is small and module-level so that it pickles by reference. Nothing imports shmshare:
the same objects are handed to ``torch.utils.data.DataLoader`` and to ``shmshare.DataLoader``.
"""

from __future__ import annotations

import os
import random
import time
from collections import namedtuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Point = namedtuple("Point", ["x", "y"])


class RangeDataset(Dataset):
    """Item i is the int i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


class PidDataset(Dataset):
    """Item i is (i, worker id or -1, the pid that produced it)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        if self.delay:
            time.sleep(self.delay)
        info = get_worker_info()
        return i, -1 if info is None else info.id, os.getpid()


class WorkerQueueDataset(Dataset):
    """torch's TestIndividualWorkerQueue: the worker id is per-worker state set by ``worker_init_fn``;
    worker w is made slower the larger w is, so a loader that did not keep batch i on worker i % n
    (or did not return batches in order) would show it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.worker_id: int | None = None

    def __len__(self) -> int:
        return self.n

    def worker_init_fn(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def __getitem__(self, i: int) -> tuple[int | None, int]:
        time.sleep(0.002 * (self.worker_id or 0))
        return self.worker_id, i


MARK = "unset"  # a test sets it in the main process: forked workers inherit it, others import afresh


class ContextDataset(Dataset):
    """Item i is (i, worker id, pid, parent pid, MARK as this process sees it): enough to tell how the worker
    was started (fork: parent is the loader's process and MARK is inherited; spawn: parent is the loader's
    process, MARK is not; forkserver: the parent is the fork server)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int, int, str]:
        info = get_worker_info()
        return i, -1 if info is None else info.id, os.getpid(), os.getppid(), MARK


class SlowFirstDataset(Dataset):
    """Item 0 takes `delay` seconds; every other item is instant."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == 0:
            time.sleep(self.delay)
        return i


class BadItemError(Exception):
    """A user exception type (one message argument), raised by ErrorDataset."""


class TwoArgError(Exception):
    """An exception that cannot be made again from its message alone (torch re-raises it as RuntimeError)."""

    def __init__(self, a: object, b: object) -> None:
        super().__init__(f"{a} and {b}")


def raise_two_arg(i: int) -> None:
    raise TwoArgError("bad index", i)


def failing_init(worker_id: int) -> None:
    """worker_init_fn that fails in worker 0."""
    if worker_id == 0:
        raise ValueError(f"init failed in worker {worker_id}")


class ErrorDataset(Dataset):
    """Item `bad` raises `exc_type(f"bad index {bad}")`; every other item i is i."""

    def __init__(self, n: int, bad: int, exc_type: type[Exception] = ValueError) -> None:
        self.n = n
        self.bad = bad
        self.exc_type = exc_type

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            if self.exc_type is TwoArgError:
                raise_two_arg(i)
            raise self.exc_type(f"bad index {i}")
        return i


class BadSampleDataset(Dataset):
    """Item `bad` is `sample` (something default_collate cannot batch); every other item i is [i, i]."""

    def __init__(self, n: int, bad: int, sample: object) -> None:
        self.n = n
        self.bad = bad
        self.sample = sample

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> object:
        return self.sample if i == self.bad else [i, i]


class BigDataset(Dataset):
    """Item i is a float32 tensor of `shape` filled with i, and a numpy array of the same (big enough that a
    shared-memory loader really puts them in shared memory)."""

    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n = n
        self.shape = shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, np.ndarray]:
        return torch.full(self.shape, float(i)), np.full(self.shape, i, dtype=np.int32)


class MixedDataset(Dataset):
    """Items of every kind default_collate knows: tensors, numpy arrays and scalars, ints, floats,
    bools, strings, bytes, dicts, namedtuples, tuples and lists, nested."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {
            "tensor": torch.full((2, 3), float(i)),
            "long": torch.tensor([i, -i]),
            "array": np.arange(4, dtype=np.float32) + i,
            "int_array": np.array([i, i + 1], dtype=np.int16),
            "np_scalar": np.float64(i / 2),
            "int": i,
            "float": i / 4,
            "bool": i % 2 == 0,
            "str": f"s{i}",
            "bytes": b"b%d" % i,
            "point": Point(i, float(i)),
            "tuple": (i, torch.tensor(i)),
            "list": [i, i * 2],
            "nested": {"a": {"b": np.array([i], dtype=np.int64)}},
            "view": torch.arange(6).reshape(2, 3).t() + i,  # not contiguous
            "scalar_tensor": torch.tensor(i * 1.5),
            "half": torch.tensor([i], dtype=torch.float16),
            "bool_tensor": torch.tensor([i % 2 == 1]),
            "u8_array": np.array([i, 255], dtype=np.uint8),
        }


class ShardedIterable(IterableDataset):
    """range(n), split between the workers by ``get_worker_info()`` (the whole range without workers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class UnshardedIterable(IterableDataset):
    """range(n) in every worker: each worker's replica yields all of it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class SizedIterable(UnshardedIterable):
    """An IterableDataset that reports `length` from __len__ but yields range(n)."""

    def __init__(self, n: int, length: int) -> None:
        super().__init__(n)
        self.length = length

    def __len__(self) -> int:
        return self.length


class WorkerInfoIterable(IterableDataset):
    """Yields, once per worker, what get_worker_info() says there."""

    def __iter__(self):
        info = get_worker_info()
        assert info is not None
        yield {"id": info.id, "num_workers": info.num_workers, "seed": info.seed,
               "dataset_is_self": info.dataset is self}


# -- seeds ------------------------------------------------------------------------------------------------------

_recorded: dict | None = None


def record_seeds(worker_id: int) -> None:
    """worker_init_fn: record the seeds the loader gave this worker, before anything else draws."""
    global _recorded
    info = get_worker_info()
    _recorded = {
        "worker_id": worker_id,
        "info_id": info.id,
        "info_seed": info.seed,
        "torch_initial_seed": torch.initial_seed(),
        "random": random.random(),
        "numpy": float(np.random.rand()),
        "torch_rand": float(torch.rand(())),
    }


class SeedDataset(Dataset):
    """Item i is (i, the seeds ``record_seeds`` recorded in this worker)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, dict | None]:
        return i, _recorded


def identity_collate(batch):
    """collate_fn that keeps the list of samples as it is."""
    return batch


class RankShardedIterable(IterableDataset):
    """range(n) split over every (rank, worker) pair: shard rank * num_workers + worker id of
    world_size * num_workers. The rank and world size are read from torch.distributed where the dataset is
    made (the loader's process), so it pickles to workers of any start method."""

    def __init__(self, n: int) -> None:
        import torch.distributed as dist

        self.n = n
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        shard, shards = self.rank * nw + wid, self.world_size * nw
        return iter((i, self.rank, wid) for i in range(shard, self.n, shards))
