"""What the owner's fd server and its peers say to each other, and the errors of handles.

Frames (msgpack headers on a ``wire.Connection``; nothing is pickled):

- peer -> owner ``{"k": "t"}``: the lease table, please; owner -> peer
  ``{"k": "t", "n": slots, "pid": owner pid}`` with the table's fd.
- peer -> owner ``{"k": "s", "i": segment id}``; owner -> peer ``{"k": "s",
  "i": id, "n": size}`` with the segment's fd, or ``{"k": "e", "w": why}``.
- peer -> owner ``{"k": "r", "l": [slot, gen, slot, gen, ...]}``: releases,
  never answered; only slots CLAIMED by the peer's own pid are taken.
- owner -> peer ``{"k": "d", "i": id}``: a segment the pool gave back (drop
  the mapping once no view uses it). Sent without waiting; may be lost.
"""

from __future__ import annotations

from .._errors import PeerDied, ShmshareError

__all__ = ["KIND", "TABLE", "SEGMENT", "ERROR", "RELEASE", "DROP", "OwnerGone", "HandleError"]

KIND = "k"
TABLE, SEGMENT, ERROR, RELEASE, DROP = "t", "s", "e", "r", "d"
MAX_RELEASES = 4096  # (slot, gen) pairs in one release frame


class OwnerGone(PeerDied):
    """A handle's owning process exited or was killed before the handle was unpickled."""


class HandleError(ShmshareError):
    """A handle that cannot be unpickled here: already unpickled once, stale, or malformed."""
