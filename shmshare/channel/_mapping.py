"""A receiver's mappings of a sender's segments: new ones, grown ranges, dropped ones.

Every check here is of what a hostile sender could announce (Note [Trust no
fd] and Note [Caps per peer] in ``_plane/trust.py``); a pinned receiver also
page-locks each classic segment it maps (Note [Fenced releases]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _native, wire
from .._errors import ProtocolError
from .._plane.trust import check_fd, locally
from ..segment import Flags, Segment
from ._books import GROW_MAPS, Peer, RxSegment
from ._protocol import DROP, GROW

if TYPE_CHECKING:
    from ._receiver import Receiver

__all__ = ["map_new", "grow_and_drop", "segment_of"]


def grow_and_drop(rx: Receiver, peer: Peer, header: dict[str, Any]) -> None:
    """Map the expandable ranges a batch announces, and forget the segments it drops."""
    for seg_id, offset, nbytes in header.get(GROW, ()):
        rec = segment_of(peer, seg_id)
        if not rec.expandable:
            raise ProtocolError(f"growth announced for segment {seg_id}, which is not expandable")
        if (type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes <= 0
                or offset + nbytes > rec.size or (offset | nbytes) % _native.PAGE_SIZE):
            raise ProtocolError(f"growth [{offset!r}, +{nbytes!r}) of segment {seg_id} is not "
                                "whole pages inside it")
        rx._caps.charge(peer, 0, GROW_MAPS)
        spans = rec.with_range(offset, offset + nbytes)
        check_fd(rec.seg.fileno(), offset + nbytes, trust_unsealed=rx._trust_unsealed,
                 writable=rx._writable, backed=sum(hi - lo for lo, hi in spans))
        locally(rec.seg.map_range, offset, nbytes)
        rec.mapped = spans
        rx._caps.add(rec.charge, 0, GROW_MAPS)
    for seg_id in header.get(DROP, ()):
        gone = peer.segments.pop(seg_id, None)
        if gone is not None:  # its charge goes with its mapping, when its arrays do
            gone.seg.close()  # its arrays keep the mapping; an expandable one's fd goes now
            if rx._fences is not None:
                rx._fences.on_unmap(gone.pin)


def map_new(rx: Receiver, peer: Peer, new: Any, fds: list[wire.Fd]) -> None:
    """Check and map the segments a batch announces, taking their fds."""
    if len(new) != len(fds):
        raise ProtocolError(f"{len(new)} new segments were announced with {len(fds)} fds")
    for (seg_id, size, expandable), fd in zip(new, fds, strict=True):
        if type(size) is not int or size <= 0 or seg_id in peer.segments:
            raise ProtocolError(f"a malformed announcement of segment {seg_id!r} "
                                f"({size!r} bytes)")
        rx._caps.charge(peer, size, 0 if expandable else 1)
        check_fd(fd.fileno(), 0 if expandable else size,
                 trust_unsealed=rx._trust_unsealed, writable=rx._writable)
        flags = Flags.FROMFD if rx._writable else Flags.FROMFD | Flags.READONLY
        # The Fd is taken, never dup'ed: a classic segment's is closed once mapped, an
        # expandable one's is kept by its Segment to map the ranges announced later.
        seg = locally(Segment.from_fd, fd, size, flags, reserve=bool(expandable))
        charge = rx._caps.new_charge(peer)
        peer.segments[seg_id] = RxSegment(seg, charge, not rx._writable)
        rx._caps.add(charge, size, 0 if expandable else 1)
        if not expandable:
            seg.close()  # no fd to close any more; the Lease keeps the mapping
            if rx._fences is not None:
                rec = peer.segments[seg_id]
                rec.pin = rx._fences.on_map(rec.address, rec.size, rec.root, rec.readonly)


def segment_of(peer: Peer, seg_id: int) -> RxSegment:
    """Return `peer`'s segment `seg_id`; a segment never announced breaks the protocol."""
    try:
        return peer.segments[seg_id]
    except KeyError:
        raise ProtocolError(f"{peer.who} referred to segment {seg_id}, which it never "
                            "announced or already dropped") from None
