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
    If the owner is gone or refuses, the storage goes as a copy from our
    own pool (its values; our own tensor stays the owner's memory).

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

from .. import _fork, _native
from . import _owner

__all__ = ["share", "rebuild", "is_ours", "wrap_torch_methods"]

_U8 = np.dtype(np.uint8)
_U8_STR = _U8.str  # a handle's dtype (tensors.encode_dtype of uint8)
_lock = threading.Lock()
_moving = threading.Lock()  # held while a storage is looked at and moved
# storages this process's pool holds and pickled: (token, seg, start, nbytes) -> StorageWeakRef
_mine: dict[tuple[int, ...], Any] = {}
# storages received: (pid, token, seg, start, nbytes) -> StorageWeakRef, and their data pointers
_theirs: dict[tuple[int, ...], Any] = {}
# data_ptr -> (StorageWeakRef, the handle whose lease it holds): is_shared, and Note [Lending on]
_received_at: dict[int, tuple[Any, tuple[Any, ...]]] = {}
_prune_at = 1024  # entries before the next sweep of dead weak references


def share(st: Any) -> tuple[Any, ...] | None:
    """Put CPU storage `st` in the pool in place (Note [A tensor's storage moves into the pool])
    and lease it to a handle: the handle's arguments (``_client.rebuild_array``'s), or None: no
    room in the pool or the lease table."""
    n = st.nbytes()
    ptr = st.data_ptr()
    ow = _owner.owner()
    if _torch_is_shared(st):
        got = ow.place_shared(_u8(st), st)
        if got is not None:
            return _handle(ow.pid, ow.token, ow.path, got, True, ow.sign(got, True))
        return _ours(ow, ow.place(_u8(st)))  # torch's file_system storage: no fd to give, a copy
    received = _received(ptr)
    if received is not None:
        lent = _lend_on(received)
        if lent is not None:
            return lent
        return _ours(ow, ow.place(_u8(st)))  # its owner is gone or refused: a copy
    if _inherited(ptr, n):
        return _ours(ow, ow.place(_u8(st)))  # a copy: moving it would cut it off from the parent
    with _moving:  # two feeder threads sending one storage move it once (torch locks too)
        ptr = st.data_ptr()
        with ow._lock:
            inside = bool(ow._addrs) and ow._find(ptr, n) is not None
        view = _raw(ptr, n) if inside else _move(ow, st, n)
        got = ow.place(view)
    if got is not None:
        _remember(_mine, (ow.token, got[0], got[2], n), st)
    return _ours(ow, got)


def _ours(ow: Any, got: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    return None if got is None else _handle(ow.pid, ow.token, ow.path, got, False, ow.sign(got, False))


def _handle(pid: int, token: int, path: str, got: tuple[Any, ...], external: bool,
            mac: bytes) -> tuple[Any, ...]:
    return (pid, token, path, *got, _U8_STR, (got[3],), external, mac)


def _lend_on(handle: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A new handle on the block of a storage we received (Note [Lending on]); None if its owner
    is gone or will not."""
    from ._client import client
    from ._table import sign

    pid, token, path, seg_id, size, start, span, lo, strides, _slot, _gen = handle[:11]
    external = handle[13]
    try:
        link = client().link(pid, token, path)
        slot, gen = link.lend_again(handle[9], handle[10])
    except Exception:  # noqa: BLE001  (gone, refused, out of fds: the caller sends a copy)
        return None
    got = (seg_id, size, start, span, lo, strides, slot, gen)
    return _handle(pid, token, path, got, external,
                   sign(link.secret, seg_id, size, start, span, lo, slot, gen, external))


def _move(ow: Any, st: Any, n: int) -> np.ndarray:
    """Swap `st`'s data pointer for a pool block's, its bytes copied first; return a raw view of
    the block's bytes (for ``place``: it keeps nothing alive)."""
    block = ow.empty((n,), _U8)  # a local view: held until the storage dies
    fresh = _torch().from_numpy(block).untyped_storage()
    ptr = block.ctypes.data
    del block
    fresh.copy_(st)
    st._swap_data_ptr_(fresh)  # fresh now holds the old bytes, freed with it
    return _raw(ptr, n)


def _raw(ptr: int, n: int) -> np.ndarray:
    """`n` bytes at `ptr` as a uint8 array that holds nothing alive: only while the caller does."""
    return np.ndarray((n,), _U8, buffer=_native.Lease(None, ptr, n))  # type: ignore[arg-type]


def _u8(st: Any) -> np.ndarray:
    """The storage's bytes as a uint8 array (no copy)."""
    got: np.ndarray = _torch().empty(0, dtype=_torch().uint8).set_(st).numpy()
    return got


def _received(ptr: int) -> tuple[Any, ...] | None:
    """The handle by which this process holds the received storage at `ptr`, if it is one."""
    with _lock:
        got = _received_at.get(ptr)
        if got is None:
            return None
        if got[0].expired():
            del _received_at[ptr]
            return None
        return got[1]


def _inherited(ptr: int, n: int) -> bool:
    """Bytes of a parent's pool block, inherited at fork."""
    for segs in _owner._inherited:
        for seg in segs:
            if seg.address <= ptr and ptr + n <= seg.address + seg.size:
                return True
    return False


def rebuild(arr: np.ndarray, handle: tuple[Any, ...]) -> Any:
    """The storage of a handle: `arr` (its bytes, just claimed) or, if a storage of the same
    block range lives here already, that one (`arr` then goes, releasing its lease)."""
    torch = _torch()
    pid, token, _path, seg_id, _size, start, span = handle[:7]
    key = (pid, token, seg_id, start, span)
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
        ref = _theirs[key] = _weak(st)
        _received_at[st.data_ptr()] = (ref, handle)  # the lease it holds: for Note [Lending on]
        _maybe_prune()
    return st


def is_ours(st: Any) -> bool:
    """Whether CPU storage `st` lies in our pool or was received from one (Note [is_shared of
    our storages])."""
    n = st.nbytes()
    if n == 0:
        return False
    ptr = st.data_ptr()
    if _received(ptr) is not None:
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


def _maybe_prune() -> None:
    """Drop dead weak references once the books grow (under _lock): as torch's shared_cache."""
    global _prune_at
    if len(_mine) + len(_theirs) + len(_received_at) < _prune_at:
        return
    for book in (_mine, _theirs):
        for k in [k for k, ref in book.items() if ref.expired()]:
            del book[k]
    for ptr in [p for p, (ref, _) in _received_at.items() if ref.expired()]:
        del _received_at[ptr]
    _prune_at = max(1024, 2 * (len(_mine) + len(_theirs) + len(_received_at)))


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
