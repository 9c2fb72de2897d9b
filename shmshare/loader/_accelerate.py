"""HF Accelerate's ``prepare`` keeps a shmshare loader a shmshare loader.

Note [Accelerate rebuilds loaders]
    ``Accelerator.prepare`` (through ``Accelerator.prepare_data_loader``) does
    not wrap the loader it is given. It reads its dataset, samplers and
    arguments, and builds a new ``torch.utils.data.DataLoader`` from them
    inside its ``DataLoaderShard`` or ``DataLoaderDispatcher``
    (``accelerate.data_loader.DataLoaderAdapter``), with no way to name
    another class; ``Accelerator.skip_first_batches`` does the same. A
    shmshare loader, being a torch loader (Note [A torch DataLoader when
    torch is imported]), would come back as torch's, silently.

    So those two methods of ``Accelerator`` are wrapped, once accelerate is
    imported and a torch-mode shmshare loader has been made: when the loader
    given is shmshare's (or a prepared one over shmshare's), the torch loader
    that Accelerate built is replaced by a shmshare loader made from its
    arguments, which keep Accelerate's sampling (its sharded batch sampler,
    skipped batches), plus the given loader's own (``pool_limit``,
    ``device``). Accelerate's wrapper, its device placement and its
    end-of-data bookkeeping stay as they are. It is the plain
    ``shmshare.DataLoader``, as Accelerate's is the plain torch class whatever
    the class given. Loaders of other classes pass untouched, and so does a
    ``StatefulDataLoader`` (``use_stateful_dataloader=True``): shmshare's
    loader has no ``state_dict``.

    When the first torch-mode loader comes before ``import accelerate``, a
    finder on ``sys.meta_path`` waits for ``accelerate.accelerator`` to be
    executed, wraps, and leaves. ``accelerate.data_loader.prepare_data_loader``
    called directly, not through an ``Accelerator``, still builds torch's.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, cast

import torch.utils.data

from . import _dataloader

__all__ = ["keep_in_accelerate"]

_MODULE = "accelerate.accelerator"
_METHODS = ("prepare_data_loader", "skip_first_batches")  # the Accelerator methods that build loaders
# torch's arguments that are not about sampling, read back from the loader Accelerate built
_ARGUMENTS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
              "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def keep_in_accelerate() -> None:
    """Wrap Accelerate's loader-building methods now if it is imported, else when it is (once)."""
    with _lock:
        module = sys.modules.get(_MODULE)
        if module is not None:
            _wrap(module)
        elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(_MODULE, _wrap))


def _wrap(module: ModuleType) -> None:
    accelerator = getattr(module, "Accelerator", None)
    for name in _METHODS:
        method = None if accelerator is None else accelerator.__dict__.get(name)
        if callable(method) and not getattr(method, "_keeps_shmshare", False):
            setattr(accelerator, name, _keeping(method))


def _keeping(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def keep(self: Any, dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        made = method(self, dataloader, *args, **kwargs)
        given = getattr(dataloader, "base_dataloader", dataloader)  # skip_first_batches takes a prepared loader
        return _with_shmshare(made, given) if isinstance(given, _dataloader.DataLoader) else made

    keep._keeps_shmshare = True  # type: ignore[attr-defined]  # wrapped once, however often asked
    return keep


def _with_shmshare(made: Any, given: _dataloader.DataLoader[Any]) -> Any:
    base = getattr(made, "base_dataloader", None)
    if type(base) is torch.utils.data.DataLoader:  # a DataLoaderShard, DataLoaderDispatcher or SkipDataLoader
        made.base_dataloader = _rebuilt(base, given)
        return made
    if type(made) is torch.utils.data.DataLoader:  # skip_first_batches over an unprepared loader
        return _rebuilt(made, given)
    return made  # already shmshare's (a loader prepared twice), or a StatefulDataLoader


def _rebuilt(torch_loader: Any, given: _dataloader.DataLoader[Any]) -> Any:
    """A shmshare loader that samples as `torch_loader` does, with its arguments and `given`'s own."""
    if isinstance(torch_loader.dataset, torch.utils.data.IterableDataset):
        sampling = {"batch_size": torch_loader.batch_size, "drop_last": torch_loader.drop_last}
    elif torch_loader.batch_size is None and torch_loader.batch_sampler is not None:  # made with a batch_sampler
        sampling = {"batch_sampler": torch_loader.batch_sampler}
    else:  # a sampler (Accelerate's batch sampler as a sampler, with batch_size), or no batching
        sampling = {"sampler": torch_loader.sampler, "batch_size": torch_loader.batch_size,
                    "drop_last": torch_loader.drop_last}
    arguments = {name: getattr(torch_loader, name) for name in _ARGUMENTS}
    return _dataloader.DataLoader(torch_loader.dataset, **sampling, **arguments, pool_limit=given.pool_limit,
                                  worker_start=given.worker_start, device=given.device)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module `name` has been executed, and leaves ``sys.meta_path``."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):  # the finders after us, as the import system would ask them
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else cast(importlib.machinery.ModuleSpec | None, find(fullname, path, target))
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec  # a namespace package: nothing executes, nothing to wrap
        spec.loader = _ThenLoader(spec.loader, self._then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """Executes a module with its own loader, puts that loader back on it, then runs `then(module)`."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # tracebacks and inspect read the source through it
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            self._then(module)


_lock = threading.Lock()  # one wrapping, whichever thread makes the first loader or imports accelerate
