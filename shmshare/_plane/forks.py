"""Blocks a forked child may still map: kept out of a lender's pool until it is gone.

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

    The channel's sender and the multiprocessing owner both hold one, as their
    ``LendingPool``'s retirer (``pool.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._procfs import pid_alive as alive

__all__ = ["ForkBook"]

_SWEEP = 1.0  # s between two looks at whether retired blocks' children are gone


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

    def busy(self) -> bool:
        """Whether any block is marked or retired (else :meth:`retire` and :meth:`free_now` do nothing)."""
        return bool(self._marked or self._retired)

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
