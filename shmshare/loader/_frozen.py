"""Read-only containers packed once into sealed shared memory: one copy of a dataset's index, whatever the workers.

Note [One copy of the dataset]
    A dataset that holds a Python list of a million paths is a million str
    objects. A forked worker shares their pages until it touches them, and
    reading an element touches it: its reference count is written, so the
    page is copied into the worker (pytorch issue #13246, "copy-on-read").
    After an epoch every worker holds its own copy of most of the list. Under
    spawn and forkserver each worker unpickles a copy from the start.

    ``share(items)`` packs such a container once into a memfd: the elements'
    bytes one after another, and an ``int64`` array of where each begins.
    The memfd is sealed (no write, no resize) and mapped read-only; the
    container is one Python object over it, and an element is made when it
    is read (a str decoded from its bytes). Nothing per element is a Python
    object that lives on, so nothing is copied by reading: every worker
    maps the same pages.

    Pickled while multiprocessing starts a process (a loader's worker
    under spawn or forkserver, any ``Process``'s arguments), a container
    goes as its fd (``DupFd``): the child maps the same memfd. Under fork
    the child inherits the mapping. Pickled anywhere else (a file, a
    queue), it goes by value and is packed again where it is loaded.

    Kinds (``SharedSequence.kind``):

    * ``"str"``, ``"bytes"``: UTF-8 (with ``surrogatepass``: any str round
      trips, the ``surrogateescape`` of ``os.listdir`` included) or raw bytes.
    * ``"int"``, ``"float"``, ``"bool"``: an ``int64``, ``float64`` or
      ``bool`` array; an element reads as a Python ``int``/``float``/``bool``.
    * ``"ndarray"``: a numpy array given as one (not ``object`` dtype);
      elements are numpy's (rows of it, read-only).
    * ``"arrays"``: numpy arrays of any shapes and dtypes, each element a
      read-only view of the shared pages (no copy).
    * ``"pickle"``: anything else picklable, each element pickled alone and
      unpickled when read (a new object per read).

    ``SharedMapping`` maps str keys to values packed as one of those kinds.
    Lookup hashes the key's UTF-8 (``_native.hash_bytes``: the same in every
    process, unlike ``hash()``) and bisects a sorted ``int64`` array of the
    keys' hashes: no dict, no Python object per key.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

import msgpack
import numpy as np

from .. import _native
from .._fd import Fd
from .._segcalls import memfd_create

__all__ = ["SharedSequence", "SharedMapping", "share"]

_MAGIC = b"shmshare-frozen\x01"
_ALIGN = 64
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_NUMERIC = {int: ("int", np.int64), float: ("float", np.float64), bool: ("bool", np.bool_)}
_KINDS = ("str", "bytes", "int", "float", "bool", "ndarray", "arrays", "pickle")
_ALLOWED: dict[str, tuple[type, ...]] = {"int": (int, np.integer), "float": (int, float, np.integer, np.floating),
                                         "bool": (bool, np.bool_)}
_NONE = object()


class _Packed:
    """One sealed, read-only memfd of named numpy sections, with the fd kept for passing it on."""

    __slots__ = ("fd", "map", "meta", "sections", "nbytes", "__weakref__")

    def __init__(self, fd: Fd, size: int) -> None:
        self.fd = fd
        self.nbytes = size
        self.map = mmap.mmap(fd.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            start = len(_MAGIC) + 8
            if size < start or self.map[:len(_MAGIC)] != _MAGIC:
                raise ValueError("not a shmshare shared container (its header is wrong)")
            hlen = int.from_bytes(self.map[len(_MAGIC):start], "little")
            self.meta: dict[str, Any] = msgpack.unpackb(self.map[start:start + hlen])
            self.sections: dict[str, np.ndarray] = {}
            for name, (offset, dtype, count) in self.meta.pop("sections").items():
                if offset + count * np.dtype(dtype).itemsize > size:
                    raise ValueError(f"shared container section {name!r} runs past its memfd")
                arr = np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)
                self.sections[name] = arr  # read-only: the map is PROT_READ
        except BaseException:
            self.sections = {}
            arr = None  # its export of the map goes before the map
            try:
                self.map.close()
            except BufferError:
                pass  # a view the exception's traceback holds: the map goes with it
            raise

    @classmethod
    def pack(cls, meta: dict[str, Any], sections: dict[str, np.ndarray]) -> _Packed:
        """Write `sections` after a header naming them, seal, map read-only."""
        table: dict[str, list[Any]] = {}
        layout = []
        at = 0  # offsets from the end of the header: fixed up below
        for name, arr in sections.items():
            arr = np.ascontiguousarray(arr)
            at = -(-at // _ALIGN) * _ALIGN
            layout.append((at, arr))
            table[name] = [at, arr.dtype.str, arr.size]
            at += arr.nbytes
        # the header's length depends on the offsets, which depend on it: pad it to a fixed size
        probe = msgpack.packb({**meta, "sections": {k: [1 << 62, d, 1 << 62] for k, (_, d, _) in
                                                    table.items()}})
        base = -(-(len(_MAGIC) + 8 + len(probe)) // _ALIGN) * _ALIGN
        for v in table.values():
            v[0] += base
        header = msgpack.packb({**meta, "sections": table})
        size = base + at
        fd = Fd(memfd_create("shmshare-shared-" + meta["kind"]))
        try:
            os.ftruncate(fd.fileno(), size)
            _write(fd.fileno(), _MAGIC + len(header).to_bytes(8, "little") + header, 0)
            for offset, arr in layout:
                _write(fd.fileno(), arr.reshape(-1).view(np.uint8), base + offset)
            fcntl.fcntl(fd.fileno(), fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, size)
        except BaseException:
            fd.close()
            raise

    @classmethod
    def attach(cls, fd: Fd) -> _Packed:
        """Map a memfd passed from another process, once sure it is sealed against writes."""
        try:
            seals = fcntl.fcntl(fd.fileno(), fcntl.F_GET_SEALS)
            if seals & _SEALS != _SEALS:
                raise ValueError("the fd of a shared container is not sealed read-only; it was not made by share()")
            return cls(fd, os.fstat(fd.fileno()).st_size)
        except BaseException:
            fd.close()
            raise

    def __reduce__(self) -> Any:
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is not None:  # a process is being started: send the fd
            return _attach, (reduction.DupFd(self.fd.fileno()),)
        return _from_bytes, (bytes(self.map),)  # by value, packed again where loaded


def _attach(dup: Any) -> _Packed:
    return _Packed.attach(Fd(dup.detach()))


def _from_bytes(data: bytes) -> _Packed:
    fd = Fd(memfd_create("shmshare-shared"))
    try:
        os.ftruncate(fd.fileno(), len(data))
        _write(fd.fileno(), memoryview(data), 0)
        fcntl.fcntl(fd.fileno(), fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        fd.close()
        raise
    return _Packed.attach(fd)


def _write(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class SharedSequence(Sequence[Any]):
    """A read-only sequence packed once into sealed shared memory (Note [One copy of the dataset]).

    Made by :func:`share`. Indexing, ``len``, iteration and slicing (a list)
    behave as a tuple's; ``kind`` says how the elements are stored;
    ``nbytes`` is the memory it holds, shared by every process that has it.
    """

    __slots__ = ("_packed", "_prefix", "kind", "_n", "_offsets", "_data", "_values", "_extra")

    def __init__(self, packed: _Packed, prefix: str = "") -> None:
        meta = packed.meta[prefix + "seq"] if prefix else packed.meta
        self._packed = packed
        self._prefix = prefix
        self.kind: str = meta["kind"]
        if self.kind not in _KINDS:
            raise ValueError(f"unknown shared container kind {self.kind!r}")
        self._n: int = meta["n"]
        s = packed.sections
        self._offsets: Any = None
        self._data: Any = None
        self._values: Any = None
        self._extra: Any = None
        if self.kind in ("str", "bytes", "pickle", "arrays"):
            self._offsets = s[prefix + "offsets"].data.cast("B").cast("q")  # Python ints, fast
            self._data = s[prefix + "data"].data.cast("B")
            if len(self._offsets) != self._n + 1:
                raise ValueError("a shared container's offsets do not match its length")
        if self.kind == "arrays":
            self._extra = (meta["dtypes"], s[prefix + "codes"], s[prefix + "shape_at"], s[prefix + "shapes"])
        elif self.kind in ("int", "float", "bool"):
            self._values = s[prefix + "values"]
        elif self.kind == "ndarray":
            self._values = s[prefix + "values"].view(_dtype_of(meta["dtype"])).reshape(meta["shape"])

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory behind the container (its memfd, header included)."""
        return self._packed.nbytes

    @property
    def array(self) -> np.ndarray:
        """The values as a read-only numpy array (kinds ``int``, ``float``, ``bool`` and ``ndarray``)."""
        if self._values is None:
            raise TypeError(f"a SharedSequence of kind {self.kind!r} has no single array; index it instead")
        return self._values  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(self._n))]
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"SharedSequence indices must be integers or slices, not "
                            f"{type(index).__name__}") from None
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"SharedSequence index {index} out of range (it has {self._n} elements)")
        return self._get(i)

    def _get(self, i: int) -> Any:
        kind = self.kind
        if self._values is not None:
            v = self._values[i]
            return v if kind == "ndarray" else v.item()
        a, b = self._offsets[i], self._offsets[i + 1]  # ("arrays": b is where the next one starts)
        if kind == "str":
            return str(self._data[a:b], "utf-8", "surrogatepass")
        if kind == "bytes":
            return bytes(self._data[a:b])
        if kind == "pickle":
            return pickle.loads(self._data[a:b])
        dtypes, codes, shape_at, shapes = self._extra
        shape = tuple(shapes[shape_at[i]:shape_at[i + 1]].tolist())
        dtype = _dtype_of(dtypes[codes[i]])
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._data, dtype=dtype, count=count, offset=a).reshape(shape)

    def __iter__(self) -> Iterator[Any]:
        if self._values is not None and self.kind != "ndarray":
            return iter(self._values.tolist())
        return (self._get(i) for i in range(self._n))

    def __reduce__(self) -> Any:
        return SharedSequence, (self._packed, self._prefix)

    def __copy__(self) -> SharedSequence:
        return self  # read-only: a copy would be the same

    def __deepcopy__(self, memo: Any) -> SharedSequence:
        return self

    def __repr__(self) -> str:
        return f"<SharedSequence kind={self.kind!r} len={self._n} nbytes={self.nbytes}>"


class SharedMapping(Mapping[str, Any]):
    """A read-only mapping from str, packed once into sealed shared memory (Note [One copy of the dataset]).

    Made by :func:`share` from a mapping whose keys are all str. Lookup,
    ``in``, ``len``, ``get``, ``keys``/``values``/``items`` (in the order
    given) behave as a dict's; values are stored as one :class:`SharedSequence`.
    """

    __slots__ = ("_packed", "_keys", "_values", "_hashes", "_order")

    def __init__(self, packed: _Packed) -> None:
        self._packed = packed
        self._keys = SharedSequence(packed, "k.")
        self._values = SharedSequence(packed, "v.")
        self._hashes: np.ndarray = packed.sections["hashes"]
        self._order: np.ndarray = packed.sections["order"]
        if self._keys.kind != "str" or not (len(self._keys) == len(self._values) == len(self._hashes)
                                            == len(self._order)):
            raise ValueError("a shared mapping's sections do not match")

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory behind the mapping (its memfd, header included)."""
        return self._packed.nbytes

    @property
    def values_kind(self) -> str:
        """How the values are stored (a :class:`SharedSequence` kind)."""
        return self._values.kind

    def _find(self, key: Any) -> int:
        if type(key) is not str:
            if not isinstance(key, str):
                return -1
            key = str(key)
        keys = self._keys
        return _native.find_key(key.encode("utf-8", "surrogatepass"), self._hashes, self._order,
                                keys._offsets, keys._data)

    def __getitem__(self, key: str) -> Any:
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        return self._values._get(i)

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __reduce__(self) -> Any:
        return SharedMapping, (self._packed,)

    def __copy__(self) -> SharedMapping:
        return self

    def __deepcopy__(self, memo: Any) -> SharedMapping:
        return self

    def __repr__(self) -> str:
        return (f"<SharedMapping len={len(self)} values_kind={self.values_kind!r} "
                f"nbytes={self.nbytes}>")


def share(items: Iterable[Any] | Mapping[str, Any], kind: str | None = None) -> Any:
    """Pack `items` once into sealed, read-only shared memory; return a container over it.

    Parameters
    ----------
    items
        A sequence (any iterable) of str, of bytes, of ints, of floats, of
        bools, of numpy arrays, or of anything picklable; a numpy array; or
        a mapping whose keys are all str (a ``dict``).
    kind
        How to store the elements (values, for a mapping): one of
        ``"str"``, ``"bytes"``, ``"int"``, ``"float"``, ``"bool"``,
        ``"arrays"``, ``"pickle"``. By default the narrowest that holds every
        element exactly: ``"pickle"`` for a mix of types, for ints past
        int64, for tuples and other objects.

    Returns
    -------
    SharedSequence or SharedMapping
        Read-only, one Python object, usable in forked and spawned
        processes without a copy per process (Note [One copy of the dataset]).

    Raises
    ------
    TypeError
        If `items` is a str or bytes (share a list of them), a mapping with
        keys that are not str, or elements that `kind` cannot hold.
    ValueError
        If `kind` is not one of the kinds.
    """
    if (kind is not None and kind not in _KINDS) or kind == "ndarray":
        raise ValueError(f"kind must be one of {', '.join(k for k in _KINDS if k != 'ndarray')} "
                         f"or None (chosen from the elements), not {kind!r}")
    if isinstance(items, (SharedSequence, SharedMapping)):
        return items
    if isinstance(items, (str, bytes, bytearray)):
        raise TypeError(f"share() takes a collection of elements, not one {type(items).__name__}; "
                        "share a list of them")
    if isinstance(items, Mapping):
        return _share_mapping(items, kind)
    if type(items).__module__.startswith("torch") and hasattr(items, "numpy"):  # a tensor: as its array
        tensor: Any = items
        if tensor.device.type != "cpu":
            raise TypeError(f"share() packs host memory; this tensor is on {tensor.device}: pass tensor.cpu()")
        items = tensor.detach().numpy()
    if isinstance(items, np.ndarray) and items.ndim == 0:
        raise TypeError("share() takes a collection; a 0-d array is one value: share(x.reshape(1)) or share([x])")
    if isinstance(items, np.ndarray) and kind is None:
        if items.dtype.hasobject:
            items = items.tolist()
        else:
            return SharedSequence(_Packed.pack({"kind": "ndarray", "n": len(items), "shape": list(items.shape),
                                                "dtype": _dtype_code(items.dtype)},
                                               {"values": items.reshape(-1).view(np.uint8)}))
    meta, sections = _pack_seq(list(items), kind, "")
    return SharedSequence(_Packed.pack(meta, sections))


def _share_mapping(items: Mapping[Any, Any], kind: str | None) -> SharedMapping:
    keys = list(items.keys())
    bad = next((k for k in keys if type(k) is not str), _NONE)
    if bad is not _NONE:
        raise TypeError(f"share() of a mapping takes str keys only; {bad!r} is a "
                        f"{type(bad).__name__}. Convert the keys (str(k)), or share a list of the values")
    kmeta, ksec = _pack_seq(keys, "str", "k.")
    vmeta, vsec = _pack_seq([items[k] for k in keys], kind, "v.")
    hashes = np.empty(len(keys), np.int64)
    _native.hash_spans(ksec["k.data"], ksec["k.offsets"], hashes)
    order = np.argsort(hashes, kind="stable")
    sections = {**ksec, **vsec, "hashes": hashes[order], "order": order.astype(np.int64)}
    return SharedMapping(_Packed.pack({"kind": "mapping", "k.seq": kmeta, "v.seq": vmeta}, sections))


def _pack_seq(items: list[Any], kind: str | None, prefix: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    kind = kind or _kind_of(items)
    n = len(items)
    meta: dict[str, Any] = {"kind": kind, "n": n}
    if kind in ("int", "float", "bool"):
        allowed = _ALLOWED[kind]
        bad = next((x for x in items if not isinstance(x, allowed)
                    or (kind != "bool" and isinstance(x, (bool, np.bool_)))), _NONE)
        if bad is not _NONE:
            raise TypeError(f"share(kind={kind!r}) needs every element to be a {kind}, and "
                            f"{bad!r} is a {type(bad).__name__}: convert it first, or use kind='pickle'")
        dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_}[kind]
        try:
            values: np.ndarray = np.array(items, dtype=dtype) if n else np.empty(0, dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"share(kind={kind!r}) needs every element to be a {kind}: {exc}") from None
        if values.shape != (n,):
            raise TypeError(f"share(kind={kind!r}) needs scalars; got elements of shape {values.shape[1:]}")
        return meta, {prefix + "values": values}
    if kind == "arrays":
        return _pack_arrays(items, meta, prefix)
    if kind == "str":
        if not all(type(s) is str or isinstance(s, str) for s in items):
            raise TypeError("share(kind='str') needs every element to be a str")
        blobs = [s.encode("utf-8", "surrogatepass") for s in items]
    elif kind == "bytes":
        if not all(isinstance(b, (bytes, bytearray, memoryview)) for b in items):
            raise TypeError("share(kind='bytes') needs every element to be bytes")
        blobs = [bytes(b) for b in items]
    else:
        blobs = [pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in items]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(map(len, blobs), np.int64, count=n), out=offsets[1:])
    data = np.frombuffer(b"".join(blobs), np.uint8)
    return meta, {prefix + "offsets": offsets, prefix + "data": data}


def _pack_arrays(items: list[Any], meta: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    arrays = []
    for a in items:
        if not isinstance(a, np.ndarray) or a.dtype.hasobject:
            raise TypeError("share(kind='arrays') needs every element to be a numpy array of a "
                            f"non-object dtype, not {type(a).__name__}; use kind='pickle'")
        arrays.append(a if a.flags.c_contiguous else a.copy(order="C"))  # (ascontiguousarray makes 0-d 1-d)
    dtypes: list[str] = []
    index: dict[str, int] = {}
    codes = np.empty(len(arrays), np.int64)
    shape_at = np.zeros(len(arrays) + 1, np.int64)
    offsets = np.zeros(len(arrays) + 1, np.int64)
    at = 0
    for i, a in enumerate(arrays):
        code = _dtype_code(a.dtype)
        key = repr(code)
        codes[i] = index.setdefault(key, len(dtypes))
        if codes[i] == len(dtypes):
            dtypes.append(code)
        shape_at[i + 1] = shape_at[i] + a.ndim
        at = -(-at // 16) * 16  # each element aligned for its dtype
        offsets[i] = at
        at += a.nbytes
    offsets[-1] = at
    shapes = np.fromiter((d for a in arrays for d in a.shape), np.int64, count=int(shape_at[-1]))
    data = np.zeros(at, np.uint8)
    for i, a in enumerate(arrays):
        data[offsets[i]:offsets[i] + a.nbytes] = np.frombuffer(a.tobytes(), np.uint8)
    meta["dtypes"] = dtypes
    return meta, {prefix + "offsets": offsets, prefix + "data": data, prefix + "codes": codes,
                  prefix + "shape_at": shape_at, prefix + "shapes": shapes}


def _dtype_code(dtype: np.dtype[Any]) -> Any:
    """A dtype as header data: its str, or its description where it has fields (a struct) or a subarray."""
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str
    return ["descr", np.lib.format.dtype_to_descr(dtype)]


def _dtype_of(code: Any) -> np.dtype[Any]:
    if isinstance(code, str):
        return np.dtype(code)
    return np.lib.format.descr_to_dtype(_tuples(code[1]))


def _tuples(descr: Any) -> Any:
    """msgpack gives lists where numpy's descriptions have tuples."""
    if isinstance(descr, list):
        if descr and all(isinstance(f, list) for f in descr):
            return [tuple(_tuples(x) for x in f) for f in descr]
        return [tuple(_tuples(x) for x in f) if isinstance(f, list) else f for f in descr]
    return descr


def _kind_of(items: list[Any]) -> str:
    types = {type(x) for x in items}
    if not types:
        return "pickle"
    if len(types) == 1:
        t = types.pop()
        if t is str:
            return "str"
        if t is bytes:
            return "bytes"
        if t in _NUMERIC:
            if t is int and not all(-(1 << 63) <= x < (1 << 63) for x in items):
                return "pickle"
            return _NUMERIC[t][0]
        if t is np.ndarray and not any(a.dtype.hasobject for a in items):
            return "arrays"
        if issubclass(t, np.bool_):
            return "bool"
        if issubclass(t, np.integer) and np.can_cast(t, np.int64):
            return "int"  # (list(series) and the like: read back as Python ints)
        if issubclass(t, np.floating) and np.can_cast(t, np.float64):
            return "float"
    return "pickle"


