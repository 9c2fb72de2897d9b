"""What a sender reads from its receiver: releases, notes and a refusal (``_protocol.py``).

The receiver's frames are untrusted input like any peer's: a release must
name its leases in a list (unknown ids change nothing), notes unread are
capped at MAX_NOTES, and anything else of the wrong shape is a
ProtocolError, which ends the connection once (the sender says why ever
after).
"""

from __future__ import annotations

import collections
from typing import Any

from .._errors import ProtocolError, ShmshareError
from .._plane import LendingPool
from ._protocol import KIND, LEASES, MAX_NOTES, NOTE, REFUSE, RELEASE, RELEASE_CHUNK, VALUE, WHY

__all__ = ["Inbox", "REFUSED"]

REFUSED = "the receiver refused a batch from this sender and dropped the connection: "


class Inbox:
    """The sender's side of what comes back: releases go to its pool, notes wait for
    ``recv_note``, and a REFUSE frame's reason is kept."""

    __slots__ = ("pool", "notes", "refused")

    def __init__(self, pool: LendingPool) -> None:
        self.pool = pool
        self.notes: collections.deque[Any] = collections.deque()  # Receiver.tell's, unread
        self.refused: str | None = None  # a REFUSE frame's reason

    def take(self, header: dict[Any, Any], fds: list[Any]) -> None:
        """Take in one frame from the receiver (ProtocolError or TypeError: it is broken)."""
        for f in fds:
            f.close()
        kind = header.get(KIND)
        if kind == RELEASE:
            ids = header.get(LEASES)
            if type(ids) is not list:
                raise ProtocolError(f"a release frame's leases are a {type(ids).__name__}, not a list")
            if len(ids) > RELEASE_CHUNK:  # a receiver sends at most that many a frame
                raise ProtocolError(f"a release frame of {len(ids)} leases (at most {RELEASE_CHUNK})")
            self.pool.give_back(ids)
        elif kind == NOTE:
            if len(self.notes) >= MAX_NOTES:
                raise ProtocolError(f"the receiver sent more than {MAX_NOTES} notes that were "
                                    "never read")
            self.notes.append(header.get(VALUE))
        elif kind == REFUSE:
            self.refused = REFUSED + str(header.get(WHY))

    def refusal(self, conn: Any) -> str | None:
        """The receiver hung up: read what it said before it did; a REFUSE frame's reason, if any."""
        try:
            while self.refused is None and (got := conn.recv_nowait()) is not None:
                header, fds = got
                for f in fds:
                    f.close()
                if header.get(KIND) == REFUSE:
                    self.refused = REFUSED + str(header.get(WHY))
        except (ShmshareError, ValueError):
            pass  # end of stream, or a frame we cannot read: there is no reason to give
        return self.refused
