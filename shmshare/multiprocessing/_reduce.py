"""Reductions on multiprocessing's ForkingPickler: arrays and CPU tensors as handles.

Note [What goes as a handle]
    ``ForkingPickler`` looks reducers up by exact type, so these cover
    ``numpy.ndarray``, ``torch.Tensor``, ``torch.nn.Parameter`` and
    ``torch.UntypedStorage`` (not subclasses such as ``np.memmap``, which
    pickle as they always did).

    numpy arrays keep the stdlib's value semantics: an array goes as a
    handle to a copy of its elements in a block of this process's pool when
    its dtype holds no object references, it has at least ``BY_VALUE_BELOW``
    bytes (``SHMSHARE_MP_BY_VALUE_BELOW``, default 1024: smaller ones are
    cheaper as bytes, a handle costing a slot, a release and ~170 bytes of
    pickle), and the pool and the lease table have room; an array already in
    the pool (``empty()``) goes with no copy. Otherwise it goes by value, as
    numpy pickles it.

    torch tensors keep torch's semantics: the tensor reducer is torch's own
    (a tensor is its storage plus offset, sizes and strides; CUDA, sparse,
    nested, meta tensors and every check are torch's), and a CPU storage of
    any size goes through ours, which moves it into the pool in place and
    sends a handle to it, so sender and receivers share its memory (Note [A
    tensor's storage moves into the pool] in ``_storages.py``). Under
    torch's ``file_system`` strategy, or where the pool has no room,
    storages go through torch's own reducer: still shared, torch's way.

Note [Reducers against import order]
    ``import torch`` imports ``torch.multiprocessing``, which registers
    torch's reducers and would replace ours if torch is imported after this
    module. So ours are registered when torch is already imported, and
    otherwise a one-shot import hook registers them right after
    ``torch.multiprocessing`` has run. :func:`init_reductions` registers
    them again, for code that wants to be explicit.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from types import ModuleType
from typing import Any

import numpy as np

from .. import _native, tensors
from . import _storages
from ._client import rebuild_array
from ._common import env_number
from ._owner import current_owner, exiting, owner

__all__ = ["init_reductions", "reduce_ndarray", "reduce_tensor", "reduce_storage", "BY_VALUE_BELOW"]

# bytes: smaller arrays not in the pool pickle by value (Note [What goes as a handle])
BY_VALUE_BELOW = int(env_number("SHMSHARE_MP_BY_VALUE_BELOW", 1024, "bytes"))


def _handle(arr: np.ndarray, storage: Any = None) -> tuple[Any, ...] | None:
    """A handle's arguments for `arr`, or None: pickle it by value.

    Never raises: an array that cannot go as a handle (a host out of fds or
    memory, this library's own bug) goes by value with a warning -- raising
    here would drop it, in a Queue's feeder thread, with a traceback only.
    """
    if arr.dtype.hasobject:
        return None
    try:
        return _make_handle(arr, storage)
    except Exception as exc:  # noqa: BLE001  (see above: bytes, not lost)
        _warn_by_value(exc)
        ow = current_owner()
        if ow is not None:
            ow._counts["by_value"] += 1
        return None


def _make_handle(arr: np.ndarray, storage: Any) -> tuple[Any, ...] | None:
    if arr.nbytes == 0 or arr.dtype.itemsize == 0:
        return None  # nothing to share, whatever BY_VALUE_BELOW says
    if exiting():
        return None  # by value, as it should at exit: nothing to warn about
    ow = owner()
    if storage is not None:  # torch shared it: no copy (Note [What goes as a handle])
        got = ow.place_shared(arr, storage)
        if got is not None:
            return (ow.pid, ow.token, ow.path, *got, _dtype_str(arr.dtype), arr.shape, True,
                    ow.sign(got, True))
    if arr.nbytes < BY_VALUE_BELOW:
        if not ow._addrs:
            return None
        ptr, lo, span = _native.extent(arr)
        with ow._lock:
            if ow._find(ptr + lo, span) is None:
                return None
    got = ow.place(arr)
    if got is None:
        return None
    return (ow.pid, ow.token, ow.path, *got, _dtype_str(arr.dtype), arr.shape, False,
            ow.sign(got, False))


_dtype_strs: dict[np.dtype, str] = {}


def _dtype_str(dt: np.dtype) -> str:
    got = _dtype_strs.get(dt)
    if got is None:
        got = tensors.encode_dtype(dt)
        if len(_dtype_strs) < 1024:
            _dtype_strs[dt] = got
    return got


_warned = False


def _warn_by_value(exc: BaseException, how: str = "by value (pickled bytes)") -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"shmshare.multiprocessing: an array goes {how}, not as a handle to the "
                      f"pool: {type(exc).__name__}: {exc} (said once per process)",
                      ResourceWarning, stacklevel=4)


def reduce_ndarray(arr: np.ndarray) -> Any:
    """ForkingPickler's reducer for ``numpy.ndarray``."""
    h = _handle(arr) if type(arr) is np.ndarray else None
    if h is None:
        return arr.__reduce__()
    return rebuild_array, h


def reduce_tensor(t: Any) -> Any:
    """ForkingPickler's reducer for ``torch.Tensor`` and ``torch.nn.Parameter``: torch's own.

    It pickles a CPU tensor as its storage (a ``TypedStorage``) and its
    offset, sizes and strides; the storage's bytes go through
    :func:`reduce_storage`, ours (Note [A tensor's storage moves into the pool]
    in ``_storages.py``). Everything else about tensors -- grads and hooks
    refused, Parameters, CUDA, sparse, nested and meta tensors -- is torch's.
    """
    return _torch().multiprocessing.reductions.reduce_tensor(t)


def reduce_storage(st: Any) -> Any:
    """ForkingPickler's reducer for ``torch.UntypedStorage``: a CPU storage moves into this
    process's pool, in place, and goes as a handle (Note [A tensor's storage moves into the pool])."""
    torch = _torch()
    if st.device.type != "cpu" or st.nbytes() == 0 or exiting() \
            or torch.multiprocessing.get_sharing_strategy() == "file_system":
        return torch.multiprocessing.reductions.reduce_storage(st)  # theirs, unchanged
    try:
        handle = _storages.share(st)
    except Exception as exc:  # noqa: BLE001  (torch's own reducer shares it instead, below)
        _warn_by_value(exc, "torch's own shared memory")
        handle = None
    if handle is None:  # no room in the pool or the lease table: shared all the same, torch's way
        return torch.multiprocessing.reductions.reduce_storage(st)
    return rebuild_storage, (handle,)


def rebuild_storage(handle: tuple[Any, ...]) -> Any:
    """Unpickle a storage: one storage per block range while any view of it lives here."""
    return _storages.rebuild(rebuild_array(*handle), handle)


_torch_mod: Any = None


def _torch() -> Any:
    global _torch_mod
    if _torch_mod is None:
        import torch
        import torch.multiprocessing.reductions

        _torch_mod = torch
    return _torch_mod


_registered_lock = threading.Lock()


def init_reductions() -> None:
    """Register the reducers on ForkingPickler (again): numpy arrays, and torch's CPU tensors
    if torch is imported (Note [Reducers against import order])."""
    with _registered_lock:
        ForkingPickler.register(np.ndarray, reduce_ndarray)
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "Tensor"):
            from torch.nn.parameter import Parameter  # as torch's own init_reductions does

            ForkingPickler.register(torch.Tensor, reduce_tensor)
            ForkingPickler.register(Parameter, reduce_tensor)
            ForkingPickler.register(torch.UntypedStorage, reduce_storage)
            _storages.wrap_torch_methods()


class _AfterTorchMultiprocessing(importlib.abc.MetaPathFinder):
    """Register ours again once ``torch.multiprocessing`` has registered torch's."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch.multiprocessing":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if isinstance(spec, importlib.machinery.ModuleSpec) and spec.loader is not None:
                spec.loader = _Then(spec.loader)
                return spec
        return None


class _Then(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            _remove_hook()
        init_reductions()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_source, ... of the real one
        return getattr(self._loader, name)


_hook = _AfterTorchMultiprocessing()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def install() -> None:
    """At import: register now, and again after torch's own if torch comes later."""
    init_reductions()
    if "torch.multiprocessing" not in sys.modules and _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)

