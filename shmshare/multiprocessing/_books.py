"""Two small books of the owner's: slots lent on for a peer, and blocks a forked child inherited.

Note [Lends and who asked]
    A slot lent on (Note [Lending on] in ``_storages.py``) is pending until
    the process that the asking peer sent the handle to claims it. The asker
    may die first, or be a hostile peer asking again and again: its claim
    map is memory it writes itself, so the owner's checks cannot prove it
    holds the lease it names. So each lent slot remembers its asker; a peer
    may have at most ``MAX_LENDS`` of its lends unclaimed at once, and when
    the asker's process is gone, those of its lends still unclaimed are
    given back (as its claims are). What a lend can cost is then a block
    pinned while the asker lives.

Note [Blocks a child inherits]
    A child forked while a block is in use here (a tensor whose storage
    moved into the pool, an array from ``empty()``) maps it through its copy
    of our mapping, as torch's children map shared storages they inherit,
    for as long as it lives, without telling us. So at each fork the blocks
    in use are marked with the child just made (the pids new in its
    ``/proc/self/task/*/children``); once dropped here, a marked block is
    retired, not reused, until none of those children lives, and only then
    goes back to the pool (``close()`` frees the rest: our side unmapped,
    a child's mapping keeps the pages).
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

from ._common import alive

__all__ = ["LendBook", "ForkBook", "MAX_LENDS"]

MAX_LENDS = 4096  # a peer's lends not yet claimed (Note [Lends and who asked])
_SWEEP = 1.0  # s between two looks at whether retired blocks' children are gone


class LendBook:
    """Slots lent on, by the claim map of the process that asked (the owner's lock held)."""

    def __init__(self) -> None:
        self._asker: dict[int, Any] = {}  # slot -> the asker's ClaimMap
        self._count: collections.Counter[int] = collections.Counter()  # ClaimMap key -> lends out

    def allow(self, cm: Any) -> bool:
        return self._count[cm.key] < MAX_LENDS

    def note(self, slot: int, cm: Any) -> None:
        self._asker[slot] = cm
        self._count[cm.key] += 1

    def forget(self, slot: int) -> None:
        """Slot `slot` was claimed or given back: no longer the asker's."""
        cm = self._asker.pop(slot, None)
        if cm is not None:
            self._count[cm.key] -= 1
            if self._count[cm.key] <= 0:
                del self._count[cm.key]

    def of(self, cm: Any) -> list[int]:
        """The slots lent on for `cm`'s process."""
        return [slot for slot, asker in self._asker.items() if asker is cm]


class ForkBook:
    """Blocks in use at a fork, and those retired since (Note [Blocks a child inherits])."""

    def __init__(self) -> None:
        self._marked: dict[int, frozenset[int]] = {}  # block address -> children at the fork
        self._retired: list[tuple[Any, frozenset[int]]] = []  # (block, children) not reusable yet
        self._swept = 0.0
        self._kids: frozenset[int] = frozenset()  # the children at the last fork

    def forked(self, addrs: list[int]) -> None:
        now = _children()
        kids, self._kids = now - self._kids, now  # the new one(s): older ones never mapped these
        for addr in addrs:
            self._marked[addr] = self._marked.get(addr, frozenset()) | kids

    def retire(self, addr: int, block: Any) -> bool:
        """True if the block at `addr`, dropped here, must wait for children that may map it."""
        kids = self._marked.pop(addr, None)
        if kids is None or not any(map(alive, kids)):
            return False
        self._retired.append((block, kids))
        return True

    def free_now(self, force: bool = False) -> list[Any]:
        """The retired blocks whose children are all gone (all of them with `force`)."""
        now = time.monotonic()
        if not self._retired or (not force and now - self._swept < _SWEEP):
            return []
        self._swept = now
        done = [b for b, kids in self._retired if force or not any(map(alive, kids))]
        self._retired = [] if force else [(b, k) for b, k in self._retired if any(map(alive, k))]
        return done


def _children() -> frozenset[int]:
    """This process's children now (every thread's)."""
    kids: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                kids.update(int(p) for p in f.read().split())
    except OSError:
        pass  # no procfs or no children file: marked with none, reused at once (as before)
    return frozenset(kids)
