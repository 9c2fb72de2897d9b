"""Making objects: the daemon's put, create and seal, and the checks and memory behind them.

Each function takes the Server first (Note [One thread]: no lock). A request is refused
before anything is let go of -- the object a put replaces, or an evicted one -- so a refusal
leaves the store as it was.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .. import _native
from .._errors import ProtocolError
from .._fd import Fd
from .._plane.trust import check_fd
from ..memory._policy import MIN_LARGE_ALLOC
from ..memory._shm import _new_id
from ..tensors import decode
from ._objects import HostFull, Obj, daemon_refusal
from ._packing import SEALS, allocate_pages, new_memfd, torch_dtype_problem
from ._protocol import (
    BAD,
    EXISTS,
    LARGE,
    MAX_META,
    NOT_FOUND,
    NOT_YOURS,
    StoreFull,
    check_name,
)

if TYPE_CHECKING:
    from ._daemon import Server, _Client

__all__ = ["Bad", "put", "create", "seal", "room", "name_of", "recover_spilled"]

log = logging.getLogger("shmshare.store")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MAX_PENDING = 64  # warm puts one client may have between room and put


class Bad(Exception):
    """A request the daemon refuses: (code, text) go back in an err reply."""


def room(srv: Server, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
    """A warm put's first step (Note [Warm memory]): a block of the pool for an object of
    ``s`` bytes, pending until the client has filled it and its put names it. StoreFull when
    the pool has no room for it: the client then puts it in a memfd of its own."""
    name = name_of(h)
    size = h.get("s")
    if type(size) is not int or not LARGE <= size < 1 << 48:
        raise Bad(BAD, f"a warm put is of {LARGE}..2**48 bytes, got {size!r}")
    if fds:
        raise Bad(BAD, "a room request carries no fd")
    replace = h.get("r") is True
    if not replace and name in srv.table.names:
        raise Bad(EXISTS, _exists(name))
    if len(client.pending) >= _MAX_PENDING:
        raise Bad(BAD, f"{_MAX_PENDING} warm puts of this client are unfinished already")
    old = srv.table.names.get(name) if replace else None
    obj = warm_object(srv, client, name, size, b"", False, old)
    client.pending[obj.oid] = obj
    srv.table.pending[obj.oid] = obj
    reply = {"k": "room", "o": obj.oid}
    send: list[int] = []
    where(srv, client, obj, reply, send)
    srv._reply(client, reply, send)

def warm_object(srv: Server, client: _Client, name: str, size: int, meta: bytes,
                torch: bool, old: Obj | None = None) -> Obj:
    """An object of LARGE bytes or more in the pool: in room the pool has (free room in its
    segments counts, under a limit too); evicting only with --evict, and only from
    MIN_LARGE_ALLOC (a smaller one would take a 20 MiB segment, where its own memfd takes its
    pages), and not unless it could fit once every unreferenced object (and `old`, which a put
    replaces) went."""
    what = f"object {name!r}"
    try:
        held = srv.table.malloc(size, what, evict=False)
    except HostFull:
        raise
    except StoreFull:
        if not srv.table.evict or size < MIN_LARGE_ALLOC:
            raise
        srv.table.could_ever_fit(_pages(size), what, old, size)
        held = srv.table.malloc(size, what, evict=True)
    return Obj(srv.table.new_oid(), name, size, meta, torch, held.seg.id,
               held.block.address - held.seg.address, held.block.size, client.id, held=held)

def where(srv: Server, client: _Client, obj: Obj, reply: dict[str, Any], send: list[int]) -> None:
    """Say where a warm object's bytes go: its segment, at an offset; with the segment's
    read-write fd the first time this client is to write into it."""
    assert obj.held is not None
    seg = obj.held.seg
    reply["i"], reply["off"] = seg.id, obj.offset
    if seg.id not in client.wsegs:
        send.append(seg.fd)
        reply["n"] = seg.size
        client.wsegs.add(seg.id)

def put(srv: Server, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
    if "o" in h:
        oid = h["o"]
        room = client.pending.pop(oid, None) if type(oid) is int else None
        if room is None:
            raise Bad(BAD, f"put names room {oid!r}, which this client was not given (or put "
                      "already)")
        try:  # a refused put gives its room back, whatever refused it
            name, size, meta, torch = new_object(srv, h, client)
            put_warm(srv, client, h, room, name, size, meta, torch, h.get("r") is True, fds)
        except BaseException:
            srv.table.free_pending(room)
            raise
        return
    name, size, meta, torch = new_object(srv, h, client)
    replace = h.get("r") is True
    if not replace and name in srv.table.names:
        raise Bad(EXISTS, _exists(name))
    old = srv.table.names.get(name) if replace else None
    if fds:  # refused before anything is let go of (the old object, or evictions)
        check_memfd(srv, name, size, fds, sealed=True)
    else:
        check_staged(srv, client, size, h)
    srv.table.could_ever_fit(len(meta) + _pages(size), f"object {name!r}", old, size)
    srv.table.room_for_meta(len(meta), f"object {name!r}")
    if fds:
        if old is not None and frees_room_for(srv, old, size, memfd=True):
            unname(srv, old)  # it is room the new one surely fits in: let it go first
            old = None
        obj = memfd_object(srv, client, name, size, meta, torch, fds, sealed=True)
    else:
        if old is not None and frees_room_for(srv, old, size, memfd=False):
            unname(srv, old)
            old = None
        obj = small_object(srv, client, name, size, meta, torch)
        try:
            read_staged(srv, client, obj, h)
            if obj.fd >= 0:
                srv.table.write_seal(obj)
        except BaseException:
            free_new(srv, obj)
            raise
        obj.sealed = True
    if old is not None:  # only now: a put that fails leaves the old object as it was
        unname(srv, old)
    srv.table.add(obj)
    srv.counts["put"] += 1
    srv._reply(client, {"k": "ok", "ws": obj.write_seal})
    srv._wake_waiters(name)

def put_warm(srv: Server, client: _Client, h: dict[Any, Any], obj: Obj, name: str, size: int,
             meta: bytes, torch: bool, replace: bool, fds: list[Fd]) -> None:
    """A warm put's second step: name the block the client filled (the caller gives it back if
    this raises)."""
    if obj.size != size or obj.name != name or fds or "st" in h:
        raise Bad(BAD, f"the put of {name!r} ({size} bytes) is not what room {obj.oid} was "
                  f"given for ({obj.name!r}, {obj.size} bytes)")
    if not replace and name in srv.table.names:
        raise Bad(EXISTS, _exists(name))
    srv.table.room_for_meta(len(meta), f"object {name!r}")
    del srv.table.pending[obj.oid]
    obj.meta, obj.torch, obj.sealed, obj.created = meta, torch, True, time.time()
    old = srv.table.names.get(name) if replace else None
    if old is not None:
        unname(srv, old)
    srv.table.add(obj)
    srv.counts["put"] += 1
    srv._reply(client, {"k": "ok", "ws": obj.write_seal})
    srv._wake_waiters(name)

def frees_room_for(srv: Server, old: Obj, size: int, memfd: bool) -> bool:
    """Whether letting `old` go (unreferenced: freed at once) surely makes room for a new
    object of `size`: its memfd's pages, or a pool block at least as large."""
    if old.refs or srv.table.limit is None or srv.table.index.held(old.slot):
        return False  # viewed (a fast get's views too): it would not be freed
    if old.fd >= 0:  # a memfd (a large object's, or a small one's under a tight limit)
        return old.charge >= -(-size // _PAGE) * _PAGE
    if old.block is None:
        return False
    if not memfd:
        return bool(old.block.size >= size)
    # a pool object replaced by a memfd one: its segment goes back (trimmed) if it is alone there
    seg = old.block.segment
    alone = not any(o.seg_id == old.seg_id and o is not old
                    for o in (*srv.table.objects.values(), *srv.table.pending.values()))
    return alone and bool(seg.size >= -(-size // _PAGE) * _PAGE)

def unname(srv: Server, obj: Obj) -> None:
    for c in srv._clients.values():
        c.creating.discard(obj.oid)
    srv.table.unname(obj)

def create(srv: Server, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
    name, size, meta, torch = new_object(srv, h, client)
    if name in srv.table.names:
        raise Bad(EXISTS, _exists(name))
    warm = h.get("w") is True
    if fds:
        check_memfd(srv, name, size, fds, sealed=False)
    elif warm and size < LARGE:
        raise Bad(BAD, f"a warm create is of {LARGE} bytes or more, got {size}")
    if not warm or fds:  # a warm one looks for room in the pool first (warm_object)
        srv.table.could_ever_fit(len(meta) + _pages(size), f"object {name!r}", None, size)
    srv.table.room_for_meta(len(meta), f"object {name!r}")
    reply: dict[str, Any] = {"k": "ok"}
    send: list[int] = []
    if fds:
        obj = memfd_object(srv, client, name, size, meta, torch, fds, sealed=False)
    elif warm:  # the creator fills the pool block through its own mapping, and holds a
        obj = warm_object(srv, client, name, size, meta, torch)  # reference while it does
        try:
            where(srv, client, obj, reply, send)
        except BaseException:
            free_new(srv, obj)
            raise
        srv.table.ref(obj, client.id)
        client.refs[obj.oid] = client.refs.get(obj.oid, 0) + 1
    else:
        obj = small_object(srv, client, name, size, meta, torch)
    srv.table.add(obj)
    client.creating.add(obj.oid)
    srv.counts["create"] += 1
    reply["o"] = obj.oid
    srv._reply(client, reply, send)

def seal(srv: Server, client: _Client, h: dict[Any, Any], fds: list[Fd]) -> None:
    name = name_of(h)
    obj = srv.table.names.get(name)
    if obj is None or obj.oid not in client.creating:
        raise Bad(NOT_YOURS if obj is not None else NOT_FOUND,
                   f"{name!r} is not an object this client created and has not sealed "
                   "(sealed already, deleted, or created by another client)")
    if obj.staged:
        read_staged(srv, client, obj, h)
    try:
        srv.table.seal(obj)
    except OSError as exc:  # a creator's memfd that takes no more seals (F_SEAL_SEAL)
        raise Bad(BAD, f"{name!r} cannot be sealed against writes ({exc}): its memfd "
                   "must be one the store can seal") from exc
    if obj.fd >= 0 and not obj.staged and _holes(obj.fd, obj.size):
        # sealed now, so no more holes can be punched: any there were punched after create
        client.creating.discard(obj.oid)
        srv.table.unname(obj)
        srv._wake_waiters(name, abort=f"object {name!r} was aborted: its creator punched "
                           "holes in it before sealing")
        raise Bad(BAD, f"{name!r} has holes (pages punched out after create): refused; "
                   "it is deleted")
    client.creating.discard(obj.oid)
    if obj.write_seal == "future":
        client.future.add(obj.oid)
    srv._reply(client, {"k": "ok", "ws": obj.write_seal})
    srv._wake_waiters(name)

def new_object(srv: Server, h: dict[Any, Any], client: _Client) -> tuple[str, int, bytes, bool]:
    name = name_of(h)
    size, meta, torch = h.get("s"), h.get("m"), h.get("t")
    if type(size) is not int or size < 0 or size >= 1 << 48:
        raise Bad(BAD, f"an object's size must be 0..2**48 bytes, got {size!r}")
    if type(meta) is not bytes or len(meta) > MAX_META:
        raise Bad(BAD, f"an object's meta must be at most {MAX_META} bytes")
    _check_meta(meta, size)
    return name, size, meta, torch is True

def check_memfd(srv: Server, name: str, size: int, fds: list[Fd], sealed: bool) -> None:
    """Refuse a memfd that is not exactly an object of `size` bytes, every page there, and
    sealed as it must be: against writes already (a put), or sealable (a create)."""
    if len(fds) != 1 or size < 1:
        raise Bad(BAD, "a memfd object comes with exactly one fd and at least one byte")
    fd = fds[0].fileno()
    try:
        check_fd(fd, size, trust_unsealed=False, writable=False, backed=size)
    except ProtocolError as exc:
        raise Bad(BAD, str(exc)) from exc
    st_size = os.fstat(fd).st_size
    if st_size != size:  # larger would let pages there stand in for holes, and dodge the limit
        raise Bad(BAD, f"the memfd of {name!r} is {st_size} bytes, announced as {size}: "
                   "an object's memfd is exactly its size")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    want = SEALS | fcntl.F_SEAL_WRITE if sealed else SEALS
    if (seals & want != want) if sealed else (seals != want):
        raise Bad(BAD, f"the memfd of {name!r} must be sealed F_SEAL_SHRINK|F_SEAL_GROW"
                   + ("|F_SEAL_WRITE" if sealed else " and nothing else (the store seals "
                      "it against writes at seal)") + f"; it has seals {seals:#x}")

def memfd_object(srv: Server, client: _Client, name: str, size: int, meta: bytes, torch: bool,
                  fds: list[Fd], sealed: bool) -> Obj:
    charge = srv.table.charge_memfd(size, f"object {name!r}")
    return Obj(srv.table.new_oid(), name, size, meta, torch, _new_id(), 0, charge,
               client.id, fd=fds[0].take(), sealed=sealed,
               write_seal="full" if sealed else "none")

def small_object(srv: Server, client: _Client, name: str, size: int, meta: bytes,
                  torch: bool) -> Obj:
    """A block of the pool for it; or, when the pool cannot grow under the limit (its
    segments are 2 MiB), a memfd of the store's own, charged by the page. Each is tried
    without evicting first: nothing is evicted for what fits another way. A memfd of our
    own refused by the daemon's memory cgroup (HostFull) ends it: no way needs less, and
    evicting for it would free room under --limit, which is not what is missing."""
    if size == 0 or srv.table.limit is None:
        return arena_object(srv, client, name, size, meta, torch)
    ways = ((arena_object, False), (own_memfd, False), (own_memfd, True))
    for way, evict in ways:
        try:
            return way(srv, client, name, size, meta, torch, evict)
        except HostFull:
            if way is own_memfd:
                raise
        except StoreFull:
            pass
    # evicting: for the way that needs least first (a few pages, not a pool segment)
    return arena_object(srv, client, name, size, meta, torch, True)

def own_memfd(srv: Server, client: _Client, name: str, size: int, meta: bytes, torch: bool,
               evict: bool) -> Obj:
    what = f"object {name!r}"
    refused = daemon_refusal(_pages(size), what)  # before anything is evicted for it
    if refused is not None:
        raise refused
    charge = srv.table.charge_memfd(size, what, evict)
    try:
        fd = new_memfd(size, what)
    except BaseException:
        srv.table.memfd_bytes -= charge
        raise
    try:
        allocate_pages(fd, size, what)
    except BaseException:
        os.close(fd)
        srv.table.memfd_bytes -= charge
        raise
    return Obj(srv.table.new_oid(), name, size, meta, torch, _new_id(), 0, charge,
               client.id, fd=fd, staged=True)

def arena_object(srv: Server, client: _Client, name: str, size: int, meta: bytes,
                  torch: bool, evict: bool = True) -> Obj:
    if size >= LARGE:
        raise Bad(BAD, f"an object of {size} bytes (>= {LARGE}) comes with its own memfd")
    oid = srv.table.new_oid()
    if size == 0:
        return Obj(oid, name, 0, meta, torch, 0, 0, 0, client.id, staged=True)
    held = srv.table.malloc(size, f"object {name!r}", evict)
    block = held.block
    return Obj(oid, name, size, meta, torch, held.seg.id, block.address - held.seg.address,
               block.size, client.id, held=held, staged=True)

def check_staged(srv: Server, client: _Client, size: int, h: dict[Any, Any]) -> None:
    if size and (client.staging is None or h.get("st") != size or size > client.staging[1]):
        raise Bad(BAD, f"the {size} bytes of a small object are to be staged first")

def read_staged(srv: Server, client: _Client, obj: Obj, h: dict[Any, Any]) -> None:
    """Copy a small object's bytes from the client's staging memfd into its block."""
    if obj.size == 0:
        return
    check_staged(srv, client, obj.size, h)
    assert client.staging is not None
    if obj.block is not None:
        dst = memoryview(_native.Lease(None, obj.block.address, obj.size))
        got = os.preadv(client.staging[0], [dst], 0)  # never maps the client's memory
    else:  # a memfd of our own (_small_object): through a buffer, never a mapping
        buf = bytearray(obj.size)
        got = os.preadv(client.staging[0], [buf], 0)
        if got == obj.size:
            os.pwrite(obj.fd, buf, 0)
    if got != obj.size:
        raise Bad(BAD, f"the staging memfd held {got} of {obj.size} bytes")

def free_new(srv: Server, obj: Obj) -> None:
    """Give back the block of an object that never made it into the table."""
    if obj.held is not None:
        srv.table.free_held(obj)
    if obj.fd >= 0:
        fd, obj.fd = obj.fd, -1
        os.close(fd)
        srv.table.memfd_bytes -= obj.charge



def recover_spilled(srv: Server) -> None:
    """Take back the objects a killed daemon spilled to the directory (Note [Spilling]): under
    their names, spilled; a file whose meta the daemon would refuse is reported and kept."""
    table = srv.table
    if table.spill is None:
        return
    for f in table.spill.recover():
        try:
            check_name(f.name)
            _check_meta(f.meta, f.size)
        except (Bad, TypeError, ValueError) as exc:
            log.error("spill file %s is not an object the store would take (%s): left as it "
                      "is", f.path, exc.args[-1])
            table.spill.bytes -= f.size
            continue
        old = table.names.get(f.name)
        if old is not None:
            log.warning("spill files %s and %s both hold %r: the newer is kept", old.spilled,
                        f.path, f.name)
            table.unname(old)
        table.add(Obj(table.new_oid(), f.name, f.size, f.meta, f.torch, 0, 0, 0, 0,
                      sealed=True, write_seal="full", created=f.created, spilled=f.path,
                      spill_at=f.data_at))
        log.info("recovered spilled object %r (%d bytes) from %s", f.name, f.size, f.path)


def name_of(h: dict[Any, Any]) -> str:
    try:
        return check_name(h.get("n"))
    except (TypeError, ValueError) as exc:
        raise Bad(BAD, str(exc)) from exc


def _exists(name: str) -> str:
    return (f"the store has an object {name!r} already: delete it first, or "
            "put(..., replace=True)")


def _check_meta(meta: bytes, size: int) -> None:
    """Refuse meta a getter could not rebuild: arrays outside the object, object dtypes, a
    torch dtype that is not its numpy dtype's (a getter trusts the meta)."""
    def view(seg: int, block: int, offset: int, lay: Any) -> None:
        if lay.dtype.hasobject:
            raise Bad(BAD, f"an array of dtype {lay.dtype} holds object references")
        if lay.torch_dtype is not None:
            problem = torch_dtype_problem(lay.dtype, lay.torch_dtype)
            if problem is not None:
                raise Bad(BAD, problem)
        if seg == 0:
            if 0 not in lay.shape and (lay.dtype.itemsize or lay.dtype.kind in "SU"):
                raise Bad(BAD, f"an empty array's descriptor has shape {lay.shape}")
            return
        start = offset + lay.lo
        if seg != 1 or start < 0 or start + lay.nbytes > size:
            raise Bad(BAD, f"an array of {lay.nbytes} bytes at offset {start} lies outside "
                       f"its object of {size} bytes")

    try:
        decode(meta, view)
    except ValueError as exc:
        raise Bad(BAD, f"malformed meta: {exc}") from exc


def _pages(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


def _holes(fd: int, size: int) -> bool:
    return os.fstat(fd).st_blocks * 512 < size


