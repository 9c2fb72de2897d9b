"""What a sender reports of the blocks it holds, and how a local view's death reaches it.

The blocks themselves (held, leased, spare) are the sender's ``LendingPool``'s
(``_plane/pool.py``, Note [Spare blocks] there).

Note [Callbacks from the garbage collector]
    A local array's Lease calls back when its last view dies, which can be in the middle of
    any bytecode of any thread. The callback therefore only appends to a deque (atomic, takes
    no lock); the sender drains it at its safe points (``send``, ``empty``, ``poll``), locked.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from .._errors import PoolExhausted
from .._plane import Held

__all__ = ["SenderStatistics", "ViewDied", "exhausted", "cannot_fit"]


@dataclass(frozen=True)
class SenderStatistics:
    """What a sender holds now (see ``Sender.statistics()``)."""

    messages_sent: int
    arrays_copied: int  # arrays copied into the pool by send() (small ones go inline instead)
    arrays_in_place: int  # arrays sent straight from the pool (empty()/zeros())
    leases_out: int  # arrays the receiver still holds
    bytes_leased: int  # pool bytes those arrays pin
    segments_announced: int  # segments whose fd crossed the socket
    reserved_bytes: int  # shared memory the pool holds
    allocated_bytes: int  # of which in use (spare blocks included)
    spare_bytes: int  # blocks kept for the next request of their size (_plane/pool.py)
    retired_bytes: int = 0  # blocks a receiver that went may still map: never reused, freed by close()
    arrays_inline: int = 0  # small arrays sent by value, in the frame (Note [Inline arrays] in tensors.py)


class ViewDied:
    """on_release of a local array (``empty()``): Note [Callbacks from the garbage collector]."""

    __slots__ = ("done", "sender", "held")

    def __init__(self, done: collections.deque[Held], sender: Any, held: Held) -> None:
        # Strong: a sender lives as long as an array from its empty() does (the array's Lease
        # owns the allocator; this keeps the sender too, so that a close() can find its books).
        self.done, self.sender, self.held = done, sender, held

    def __call__(self) -> None:
        self.done.append(self.held)
        if self.sender._reap:
            self.sender._reap_closed()  # closed: nobody else will take it in


def exhausted(nbytes: int, limit: int, leases: dict[int, Held], held: dict[int, Held],
              host: Exception | None, setting: str = "limit=") -> PoolExhausted:
    """The error of a pool that stayed full past a wait: what holds it, and what to do."""
    pinned = sum(h.block.size for h in set(leases.values()))
    local = sum(h.block.size for h in held.values() if h.local)
    if host is not None:
        return PoolExhausted(
            f"no shared memory for {nbytes} bytes within the timeout: {host}. Meanwhile the "
            f"receiver holds {pinned} bytes of this pool in {len(leases)} arrays, and "
            f"{local} bytes are in local arrays from empty()")
    return PoolExhausted(
        f"no room for {nbytes} bytes in the sender's pool (limit {limit} bytes) within "
        f"the timeout: the receiver still holds {pinned} bytes in {len(leases)} arrays, "
        f"and {local} bytes are in local arrays from empty(). Drop received arrays sooner, "
        f"raise {setting}, or send with a longer timeout")


def cannot_fit(nbytes: int, limit: int, rounded: int | None, host: Exception | None,
               setting: str = "limit=") -> PoolExhausted:
    """The error of an array that no wait can make room for: larger than the pool's limit, or
    than an empty pool once the request is rounded up to a whole segment (`rounded` bytes)."""
    if host is not None:
        return PoolExhausted(f"no shared memory for an array of {nbytes} bytes (the pool is "
                             f"empty): {host}")
    if rounded is None:
        return PoolExhausted(f"an array of {nbytes} bytes cannot fit in this sender's pool of "
                             f"{limit} bytes; create it with a larger {setting}")
    return PoolExhausted(f"an array of {nbytes} bytes cannot fit in this sender's pool of {limit} "
                         f"bytes even when it is empty: the pool rounds requests up to whole "
                         f"segments ({rounded} bytes here); create it with a {setting} of {rounded} "
                         "bytes or more")
