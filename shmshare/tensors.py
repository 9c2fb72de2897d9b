"""Array descriptors and nested batches <-> msgpack-able trees.

A batch is a nested dict / list / tuple of arrays (numpy, or CPU torch
tensors) and plain values (None, bool, int, float, str, bytes, numpy
scalars). :func:`encode` turns it into a tree that ``wire`` can send: each
array becomes an :class:`ArrayDesc` (where its bytes lie, dtype, shape,
strides) packed as a msgpack ext, tuples and numpy scalars get exts of their
own so they come back as what they were. :func:`decode` rebuilds the batch,
asking the caller for the memory behind each descriptor.

The tree never carries array data itself: the caller's ``place`` callback
decides where an array's bytes live (a pool block) and returns its
descriptor; the receiver's ``view`` callback returns a buffer over them.
"""

from __future__ import annotations

import ast
import struct
import sys
from functools import lru_cache
from typing import Any, Callable, NamedTuple

import msgpack
import numpy as np
from numpy.lib import format as npformat

__all__ = [
    "ArrayDesc",
    "encode",
    "decode",
    "encode_dtype",
    "decode_dtype",
    "check_shareable",
    "is_torch_tensor",
    "as_numpy",
]

EXT_ARRAY, EXT_TUPLE, EXT_SCALAR = 1, 2, 3
_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_TYPES = frozenset(_PLAIN)
_KEY_TYPES = frozenset((str, int, bytes))


class ArrayDesc(NamedTuple):
    """Where an array's bytes lie and how to view them.

    ``offset`` is the byte offset of element ``[0, ..., 0]`` within segment
    ``segment``; ``strides`` are in bytes and may be negative or zero.
    ``torch_dtype`` is set when the array was a torch tensor (it comes back
    as one); ``block`` names the lease to release when its views die.
    Segment 0 means an empty array with no memory behind it.
    """

    segment: int
    block: int
    offset: int
    dtype: str  # encode_dtype() form
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    torch_dtype: str | None = None

    def pack(self) -> msgpack.ExtType:
        """Return the msgpack ext that carries this descriptor (a fixed binary layout)."""
        ndim = len(self.shape)
        dt = self.dtype.encode()
        tdt = (self.torch_dtype or "").encode()
        head = _HEAD.pack(self.segment, self.block, self.offset, ndim, len(tdt), len(dt))
        dims = _dims(ndim).pack(*self.shape, *self.strides)
        return msgpack.ExtType(EXT_ARRAY, head + dims + tdt + dt)

    @classmethod
    def unpack(cls, data: bytes) -> ArrayDesc:
        """Rebuild a descriptor from an ext's payload (raises ValueError when malformed)."""
        try:
            seg, block, off, ndim, ntdt, ndt = _HEAD.unpack_from(data)
            pos = _HEAD.size + 16 * ndim
            dims = _dims(ndim).unpack_from(data, _HEAD.size)
            tdt = data[pos:pos + ntdt].decode()
            dt = data[pos + ntdt:pos + ntdt + ndt].decode()
            if len(data) != pos + ntdt + ndt:
                raise ValueError(f"{len(data)} bytes, {pos + ntdt + ndt} expected")
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"malformed array descriptor: {exc}") from exc
        return cls(seg, block, off, dt, dims[:ndim], dims[ndim:], tdt or None)

    @property
    def nbytes(self) -> int:
        """Bytes the array's elements span (0 for an empty array)."""
        return span(decode_dtype(self.dtype).itemsize, self.shape, self.strides)[1]


# segment, block, offset, ndim, len(torch dtype), len(dtype); then shape, strides, the two strings
_HEAD = struct.Struct("<QQqBBH")


@lru_cache(maxsize=None)
def _dims(ndim: int) -> struct.Struct:
    return struct.Struct(f"<{2 * ndim}q")


def span(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """Return (lowest byte offset, bytes spanned) of a strided layout, relative to element 0."""
    lo = hi = 0
    for n, st in zip(shape, strides):  # one plain loop: this runs twice for every array sent
        if n == 0:
            return 0, 0
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi - lo + itemsize


def encode(obj: Any, place: Callable[[Any], ArrayDesc]) -> Any:
    """Return `obj` as a msgpack-able tree; `place(array)` gives each array's descriptor.

    Raises TypeError naming the path of anything that cannot be sent.
    """
    return _encode(obj, place, "batch")


def decode(tree: Any, view: Callable[[ArrayDesc], Any]) -> Any:
    """Return the batch that :func:`encode` made `tree` from; `view(desc)` gives each array."""
    if isinstance(tree, msgpack.ExtType):
        if tree.code == EXT_ARRAY:
            return view(ArrayDesc.unpack(tree.data))
        if tree.code == EXT_TUPLE:
            items = msgpack.unpackb(tree.data, raw=False, strict_map_key=False)
            return tuple(decode(x, view) for x in items)
        if tree.code == EXT_SCALAR:
            dt, raw = msgpack.unpackb(tree.data, raw=False)
            return np.frombuffer(raw, dtype=decode_dtype(dt))[0]
        raise ValueError(f"unknown ext code {tree.code} in a batch")
    if isinstance(tree, list):
        return [decode(x, view) for x in tree]
    if isinstance(tree, dict):
        return {k: decode(v, view) for k, v in tree.items()}
    return tree


def _encode(obj: Any, place: Callable[[Any], ArrayDesc], path: str) -> Any:
    t = type(obj)
    if t in _PLAIN_TYPES:  # exact types first: most of a batch, and cheaper than isinstance
        return obj
    if t is np.ndarray:
        return place(obj).pack()
    if t is dict:
        return _encode_dict(obj, place, path)
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, np.ndarray) or is_torch_tensor(obj):
        return place(obj).pack()
    if isinstance(obj, dict):
        return _encode_dict(obj, place, path)
    if isinstance(obj, list):
        return [_encode(v, place, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_encode(v, place, f"{path}[{i}]") for i, v in enumerate(obj)]
        return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
    if isinstance(obj, np.generic):
        check_shareable(obj.dtype, path)
        return msgpack.ExtType(EXT_SCALAR, msgpack.packb(
            [encode_dtype(obj.dtype), obj.tobytes()], use_bin_type=True))
    raise TypeError(f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be sent; "
                    "a batch holds arrays, torch CPU tensors, dict/list/tuple and None, bool, int, "
                    "float, str, bytes (nothing is pickled)")


def _encode_dict(obj: dict[Any, Any], place: Callable[[Any], ArrayDesc], path: str) -> Any:
    out = {}
    for k, v in obj.items():
        if type(k) not in _KEY_TYPES and (isinstance(k, bool)
                                          or not isinstance(k, (str, int, bytes))):
            raise TypeError(f"{path}: dict key {k!r} must be str, int or bytes to be sent")
        out[k] = _encode(v, place, path + "[" + repr(k) + "]") if type(v) not in _PLAIN_TYPES else v
    return out


def check_shareable(dt: np.dtype, path: str = "array") -> None:
    """Raise TypeError if arrays of dtype `dt` cannot live in shared memory."""
    if dt.hasobject:
        raise TypeError(f"{path}: dtype {dt} holds Python object references, which mean nothing "
                        "in another process; convert to a fixed-size dtype (e.g. str -> 'U<n>')")


@lru_cache(maxsize=512)
def encode_dtype(dt: np.dtype) -> str:
    """Return `dt` as a string: its ``.str``, or ``"D"`` + its descr for structured dtypes."""
    if dt.fields is None and dt.subdtype is None:
        return dt.str
    return "D" + repr(npformat.dtype_to_descr(dt))


@lru_cache(maxsize=512)
def decode_dtype(x: str) -> np.dtype:
    """Return the numpy dtype that :func:`encode_dtype` encoded (ValueError when malformed)."""
    try:
        if x.startswith("D"):
            return npformat.descr_to_dtype(ast.literal_eval(x[1:]))
        return np.dtype(x)
    except (TypeError, ValueError, SyntaxError, AttributeError) as exc:
        raise ValueError(f"malformed dtype {x!r}: {exc}") from exc


def is_torch_tensor(obj: Any) -> bool:
    """Return whether `obj` is a torch.Tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_numpy(t: Any) -> tuple[np.ndarray, str | None]:
    """Return (a numpy view of torch tensor or array `t`, torch dtype name or None).

    dtypes numpy lacks (bfloat16, float8) are viewed as same-size integers.
    """
    if isinstance(t, np.ndarray):
        return t, None
    if t.device.type != "cpu":
        raise TypeError(f"a torch tensor on {t.device} cannot go through shared memory; "
                        "move it to the CPU first (or use the CUDA pool)")
    if t.requires_grad:
        t = t.detach()
    name = str(t.dtype).removeprefix("torch.")
    try:
        return t.numpy(), name
    except TypeError:  # no numpy dtype: reinterpret the bits
        import torch

        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(as_int).numpy(), name
