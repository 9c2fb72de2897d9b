"""What an ``empty()`` or ``zeros()`` takes and hands out, as numpy's take them: a numpy or
torch dtype, a shape of ints; an array, or a torch tensor over its bytes. The channel's
sender, the multiprocessing drop-in and the store's client share them; the hot path looks
each dtype up in a cache.
"""

from __future__ import annotations

import collections.abc
import math
import operator
import sys
from typing import Any

import numpy as np

from . import _native
from .tensors import as_numpy, check_shareable

__all__ = ["alloc_dtypes", "alloc_shape", "allocated"]


def alloc_dtypes(dtype: Any) -> tuple[np.dtype, Any]:
    """Return (numpy dtype to allocate, torch dtype or None) for a numpy or torch dtype."""
    try:
        return _ALLOC_DTYPES[dtype]
    except (KeyError, TypeError):  # not seen yet, or unhashable
        pass
    if type(dtype).__module__ == "torch":
        import torch

        probe = torch.empty(0, dtype=dtype)
        np_dtype, _ = as_numpy(probe)
        got = (np_dtype.dtype, dtype)
    else:
        dt = np.dtype(dtype)
        check_shareable(dt)
        if dt.itemsize == 0 and dt.kind in "SU":
            dt = np.dtype(f"{dt.byteorder if dt.kind == 'U' else '|'}{dt.kind}1")  # numpy's np.empty widens S0/U0 too
        got = (dt, None)
    try:
        if len(_ALLOC_DTYPES) < 1024:
            _ALLOC_DTYPES[dtype] = got
    except TypeError:
        pass
    return got


_ALLOC_DTYPES: dict[Any, tuple[np.dtype, Any]] = {}


def alloc_shape(shape: Any, itemsize: int) -> tuple[tuple[int, ...], int]:
    """Return (shape as a tuple of ints, bytes) for an ``empty(shape)`` of items of `itemsize`
    bytes, taking shapes as numpy's ``empty`` does: an integer (anything with ``__index__``:
    np.int64, a 0-d integer array), or a sequence of them (a tuple, list, range, 1-d array) --
    never a bool, float, str, bytes, set, dict or iterator; at most 64 dimensions. TypeError
    or ValueError naming what is wrong, and ValueError for more bytes than an address space."""
    got = _native.shape_bytes(shape, itemsize)  # the usual shapes, in C: an empty() is a hot path
    if got is not None:
        return got
    shp: tuple[int, ...]
    if isinstance(shape, (bool, np.bool_, str, bytes)):
        raise _not_a_shape(shape)
    elif hasattr(type(shape), "__index__") and not (isinstance(shape, np.ndarray) and shape.ndim):
        shp = (operator.index(shape),)
    elif isinstance(shape, (collections.abc.Sequence, np.ndarray)):
        items = list(shape)
        if any(isinstance(n, (bool, np.bool_)) for n in items):
            raise _not_a_shape(shape)
        try:
            shp = tuple(map(operator.index, items))
        except TypeError:
            raise _not_a_shape(shape) from None
    else:
        raise _not_a_shape(shape)
    if len(shp) > _MAX_DIMS:
        raise ValueError(f"a shape of {len(shp)} dimensions: numpy's arrays have {_MAX_DIMS} at most")
    if shp and min(shp) < 0:
        raise ValueError(f"negative dimensions are not allowed: {shp}")
    # as numpy: the dimensions but the 0s must not overflow either, though the array is empty
    _sized(shp, itemsize * math.prod(n for n in shp if n))
    return shp, itemsize * math.prod(shp)


_MAX_DIMS = 64  # numpy's NPY_MAXDIMS


def _not_a_shape(shape: Any) -> TypeError:
    return TypeError(f"a shape is an int or a sequence of ints, got {shape!r:.200}")


def _sized(shape: tuple[int, ...], nbytes: int) -> int:
    if nbytes > sys.maxsize:
        raise ValueError(f"an array of shape {shape} would be {nbytes} bytes, more than this "
                         "process can address: the shape is wrong")
    return nbytes


def allocated(arr: np.ndarray, torch_dtype: Any) -> Any:
    """What an ``empty()`` hands out for the dtypes :func:`alloc_dtypes` gave: `arr` itself, or a
    tensor of `torch_dtype` over its bytes (bfloat16 and the like are viewed from their bits)."""
    if torch_dtype is None:
        return arr
    import torch

    t = torch.from_numpy(arr)
    return t if t.dtype == torch_dtype else t.view(torch_dtype)
