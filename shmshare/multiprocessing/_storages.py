"""torch's semantics for CPU tensors: the storage itself becomes shared, over our pool.

Note [A tensor's storage moves into the pool]
    torch.multiprocessing moves a CPU tensor's storage into shared memory
    when it is pickled (``share_memory_()`` inside its reducer), so the
    sender and every receiver write the same memory, and every view of
    that storage follows, the ones not sent included. We do the same over
    our own pool: the storage's bytes are copied into a block once and the
    storage's data pointer is swapped for the block's
    (``UntypedStorage._swap_data_ptr_``, the in-place exchange torch's own
    ``share_memory_()`` does), so the ``StorageImpl`` that all views share
    now lies in the pool. No fd per storage: the block lies in a pooled
    segment whose fd crosses once per peer, and the handle is the
    channel's (a slot, a signature). The block's local view is the swapped
    storage's data pointer itself (a numpy array over our ``Lease``, held by
    torch's deleter): when the last tensor of the storage dies, the view
    dies, and the block comes back once no receiver holds it either.

    A handle names the whole storage (its block range) and carries the
    tensor's dtype, storage offset, sizes and strides, as torch's does. A
    receiver keeps one storage per (owner, block range) while any view of it
    lives (``StorageWeakRef``, as torch's ``shared_cache``), so views sent
    in one message or across messages alias each other; in the process that
    sent it, a handle gives back the original storage itself (its
    ``_cdata``, torch's ``test_fd_preserve_sharing``). A storage made on the
    receiver is made from a tensor (``torch.from_numpy``); when the tensor
    sent is all of that storage, in a dtype numpy has, with no grad, that
    tensor is the one that arrives, rather than a second one ``set_()`` on
    the storage: the same dtype, sizes, strides and storage.

    A storage inherited by a forked child from its parent's pool is sent as
    a copy: swapping it would cut the child off from the parent's memory,
    and the parent's leases are not the child's to lend. torch's own shared
    storages (``share_memory_()``) go with no copy, by their fd, as before.

Note [Lending on]
    A storage this process received (it holds a lease, a claimed slot, on
    another owner's block) and now sends on -- a Pool worker returning the
    tensor it was given, a stage of a pipeline passing it along -- must name
    the same memory, as torch's fd does. Only the owner can issue a slot, so
    the sender asks it over the link it already has (``{"k": "l"}``, one
    round trip): the owner checks that this process's claim map marks the
    slot and that the slot is claimed, and leases the same block to a new
    slot. The handle then names the original owner, and whoever unpickles
    it claims that slot as usual; in the owner's own process it becomes the
    original storage again. A request for a slot the peer does not hold is
    refused and lends nothing: a lease only ever adds to what pins a block.
    If the owner has exited (its keeper would serve the new handle only for
    its linger) or refuses (Note [Lends and who asked] in ``_books.py``),
    the storage goes as a copy from our own pool (its values; our own
    tensor stays the owner's memory).

Note [is_shared of our storages]
    torch's ``is_shared()`` is true only for its own ``MapAllocator``
    storages, and ``share_memory_()`` would move any other storage into a
    fresh torch segment, in place, silently ending its sharing with every
    process that holds our block. So ``UntypedStorage.is_shared`` and
    ``UntypedStorage.share_memory_`` are wrapped when the reducers are
    registered: for a storage in our pool or received from it, ``is_shared()``
    is True and ``share_memory_()`` leaves it where it is (torch's documented
    no-op for a storage already shared); every other storage gets torch's
    own methods, unchanged.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .. import _fork, _native
from .._errors import PoolExhausted, ShmshareError
from . import _owner
from ._common import alive

__all__ = ["share", "rebuild", "is_ours", "wrap_torch_methods", "Unshareable"]


class Unshareable(ShmshareError):
    """A storage shared already that cannot get a handle: sent any other way, it would stop
    being shared, with no error, with those who share it."""


Unshareable.__module__ = "shmshare.multiprocessing"

_U8 = np.dtype(np.uint8)
_U8_STR = _U8.str  # a handle's dtype (tensors.encode_dtype of uint8)
_lock = threading.Lock()
# storages this process's pool holds and pickled: (token, seg, start, nbytes) -> StorageWeakRef
_mine: dict[tuple[int, ...], Any] = {}
# storages received: (pid, token, seg, start, nbytes) -> StorageWeakRef
_theirs: dict[tuple[int, ...], Any] = {}
# (data_ptr, nbytes) -> (StorageWeakRef, the handle whose lease it holds): is_shared, Note [Lending on]
_received_at: dict[tuple[int, int], tuple[Any, tuple[Any, ...]]] = {}
# (data_ptr, nbytes) -> StorageWeakRef of the storages we moved, whatever owner (closed since or not)
_moved_at: dict[tuple[int, ...], Any] = {}
_prune_at = 1024  # entries before the next sweep of dead weak references
_added = 0  # entries put in the books since the last look at their sizes


def share(st: Any) -> tuple[Any, ...] | None:
    """Put CPU storage `st` in the pool in place (Note [A tensor's storage moves into the pool])
    and lease it to a handle: the handle's arguments (``_client.rebuild_array``'s), or None: a
    plain storage for which the pool or the lease table has no room (torch's reducer may move it
    instead). A storage already shared that cannot get a handle raises: moved by torch's reducer,
    it would silently stop being shared with those who hold it."""
    ow = _owner.owner()
    missed = 0  # where the storage's bytes were when our pool was found not to hold them
    if ow.pool.addrs:  # in our pool already (mp.empty(), an earlier send): nothing moves, no lock
        ptr = st.data_ptr()
        inside, got = ow.place_bytes(ptr, st.nbytes())
        if inside:
            return _or_raise(_ours(ow, got), ow)
        missed = ptr
    global _protected
    if _protected is None:
        _protected = _lock_protected()(_share)
    return _protected(st, ow, missed)  # type: ignore[no-any-return]


_protected: Any = None  # _share under torch's per-storage lock, made once


def _share(st: Any, ow: Any, missed: int) -> tuple[Any, ...] | None:
    if ow.closed:  # shut down while we waited for the storage's lock: this process's new one
        ow, missed = _owner.owner(), 0
    n = st.nbytes()
    ptr = st.data_ptr()
    if _torch_is_shared(st):
        try:
            fd = st._get_shared_fd()
        except RuntimeError:
            fd = -1
        if fd < 0:
            raise Unshareable(
                "a tensor whose storage torch maps from a file or shares by name (torch.from_file("
                "shared=True), or the file_system strategy) has no fd to share: a copy would lose "
                "the writes of either side. Send it under torch's file_system strategy "
                "(mp.set_sharing_strategy('file_system')), or send .clone() for its values")
        got = ow.place_shared(_u8(st), st)
        return _or_raise(_handle(ow.pid, ow.token, ow.path, got, True, ow.sign(got, True))
                         if got is not None else None, ow)
    received = _received(ptr, n)
    if received is not None:
        lent = _lend_on(received)
        if lent is not None:
            return lent
        return _or_raise(_ours(ow, ow.place(_u8(st))), ow)  # its owner is gone or refused: a copy
    # bytes at the address share() found outside the pool are outside it still (only a move, by
    # whoever held the storage's lock before us, changes where they are)
    inside, got = ow.place_bytes(ptr, n) if ow.pool.addrs and ptr != missed else (False, None)
    if inside:  # from mp.empty(), or moved by an earlier send
        return _or_raise(_ours(ow, got), ow)
    if _inherited(ptr, n) or _alive_at(_moved_at, (ptr, n)):
        # a parent's block inherited at fork, or a block of an owner shut down since: a copy
        # (moving it would cut it off from whoever shares it; lending it is not ours to do)
        return _or_raise(_ours(ow, ow.place(_u8(st))), ow)
    if ow.table.used >= ow.table.slots:
        return None  # no slot for it: not moved, so torch's reducer may share it its own way
    got = _move(ow, st, n)
    if got is None:
        # the move is done, its storage ours: no handle now must not hand it to torch's reducer
        return _or_raise(None, ow)
    ref = _weak(st)  # one weak reference, in both books
    with _lock:
        _mine[ow.token, got[0], got[2], n] = ref
        _moved_at[st.data_ptr(), n] = ref
        _maybe_prune(2)
    return _ours(ow, got)


class _NoRoom(Unshareable, PoolExhausted):
    """Shown as shmshare.PoolExhausted; caught as either."""


_NoRoom.__module__, _NoRoom.__qualname__, _NoRoom.__name__ = "shmshare", "PoolExhausted", "PoolExhausted"


def _or_raise(handle: tuple[Any, ...] | None, ow: Any) -> tuple[Any, ...]:
    if handle is None:
        raise _NoRoom(
            f"pid {ow.pid} cannot hand out another handle to its shared memory (the lease table has "
            f"{ow.table.slots} slots, {ow.table.used} of them out, or the pool is full) and this "
            "tensor's storage is shared already, so it cannot go another way: let the receivers "
            "take (unpickle) what was sent before sending more")
    return handle


def _lock_protected() -> Any:
    """torch's per-storage lock of ``share_memory_()`` (one move of a storage at a time, theirs or
    ours), or a plain lock where this torch has none."""
    global _protect
    if _protect is None:
        got = getattr(_torch().storage, "_share_memory_lock_protected", None)
        if got is None:
            fallback = threading.RLock()

            def got(fn: Any) -> Any:
                def locked(*args: Any) -> Any:
                    with fallback:
                        return fn(*args)
                return locked
        _protect = got
    return _protect


_protect: Any = None


def _ours(ow: Any, got: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    return None if got is None else _handle(ow.pid, ow.token, ow.path, got, False, ow.sign(got, False))


def _handle(pid: int, token: int, path: str, got: tuple[Any, ...], external: bool,
            mac: bytes) -> tuple[Any, ...]:
    return (pid, token, path, *got, _U8_STR, (got[3],), external, mac)


def _lend_on(handle: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A new handle on the block of a storage we received (Note [Lending on]); None if its owner
    is gone or will not."""
    from ._client import client

    pid, token, path, seg_id, size, start, span, lo, strides, _slot, _gen = handle[:11]
    external = handle[13]
    if not alive(pid):
        return None  # its keeper may serve a lend, but only for its linger: a copy of ours lives on
    try:
        link = client().link(pid, token, path)
        slot, gen = link.lend_again(handle[9], handle[10])
    except Exception:  # noqa: BLE001  (gone, refused, out of fds: the caller sends a copy)
        return None
    got = (seg_id, size, start, span, lo, strides, slot, gen)
    return _handle(pid, token, path, got, external,
                   link.sign(seg_id, size, start, span, lo, slot, gen, external))


def _move(ow: Any, st: Any, n: int) -> tuple[Any, ...] | None:
    """Swap `st`'s data pointer for a pool block's, its bytes copied first, and lease the block:
    ``place``'s tuple, or None (no slot: the storage is moved all the same)."""
    block, held = ow.take_local(n)  # a local view: held until the storage dies
    fresh = _torch().from_numpy(block).untyped_storage()
    del block
    if n < _SMALL_COPY:  # a memcpy: torch's copy_() costs several times that to dispatch
        memoryview(_native.Lease(None, held.block.address, n))[:] = _native.Lease(None, st.data_ptr(), n)
    else:
        fresh.copy_(st)  # torch's, on its threads
    st._swap_data_ptr_(fresh)  # fresh now holds the old bytes, freed with it
    return ow.place_bytes(held.block.address, n, held)[1]  # type: ignore[no-any-return]


_SMALL_COPY = 1 << 20  # bytes: a storage this small is copied into the pool by memoryview


def _u8(st: Any) -> np.ndarray:
    """The storage's bytes as a uint8 array (no copy)."""
    got: np.ndarray = _torch().empty(0, dtype=_torch().uint8).set_(st).numpy()
    return got


def _received(ptr: int, n: int) -> tuple[Any, ...] | None:
    """The handle by which this process holds the received storage at `ptr`, if it is one."""
    if (ptr, n) not in _received_at:  # the common case, without the lock (one dict lookup)
        return None
    with _lock:
        got = _received_at.get((ptr, n))
        if got is None:
            return None
        if got[0].expired():
            del _received_at[ptr, n]
            return None
        return got[1]


def _alive_at(book: dict[tuple[int, ...], Any], key: tuple[int, ...]) -> bool:
    if key not in book:  # the common case, without the lock
        return False
    with _lock:
        ref = book.get(key)
        if ref is None:
            return False
        if ref.expired():
            del book[key]
            return False
        return True


def _inherited(ptr: int, n: int) -> bool:
    """Bytes of a parent's pool block, inherited at fork."""
    for segs in _owner._inherited:
        for seg in segs:
            if seg.address <= ptr and ptr + n <= seg.address + seg.size:
                return True
    return False


def rebuild(arr: np.ndarray, handle: tuple[Any, ...],
            elements: np.dtype | None = None) -> tuple[Any, Any | None]:
    """The storage of a handle: `arr` (its bytes, just claimed) or, if a storage of the same
    block range lives here already, that one (`arr` then goes, releasing its lease); and, for
    a storage made just now with `elements` given, the tensor of those elements over all of it
    that it was made from (None otherwise)."""
    torch = _torch()
    pid, token, _path, seg_id, _size, start, span = handle[:7]
    key = (pid, token, seg_id, start, span)
    ow = _owner.current_owner()  # this process's, if any
    if ow is not None and pid == ow.pid and ow.token == token:
        st = _alive(_mine, (token, *key[2:]))
        if st is not None and _at_block(ow, st, seg_id, start, span):
            return st, None  # the sender's own storage: torch's test_fd_preserve_sharing
    st = _alive(_theirs, key)
    if st is not None and st.data_ptr() == _native.extent(arr)[0] and st.nbytes() == span:
        return st, None  # (a storage of a mapping since dropped and made again is not this one)
    whole = torch.from_numpy(arr if elements is None else arr.view(elements))
    st = whole.untyped_storage()
    ref = _weak(st)
    with _lock:
        _theirs[key] = ref
        _received_at[st.data_ptr(), span] = (ref, handle)  # the lease it holds: Note [Lending on]
        _maybe_prune(2)
    return st, None if elements is None else whole


def numpy_dtype(dtype: Any) -> np.dtype | None:
    """numpy's dtype of torch `dtype`'s elements, if numpy has one (torch.from_numpy makes it)."""
    global _numpy_dtypes
    if _numpy_dtypes is None:
        torch, got = _torch(), {}
        for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                     "float16", "float32", "float64", "complex64", "complex128"):
            try:
                got[torch.from_numpy(np.zeros(1, name)).dtype] = np.dtype(name)
            except TypeError:
                continue  # a torch without it
        _numpy_dtypes = got
    return _numpy_dtypes.get(dtype)


_numpy_dtypes: dict[Any, np.dtype] | None = None


def _at_block(ow: Any, st: Any, seg_id: int, start: int, span: int) -> bool:
    """Whether our own storage `st` still lies at (seg_id, start) of our pool, `span` bytes."""
    ptr = st.data_ptr()
    with ow._lock:
        held = ow.pool.find(ptr, span) if ow.pool.addrs else None
        return held is not None and held.seg.id == seg_id and ptr - held.seg.address == start \
            and st.nbytes() == span


def is_ours(st: Any) -> bool:
    """Whether CPU storage `st` lies in shared memory of ours: moved into a pool, received from
    one, or inherited at fork from a parent's (Note [is_shared of our storages])."""
    n = st.nbytes()
    if n == 0:
        return False
    ptr = st.data_ptr()
    if _received(ptr, n) is not None or _alive_at(_moved_at, (ptr, n)) or _inherited(ptr, n):
        return True
    ow = _owner.current_owner()
    if ow is None or not ow.pool.addrs:
        return False
    with ow._lock:
        return ow.pool.find(ptr, n) is not None  # from mp.empty()


# -- torch's methods, wrapped (Note [is_shared of our storages]) -------------------------

_wrapped = False


def wrap_torch_methods() -> None:
    global _wrapped
    if _wrapped:
        return
    torch = _torch()
    cls = torch.UntypedStorage
    their_is_shared, their_share = cls.is_shared, cls.share_memory_

    def is_shared(self: Any) -> bool:
        if their_is_shared(self):
            return True
        return self.device.type == "cpu" and is_ours(self)

    def share_memory_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.device.type != "cpu":
            return their_share(self, *args, **kwargs)
        return _lock_protected()(_share_memory_)(self, their_share, args, kwargs)

    def _share_memory_(self: Any, theirs: Any, args: Any, kwargs: Any) -> Any:
        # under the storage's lock: a move of ours (a Queue's feeder) finishes first, or waits
        if not their_is_shared(self) and is_ours(self):
            return self  # shared already: torch's no-op
        return theirs(self, *args, **kwargs)

    is_shared.__doc__ = their_is_shared.__doc__
    share_memory_.__doc__ = their_share.__doc__
    cls.is_shared = is_shared
    cls.share_memory_ = share_memory_
    _wrapped = True


def _torch_is_shared(st: Any) -> bool:
    """torch's own answer (its MapAllocator storages), not our wrapper's."""
    return bool(_torch()._C.StorageBase.is_shared(st))


# -- weak references -----------------------------------------------------------------


def _weak(st: Any) -> Any:
    global _weak_ref
    if _weak_ref is None:
        from torch.multiprocessing import reductions

        _weak_ref = reductions.StorageWeakRef
    return _weak_ref(st)


_weak_ref: Any = None  # torch's StorageWeakRef, looked up once


def _alive(book: dict[tuple[int, ...], Any], key: tuple[int, ...]) -> Any:
    if key not in book:  # the common case, without the lock
        return None
    with _lock:
        ref = book.get(key)
        if ref is None:
            return None
        st = _torch().UntypedStorage._new_with_weak_ptr(ref.cdata)
        if st is None:
            del book[key]
        return st


def _maybe_prune(added: int) -> None:
    """Drop dead weak references once the books grow (under _lock): as torch's shared_cache.
    `added`: entries just put in (counted, not summed, until a sweep may be due)."""
    global _prune_at, _added
    _added += added
    if _added < _prune_at // 4:
        return  # at most that many new keys since the last look: the books cannot be past it yet
    _added = 0
    books: tuple[dict[Any, Any], ...] = (_mine, _theirs, _moved_at)
    if sum(map(len, books)) + len(_received_at) < _prune_at:
        return
    for book in books:
        for k in [k for k, ref in book.items() if ref.expired()]:
            del book[k]
    for k in [k for k, (ref, _) in _received_at.items() if ref.expired()]:
        del _received_at[k]
    _prune_at = max(1024, 2 * (sum(map(len, books)) + len(_received_at)))


_torch_mod: Any = None


def _torch() -> Any:
    """torch, with torch.multiprocessing's reductions (imported on first use: numpy-only users
    of this package never import torch)."""
    global _torch_mod
    if _torch_mod is None:
        import torch
        import torch.multiprocessing.reductions

        _torch_mod = torch
    return _torch_mod


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    # the parent's pool blocks stay foreign to us (_owner._inherited); our received storages are
    # still views of other owners' blocks: _received_at stays; the parent's own handles do not
    _mine.clear()


_fork.on_fork_in_child(6, _after_fork_in_child)
