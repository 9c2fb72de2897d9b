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
    ``_cdata``, torch's ``test_fd_preserve_sharing``).

    Storages we cannot move in place without breaking what already shares
    them are sent as copies: one received from another process (this
    process holds a lease on another owner's block; it cannot lend it on),
    and one a forked child inherited from its parent's pool (swapping it
    would cut the child off from the parent's memory). torch's own shared
    storages (``share_memory_()``) go with no copy, by their fd, as before.

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

import os
import threading
from typing import Any

import numpy as np

from .. import _fork
from . import _owner

__all__ = ["share", "rebuild", "is_ours", "wrap_torch_methods", "receivers_key"]

_U8 = np.dtype(np.uint8)
_lock = threading.Lock()
_moving = threading.Lock()  # held while a storage is looked at and moved
# storages this process's pool holds and pickled: (token, seg, start, nbytes) -> StorageWeakRef
_mine: dict[tuple[int, ...], Any] = {}
# storages received: (pid, token, seg, start, nbytes) -> StorageWeakRef, and their data pointers
_theirs: dict[tuple[int, ...], Any] = {}
_received_at: dict[int, Any] = {}  # data_ptr -> StorageWeakRef (is_shared, and not moved again)
_prune_at = 1024  # entries before the next sweep of dead weak references


def share(st: Any) -> tuple[tuple[Any, ...] | None, bool]:
    """Put CPU storage `st` in the pool in place (Note [A tensor's storage moves into the pool])
    and lease it to a handle: (what ``Owner.place`` returns, or None: no room; external: a
    storage torch shared, named by its own segment)."""
    n = st.nbytes()
    ptr = st.data_ptr()
    ow = _owner.owner()
    if _torch_is_shared(st):
        got = ow.place_shared(_u8(st), st)
        if got is not None:
            return got, True
        return ow.place(_u8(st)), False  # torch's file_system storage: no fd to give, a copy
    if _foreign(ptr, n):
        return ow.place(_u8(st)), False  # a copy: moving it would cut it off from its owner
    with _moving:  # two feeder threads sending one storage move it once (torch locks too)
        ptr = st.data_ptr()
        with ow._lock:
            inside = bool(ow._addrs) and ow._find(ptr, n) is not None
        if not inside:
            _move(ow, st, n)
        got = ow.place(_u8(st))
    if got is not None:
        _remember(_mine, (ow.token, got[0], got[2], n), st)
    return got, False


def _move(ow: Any, st: Any, n: int) -> None:
    """Swap `st`'s data pointer for a pool block's, its bytes copied first."""
    torch = _torch()
    block = ow.empty((n,), _U8)  # a local view: held until the storage dies
    fresh = torch.from_numpy(block).untyped_storage()
    del block
    fresh.copy_(st)
    st._swap_data_ptr_(fresh)  # fresh now holds the old bytes, freed with it


def _u8(st: Any) -> np.ndarray:
    """The storage's bytes as a uint8 array (no copy)."""
    got: np.ndarray = _torch().empty(0, dtype=_torch().uint8).set_(st).numpy()
    return got


def _foreign(ptr: int, n: int) -> bool:
    """Bytes we hold on another owner's lease, or a parent's pool block inherited at fork."""
    if ptr in _received_at and _alive_at(_received_at, ptr):
        return True
    for segs in _owner._inherited:
        for seg in segs:
            if seg.address <= ptr and ptr + n <= seg.address + seg.size:
                return True
    return False


def rebuild(arr: np.ndarray, key: tuple[int, ...]) -> Any:
    """The storage of a handle: `arr` (its bytes, just claimed) or, if a storage of the same
    block range lives here already, that one (`arr` then goes, releasing its lease)."""
    torch = _torch()
    pid, token = key[0], key[1]
    ow = _owner.current_owner()
    if pid == os.getpid() and ow is not None and ow.token == token:
        st = _alive(_mine, (token, *key[2:]))
        if st is not None:
            return st  # the sender's own storage: torch's test_fd_preserve_sharing
    st = _alive(_theirs, key)
    if st is not None:
        return st
    st = torch.from_numpy(arr).untyped_storage()
    with _lock:
        _theirs[key] = _weak(st)
        _received_at[st.data_ptr()] = _theirs[key]
        _maybe_prune()
    return st


def is_ours(st: Any) -> bool:
    """Whether CPU storage `st` lies in our pool or was received from one (Note [is_shared of
    our storages])."""
    n = st.nbytes()
    if n == 0:
        return False
    ptr = st.data_ptr()
    if ptr in _received_at and _alive_at(_received_at, ptr):
        return True
    ow = _owner.current_owner()
    if ow is None or not ow._addrs:
        return False
    with ow._lock:
        return ow._find(ptr, n) is not None


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
        if self.device.type == "cpu" and not their_is_shared(self) and is_ours(self):
            return self  # shared already: torch's no-op
        return their_share(self, *args, **kwargs)

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
    from torch.multiprocessing import reductions

    return reductions.StorageWeakRef(st)  # type: ignore[no-untyped-call]


def _remember(book: dict[tuple[int, ...], Any], key: tuple[int, ...], st: Any) -> None:
    with _lock:
        ref = book.get(key)
        if ref is None or ref.expired():
            book[key] = _weak(st)
            _maybe_prune()


def _alive(book: dict[tuple[int, ...], Any], key: tuple[int, ...]) -> Any:
    with _lock:
        ref = book.get(key)
        if ref is None:
            return None
        st = _torch().UntypedStorage._new_with_weak_ptr(ref.cdata)
        if st is None:
            del book[key]
        return st


def _alive_at(book: dict[int, Any], ptr: int) -> bool:
    with _lock:
        ref = book.get(ptr)
        if ref is None:
            return False
        if ref.expired():
            del book[ptr]
            return False
        return True


def _maybe_prune() -> None:
    """Drop dead weak references once the books grow (under _lock): as torch's shared_cache."""
    global _prune_at
    if len(_mine) + len(_theirs) + len(_received_at) < _prune_at:
        return
    for book in (_mine, _theirs, _received_at):
        for k in [k for k, ref in book.items() if ref.expired()]:
            del book[k]  # type: ignore[arg-type]
    _prune_at = max(1024, 2 * (len(_mine) + len(_theirs) + len(_received_at)))


def receivers_key(handle: tuple[Any, ...]) -> tuple[int, ...]:
    """The (pid, token, segment, start, nbytes) a handle's storage is known by."""
    pid, token, _path, seg_id, _size, start, span = handle[:7]
    return (pid, token, seg_id, start, span)


_torch_mod: Any = None


def _torch() -> Any:
    global _torch_mod
    if _torch_mod is None:
        import torch

        _torch_mod = torch
    return _torch_mod


def _after_fork_in_child() -> None:
    global _lock, _moving
    _lock, _moving = threading.Lock(), threading.Lock()
    # the parent's pool blocks stay foreign to us (_owner._inherited); our received storages are
    # still views of other owners' blocks: _received_at stays; the parent's own handles do not
    _mine.clear()


_fork.on_fork_in_child(6, _after_fork_in_child)
