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

    torch tensors keep torch's semantics: a dense CPU tensor is what torch's
    reducer makes of it (its storage, plus dtype, offset, sizes, strides and
    requires_grad), and its storage, of any size, moves into the pool in
    place and goes as a handle, so sender and receivers share its memory
    (Note [A tensor's storage moves into the pool] in ``_storages.py``).
    CUDA, sparse, quantized, nested, meta, conjugate and negative-bit tensors
    go through torch's own reducer, whose CPU storages come to ours. Under
    torch's ``file_system`` strategy, or where the pool has no room, tensors
    and storages go through torch's own reducers: still shared, torch's way.

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
from . import _layouts, _storages
from ._client import rebuild_array
from ._common import HandleError, env_number
from ._owner import current_owner, exiting, owner
from ._storages import _torch

__all__ = ["init_reductions", "reduce_ndarray", "reduce_tensor", "reduce_storage", "BY_VALUE_BELOW"]

# bytes: smaller arrays not in the pool pickle by value (Note [What goes as a handle])
BY_VALUE_BELOW = int(env_number("SHMSHARE_MP_BY_VALUE_BELOW", 1024, "bytes"))


def _handle(arr: np.ndarray) -> tuple[Any, ...] | None:
    """A handle's arguments for `arr`, or None: pickle it by value.

    Never raises: an array that cannot go as a handle (a host out of fds or
    memory, this library's own bug) goes by value with a warning -- raising
    here would drop it, in a Queue's feeder thread, with a traceback only.
    """
    if arr.dtype.hasobject:
        return None
    try:
        return _make_handle(arr)
    except Exception as exc:  # noqa: BLE001  (see above: bytes, not lost)
        _warn_by_value(exc)
        ow = current_owner()
        if ow is not None:
            ow._counts["by_value"] += 1
        return None


def _make_handle(arr: np.ndarray) -> tuple[Any, ...] | None:
    if arr.nbytes == 0 or arr.dtype.itemsize == 0:
        return None  # nothing to share, whatever BY_VALUE_BELOW says
    if exiting():
        return None  # by value, as it should at exit: nothing to warn about
    ow = owner()
    if arr.nbytes < BY_VALUE_BELOW:
        if not ow.pool.addrs:
            return None
        ptr, lo, span = _native.extent(arr)
        with ow._lock:
            if ow.pool.find(ptr + lo, span) is None:
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
    """ForkingPickler's reducer for ``torch.Tensor`` and ``torch.nn.Parameter``.

    A dense CPU tensor goes as its storage's handle (Note [A tensor's storage
    moves into the pool] in ``_storages.py``) with its dtype, storage offset,
    sizes and strides, as torch's reducer sends them, without torch's
    ``TypedStorage`` on either side (a fifth of a small tensor's cost).
    Everything else -- a non-leaf requiring grad (torch's own error), CUDA,
    sparse, quantized, nested, meta, conjugate and negative-bit tensors, the
    ``file_system`` strategy -- is torch's reducer, whose storages still come
    to :func:`reduce_storage`.
    """
    torch = _torch()
    cls = type(t)
    if not t.is_cpu or t.layout is not torch.strided or t.is_quantized or t.is_nested \
            or (t.requires_grad and not t.is_leaf) or t.is_conj() or t.is_neg() \
            or (cls is not torch.Tensor and cls is not torch.nn.Parameter) or exiting() \
            or torch.multiprocessing.get_sharing_strategy() == "file_system":
        return torch.multiprocessing.reductions.reduce_tensor(t)
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return torch.multiprocessing.reductions.reduce_tensor(t)
    torch.utils.hooks.warn_if_has_hooks(t)
    handle = _share(st)
    if handle is None:
        return torch.multiprocessing.reductions.reduce_tensor(t)
    name = _torch_names.get(t.dtype)
    if name is None:
        name = _torch_names[t.dtype] = str(t.dtype).removeprefix("torch.")
    return rebuild_tensor, (handle, name, t.storage_offset(), tuple(t.size()), tuple(t.stride()),
                            bool(t.requires_grad), cls is torch.nn.Parameter)


_torch_names: dict[Any, str] = {}
_torch_dtypes: dict[str, Any] = {}  # the inverse, filled as handles come


def _torch_dtype(name: str) -> Any:
    """torch's dtype of that name (kept once seen); None if torch has none."""
    if type(name) is not str:
        return None
    got = _torch_dtypes.get(name)
    if got is None:
        torch = _torch()
        got = getattr(torch, name, None)
        if not isinstance(got, torch.dtype):
            return None
        if len(_torch_dtypes) < 256:
            _torch_dtypes[name] = got
    return got


def rebuild_tensor(handle: tuple[Any, ...], name: str, offset: int, size: tuple[int, ...],
                   stride: tuple[int, ...], requires_grad: bool, parameter: bool) -> Any:
    """Unpickle a tensor: a view of its storage's handle, as torch's ``rebuild_tensor`` makes it."""
    torch = _torch()
    _check_storage_handle(handle)
    dtype = _torch_dtype(name)
    elements = None  # numpy's dtype for a tensor that is all of its storage, one after the other
    if dtype is not None and offset == 0 and stride == (1,) and not requires_grad and not parameter:
        elements = _storages.numpy_dtype(dtype)
        if elements is not None and (size != (handle[6] // elements.itemsize,) or handle[6] % elements.itemsize):
            elements = None
    st, whole = _storages.rebuild(rebuild_array(*handle), handle, elements)
    if dtype is None:  # claimed first, as any handle that arrived: released with `st` now
        raise HandleError(f"a tensor handle of pid {handle[0]} with no torch dtype {name!r}")
    reach = _layouts.reach(size, stride)  # the last element's offset from the first; -1: none
    if offset < 0 or reach is None or (offset + reach + 1) * dtype.itemsize > st.nbytes():
        raise HandleError(f"a tensor handle of pid {handle[0]} reaches past its {st.nbytes()}-byte "
                          f"storage: offset {offset}, sizes {size}, strides {stride}")
    # the tensor over the storage made just now is this one: no second tensor set_() on it
    t = whole if whole is not None else torch.empty(0, dtype=dtype).set_(st, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def reduce_storage(st: Any) -> Any:
    """ForkingPickler's reducer for ``torch.UntypedStorage``: a CPU storage moves into this
    process's pool, in place, and goes as a handle (Note [A tensor's storage moves into the pool])."""
    torch = _torch()
    if st.device.type != "cpu" or st.nbytes() == 0 or exiting() \
            or torch.multiprocessing.get_sharing_strategy() == "file_system":
        return torch.multiprocessing.reductions.reduce_storage(st)  # theirs, unchanged
    handle = _share(st)
    if handle is None:  # no room in the pool or the lease table: shared all the same, torch's way
        return torch.multiprocessing.reductions.reduce_storage(st)
    return rebuild_storage, (handle,)


def _share(st: Any) -> tuple[Any, ...] | None:
    """The storage's handle; None (after one warning): torch's reducer shares it instead.

    Out of memory (a full memory cgroup or /dev/shm, a full lease table for a storage shared
    already) raises: torch's reducer would need the same memory (and be OOM-killed for it), or
    would move a shared storage away from those who share it."""
    try:
        got = _storages.share(st)
    except (MemoryError, _storages.Unshareable):
        raise
    except Exception as exc:  # noqa: BLE001  (a bug of ours: torch's own reducer shares it instead)
        _warn_by_value(exc, "through torch's own reducer")
        return None
    if got is None:
        _warn_by_value(ResourceWarning("no room in the pool or the lease table"),
                       "through torch's own reducer")
    return got


def rebuild_storage(handle: tuple[Any, ...]) -> Any:
    """Unpickle a storage: one storage per block range while any view of it lives here."""
    _check_storage_handle(handle)
    return _storages.rebuild(rebuild_array(*handle), handle)[0]


def _check_storage_handle(handle: tuple[Any, ...]) -> None:
    # a storage's handle is its whole extent as bytes (what the signature does not cover must
    # still say so: a shortened one would be cached as the storage of the whole block range)
    if len(handle) != 15 or handle[11] != "|u1" or tuple(handle[12]) != (handle[6],) or handle[7] != 0 \
            or tuple(handle[8]) != (1,):
        raise HandleError(f"a malformed storage handle of pid {handle[0] if handle else '?'}: its "
                          "dtype, shape and strides must be its bytes, one after the other")



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

