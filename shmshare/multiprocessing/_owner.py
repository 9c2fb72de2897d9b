"""The owning side: this process's pool, the leases its handles hold, and its fd server.

Note [One owner per process]
    Every process that pickles an array for multiprocessing has one owner,
    made on first use: a caching allocator over sealed memfds (the channel's
    pool, ``memory.ShmProvider``), the books of its blocks (a
    ``_plane.LendingPool``, as a channel's sender has: held blocks, spares), a lease table (``_table.py``) and a
    small fd server (``_server.py``) on a socket of its own. A handle names
    a block of this pool by segment id and offset, and a slot of the table.
    A block is reused only when every handle on it has come back released,
    or the process that claimed it has gone (its connection ended), or the
    owner is closing. A forked child gets a fresh owner on its first pickle:
    it never hands out its parent's blocks (Note [At fork] in ``_fork.py``).

Note [Exit linger]
    A process that puts an array on a Queue and returns must not take the
    array with it: the Queue's feeder thread flushes the pickled handle at
    exit, and the reader unpickles it later, maybe after ``join()``. So at
    exit (multiprocessing's finalizers, after the Queues' feeders are
    joined; ``atexit`` in the main process), if a handle it pickled is still
    unclaimed, the process forks a keeper and exits at once; the keeper
    serves until no handle is unclaimed, or ``exit_linger`` seconds
    (``SHMSHARE_MP_LINGER``, default 10) have passed (Note [A keeper after
    exit] in ``_keeper.py``; where no keeper can be forked, the process
    lingers itself). Handles claimed by then stay valid however long owner
    and keeper are gone: the claimer maps the memfd itself. A handle
    unpickled later raises :class:`OwnerGone` naming the owner's pid.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import secrets
import tempfile
import threading
import time
from typing import Any

import numpy as np

from .. import _fork, _native, _registry, tensors
from .._errors import PoolExhausted, ShmshareError
from .._plane import SPARE_BYTES, Held, LendingPool, host_cause
from ..memory import OutOfMemoryError, ShmSegment
from ._books import ForkBook, LendBook
from ._claims import ClaimBook, ClaimMap
from ._external import External, TorchSegments
from ._keeper import exit_linger, keep_after_exit, set_exit_linger
from ._server import Server, sweep_stale
from ._statistics import OwnerStatistics
from ._table import CLAIMED, PENDING, LeaseTable, Signer, word

__all__ = ["Owner", "owner", "current_owner", "exit_linger", "set_exit_linger"]

_RECHECK = 0.1  # s between two looks at slots released while still marked
_U8 = np.dtype(np.uint8)
Placed = tuple[int, int, int, int, int, tuple[int, ...], int, int]  # what place() returns



class _LocalDied:
    """on_release of an array from :func:`empty`: queue its block (no lock: any bytecode)."""

    __slots__ = ("done", "held")

    def __init__(self, done: collections.deque[Held], held: Held) -> None:
        self.done, self.held = done, held

    def __call__(self) -> None:
        self.done.append(self.held)


class Owner:
    """This process's pool and the leases of its handles (Note [One owner per process])."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = secrets.randbits(62)
        self._lock = threading.RLock()
        # classic segments whatever SHMSHARE_ALLOC_CONF says: a handle names a whole segment,
        # mapped once by each receiver (expandable ones would be announced piece by piece)
        pool = self.pool = LendingPool(None, "memfd", "expandable_segments:False", SPARE_BYTES)
        self._provider, self._alloc = pool.provider, pool.alloc
        self._provider.listeners.append(self._on_segment_event)
        self._slots: dict[int, Held | External] = {}  # slot -> the block its handle names
        self._since: dict[int, float] = {}  # slot -> when its handle was made, oldest first
        self._torch_segs = TorchSegments()  # torch's shared storages lent as they are
        self._sent = 0  # arrays placed: the clock of the pool's spares (Note [Spare blocks])
        self._forks = pool.retirer = ForkBook()  # blocks a forked child may map (Note [Blocks a child inherits])
        self._lends = LendBook()  # slots lent on, by asker (Note [Lends and who asked])
        self.table = LeaseTable()
        self.claims = ClaimBook(self.table.slots)  # who holds what, by our own record
        self._recheck: set[int] = set()  # slots released while still marked: looked at again
        self._recheck_at = 0.0  # not before then (a forged release must not cost every round)
        self.secret = os.urandom(16)  # signs handles: one altered on the way is refused
        self._signer = Signer(self.secret)
        self._counts = collections.Counter[str]()
        self._copied = self._in_place = 0  # the hot counters, plain ints
        self.server: Any = None  # _server.Server, started by the first handle
        self.path = os.path.join(tempfile.gettempdir(), f"shmshare-mp-{self.pid}-{self.token:x}", "fd")
        self.closed = False
        _registry.register("owners", self, _report)

    # -- the pickling side ----------------------------------------------------

    def place(self, arr: np.ndarray) -> tuple[int, int, int, int, int, tuple[int, ...], int,
                                              int] | None:
        """Lease `arr` to a handle; None: pickle it by value.

        Returns (segment id, segment size, start, span, lo, strides, slot,
        gen): its elements span ``[start, start + span)`` of the segment, and
        element 0 is ``-lo`` bytes into that. An array whose bytes lie in a
        block of this pool goes as it is; any other is copied into a new
        block once (C order).
        """
        ptr, lo, span = _native.extent(arr)
        with self._lock:
            if self.server is None:
                if self.closed:
                    return None
                self._serve()
            if self.pool.local_done:
                self.pool.drain_local()
            self._sent += 1
            held = self.pool.find(ptr + lo, span) if self.pool.addrs else None
            if held is None:
                try:
                    held = self.pool.copy_in(arr, ptr, span, self._sent, self._malloc)
                except MemoryError:
                    self._counts["by_value"] += 1
                    return None
                start, lo = held.block.address - held.seg.address, 0
                strides = tensors.c_strides(arr.dtype.itemsize, arr.shape)
                span = arr.nbytes  # C order now: a broadcast source spanned fewer bytes
                self._copied += 1
            else:
                start, strides = ptr + lo - held.seg.address, arr.strides
                self._in_place += 1
            slot_gen = self._lease(held)
            if slot_gen is None:
                return None
            seg = held.seg
            return seg.id, seg.size, start, span, lo, strides, *slot_gen

    def place_shared(self, arr: np.ndarray, storage: Any) -> tuple[int, int, int, int, int,
                                                                   tuple[int, ...], int, int] | None:
        """Lease a view of a storage torch shared (``share_memory_()``) with no copy; None: the
        storage has no fd to give (torch's file_system strategy) or no slot is free."""
        ptr, lo, span = _native.extent(arr)
        base = storage.data_ptr()
        with self._lock:
            if self.closed:
                return None
            if self.server is None:
                self._serve()
            try:
                # only a storage already fd-backed: _share_fd_cpu_() would move one shared by
                # file name (torch's file_system strategy) into a new segment, under its tensor
                fd = storage._get_shared_fd()
            except (RuntimeError, AttributeError):
                return None  # shared by file name: no fd to give, so the array is copied
            if not isinstance(fd, int) or fd < 0:
                return None
            ext = self._torch_segs.get(fd, storage.nbytes())
            if not (base <= ptr + lo and ptr + lo + span <= base + min(ext.nbytes, ext.size)):
                self._drop_external(ext)
                return None
            slot_gen = self._lease(ext)
            if slot_gen is None:
                return None
            self._in_place += 1
            return ext.id, ext.size, ptr + lo - base, span, lo, arr.strides, *slot_gen

    def sign(self, placed: tuple[int, int, int, int, int, tuple[int, ...], int, int],
             external: bool) -> bytes:
        """The signature of a handle to what :meth:`place` or :meth:`place_shared` returned."""
        seg_id, size, start, span, lo, _strides, slot, gen = placed
        return self._signer(seg_id, size, start, span, lo, slot, gen, external)

    def place_bytes(self, ptr: int, nbytes: int, held: Held | None = None) -> tuple[bool, Placed | None]:
        """:meth:`place` for `nbytes` bytes at `ptr` as bytes, one after the other (a storage's),
        with no view made: (True, place()'s tuple, or None if no slot is free) when they lie in
        a block of this pool, (False, None) when not. `held`: the block :meth:`take_local` gave
        for them just now (Note [A tensor's storage moves into the pool]), not looked up again,
        and counted as copied."""
        with self._lock:
            copied = held is not None
            if held is None:
                if self.pool.local_done:
                    self.pool.drain_local()
                held = self.pool.find(ptr, nbytes) if self.pool.addrs else None
                if held is None:
                    return False, None
            if self.server is None:
                if self.closed:
                    return True, None
                self._serve()
            self._sent += 1
            slot_gen = self._lease(held)
            if slot_gen is None:
                return True, None
            if copied:
                self._copied += 1
            else:
                self._in_place += 1
            seg = held.seg
            return True, (seg.id, seg.size, ptr - seg.address, nbytes, 0, (1,), *slot_gen)

    def _lease(self, rec: Held | External) -> tuple[int, int] | None:
        """A table slot for a handle to `rec`; None (and `rec` let go of) when all are out."""
        got = self.table.take()
        if got is None:
            if isinstance(rec, External):
                self._drop_external(rec)
            else:
                self.pool.maybe_free(rec)
            self._counts["by_value"] += 1
            return None
        self._slots[got[0]] = rec
        self._since[got[0]] = _monotonic()  # for the stats socket's oldest handle (Note [Reporters])
        rec.leases += 1
        return got

    def lend_again(self, cm: ClaimMap, slot: int, gen: int) -> tuple[int, int] | None:
        """A new slot on the block of lease (slot, gen), which `cm`'s process holds, for a handle
        it pickles on; None if it holds no such lease (Note [Lending on] in ``_storages.py``)."""
        with self._lock:
            rec = self._slots.get(slot)
            if rec is None or self.table.gens[slot] != gen or self.table.state(slot)[:2] != (gen, CLAIMED) \
                    or cm.closed or not cm.marks[slot] or not self._lends.allow(cm):
                return None
            got = self._lease(rec)
            if got is not None:
                self._in_place += 1
                self._lends.note(got[0], cm)
            return got

    def _drop_external(self, ext: External) -> None:
        if self._torch_segs.drop(ext) and self.server is not None:
            self.server.dropped(ext.id)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized array in the pool: pickled, it goes with no copy."""
        nbytes = dtype.itemsize * math.prod(shape)  # ints already (np.prod costs ~10 us)
        return self.take_local(nbytes, shape, dtype)[0]

    def take_local(self, nbytes: int, shape: tuple[int, ...] | None = None,
                   dtype: np.dtype = _U8) -> tuple[np.ndarray, Held]:
        """A block of `nbytes` held by the array returned with it (uint8 of `nbytes` without a
        `shape`): the block comes back once that array, and every lease on it, is gone."""
        with self._lock:
            if self.closed:
                raise ShmshareError("shmshare.multiprocessing was shut down in this process")
            if self.pool.local_done:
                self.pool.drain_local()
            held = self.pool.take(nbytes or 1, self._sent, self._malloc, True)
        lease = _native.Lease(self._alloc, held.block.address, nbytes, False,
                              _LocalDied(self.pool.local_done, held))
        # buffer positional: a keyword costs ~0.5 us a call
        return np.ndarray((nbytes,) if shape is None else shape, dtype, lease), held  # type: ignore[arg-type]

    def forked(self) -> None:
        """After a fork, in the parent: the blocks in use here now wait for the children (without
        the lock, which a thread waiting for a local view's block may hold: Note [At fork])."""
        self._forks.forked([addr for addr, h in list(self.pool.held.items()) if h.local])

    def _malloc(self, nbytes: int) -> Any:
        try:
            return self._alloc.malloc(nbytes)
        except OutOfMemoryError as exc:
            host = host_cause(exc)  # a full memory cgroup or /dev/shm: say that first
            if host is None:
                raise
            raise PoolExhausted(f"no shared memory for an array of {nbytes} bytes in pid "
                                f"{self.pid}'s pool: {host}") from exc

    # -- the serving side (the server thread calls these) ----------------------

    def release(self, pairs: list[int]) -> int:
        """Look at the slots (slot, gen, ...) a peer says it released; give back each one that
        is claimed and that no live process's claim map marks; return how many."""
        n = 0
        with self._lock:
            slots, gens, held, claimed = self._slots, self.table.gens, self.claims.held, self.table.claimed
            for i in range(0, len(pairs) - 1, 2):
                slot, gen = pairs[i], pairs[i + 1]
                if type(slot) is not int or type(gen) is not int or slot not in slots \
                        or gens[slot] != gen:
                    continue  # stale, or never ours
                if not claimed(slot, gen):
                    continue  # not claimed (yet)
                if held(slot):
                    # a live process holds it (a forged release), or its mark is set for a
                    # moment (a failed second unpickle of the same handle): look again later
                    self._recheck.add(slot)
                    continue
                self._give_back(slot, gen)
                n += 1
            if self._recheck:
                n += self._look_again()
            if self.pool.local_done:
                self.pool.drain_local()
        return n

    def recheck(self) -> int:
        """Give back the released slots that were still marked, now that they are not."""
        if not self._recheck:
            return 0
        with self._lock:
            return self._look_again()

    def _look_again(self) -> int:
        now = _monotonic()
        if now < self._recheck_at:
            return 0
        self._recheck_at = now + _RECHECK
        n = 0
        for slot in list(self._recheck):
            if slot not in self._slots:
                self._recheck.discard(slot)
                continue
            gen, state, _ = self.table.state(slot)
            if self.claims.held(slot):
                continue
            self._recheck.discard(slot)
            if state == CLAIMED and gen == self.table.gens[slot]:
                self._give_back(slot, gen)
                n += 1
        return n

    def join(self, pid: int) -> tuple[ClaimMap, ClaimMap | None]:
        """A process connected to the fd server: its claim map (made on its first connection),
        and a map of the same pid whose process is gone (for the caller's ``left``)."""
        with self._lock:
            return self.claims.join(pid)

    def left(self, cm: ClaimMap, exited: bool) -> int:
        """One of `cm`'s connections ended, or (`exited`) its process is gone: once the process is
        gone (or, for a map without a pidfd, its last connection ended), take back what it held."""
        with self._lock:
            if not exited:
                cm.conns -= 1
                if cm.pidfd is not None or cm.conns > 0:
                    return 0  # alive: its arrays stay valid however its connections come and go
            return self._reclaim(cm)

    def _reclaim(self, cm: ClaimMap) -> int:
        if cm.closed:
            return 0  # retired already
        words = np.frombuffer(self.table.buffer, np.uint64)
        low = words & np.uint64(0xFFFFFFFF)
        # what it marked, and what the table says it claimed (a release it cleared but never sent)
        look = set(self.claims.retire(cm).tolist())
        if cm.pid > 0:
            look.update(np.flatnonzero(low == np.uint64(word(0, CLAIMED, cm.pid))).tolist())
        n = 0
        for slot in look:
            if slot not in self._slots:
                continue
            gen, state, _ = self.table.state(slot)
            if state == CLAIMED and gen == self.table.gens[slot] and not self.claims.held(slot):
                self._give_back(slot, gen)
                n += 1
        for slot in self._lends.of(cm):  # its lends nobody claimed: Note [Lends and who asked]
            if self.table.state(slot)[1] == PENDING:
                self._give_back(slot, self.table.gens[slot])
                n += 1
        self._counts["reclaimed"] += n
        return n

    def _give_back(self, slot: int, gen: int) -> None:
        self._lends.forget(slot)
        held = self._slots.pop(slot)
        self._since.pop(slot, None)
        self._recheck.discard(slot)
        self.table.give_back(slot, gen)
        held.leases -= 1
        if isinstance(held, External):
            self._drop_external(held)
        else:
            self.pool.maybe_free(held)

    def segment(self, seg_id: int) -> tuple[int, int] | None:
        """(a dup of its fd, size) of a pool segment or of a torch segment with handles out; None
        if gone. A dup, made under the lock: the pool may close its own fd while this one is sent."""
        with self._lock:
            seg = self._provider.segments.get(seg_id) or self._torch_segs.find(seg_id)
            if seg is None:
                return None
            got = (seg.fd, seg.size)
            self._counts["segments_sent"] += 1
            return os.dup(got[0]), got[1]

    def _on_segment_event(self, kind: str, seg: ShmSegment, offset: int, nbytes: int) -> None:
        if kind == "segment_free" and self.server is not None:
            self.server.dropped(seg.id)

    def fds(self) -> set[int]:
        """Every fd this owner and its server use (a keeper closes the rest)."""
        got = {seg.fd for seg in self._provider.segments.values()} | {self.table.fd}
        got |= self._torch_segs.fds()
        for cm in self.claims.maps.values():
            got.add(cm.fd)
            if cm.pidfd is not None:
                got.add(cm.pidfd)
        if self.server is not None:
            got |= self.server.fds()
        return {fd for fd in got if fd is not None and fd >= 0}

    def unclaimed(self) -> int:
        with self._lock:
            return sum(1 for slot in self._slots if self.table.state(slot)[1] == PENDING)

    def statistics(self) -> OwnerStatistics:
        with self._lock:
            if self.pool.local_done:
                self.pool.drain_local()
            states = [self.table.state(slot)[1] for slot in self._slots]
            stats = self._alloc.memory_stats()
            c = self._counts
            return OwnerStatistics(
                pid=self.pid, handles_pickled=self._copied + self._in_place,
                arrays_copied=self._copied, arrays_in_place=self._in_place, by_value=c["by_value"],
                handles_unclaimed=states.count(PENDING), handles_claimed=states.count(CLAIMED),
                bytes_leased=sum(h.nbytes if isinstance(h, External) else h.block.size
                                 for h in set(self._slots.values())),
                reclaimed=c["reclaimed"], peers=0 if self.server is None else self.server.peers(),
                segments_sent=c["segments_sent"],
                reserved_bytes=stats.get("reserved_bytes.all.current", 0),
                allocated_bytes=stats.get("allocated_bytes.all.current", 0))

    # -- life ------------------------------------------------------------------

    def _serve(self) -> None:
        with contextlib.suppress(Exception):  # a sweep never stops the server from starting
            sweep_stale(os.path.dirname(os.path.dirname(self.path)))
        self.server = Server(self, self.path)

    def close(self, linger: float = 0.0) -> None:
        """Serve handles not yet unpickled for up to `linger` s, then stop and give memory back."""
        deadline = time.monotonic() + linger
        while self.server is not None and self.unclaimed() and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            if self.closed:
                return
            self.closed = True
            server, self.server = self.server, None
        if server is not None:
            server.close()
        with self._lock:
            for slot in list(self._slots):  # every peer is gone from our books: void them all
                self._give_back(slot, self.table.gens[slot])
            self.pool.drain_local()
            self.pool.free_spares()
            for block in self._forks.free_now(force=True):  # a child's mapping keeps its pages
                self.pool.free_block(block)
            self._alloc.empty_cache()
            self.table.close()
            self.claims.close()
            for ext in self._torch_segs.all():
                ext.leases = 0
                self._drop_external(ext)


def _report(ow: Owner) -> dict[str, Any] | None:
    """The owner's report for the stats socket: handles out, and the oldest (Note [Reporters])."""
    if ow.closed or ow.pid != os.getpid():
        return None  # shut down, or a forked child's copy of its parent's owner
    since = list(ow._since.items())  # one C call: no other thread runs in between
    now = _monotonic()
    unclaimed, oldest_unclaimed = 0, None
    for slot, at in since:
        if ow.table.state(slot)[1] == PENDING:
            unclaimed += 1
            if oldest_unclaimed is None:
                oldest_unclaimed = round(now - at, 3)
    held = {id(h): h for h in list(ow._slots.values())}.values()
    return {
        "pool": id(ow._alloc),
        "handles_out": len(since),
        "handles_unclaimed": unclaimed,
        "handles_claimed": len(since) - unclaimed,
        "bytes_leased": sum(h.nbytes if isinstance(h, External) else h.block.size for h in held),
        "oldest_handle_s": round(now - since[0][1], 3) if since else None,
        "oldest_unclaimed_s": oldest_unclaimed,
        "peers": 0 if ow.server is None else len(ow.server._peers),
    }


_monotonic = time.monotonic
_owner: Owner | None = None
_owner_lock = threading.Lock()


_exiting = False  # set at exit: a pickle after that goes by value, never starting a new owner


def exiting() -> bool:
    """Whether this process's exit began: a pickle goes by value now (no new owner, no keeper)."""
    return _exiting


def owner() -> Owner:
    """This process's owner, made on first use."""
    global _owner
    if _exiting:
        raise ShmshareError("the process is exiting: no new handles (the array goes by value)")
    got = _owner
    if got is not None and got.pid == os.getpid() and not got.closed:
        return got
    with _owner_lock:
        if _owner is None or _owner.pid != os.getpid() or _owner.closed:
            _owner = Owner()
        return _owner


def current_owner() -> Owner | None:
    got = _owner
    return got if got is not None and got.pid == os.getpid() else None


def close_owner(linger: float, exiting: bool = False) -> None:
    global _owner, _exiting
    if exiting:
        _exiting = True
    with _owner_lock:
        got, _owner = current_owner(), None
    if got is not None and not (exiting and keep_after_exit(got, linger)):
        got.close(linger)


_inherited: list[Any] = []  # in a forked child: the parent's segments arrays of ours point into


def _after_fork_in_child() -> None:
    global _owner, _owner_lock, _exiting
    _owner_lock = threading.Lock()
    _exiting = False
    got, _owner = _owner, None
    if got is None or got.pid == os.getpid():
        return
    if got.server is not None:
        got.server.forget_in_child()  # the parent's sockets: closed here, served there
    # The parent's fds are not ours to hold (they would pin its pool's memory while we live):
    # forget them all, and keep mapped only what an array from empty() may point into.
    in_use = {h.seg.id for h in got.pool.held.values() if h.local}
    _inherited.append(got._provider.after_fork_in_child(in_use))
    got.table.segment._forget_after_fork()
    got.table.close()  # nothing of the child's points into the parent's table
    got.claims.forget_in_child()
    got._torch_segs.forget()


def _locks_to_hold() -> list[Any]:
    # the module's lock first (owner() makes an Owner under it), then the owner's own (place()
    # makes its server, and copies, under it): fork waits for a first put's setup to end
    got = _owner
    return [_owner_lock] + ([got._lock] if got is not None and got.pid == os.getpid() else [])


def _after_fork_in_parent() -> None:
    got = current_owner()
    if got is not None and not got.closed:
        got.forked()


_fork.on_fork_in_child(6, _after_fork_in_child)
_fork.on_fork_in_parent(_after_fork_in_parent)
_fork.hold_across_fork(6, _locks_to_hold)
# tempfile's first gettempdir() takes its module lock and tries the candidate directories: done
# now, at import, not by a Queue's feeder thread that a fork may interrupt (a child would start
# with that lock held, and hang at its own first handle)
tempfile.gettempdir()
