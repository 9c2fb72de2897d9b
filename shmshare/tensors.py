"""Array descriptors and nested batches <-> msgpack bytes.

A batch is a nested dict / list / tuple of arrays (numpy, or CPU torch
tensors) and plain values (None, bool, int, float, str, bytes, numpy
scalars). :func:`encode` (or an :class:`Encoder`, which keeps its packer)
packs it into msgpack bytes: each array becomes an :class:`ArrayDesc` (where
its bytes lie, dtype, shape, strides) packed as a msgpack ext, tuples and
numpy scalars get exts of their own so they come back as what they were.
:func:`decode` rebuilds the batch, asking the caller for the memory behind
each descriptor.

Both walks over the batch run in msgpack's C code (Note [Hot path] in
``shmshare/channel/__init__.py``): Python runs only for the exts. The bytes never carry array data
itself: the caller's ``place`` callback decides where an array's bytes live
(a pool block) and returns its descriptor; the receiver's ``view`` callback
returns a buffer over them.

Note [Tensors to a process without torch]
    A torch tensor's descriptor names its torch dtype. A receiver (a channel
    ``Receiver``, ``Store.get``) makes it a torch tensor only if torch is
    imported in its process already: importing torch to hand a numpy
    program a tensor cost seconds (a ``Store.get`` took 6.7 s, a channel
    receiver stalled its sender 8.3 s) and hundreds of MB. Without torch it
    gets a numpy array over the same bytes (read-only unless the receiver
    maps writable), of the tensor's numpy dtype; a torch dtype numpy has
    not (bfloat16, float8) comes as its bits, an integer array of the same
    width (int16, int8): ``torch.from_numpy(a).view(torch.bfloat16)`` makes it
    the tensor again. ``shmshare.multiprocessing`` keeps torch's own
    behaviour instead (an unpickled tensor is a tensor, torch imported if
    need be), as the drop-in for ``torch.multiprocessing`` must.
"""

from __future__ import annotations

import ast
import collections
import math
import struct
import sys
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import msgpack
import numpy as np
from numpy.lib import format as npformat

__all__ = [
    "ArrayDesc",
    "desc_dtype_bytes",
    "DTYPE_BYTES",
    "Encoder",
    "encode",
    "pack_desc",
    "parse_desc",
    "Layout",
    "decode",
    "encode_dtype",
    "decode_dtype",
    "check_shareable",
    "c_strides",
    "c_bytes",
    "is_torch_tensor",
    "as_numpy",
    "as_torch",
]

EXT_ARRAY, EXT_TUPLE, EXT_SCALAR, EXT_INLINE = 1, 2, 3, 4

# Note [Inline arrays]
#     A small array that would be copied into the sender's pool anyway (not
#     from its ``empty()``, so the receiver gets a snapshot either way) goes
#     by value instead: an EXT_INLINE ext is its C-order descriptor (segment,
#     block and offset 0) followed by its bytes, in the frame itself. No pool
#     block, lease or release is paid for 64 bytes, and the frame still fits a
#     ring slot: the channel inlines at most INLINE_BYTES of arrays a batch
#     (``Sender._place``). The receiver checks the descriptor as any other
#     (:func:`parse_inline`) and hands out a private copy, read-only unless it
#     maps writable (or makes a torch tensor of it, which must be writable).
#     The bytes are every byte of every element as it lies, padding included
#     (:func:`c_bytes`). A batch whose frame would pass max_frame so sends its
#     small arrays by the pool after all; the DataLoader's workers send nothing
#     by value (their batches are shared, and pinned where they lie).


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
        return pack_desc(self.segment, self.block, self.offset, self.dtype.encode(), self.shape,
                         self.strides, (self.torch_dtype or "").encode())

    @classmethod
    def unpack(cls, data: bytes) -> ArrayDesc:
        """Rebuild a descriptor from an ext's payload (raises ValueError when malformed)."""
        seg, block, off, dt, shape, strides, tdt = _fields(data)
        # tuple.__new__: the namedtuple's own __new__ costs as much as the parsing
        return tuple.__new__(cls, (seg, block, off, dt, shape, strides, tdt))

    @property
    def nbytes(self) -> int:
        """Bytes the array's elements span (0 for an empty array)."""
        return span(decode_dtype(self.dtype).itemsize, self.shape, self.strides)[1]


# segment, block, offset, ndim, len(torch dtype), len(dtype); then shape, strides, the two strings
_HEAD = struct.Struct("<QQqBBH")
_WHERE = struct.Struct("<QQq")  # the part that differs between arrays of one layout


class Layout(NamedTuple):
    """A descriptor's layout, checked once and shared by every array that has it."""

    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    torch_dtype: str | None
    lo: int  # lowest byte offset of an element, relative to element 0 (<= 0)
    nbytes: int  # bytes the elements span (0 for an empty array)
    dense: bool  # C-contiguous from element 0: a view needs no offset or strides


def parse_desc(data: bytes) -> tuple[int, int, int, Layout]:
    """Return (segment, block, offset, layout) of an array ext's payload.

    Raises ValueError when malformed. Arrays of one shape, dtype and strides
    share their layout bytes, so each distinct layout is parsed and checked
    once (Note [Hot path]).
    """
    tail = data[_WHERE.size:]
    layout = _layouts.get(tail)
    if layout is None:
        _, _, _, dt, shape, strides, tdt = _fields(data)
        try:
            dtype = decode_dtype(dt)
        except ValueError as exc:
            raise ValueError(f"malformed array descriptor: {exc}") from exc
        # What numpy itself does not survive (a negative dimension of a 0-byte dtype is a
        # SIGFPE inside np.ndarray) is refused here, once per layout.
        if len(shape) > 64 or any(n < 0 for n in shape) or math.prod(shape) >= 1 << 63:
            raise ValueError(f"malformed array descriptor: shape {shape} (at most 64 dimensions, "
                             "none negative, fewer than 2**63 elements)")
        lo, nbytes = span(dtype.itemsize, shape, strides)
        dense = lo == 0 and strides == c_strides(dtype.itemsize, shape) and nbytes > 0
        layout = Layout(dtype, shape, strides, tdt, lo, nbytes, dense)
        if len(tail) <= 1024:  # a long structured dtype is parsed each time, never kept
            if len(_layouts) >= 4096:
                _layouts.clear()  # a peer sending ever new shapes: start over, never grow
            _layouts[tail] = layout
    return (*_WHERE.unpack_from(data), layout)


_layouts: dict[bytes, Layout] = {}


def c_strides(itemsize: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _fields(data: bytes) -> tuple[int, int, int, str, tuple[int, ...], tuple[int, ...], str | None]:
    try:
        seg, block, off, ndim, ntdt, ndt = _HEAD.unpack_from(data)
        if len(data) != _HEAD.size + 16 * ndim + ntdt + ndt:
            raise ValueError(f"{len(data)} bytes, {_HEAD.size + 16 * ndim + ntdt + ndt} expected")
        f = _layout(ndim, ntdt, ndt).unpack(data)
        tdt = f[6 + 2 * ndim].decode()
        dt = f[7 + 2 * ndim].decode()
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"malformed array descriptor: {exc}") from exc
    return seg, block, off, dt, f[6:6 + ndim], f[6 + ndim:6 + 2 * ndim], tdt or None


def span(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """Return (lowest byte offset, bytes spanned) of a strided layout, relative to element 0."""
    lo = hi = 0
    for n, st in zip(shape, strides, strict=True):  # one plain loop: this runs twice for every array sent
        if n == 0:
            return 0, 0
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi - lo + itemsize


class Encoder:
    """Packs batches into msgpack bytes; ``place(array)`` gives each array's descriptor.

    The walk over dicts, lists and plain values is msgpack's C packer's; only
    what it does not know (arrays, tuples, numpy scalars, subclasses) comes
    back here through its ``default`` hook. ``place`` returns an
    :class:`ArrayDesc` or the ext from :func:`pack_desc`. Dict keys may be
    any plain value or tuple of them (they must be hashable to be keys).
    """

    __slots__ = ("_place", "_packer", "_failed")

    def __init__(self, place: Callable[[Any], Any]) -> None:
        self._place = place
        self._packer = msgpack.Packer(default=self._default, use_bin_type=True, strict_types=True)
        self._failed: BaseException | None = None  # what place() raised in this encode()

    def encode(self, obj: Any) -> bytes:
        """Return `obj` as msgpack bytes (TypeError naming the path of what cannot be sent).

        What ``place`` raises comes out as it is (no room in the pool, the
        peer died, the sender was closed, ...), except a TypeError, which is
        about the batch's content and gets its path named.
        """
        self._failed = None
        try:
            return self._packer.pack(obj)
        except (TypeError, ValueError, OverflowError) as exc:
            failed, self._failed = self._failed, None
            if exc is failed and not isinstance(exc, TypeError):
                raise
            raise _explain(obj, exc) from exc
        finally:
            self._failed = None

    def _default(self, o: Any) -> Any:
        t = type(o)
        if t is np.ndarray or isinstance(o, np.ndarray) or is_torch_tensor(o):
            try:
                got = self._place(o)
            except BaseException as exc:
                self._failed = exc
                raise
            return got.pack() if type(got) is ArrayDesc else got
        if isinstance(o, tuple):
            # A list led by the marker (Note [Tuples]); the packer walks the items itself.
            return [_TUPLE_EXT, *tuple.__iter__(o)]
        if isinstance(o, np.generic):
            check_shareable(o.dtype, "a numpy scalar")
            return _ext(EXT_SCALAR, msgpack.packb([encode_dtype(o.dtype), o.tobytes()],
                                                  use_bin_type=True))
        # Subclasses (IntEnum, a str Enum, OrderedDict, ...) go as their base's value, taken
        # with the base's own methods: no __str__/__float__/keys() of theirs runs here.
        for base, value in _BASE_VALUE:
            if isinstance(o, base):
                return value(o)
        raise TypeError(f"a {t.__module__}.{t.__qualname__} cannot be sent")


def encode(obj: Any, place: Callable[[Any], Any]) -> bytes:
    """Return `obj` as msgpack bytes; `place(array)` gives each array's descriptor.

    Raises TypeError naming the path of anything that cannot be sent.
    """
    return Encoder(place).encode(obj)


def decode(data: bytes, view: Callable[[int, int, int, Layout], Any],
           inline: Callable[[Layout, bytes], Any] | None = None) -> Any:
    """Return the batch that :func:`encode` packed into `data`.

    ``view(segment, block, offset, layout)`` gives each array (see
    :func:`parse_desc`); ``inline(layout, data)`` each array sent by value (Note [Inline
    arrays]; without it, one is refused). Raises ValueError for bytes that are not such a batch.
    """
    marks = [0]  # tuple markers unpacked and not yet consumed by a list: 0 at the end

    def hook(code: int, payload: bytes) -> Any:
        if code == EXT_ARRAY:
            return view(*parse_desc(payload))
        if code == EXT_INLINE and inline is not None:
            return inline(*parse_inline(payload))
        if code == EXT_TUPLE and not payload:
            marks[0] += 1
            return _TUPLE_MARK
        if code == EXT_SCALAR:
            return _scalar(payload)
        raise ValueError(f"unknown ext code {code} (or a malformed one) in a batch")

    def tuples(items: list[Any]) -> Any:
        if items and items[0] is _TUPLE_MARK:
            marks[0] -= 1
            return tuple(items[1:])
        return items

    try:
        got = msgpack.unpackb(data, ext_hook=hook, list_hook=tuples, raw=False,
                              strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # msgpack's, or the hook's
        raise ValueError(f"malformed batch: {type(exc).__name__}: {exc}") from exc
    if marks[0]:
        raise ValueError("malformed batch: a tuple marker out of place (Note [Tuples])")
    return got


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    return tuple.__new__(msgpack.ExtType, (code, data))  # its checks cost more than the packing


# Note [Tuples]
#     msgpack has no tuple. A tuple goes as a list whose first item is an
#     empty EXT_TUPLE ext; the unpacker's list_hook turns such lists back into
#     tuples. Packing an ext's payload with a nested packb, and unpacking it
#     with a nested unpackb from inside the ext hook, would be simpler, but
#     each nested unpacker takes ~32 KB of C stack: a tuple nested a few
#     hundred deep -- from any peer -- would crash the receiver with SIGSEGV
#     before Python's recursion limit is reached. This way both walks stay
#     inside one packer/unpacker and their own depth limits.
class _TupleMark:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<shmshare tuple marker out of place: a malformed batch>"


_TUPLE_MARK = _TupleMark()
_TUPLE_EXT = tuple.__new__(msgpack.ExtType, (EXT_TUPLE, b""))
_BaseValue = tuple[type[Any], Callable[[Any], Any]]  # a base type, and how its value is taken
_BASE_VALUE: tuple[_BaseValue, ...] = (
    (collections.OrderedDict, lambda d: dict(collections.OrderedDict.items(d))),
    (dict, lambda d: dict(dict.items(d))), (list, list.copy), (str, str.__str__),
    (int, int.__index__),
    (float, float.__float__), (bytes, bytes.__bytes__))


def _scalar(payload: bytes) -> Any:
    try:
        dt, raw = msgpack.unpackb(payload, raw=False)  # no ext hook: nothing nests in here
        dtype = decode_dtype(dt)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"malformed numpy scalar: {exc}") from exc
    if dtype.hasobject or type(raw) is not bytes or len(raw) != dtype.itemsize:
        raise ValueError(f"malformed numpy scalar of dtype {dtype}: {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)[0] if dtype.itemsize else np.zeros((), dtype)[()]


def _explain(obj: Any, exc: Exception) -> TypeError:
    """Return a TypeError naming where in `obj` the packer's `exc` came from."""
    try:
        found = _find_bad(obj, "batch")
    except RecursionError:
        found = None  # nested deeper than Python walks: the packer's own message says so
    path, why = found or ("batch", f"{type(exc).__name__}: {exc}")
    return TypeError(f"{path}: {why}; a batch holds arrays, torch CPU tensors, dict/list/tuple and "
                     "None, bool, int (64-bit), float, str, bytes (nothing is pickled)")


def _find_bad(obj: Any, path: str) -> tuple[str, str] | None:
    """Return (path, reason) of the first part of `obj` that cannot be sent, or None."""
    t = type(obj)
    if isinstance(obj, bool) or obj is None or isinstance(obj, (float, str, bytes)):
        return None
    if isinstance(obj, int):
        return None if -(1 << 63) <= obj < (1 << 64) else (path, f"{obj} does not fit 64 bits")
    if isinstance(obj, np.ndarray) or is_torch_tensor(obj) or isinstance(obj, np.generic):
        dt = obj.dtype if not is_torch_tensor(obj) else None
        if dt is not None and dt.hasobject:
            return path, f"dtype {dt} holds Python object references"
        return None
    if isinstance(obj, dict):
        for k, v in dict.items(obj):
            bad = _find_bad(k, f"{path} key {k!r}") or _find_bad(v, f"{path}[{k!r}]")
            if bad:
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(list.__iter__(obj) if isinstance(obj, list) else tuple.__iter__(obj)):
            if bad := _find_bad(v, f"{path}[{i}]"):
                return bad
        return None
    return path, f"a {t.__module__}.{t.__qualname__} cannot be sent"


def pack_desc(segment: int, block: int, offset: int, dtype: bytes, shape: tuple[int, ...],
              strides: tuple[int, ...], torch_dtype: bytes = b"") -> msgpack.ExtType:
    """Return the ext of ``ArrayDesc(...).pack()`` without building the descriptor (hot path).

    `dtype` and `torch_dtype` are the encoded strings as ASCII bytes.
    """
    key = (dtype, shape, strides, torch_dtype)
    tail = _tails.get(key)  # what arrays of one layout share, packed once
    if tail is None:
        n = len(shape)
        tail = _layout(n, len(torch_dtype), len(dtype)).pack(
            0, 0, 0, n, len(torch_dtype), len(dtype), *shape, *strides, torch_dtype,
            dtype)[_WHERE.size:]
        if len(_tails) >= 4096:
            _tails.clear()  # ever new shapes: start over rather than grow without bound
        _tails[key] = tail
    return _ext(EXT_ARRAY, _WHERE.pack(segment, block, offset) + tail)


_tails: dict[tuple[bytes, tuple[int, ...], tuple[int, ...], bytes], bytes] = {}


def pack_inline(dtype: bytes, shape: tuple[int, ...], itemsize: int, data: bytes,
                torch_dtype: bytes = b"") -> msgpack.ExtType:
    """The ext of an array sent by value: `data`, its bytes in C order (Note [Inline arrays])."""
    desc = pack_desc(0, 0, 0, dtype, shape, c_strides(itemsize, shape), torch_dtype)
    return _ext(EXT_INLINE, desc.data + data)


def c_bytes(arr: np.ndarray) -> bytes:
    """Every byte of every element of `arr`, in C order: a structured dtype's padding too (numpy's
    tobytes() of a strided structured array copies field by field, leaving the padding whatever
    its new buffer held: this process's memory, sent)."""
    if arr.dtype.fields is None or arr.flags.c_contiguous:
        return arr.tobytes()
    return arr.view(np.dtype((np.void, arr.dtype.itemsize))).tobytes()


def parse_inline(payload: bytes) -> tuple[Layout, bytes]:
    """The layout and bytes of an EXT_INLINE payload; ValueError unless they are a C-order array
    of a fixed-size dtype whose bytes are all there, nothing more."""
    try:
        ndim, ntdt, ndt = _HEAD.unpack_from(payload)[3:]
    except struct.error as exc:
        raise ValueError(f"malformed inline array: {exc}") from None
    n = _HEAD.size + 16 * ndim + ntdt + ndt
    seg, block, off, lay = parse_desc(payload[:n])
    data = payload[n:]
    if seg or block or off or not lay.dense or len(data) != lay.nbytes or lay.dtype.hasobject:
        raise ValueError(f"malformed inline array: {len(data)} bytes for shape {lay.shape} of "
                         f"{lay.dtype} (a C-order array of a fixed-size dtype, its bytes all there)")
    return lay, data


@lru_cache(maxsize=1024)
def _layout(ndim: int, ntdt: int, ndt: int) -> struct.Struct:
    return struct.Struct(f"<QQqBBH{2 * ndim}q{ntdt}s{ndt}s")


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
    except (TypeError, ValueError, SyntaxError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError) as exc:  # what a hostile descr makes numpy raise
        raise ValueError(f"malformed dtype {x!r}: {type(exc).__name__}: {exc}") from exc


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
    if t.layout is not _strided(t):
        raise TypeError(f"a {t.layout} tensor has no one block of memory to share; send "
                        ".to_dense(), or its parts (for a sparse COO tensor: .indices() and "
                        ".values(), with its shape)")
    if t.requires_grad:
        t = t.detach()
    name = str(t.dtype).removeprefix("torch.")
    try:
        return t.numpy(), name
    except TypeError:  # no numpy dtype: reinterpret the bits
        import torch

        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(as_int).numpy(), name


def _strided(t: Any) -> Any:
    import torch

    return torch.strided


def torch_imported() -> bool:
    """Whether this process asked for torch (imported it): a receiver that did not gets a torch
    tensor's bytes as a numpy array, not seconds of ``import torch`` (Note [Tensors to a process
    without torch])."""
    return "torch" in sys.modules


def as_torch(arr: np.ndarray, torch_dtype: str) -> Any:
    """Return a torch tensor sharing `arr`'s memory, of torch dtype `torch_dtype` (a name)."""
    import torch

    t = torch.from_numpy(arr)
    want = vars(torch).get(torch_dtype)  # not getattr: a peer's name must not import a submodule
    if not isinstance(want, torch.dtype):
        raise ValueError(f"{torch_dtype!r} is not a torch dtype")
    return t if t.dtype == want else t.view(want)


def desc_dtype_bytes(dt: np.dtype) -> bytes:
    """Return `dt` as a descriptor's dtype bytes, refusing object dtypes (cached)."""
    check_shareable(dt)
    got = encode_dtype(dt).encode()
    if len(DTYPE_BYTES) < 1024:
        DTYPE_BYTES[dt] = got
    return got


DTYPE_BYTES: dict[np.dtype, bytes] = {}
