"""A lender's segments by address, and what its borrower knows of them.

A segment's fd crosses to a borrower once, with the first message that has
an array in it; the ranges an expandable segment maps later follow, and a
segment the pool gives back is named so the borrower can forget it (the
channel's ``"s"``, ``"g"``, ``"d"``: ``channel/_protocol.py``). The
allocator tells of each segment event through the provider's listeners;
this book turns them into what the next message says (:meth:`pending`).
"""

from __future__ import annotations

import bisect
from typing import Any

from ..memory import ShmSegment

__all__ = ["SegmentBook"]


class SegmentBook:
    """Segments sorted by address, and the announcements pending for the receiver."""

    __slots__ = ("announced", "to_announce", "grow", "drop", "count", "_addrs", "_segs")

    def __init__(self) -> None:
        self.announced: set[int] = set()  # ids of segments the receiver has mapped
        self.to_announce: list[ShmSegment] = []  # wanted by the batch being packed
        self.grow: list[list[int]] = []  # [id, offset, nbytes] mapped since the last header
        self.drop: list[int] = []  # ids given back since the last header
        self.count = 0  # segments announced so far
        self._addrs: list[int] = []  # sorted start addresses of our segments
        self._segs: list[ShmSegment] = []  # parallel to _addrs

    def segment_of(self, address: int) -> ShmSegment:
        """Return the segment that `address` lies in."""
        return self._segs[bisect.bisect_right(self._addrs, address) - 1]

    def knows(self, seg: ShmSegment) -> bool:
        """Whether the receiver has (or is about to have) `seg` mapped."""
        return seg.id in self.announced or seg in self.to_announce

    def pending(self) -> tuple[list[list[Any]], list[list[int]], list[int], list[int]]:
        """What the borrower is still to hear: the new segments ``[id, size, expandable]``, the
        ranges mapped ``[id, offset, nbytes]`` (a new expandable segment's included), the
        segments given back, and the new segments' fds (in the order of the first list)."""
        grow = list(self.grow)
        new = [[s.id, s.size, s.expandable] for s in self.to_announce]
        grow += [[s.id, off, n] for s in self.to_announce if s.expandable
                 for off, n in sorted(s.mapped.items())]
        return new, grow, list(self.drop), [s.fd for s in self.to_announce]

    def commit(self) -> None:
        """The header went out: what was pending is known now."""
        for s in self.to_announce:
            self.announced.add(s.id)
        self.count += len(self.to_announce)
        self.to_announce.clear()
        self.grow.clear()
        self.drop.clear()

    def on_segment_event(self, kind: str, seg: ShmSegment, offset: int, nbytes: int) -> None:
        """The provider's listener: keep the index, and what the receiver must be told."""
        if kind in ("segment_alloc", "segment_reserve"):
            i = bisect.bisect_left(self._addrs, seg.address)
            self._addrs.insert(i, seg.address)
            self._segs.insert(i, seg)
        elif kind == "segment_map" and seg.id in self.announced:
            self.grow.append([seg.id, offset, nbytes])
        elif kind == "segment_free":
            i = bisect.bisect_left(self._addrs, seg.address)
            del self._addrs[i], self._segs[i]
            if seg.id in self.announced:
                self.announced.discard(seg.id)
                self.drop.append(seg.id)
            self.grow[:] = [g for g in self.grow if g[0] != seg.id]
            if seg in self.to_announce:  # a send that failed wanted it; it is gone now
                self.to_announce.remove(seg)
