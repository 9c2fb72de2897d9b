"""The receiver's books: each sender and the segments it announced.

A sender is a :class:`Lender` and its segments are charged to the plane's
:class:`Caps` (Note [One borrower] in ``_plane/borrow.py``; Note [Caps per
peer] in ``_plane/trust.py``): a segment's charge is added before it is mapped
and taken off only when its mapping is gone.
"""

from __future__ import annotations

import bisect
import os

from .. import _native, wire
from .._plane.borrow import Caps, Charge, Lender
from ..segment import Segment

__all__ = ["Caps", "Charge", "Peer", "RxSegment", "GROW_MAPS"]  # Caps, Charge: the plane's

GROW_MAPS = 2  # mappings one announced range may cost (it splits the reservation around it)


class RxSegment:
    """A sender's segment as mapped here: its Segment and the root Lease over the whole range."""

    __slots__ = ("seg", "root", "address", "size", "expandable", "mapped", "charge", "readonly", "pin")

    def __init__(self, seg: Segment, charge: Charge, readonly: bool) -> None:
        self.seg = seg  # owns the mapping, and an expandable segment's fd (new ranges come from it)
        # Every array's Lease owns this root, and the root the Segment's own: the mapping
        # outlives the sender, and the charge is given back when the mapping goes.
        self.root = _native.Lease(seg.lease, seg.address, seg.size, readonly, charge)
        self.address = seg.address
        self.size = seg.size
        self.expandable = seg.expandable
        self.mapped: list[tuple[int, int]] = [] if self.expandable else [(0, self.size)]  # merged
        self.charge = charge
        self.readonly = readonly
        self.pin: object = None  # a pinned receiver's registration (Note [Fenced releases])

    def with_range(self, start: int, end: int) -> list[tuple[int, int]]:
        """Return the mapped ranges with [start, end) added, touching ranges merged."""
        spans = sorted([*self.mapped, (start, end)])
        merged = [spans[0]]
        for lo, hi in spans[1:]:
            if lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
            else:
                merged.append((lo, hi))
        return merged

    def covers(self, start: int, end: int) -> bool:
        """Return whether [start, end) lies in one mapped range (reading elsewhere would fault)."""
        i = bisect.bisect_right(self.mapped, (start, float("inf"))) - 1
        return i >= 0 and self.mapped[i][0] <= start and end <= self.mapped[i][1]


class Peer(Lender):
    """One sender, as the receiver knows it."""

    __slots__ = ("conn", "number", "segments", "bye")

    def __init__(self, conn: wire.Connection, number: int) -> None:
        super().__init__()
        self.conn = conn
        self.number = number  # Receiver.recv_from and tell name senders by it
        self.segments: dict[int, RxSegment] = {}
        self.bye = False

    @property
    def who(self) -> str:
        """Name the sending process: the pid of its last HELLO, not the socket's creator.

        A ``channel()`` socketpair is created by the receiver's own process, so
        its SO_PEERCRED pid is ours until the sender introduces itself.
        """
        hello = self.conn.peer_hello
        if hello is not None and isinstance(hello.get("pid"), int):
            return f"the sender (pid {hello['pid']})"
        pid = self.conn.peer_cred.pid
        if pid == os.getpid():
            return "the sender (which never sent anything)"
        return f"the sender (pid {pid})"
