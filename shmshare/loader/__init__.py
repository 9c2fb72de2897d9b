"""A worker-pool DataLoader, a drop-in for ``torch.utils.data.DataLoader``.

``shmshare.DataLoader`` takes torch's arguments and behaves as torch's
loader (docs/loader.md says where it differs); its workers collate each
batch straight into a shared-memory pool of their own, so a batch reaches
the main process with no copy and no new segment, and its pages are
recycled once the main process drops it. Without torch it loads numpy
datasets into numpy batches, with the samplers below.

Modules: ``_dataloader`` (the class), ``_iter_base`` and ``_iters`` (the main
process's side: without workers, and over them), ``_starting`` and ``_zygote``
(starting workers: one by one, or forked from one process under spawn and
forkserver), ``_worker`` (a worker), ``_resume`` and ``_progress``
(``state_dict``/``load_state_dict``), ``_stats`` (``stats()``), ``_collate`` and ``_pool`` (batches made in the
pool), ``_batch`` (a batch on the wire), ``_frozen`` (``share``: read-only
containers in sealed shared memory, one copy for every worker), ``_fetch``, ``_wrap`` (worker
exceptions), ``_samplers`` and ``_seeding`` (torch's, without torch);
with torch imported, ``_torch_loader`` (the loader's class: torch's
DataLoader too) and ``_accelerate`` (Accelerate's ``prepare`` keeps it).
"""

from __future__ import annotations

from ._collate import default_collate, default_convert, numpy_collate, numpy_convert
from ._dataloader import DataLoader
from ._frozen import SharedMapping, SharedSequence, share
from ._samplers import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from ._worker import WorkerInfo, get_worker_info

__all__ = [
    "DataLoader",
    "get_worker_info",
    "WorkerInfo",
    "default_collate",
    "default_convert",
    "numpy_collate",
    "numpy_convert",
    "Dataset",
    "IterableDataset",
    "Sampler",
    "SequentialSampler",
    "RandomSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
    "BatchSampler",
    "DistributedSampler",
    "share",
    "SharedSequence",
    "SharedMapping",
]
