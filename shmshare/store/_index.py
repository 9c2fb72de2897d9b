"""Gets without a round trip: the daemon's index of published objects, and each client's counts.

Note [Gets without a round trip]
    A client that has got an object once knows where it lies (its segment,
    offset, size and meta). A later get of the same name needs only two
    answers from the daemon -- is the name still that object, there? and
    will the object stay while the views live? -- and both are in shared
    memory:

    - the *index*: a memfd of SLOTS 8-byte words that only the daemon
      writes (clients map it ``PROT_READ``). A published object has a slot,
      and its word holds the object's *generation*, a number never used
      twice. The daemon zeroes the word (*retires* it) before the name goes
      or the bytes move (delete, replace, evict, abort, spill), and writes
      a new generation when the object is published again (a spilled
      object read back).
    - each client's *counts*: a memfd of SLOTS words that only that client
      writes (the daemon maps it ``PROT_READ``), one count per slot of the
      views its fast gets hold.

    A fast get adds 1 to its count for the slot, then loads the index's
    word; if that is the generation it cached, the views are made from the
    cached location; else it takes the 1 back and asks the daemon. The
    daemon, before it frees an object or moves its bytes, retires its slot
    and then reads every client's count for it: a count above 0 holds the
    object as a reference does (it is freed later, once the counts are
    0: looked at every HELD_POLL s, and when a client goes). Both sides use
    sequentially consistent atomics (``add64``, ``load64``, ``store64``),
    so of a client's add-then-load and the daemon's retire-then-read, at
    least one sees the other's write (Dekker): a client that saw its
    generation is counted, and a count that came too late is taken back by
    a client that sees the word retired.

    Neither side trusts the other's memory: a client compares the index's
    word with a generation the daemon gave it in a reply, and uses only a
    location from that reply, in a segment the daemon sent it; the daemon
    reads counts as numbers, so a hostile client can pin objects only as
    its gets could, until it goes. A slot is reused only once its object
    is freed (every count 0), under a new generation.

    A fast get does not move the object in the LRU of ``--evict`` and
    ``--spill``; the views it makes are counted in ``info().refs``. Torch
    objects (a copy-on-write mapping per get) and empty ones are always
    got from the daemon.
"""

from __future__ import annotations

import fcntl
import itertools
import os
from typing import Any

import numpy as np

from .. import _native
from .._fd import Fd
from .._plane.trust import check_fd
from ._packing import new_memfd, reserve

__all__ = ["SLOTS", "HELD_POLL", "DaemonIndex", "map_counts", "new_counts"]

SLOTS = 1 << 14  # published objects at once (more are got through the daemon, as before)
WORDS = SLOTS * 8  # bytes of the index, and of each client's counts
HELD_POLL = 0.02  # s between looks at objects a fast get's views still hold
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def new_counts() -> tuple[int, int]:
    """A client's counts: (a memfd of WORDS bytes, every page there and sealed against resizing,
    its address mapped read-write here). The caller owns both."""
    fd = _new(WORDS, "the store client's counts of fast gets")
    try:
        return fd, _native.mmap(WORDS, fd, 0, writable=True, shared=True)
    except BaseException:
        os.close(fd)
        raise


def _new(nbytes: int, what: str) -> int:
    fd = new_memfd(nbytes, what)  # sealed against shrinking and growing
    try:
        reserve(fd, nbytes, what)  # every page there: a reader never faults one in (SIGBUS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_counts(fd: Fd) -> Any:
    """A client's counts as the daemon maps them: PROT_READ, after the checks every fd from a
    peer gets (a memfd sealed against shrinking, every page there: no SIGBUS here)."""
    try:
        check_fd(fd.fileno(), WORDS, trust_unsealed=False, writable=False, backed=WORDS)
        address = _native.mmap(WORDS, fd.fileno(), 0, writable=False, shared=True)
    finally:
        fd.close()
    return _native.Lease(None, address, WORDS, True, None, unmap=True)


class DaemonIndex:
    """The index (written here only) and the slots' books."""

    def __init__(self) -> None:
        self.fd = _new(WORDS, "the store's index")
        self.address = _native.mmap(WORDS, self.fd, 0, writable=True, shared=True)
        # written through this mapping only: no write(), no new writable mapping, not even of
        # a client's fd reopened read-write through /proc (a forged generation), no more seals
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        self.ro_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._free = list(range(SLOTS - 1, -1, -1))  # slots to hand out, lowest first
        self._gens = itertools.count(1)
        self.counts: dict[int, Any] = {}  # client id -> its counts (a Lease, PROT_READ)

    def publish(self, slot: int) -> tuple[int, int]:
        """A slot (a new one if `slot` < 0) with a new generation; (slot, generation), or
        (-1, 0) when every slot is taken."""
        if slot < 0:
            if not self._free:
                return -1, 0
            slot = self._free.pop()
        gen = next(self._gens)
        _native.store64(self.address + 8 * slot, gen)
        return slot, gen

    def retire(self, slot: int) -> None:
        """No fast get may start on this slot's object any more."""
        if slot >= 0:
            _native.store64(self.address + 8 * slot, 0)

    def held(self, slot: int) -> bool:
        """Whether a client's views hold the slot's object (call after :meth:`retire`)."""
        if slot < 0:
            return False
        off = 8 * slot
        return any(_native.load64(c.address + off) for c in self.counts.values())

    def still_held(self, slots: list[int]) -> set[int]:
        """Which of `slots` some client's views hold (after :meth:`retire`): one look per
        client at all of them, so that many held objects and many clients stay cheap."""
        if not slots or not self.counts:
            return set()
        want = np.asarray(slots, np.intp)
        held = np.zeros(len(slots), bool)
        for c in self.counts.values():
            held |= np.frombuffer(memoryview(c), np.uint64)[want] != 0
        return {s for s, h in zip(slots, held.tolist(), strict=True) if h}

    def count(self, slot: int) -> tuple[int, set[int]]:
        """(views held through fast gets, the clients holding them) of a slot (for info)."""
        if slot < 0:
            return 0, set()
        off = 8 * slot
        got = {cid: _native.load64(c.address + off) for cid, c in self.counts.items()}
        held = {cid: min(x, 1 << 32) for cid, x in got.items() if x}  # a number, nothing more
        return sum(held.values()), set(held)

    def free(self, slot: int) -> None:
        """The slot's object is freed: the slot may serve another."""
        if slot >= 0:
            _native.store64(self.address + 8 * slot, 0)
            self._free.append(slot)

    def close(self) -> None:
        self.counts.clear()
        _native.unmap(self.address, WORDS, release=True)
        os.close(self.ro_fd)
        os.close(self.fd)
