"""The receiver's books: each sender, the segments it announced, and what they cost here.

Note [Caps per peer] (in ``_plane/trust.py``) says why there are caps; here is how
they are kept: a segment's :class:`Charge` is added before it is mapped and
taken off only when its mapping is gone -- when the root Lease that every
array of it owns calls back -- not when the sender drops it, since a
receiver's arrays keep a dropped segment mapped.
"""

from __future__ import annotations

import bisect
import collections
import os

from .. import _native, wire
from .._errors import ProtocolError
from ..segment import Segment

__all__ = ["Caps", "Charge", "Peer", "RxSegment", "GROW_MAPS"]

GROW_MAPS = 2  # mappings one announced range may cost (it splits the reservation around it)
_TOTAL_PEERS_SHARE = 4  # all senders together may hold this many times one sender's caps


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


class Charge:
    """What one segment costs its receiver, until its mapping is gone (Note [Caps per peer]).

    Called as the on_release of the segment's root Lease -- at any bytecode
    of any thread (the garbage collector) -- so it only queues itself; the
    receiver takes the charge off at its next announcement.
    """

    __slots__ = ("peer", "nbytes", "nmaps", "done")

    def __init__(self, peer: Peer, nbytes: int, nmaps: int,
                 done: collections.deque[Charge]) -> None:
        self.peer, self.nbytes, self.nmaps, self.done = peer, nbytes, nmaps, done

    def __call__(self) -> None:
        self.done.append(self)


class Peer:
    """One sender, as the receiver knows it."""

    __slots__ = ("conn", "number", "segments", "bye", "reserved", "nmaps", "__weakref__")

    def __init__(self, conn: wire.Connection, number: int) -> None:
        self.conn = conn
        self.number = number  # Receiver.recv_from and tell name senders by it
        self.segments: dict[int, RxSegment] = {}
        self.bye = False
        self.reserved = 0  # bytes of address space its segments take here
        self.nmaps = 0  # mappings its segments take here

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


class Caps:
    """What all senders hold here, against the caps (Note [Caps per peer])."""

    def __init__(self, max_peer_bytes: int, max_peer_segments: int) -> None:
        self.max_peer_bytes = max_peer_bytes
        self.max_peer_segments = max_peer_segments
        self.reserved = self.nmaps = 0  # what all senders together hold
        self.uncharged: collections.deque[Charge] = collections.deque()  # mappings gone

    def new_charge(self, peer: Peer) -> Charge:
        """Return an empty charge for a segment of `peer`'s."""
        return Charge(peer, 0, 0, self.uncharged)

    def add(self, charge: Charge, nbytes: int, nmaps: int) -> None:
        charge.nbytes += nbytes
        charge.nmaps += nmaps
        charge.peer.reserved += nbytes
        charge.peer.nmaps += nmaps
        self.reserved += nbytes
        self.nmaps += nmaps

    def charge(self, peer: Peer, nbytes: int, nmaps: int) -> None:
        """Refuse what would take `peer`, or all senders, past the caps (Note [Caps per peer])."""
        done = self.uncharged
        while done:  # mappings gone since: their charges come off first
            c = done.popleft()
            self.add(c, -c.nbytes, -c.nmaps)
        if peer.reserved + nbytes > self.max_peer_bytes:
            raise ProtocolError(
                f"{peer.who} announced segments of {peer.reserved + nbytes} bytes in all, past "
                f"this receiver's max_peer_bytes={self.max_peer_bytes}; raise it (listen(..., "
                "max_peer_bytes=)) or give the sender a smaller pool (limit=)")
        if peer.nmaps + nmaps > self.max_peer_segments:
            raise ProtocolError(
                f"{peer.who} would need {peer.nmaps + nmaps} mappings here, past this "
                f"receiver's max_peer_segments={self.max_peer_segments}; raise it, or give the "
                "sender larger segments")
        if self.reserved + nbytes > _TOTAL_PEERS_SHARE * self.max_peer_bytes or \
                self.nmaps + nmaps > _TOTAL_PEERS_SHARE * self.max_peer_segments:
            raise ProtocolError(
                f"{peer.who} announced a segment past what all senders together may hold here "
                f"({self.reserved} bytes of address space and {self.nmaps} mappings held, at "
                f"most {_TOTAL_PEERS_SHARE}x max_peer_bytes / max_peer_segments); drop received "
                "arrays sooner, or raise the caps")
