"""What an ``empty()`` or ``zeros()`` takes and hands out, as numpy's take them: a numpy or
torch dtype, a shape of ints; an array, or a torch tensor over its bytes. The channel's
sender, the multiprocessing drop-in and the store's client share them; the hot path looks
each dtype up in a cache.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any

import numpy as np

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
    bytes; ValueError for a negative dimension or more bytes than an address space has, as
    numpy's."""
    if type(shape) is int and shape >= 0:
        return (shape,), _sized((shape,), itemsize * shape)
    if type(shape) is tuple:  # the usual case, kept short (an empty()'s costliest line was here)
        try:
            shp = tuple(map(operator.index, shape))
        except TypeError:
            raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}") from None
        if shp and min(shp) < 0:
            raise ValueError(f"negative dimensions are not allowed: {shp}")
        return shp, _sized(shp, itemsize * math.prod(shp))
    try:  # as numpy takes them: ints, and objects with __index__ (np.int64), never str or float
        shp = (operator.index(shape),) if not hasattr(shape, "__iter__") else tuple(
            operator.index(n) for n in shape)
    except TypeError:
        raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}") from None
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}")
    if any(n < 0 for n in shp):
        raise ValueError(f"negative dimensions are not allowed: {shp}")
    return shp, _sized(shp, itemsize * math.prod(shp))


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
