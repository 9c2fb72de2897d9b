"""The owner's book of slots lent on for a peer (and its ForkBook, the plane's).

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

Note [Blocks a child inherits] is in ``_plane/forks.py`` (the channel's sender keeps one too).
"""

from __future__ import annotations

import collections
from typing import Any

from .._plane.forks import ForkBook

__all__ = ["LendBook", "ForkBook", "MAX_LENDS"]  # ForkBook: the plane's (_plane/forks.py)

MAX_LENDS = 4096  # a peer's lends not yet claimed (Note [Lends and who asked])


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
