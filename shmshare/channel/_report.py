"""What a sender tells the stats socket: its leases out, and how old the oldest is.

Note [The age of a lease, for nothing]
    A sender keeps no time per lease: a clock read per array would cost the
    hot path (Note [Hot path] in ``__init__.py``) for a figure nobody may
    ever ask for. What it does keep is enough: lease ids grow by one per
    array (``pid << 32 | counter``), and ``Sender._leases`` holds the ones
    out in the order they were made. So while the stats thread runs, it
    notes about twice a second (``tick``) the newest lease out, ``(id,
    time)``. A lease ``L`` is then at least as old as the first note whose
    id is ``>= L``: that lease was made before the note, and ``L`` no later.
    The first note taken after ``L`` was made has an id ``>= L`` (``L``
    itself is out), so the figure is the true age less at most one tick.
    Notes older than the oldest lease out are dropped; past _MAX_NOTES, the
    first note (the oldest lease's) stays and every other one of the older
    half goes, keeping the later of each pair: a sender whose one lease is
    held for hours while others come and go keeps a few dozen notes, the
    oldest lease's age stays within a tick, and the next ones' ages are
    still lower bounds, only looser. Leases made before the stats thread
    started count from its first note.
"""

from __future__ import annotations

import collections
import time
from typing import Any

__all__ = ["SenderReport", "oldest_key"]

_MAX_NOTES = 64


class SenderReport:
    """The reporter of one sender (``_registry.register``): its figures, and the notes above."""

    __slots__ = ("notes",)

    def __init__(self) -> None:
        self.notes: collections.deque[tuple[int, float]] = collections.deque()  # (lease id, time)

    def tick(self, sender: Any, now: float) -> None:
        """Note the newest lease out now (the stats thread, about twice a second)."""
        leases = sender._leases
        newest = _newest_key(leases)
        notes = self.notes
        if newest is None:
            notes.clear()  # nothing out: every later lease is newer than any note
            return
        if not notes or notes[-1][0] != newest:
            notes.append((newest, now))
        oldest = oldest_key(leases)
        while len(notes) > 1 and oldest is not None and notes[0][0] < oldest:
            notes.popleft()
        if len(notes) > _MAX_NOTES:  # the first stays: it bounds the oldest lease
            first = notes.popleft()
            old = [notes.popleft() for _ in range(_MAX_NOTES // 2)]
            notes.extendleft(reversed(old[1::2]))  # the later of each pair: still a lower bound
            notes.appendleft(first)

    def __call__(self, sender: Any) -> dict[str, Any] | None:
        if sender._closed:
            return None  # its pool says what its local arrays still hold
        leases = sender._leases
        held = list(leases.values())  # one C call: no other thread runs in between (Note [Reporters])
        oldest = oldest_key(leases)
        return {
            "pool": id(sender._alloc),
            "state": "peer gone" if sender._peer_dead else "open",
            "messages_sent": sender._sent,
            "leases_out": len(held),
            "bytes_leased": sum(h.block.size for h in {id(h): h for h in held}.values()),
            "oldest_lease_s": self.age(oldest, time.monotonic()),
            "spare_bytes": sender._pool.spare_bytes,
        }

    def age(self, oldest: int | None, now: float) -> float | None:
        """At least how long lease `oldest` has been out at `now` (None: no lease; 0.0: under a tick)."""
        if oldest is None:
            return None
        for lease, at in list(self.notes):
            if lease >= oldest:
                return round(max(0.0, now - at), 3)
        return 0.0


def oldest_key(d: dict[Any, Any]) -> Any:
    """The first key of `d` (its oldest entry), or None; read from another thread without a lock."""
    for _ in range(3):
        try:
            return next(iter(d), None)
        except RuntimeError:  # changed size between iter() and next(): look again
            continue
    return None


def _newest_key(d: dict[Any, Any]) -> Any:
    for _ in range(3):
        try:
            return next(reversed(d), None)
        except RuntimeError:
            continue
    return None
