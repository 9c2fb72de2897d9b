"""The daemon's objects: names, references, memory, the limit and eviction.

Note [When an object's memory comes back]
    A name maps to one object until ``delete`` (or eviction, or its
    creator's death before ``seal``). The object itself lives on while any
    client holds views from a ``get`` of it: each get is one reference of
    that client's, given back by a ``rel`` frame when the get's last view
    dies, or all at once when the client's connection ends. An object with
    no name and no reference is *freed*: its pool block goes back to the
    daemon's pool, or the daemon closes its memfd. Its bytes count against
    ``--limit`` until then. A client may still map a freed
    memfd for a moment (the kernel keeps the pages for that mapping); the
    daemon tells it (a ``drop`` frame) so it unmaps.

Note [Eviction]
    With ``--evict``, an object that does not fit first makes room by
    deleting sealed objects that no client references, least recently put
    or got first (Ray's LRU of unpinned objects). Referenced objects, and
    objects being created, are never evicted: eviction never takes memory
    from under a view. Without ``--evict`` the put fails with
    :class:`StoreFull`, naming what the store holds.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any

from .. import _native
from .._plane.pool import Held, LendingPool
from ..memory import OutOfMemoryError
from ..memory._policy import format_size
from ..memory._shm import _new_id
from ._index import DaemonIndex
from ._packing import allocate_pages, new_memfd
from ._protocol import StoreFull
from ._refusals import HostFull, amount, daemon_refusal, host_cause, objects
from ._spill import Spiller, write_from_fd, write_from_memory

__all__ = ["Obj", "Table", "HostFull", "daemon_refusal"]

_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_ids = itertools.count(1)
IDLE_TRIM = 0.5  # s an empty pool keeps its segments before they go back (Note [Eviction])
_SMALL_SEGMENT = 2 << 20  # the pool's segment for objects under 1 MiB (PyTorch's small pool)


def default_cache() -> int:
    """Bytes of free pool segments kept warm without a --limit (Note [Warm memory]): a quarter
    of the host's memory, at most 8 GiB, at least 32 MiB."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        ram = 0
    return max(32 << 20, min(8 << 30, ram // 4))


@dataclass(eq=False)
class Obj:
    """One object of the store."""

    oid: int  # unique in this daemon, never reused
    name: str
    size: int  # bytes of the object
    meta: bytes  # the value's description (Note [An object's layout])
    torch: bool  # holds torch tensors
    seg_id: int  # the segment its bytes lie in (an arena segment, or its own memfd)
    offset: int  # where in that segment
    charge: int  # bytes counted against the limit
    creator: int  # client id that made it
    held: Held | None = None  # arena objects: the pool block, held while the object lives
    fd: int = -1  # memfd objects: the daemon's fd of it (owned)
    sealed: bool = False
    write_seal: str = "none"  # "full" (F_SEAL_WRITE), "future" (F_SEAL_FUTURE_WRITE), "none"
    refs: dict[int, int] = field(default_factory=dict)  # client id -> gets not given back
    created: float = field(default_factory=time.time)
    named: bool = True  # still under its name (not deleted, evicted or aborted)
    staged: bool = False  # its bytes come through the client's staging memfd (small objects)
    spilled: str | None = None  # its spill file, while its bytes are there (Note [Spilling])
    spill_at: int = 0  # where its bytes start in that file
    slot: int = -1  # its word in the index, and its generation there (Note [Gets without a
    gen: int = 0  # round trip] in _index.py); -1: not published

    @property
    def block(self) -> Any:
        """The pool block of an arena object (the allocator's Block), else None."""
        return None if self.held is None else self.held.block

    @property
    def kind(self) -> str:
        if self.spilled is not None:
            return "spilled"
        return "arena" if self.held is not None else "memfd" if self.fd >= 0 else "empty"

    @property
    def nrefs(self) -> int:
        return sum(self.refs.values())



class Table:
    """Names, objects, the arena (the daemon's lending pool) and the limit.

    Note [The store's pool]
        The arena is the :class:`LendingPool` the channel's sender and the
        multiprocessing owner lend from (``_plane/pool.py``): the caching
        allocator over sealed memfds, the segments by address, and the
        blocks held. Here an object holds its block as a lender's own view
        does (``local``) for as long as the table keeps the object -- named,
        or referenced by a get (Note [When an object's memory comes back]);
        the table, not the pool's lease ids, counts each client's gets,
        since many clients borrow one object and a client's death gives
        back all of its gets at once. A freed block goes straight back to
        the allocator: the store keeps no spares (the pool's Note [Spare
        blocks]). They were tried: the allocator's cached room is as warm
        (its pages stay mapped and populated), while a spare holds its
        place in a segment against puts of other sizes -- under a limit a
        4.25 MiB store then held 3 objects of 600 kB where it holds 4, and
        without one a producer that turned from 400 kB objects to 600 kB
        ones held 35.7 MB where 18.9 MB do.
    """

    def __init__(self, limit: int | None, evict: bool, on_drop: Any, spill: Spiller | None = None
                 ) -> None:
        self.limit = limit
        self.spill = spill  # room is made by spilling what --evict would evict (Note [Spilling])
        self.evict = evict or spill is not None
        self._on_drop = on_drop  # on_drop(seg_id): a segment clients may map is gone
        self.names: dict[str, Obj] = {}
        self.objects: dict[int, Obj] = {}  # oid -> every object not freed yet
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.memfd_bytes = 0  # charged by memfd objects
        self.meta_bytes = 0  # of every object's meta
        self.pool = LendingPool(None, "memfd", "expandable_segments:False", 0)  # no spares
        self.provider = self.pool.provider
        self.provider.listeners.append(self._on_segment)
        self.arena = self.pool.alloc
        self.ro_fds: dict[int, int] = {}  # arena segment id -> a read-only fd of it, for getters
        self.evicted = 0
        self.freed = 0
        self._sorted: list[str] | None = None  # the names in order, until they change
        self.emptied_at: float | None = None  # when the pool last became empty
        # free pool room kept warm: all of it under a --limit (held_bytes counts it, and room
        # is made by trimming it first), else default_cache() (Note [Warm memory])
        self.cache_limit = limit if limit is not None else default_cache()
        self.pending: dict[int, Obj] = {}  # oid -> a warm put's block, filled by its client
        self.index = DaemonIndex()  # Note [Gets without a round trip]
        self.fast_held: dict[int, Obj] = {}  # oid -> freed but for views of fast gets

    def entry(self, obj: Obj, now: float) -> list[Any]:
        """The object as ``info``/``list`` tell it (views of fast gets counted)."""
        fast, holders = self.index.count(obj.slot)
        return [obj.name, obj.size, obj.sealed, obj.nrefs + fast, round(now - obj.created, 3),
                obj.kind, obj.write_seal, len(holders | set(obj.refs))]

    def publish(self, obj: Obj) -> None:
        """Let fast gets find it (a new generation: its bytes may have moved)."""
        if obj.size and obj.named and obj.sealed and obj.spilled is None:
            obj.slot, obj.gen = self.index.publish(obj.slot)

    def _held_by_fast_gets(self, obj: Obj) -> bool:
        """Retire its slot, and whether fast gets' views still hold it (then published again:
        it stays as it was)."""
        if obj.slot < 0:
            return False
        self.index.retire(obj.slot)
        if self.index.held(obj.slot):
            self.publish(obj)
            return True
        return False

    def recheck_held(self) -> bool:
        """Free the objects fast gets' views no longer hold; whether some are still held."""
        held = self.index.still_held([o.slot for o in self.fast_held.values()])
        for obj in [o for o in self.fast_held.values() if o.slot not in held]:
            self._free(obj)
        return bool(self.fast_held)

    def sorted_names(self) -> list[str]:
        """The names in order (sorted once per change, not once per page of a listing)."""
        if self._sorted is None:
            self._sorted = sorted(self.names)
        return self._sorted

    # -- memory ------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        """Bytes the store holds: memfd objects, the arena's segments, and the objects' meta
        (a value's description is the daemon's own memory: a flood of them counts too)."""
        return self.memfd_bytes + self.provider.used + self.meta_bytes

    def charge_memfd(self, size: int, what: str, evict: bool = True) -> int:
        """Count a memfd object of `size` against the limit; the bytes charged."""
        charge = -(-size // _PAGE) * _PAGE
        self._make_room(charge, what, evict, size)
        self.memfd_bytes += charge
        return charge

    def could_ever_fit(self, need: int, what: str, old: Obj | None, size: int | None = None) -> None:
        """StoreFull, before anything is evicted, unless `need` bytes (an object of `size` in
        whole pages, and its meta) could fit once every unreferenced object went (with --evict)
        and `old` (the object a put replaces, if unreferenced) was given back."""
        if self.limit is None or self.held_bytes + need <= self.limit:
            return
        room = self._reclaimable(self.evict)
        if old is not None and not old.refs and not self.index.held(old.slot) \
                and not (self.evict and old.oid in self._idle):
            room += old.charge + len(old.meta)  # not counted among the evictable already
        if self.held_bytes - room + need > self.limit:
            raise self._full(need, what, size=size, counted="in whole pages, with its description")

    def room_for_meta(self, nbytes: int, what: str) -> None:
        """StoreFull unless `nbytes` of meta fit (evicting if asked)."""
        self._make_room(nbytes, f"the description of {what}", True)

    def malloc(self, size: int, what: str, evict: bool = True) -> Held:
        """A block of the arena for an object of `size` bytes, held until :meth:`_free` (StoreFull
        past the limit; Note [The store's pool])."""
        while True:
            if self.limit is not None:
                self.provider.limit = max(1, self.limit - self.memfd_bytes - self.meta_bytes)
            try:
                return self.pool.hold(self.arena.malloc(size), size, True)
            except OutOfMemoryError as exc:
                if self.limit is None or host_cause(exc) is not None:
                    raise self._host_full(size, what, exc) from exc
                # it needs a new segment of the pool (2 MiB for objects under 1 MiB)
                need = max(size, _SMALL_SEGMENT)
                if not evict or not self._could_fit(need) or not self._evict_one():
                    raise self._full(size, what, size=size, segment=need) from exc

    def _make_room(self, charge: int, what: str, evict: bool, size: int | None = None) -> None:
        if self.limit is None:
            return
        if self.held_bytes + charge > self.limit and not self._could_fit(charge if evict else -1):
            raise self._full(charge, what, size=size, counted="in whole pages")
        while self.held_bytes + charge > self.limit:
            if self._cached_arena() and self._trim():
                continue
            if not evict or not self._evict_one():
                raise self._full(charge, what, size=size, counted="in whole pages")

    def _could_fit(self, need: int) -> bool:
        """Whether giving back the pool's wholly free segments and (with --evict) evicting
        every unreferenced object could make room for `need` more bytes: nothing is evicted
        for a put that would fail all the same (`need` < 0: trimming alone, no eviction)."""
        assert self.limit is not None
        return self.held_bytes - self._reclaimable(need >= 0) + abs(need) <= self.limit

    def _reclaimable(self, evicting: bool) -> int:
        """Bytes that trimming (and evicting every idle object) would give back: a pool
        segment comes back only when no object is left in it at all."""
        sizes: dict[int, int] = {}  # pool segment id -> its size
        all_idle: dict[int, bool] = {}  # pool segment id -> every object in it idle
        freed = 0
        for o in self.pending.values():  # a client is writing it: never given back for room
            if o.block is not None:
                sizes[o.seg_id] = o.block.segment.size
                all_idle[o.seg_id] = False
        for o in self.objects.values():
            idle = evicting and o.oid in self._idle and not self.index.held(o.slot)
            if o.block is not None:
                sizes[o.seg_id] = o.block.segment.size
                all_idle[o.seg_id] = all_idle.get(o.seg_id, True) and idle
            elif idle:
                freed += o.charge
            if idle and self.spill is None:  # a spilled object keeps its description here
                freed += len(o.meta)
        wholly_free = max(0, self.provider.used - sum(sizes.values()))  # cached, no object
        return freed + wholly_free + sum(n for sid, n in sizes.items() if all_idle[sid])

    def _evict_one(self) -> bool:
        if not self.evict or not self._idle:
            return False
        if self.spill is not None:
            return self._spill_one()
        for oid in list(self._idle):  # least recently used first
            obj = self.objects[oid]
            if self._held_by_fast_gets(obj):
                continue
            del self._idle[oid]
            self.evicted += 1
            self.unname(obj)
            return True
        return False

    def _spill_one(self) -> bool:
        """Spill the least recently used unreferenced object that holds memory (Note [Spilling]);
        StoreFull (and nothing spilled) if the spill directory is full."""
        assert self.spill is not None
        obj = next((o for o in map(self.objects.__getitem__, list(self._idle))
                    if o.size and not self._held_by_fast_gets(o)), None)
        if obj is None:
            return False
        if obj.held is not None:
            view = memoryview(_native.Lease(None, obj.held.block.address, obj.size, readonly=True))
            source = write_from_memory(view)
        else:
            source = write_from_fd(obj.fd, obj.size)
        try:
            obj.spilled, obj.spill_at = self.spill.write(obj.oid, obj.name, obj.size, obj.meta,
                                                         obj.torch, obj.created, source)
        except BaseException:
            self.publish(obj)  # retired for the spill, which did not happen
            raise
        del self._idle[obj.oid]
        self._let_go_of_memory(obj)
        return True

    def _full(self, need: int, what: str, *, size: int | None = None, counted: str = "",
              segment: int = 0) -> StoreFull:
        """StoreFull for `need` bytes past the limit -- `what` of `size` bytes, counted as
        `counted` says; or a whole new pool `segment` -- that states the bytes asked, the limit,
        what the store holds, and what to do."""
        limit = self.limit or 0
        held = self.held_bytes
        objs = list(self.objects.values())
        viewed = sum(o.size for o in objs if o.refs or self.index.held(o.slot))
        besides = max(0, held - sum(o.size for o in objs)
                      - sum(o.size for o in self.pending.values()))
        if segment > need:  # the pool's segments are larger than small objects
            asked = (f"{what} needs {amount(need)} (and for it the store's pool a new "
                     f"{format_size(segment)} segment)")
        elif size is not None and size != need:
            asked = f"{what} of {amount(size)} needs {need} bytes of the limit ({counted})"
        else:
            asked = f"{what} needs {amount(need)}"
        text = (f"{asked}, but the store's --limit is {amount(limit)} and it holds "
                f"{format_size(held)} already, so {format_size(max(0, limit - held))} is free. "
                f"It holds {objects([o for o in objs if o.named], '')} by name, "
                f"{objects([o for o in objs if not o.named], 'deleted ')} that getters still "
                f"view, {objects(list(self.pending.values()), 'unfinished ')} that putters are "
                f"writing, and {format_size(besides)} besides (room between objects in its "
                f"pool, the objects' descriptions); getters are viewing {format_size(viewed)} "
                "of it.")
        if max(need, segment) > limit:
            fix = (f"Deleting objects cannot make room for {format_size(max(need, segment))} "
                   f"under a limit of {format_size(limit)}: restart the store with a larger "
                   "--limit (`shmshare serve --limit ...`), or put less at once.")
        elif self.evict:
            how = "--spill, but nothing unreferenced is left to spill" if self.spill else \
                "--evict, but nothing unreferenced is left to evict"
            fix = (f"It runs with {how}: getters hold views of the rest. Drop those views or "
                   "delete objects (Store.delete), or restart the store with a larger --limit.")
        else:
            fix = ("To make room: delete objects that are no longer needed (Store.delete), "
                   "restart the store with a larger --limit, or run `shmshare serve --evict` so "
                   "that it evicts the least recently used objects no getter is viewing.")
        return StoreFull(f"{text} {fix}")

    def _host_full(self, size: int, what: str, exc: OutOfMemoryError) -> HostFull:
        """The pool could not grow for want of the daemon's memory, not of room under --limit."""
        got = daemon_refusal(_SMALL_SEGMENT, f"a new {format_size(_SMALL_SEGMENT)} segment of "
                             f"the store's pool, for {what} ({format_size(size)})")
        if got is not None:
            return got
        cause = host_cause(exc) or exc
        limit = f" under a --limit of {amount(self.limit)}" if self.limit is not None else ""
        return HostFull(f"{what} needs {amount(size)}, and the store daemon (pid "
                        f"{os.getpid()}) could not grow its pool: {cause}. The store holds "
                        f"{format_size(self.held_bytes)}{limit}, "
                        f"{objects(list(self.objects.values()), '')} among it. Delete objects "
                        "that are no longer needed (Store.delete), or give the daemon more "
                        "memory (the host's, or its container's).")

    def trim_if_idle(self, now: float) -> float | None:
        """Give the pool's segments back once it has been empty for IDLE_TRIM; the time of
        the next look (None: nothing pending)."""
        if self.emptied_at is None:
            return None
        if self.arena.memory_stats()["allocated_bytes.all.current"]:
            self.emptied_at = None  # in use again
            return None
        due = self.emptied_at + IDLE_TRIM
        if now < due:
            return due
        self.emptied_at = None
        self._trim()
        return None

    def _cached_arena(self) -> int:
        st = self.arena.memory_stats()
        return st["reserved_bytes.all.current"] - st["allocated_bytes.all.current"]

    def _trim(self) -> bool:
        before = self.provider.used
        self.arena.empty_cache()
        return self.provider.used < before

    def _on_segment(self, kind: str, rec: Any, offset: int, nbytes: int) -> None:
        if kind == "segment_alloc":
            # no more seals: a putter holds its fd read-write, and a write seal it added would
            # refuse every other putter's mapping and pass the segment off as an object's own
            # memfd (whose views a forked child need not copy)
            fcntl.fcntl(rec.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        if kind == "segment_free":
            fd = self.ro_fds.pop(rec.id, -1)
            if fd >= 0:
                os.close(fd)
            self._on_drop(rec.id)

    def ro_fd(self, seg: Any) -> int:
        """A read-only fd of an arena segment (a getter can map it ``PROT_READ`` only)."""
        fd = self.ro_fds.get(seg.id, -1)
        if fd < 0:
            fd = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDONLY | os.O_CLOEXEC)
            self.ro_fds[seg.id] = fd
        return fd

    # -- lifetimes -----------------------------------------------------------------

    def new_oid(self) -> int:
        return next(_ids)

    def add(self, obj: Obj) -> None:
        self._sorted = None
        self.meta_bytes += len(obj.meta)
        self.names[obj.name] = obj
        self.objects[obj.oid] = obj
        if obj.sealed and obj.spilled is None:
            self._idle[obj.oid] = None
            self.publish(obj)

    def seal(self, obj: Obj) -> None:
        """Seal it (OSError, and left unsealed, if its memfd takes no write seal)."""
        if obj.fd >= 0:
            self.write_seal(obj)
        obj.sealed = True
        self.publish(obj)
        if not obj.refs and obj.named:
            self._idle[obj.oid] = None

    def write_seal(self, obj: Obj) -> None:
        """Seal a memfd object against writes: fully once no writable mapping is left, else
        against new ones (its creator still maps it: Note [The write seal])."""
        if obj.write_seal == "full" or obj.fd < 0:
            return
        try:
            fcntl.fcntl(obj.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            obj.write_seal = "full"
            return
        except OSError:
            pass  # EBUSY: a writable mapping of it is still there
        if obj.write_seal == "none":
            fcntl.fcntl(obj.fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
            obj.write_seal = "future"

    def ref(self, obj: Obj, client: int) -> None:
        obj.refs[client] = obj.refs.get(client, 0) + 1
        self._idle.pop(obj.oid, None)

    def unref(self, obj: Obj, client: int, n: int = 1) -> None:
        have = obj.refs.get(client, 0)
        if have <= n:
            obj.refs.pop(client, None)
        else:
            obj.refs[client] = have - n
        if obj.refs:
            return
        if not obj.named:
            self._free(obj)
        elif obj.sealed:
            self._idle[obj.oid] = None  # now the most recently used

    def touch(self, obj: Obj) -> None:
        if obj.oid in self._idle:
            self._idle.move_to_end(obj.oid)

    def unname(self, obj: Obj) -> None:
        """Take the object's name away (delete, evict, abort); free it unless it is viewed."""
        self.index.retire(obj.slot)  # first: no fast get finds it from now on
        if obj.named:
            obj.named = False
            if self.names.get(obj.name) is obj:
                del self.names[obj.name]
                self._sorted = None
        self._idle.pop(obj.oid, None)
        if not obj.refs:
            self._free(obj)

    def restore(self, obj: Obj) -> None:
        """Read a spilled object back into a memfd of the daemon's own, sealed against writes,
        making room as a put does (StoreFull, and it stays spilled, if there is none)."""
        assert self.spill is not None and obj.spilled is not None
        what = f"spilled object {obj.name!r}"
        refused = daemon_refusal(-(-obj.size // _PAGE) * _PAGE, what)
        if refused is not None:
            raise refused
        charge = self.charge_memfd(obj.size, what)
        try:
            fd = new_memfd(obj.size, what)
            try:
                allocate_pages(fd, obj.size, what)
                self.spill.read_into(obj.spilled, obj.name, obj.size, fd)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self.memfd_bytes -= charge
            raise
        self.spill.remove(obj.spilled, obj.size)
        obj.spilled, obj.fd, obj.charge, obj.seg_id, obj.offset = None, fd, charge, _new_id(), 0
        obj.write_seal = "full"
        self.publish(obj)  # a new generation: fast gets cached its old place
        self._idle[obj.oid] = None  # in memory again: its get takes a reference next

    def _free(self, obj: Obj) -> None:
        if obj.oid not in self.objects:
            return
        if obj.slot >= 0:
            self.index.retire(obj.slot)
            if self.index.held(obj.slot):  # a fast get's views: as a reference (recheck_held)
                self.fast_held[obj.oid] = obj
                return
            self.index.free(obj.slot)
            obj.slot = -1
        self.fast_held.pop(obj.oid, None)
        del self.objects[obj.oid]
        self.freed += 1
        self.meta_bytes -= len(obj.meta)
        self._let_go_of_memory(obj)
        if obj.spilled is not None and self.spill is not None:
            self.spill.remove(obj.spilled, obj.size)
            obj.spilled = None

    def _let_go_of_memory(self, obj: Obj) -> None:
        """Its pool block back to the pool, or its memfd closed (freed, or spilled)."""
        if obj.held is not None:
            self.free_held(obj)
            if self._cached_arena() > self.cache_limit:
                self._trim()
            elif self.arena.memory_stats()["allocated_bytes.all.current"] == 0:
                self.emptied_at = time.monotonic()  # given back in IDLE_TRIM unless reused
        if obj.fd >= 0:
            fd, obj.fd = obj.fd, -1
            os.close(fd)
            self.memfd_bytes -= obj.charge
            self._on_drop(obj.seg_id)

    def free_pending(self, obj: Obj) -> None:
        """A warm put's block that never became an object (refused, abandoned, or its client
        went) goes back."""
        if self.pending.pop(obj.oid, None) is obj:
            self.free_held(obj)
            if self.arena.memory_stats()["allocated_bytes.all.current"] == 0:
                self.emptied_at = time.monotonic()

    def free_held(self, obj: Obj) -> None:
        """The object lets go of its pool block (back to the allocator: Note [The store's pool])."""
        held, obj.held = obj.held, None
        if held is not None:
            held.local = False
            self.pool.maybe_free(held)

    def close(self) -> None:
        """Free everything (the daemon is stopping)."""
        for obj in list(self.pending.values()):
            self.free_pending(obj)
        self.index.counts.clear()  # every client is gone: nothing holds anything
        for obj in list(self.objects.values()):
            obj.refs.clear()
            obj.named = False
            self._free(obj)
        self.names.clear()
        self._idle.clear()
        self.arena.empty_cache()
        if self.spill is not None:
            self.spill.close()
        self.index.close()
        for fd in self.ro_fds.values():
            os.close(fd)
        self.ro_fds.clear()
        self.provider.close()

    def stats(self) -> dict[str, Any]:
        st = self.arena.memory_stats()
        return {
            "objects": sum(1 for o in self.objects.values() if o.named),
            "deleted_viewed": sum(1 for o in self.objects.values() if not o.named),
            "held_bytes": self.held_bytes, "memfd_bytes": self.memfd_bytes,
            "meta_bytes": self.meta_bytes,
            "arena_reserved_bytes": st["reserved_bytes.all.current"],
            "arena_allocated_bytes": st["allocated_bytes.all.current"],
            "limit": self.limit, "evict": self.evict, "evicted": self.evicted,
            "freed": self.freed, "pending": len(self.pending), "fast_held": len(self.fast_held),
            "spilled": sum(1 for o in self.objects.values() if o.spilled is not None),
            "spilled_bytes": 0 if self.spill is None else self.spill.bytes,
            "spills": 0 if self.spill is None else self.spill.spilled,
            "restores": 0 if self.spill is None else self.spill.restored,
            "spill_dir": None if self.spill is None else self.spill.dir,
            "cache_limit": self.cache_limit,
        }
