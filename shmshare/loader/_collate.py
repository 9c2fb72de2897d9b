"""Collate functions that put each batch straight into the worker's pool.

``default_collate`` is torch's (``torch.utils.data.default_collate``: the
same types, dtypes and errors, through torch's own ``collate`` and its
``collate_fn_map``) with one change: in a shmshare worker a stacked tensor
is allocated in the worker's pool, so its pages are recycled and already
mapped in the main process, where torch's allocates a fresh shm segment per
tensor per batch. ``numpy_collate`` is the same walk for numpy users: numpy
arrays in, numpy arrays out, no torch needed.
"""

from __future__ import annotations

import collections.abc
import copy
import functools
from typing import Any

import numpy as np

from . import _pool

__all__ = ["default_collate", "default_convert", "numpy_collate", "numpy_convert", "is_torch_default",
           "numpy_mode_collate"]

_NP_ERR = ("numpy_collate: batch must contain numpy arrays, numbers, strings, dicts or lists; "
           "found {}")
_TORCH_IN_NUMPY = ("numpy_collate: batch holds a torch tensor ({}); numpy_collate stacks numpy "
                   "arrays only. Leave collate_fn unset (a loader collates torch samples with "
                   "torch's default_collate), or pass collate_fn=torch.utils.data.default_collate")


class _TorchSample(TypeError):
    """numpy_collate met a torch tensor: what the numpy mode's default hands to torch's."""


def numpy_mode_collate(batch: Any) -> Any:
    """The default collate of a loader made before ``import torch`` (Note [Two modes: torch's
    and numpy's]): numpy's, unless the samples turn out to be torch's; then torch's
    ``default_collate`` (pooled), as a loader made after ``import torch`` would have used."""
    try:
        return numpy_collate(batch)
    except _TorchSample:
        return default_collate(batch)


def default_collate(batch: Any) -> Any:
    """torch's ``default_collate``, stacking tensors into the worker's pool (needs torch)."""
    from torch.utils.data._utils.collate import collate

    return collate(batch, collate_fn_map=_pool_map())


def default_convert(data: Any) -> Any:
    """torch's ``default_convert`` (``batch_size=None``: numpy arrays become tensors)."""
    from torch.utils.data._utils.collate import default_convert as convert

    return convert(data)  # type: ignore[no-untyped-call]


def is_torch_default(fn: Any) -> bool:
    """Whether `fn` is torch's own default_collate (a worker swaps in ours: same result, pooled)."""
    import sys

    collate = sys.modules.get("torch.utils.data._utils.collate")
    return collate is not None and fn is getattr(collate, "default_collate", None)


@functools.cache
def _pool_map() -> dict[Any, Any]:
    import torch
    from torch.utils.data._utils.collate import default_collate_fn_map

    fns = dict(default_collate_fn_map)
    fns[torch.Tensor] = _collate_tensor
    return fns


def _collate_tensor(batch: Any, *, collate_fn_map: Any = None) -> Any:
    import torch
    from torch.utils.data._utils.collate import collate_tensor_fn

    elem = batch[0]
    if (_pool._sender is None or elem.is_nested or elem.layout is not torch.strided
            or elem.device.type != "cpu"):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's errors, too
    out = _pool.empty((len(batch), *elem.shape), elem.dtype)
    return torch.stack(batch, 0, out=out)


def numpy_collate(batch: Any) -> Any:
    """Collate samples into numpy batches, as ``default_collate`` does into tensors.

    Arrays are stacked (in the worker's pool) along a new first axis; Python
    and numpy numbers become arrays (ints int64, floats float64, bools bool);
    strings and bytes stay lists; dicts, namedtuples and sequences are
    collated field by field, keeping their types where they can be rebuilt.
    """
    elem: Any = batch[0]
    if isinstance(elem, np.ndarray):
        if elem.dtype.kind in "SaUO":
            raise TypeError(_NP_ERR.format(elem.dtype))
        return _stack(batch)
    if isinstance(elem, (np.bool_, np.number)):
        return np.array(batch)
    if isinstance(elem, bool):
        return np.array(batch)  # bool if all are (torch: a bool tensor), else int64
    if isinstance(elem, float):
        return np.array(batch, dtype=np.float64)
    if isinstance(elem, int):
        return np.array(batch, dtype=np.int64)
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, collections.abc.Mapping):
        fields = {key: numpy_collate([d[key] for d in batch]) for key in elem}
        if isinstance(elem, collections.abc.MutableMapping):
            mapping = copy.copy(elem)
            mapping.update(fields)
            return mapping
        kind: Any = type(elem)
        try:
            return kind(fields)
        except TypeError:
            return fields
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple
        return type(elem)(*(numpy_collate(list(s)) for s in zip(*batch, strict=True)))
    if isinstance(elem, collections.abc.Sequence):
        size = len(elem)
        if any(len(e) != size for e in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        columns = [numpy_collate(list(s)) for s in zip(*batch, strict=True)]
        if isinstance(elem, tuple):
            return columns
        if isinstance(elem, collections.abc.MutableSequence):
            seq = copy.copy(elem)
            for i, col in enumerate(columns):
                seq[i] = col
            return seq
        kind = type(elem)
        try:
            return kind(columns)
        except TypeError:
            return columns
    if type(elem).__module__.startswith("torch"):
        raise _TorchSample(_TORCH_IN_NUMPY.format(type(elem).__name__))
    raise TypeError(_NP_ERR.format(type(elem)))


def numpy_convert(data: Any) -> Any:
    """``batch_size=None`` without torch: each sample goes as it is."""
    return data


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    first = arrays[0]
    dtype = np.result_type(*{a.dtype for a in arrays})
    out = _pool.empty((len(arrays), *first.shape), dtype)
    np.stack(arrays, out=out)
    return out  # type: ignore[no-any-return]
