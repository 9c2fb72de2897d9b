"""What a batch's header tells the receiver of the sender's segments (``_protocol.py``).

A segment's fd crosses the socket once, in the header of the first batch
that has an array in it (``"s"``); the ranges an expandable segment maps
later follow as ``"g"``, and a segment the pool gives back as ``"d"``. The
sender's ``LendingPool`` keeps the book (``_plane/segments.py``); this puts
what it holds pending into a header.
"""

from __future__ import annotations

from typing import Any

from .._plane import SegmentBook
from ._protocol import DROP, GROW, NEW

__all__ = ["announce"]


def announce(book: SegmentBook, header: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """Add what `book` has pending to a batch's `header`; return it and the fds to send."""
    new, grow, drop, fds = book.pending()
    if new:
        header[NEW] = new
    if grow:
        header[GROW] = grow
    if drop:
        header[DROP] = drop
    return header, fds
