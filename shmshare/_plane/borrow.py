"""The borrowing side of the plane: what one process maps of its lenders' segments, and what
each lender may make it hold.

Note [One borrower]
    Every service that receives shared memory from another process -- the
    channel's ``Receiver`` (from its senders), the multiprocessing client
    (from the owners of the handles it unpickles) and the store's client
    (from its daemon) -- maps segments a lender sent as fds, keeps one
    mapping per segment for every view of it, and forgets it when the
    lender says it is gone. The lender may be hostile (Note [Trust no fd])
    and may announce segments without end (Note [Caps per peer]). So the
    three hold the same objects, kept here:

    - :class:`Lender`: one lender as a borrower knows it (who it is, what
      its segments cost here);
    - :class:`Caps` and :class:`Charge`: what all lenders together hold,
      against the caps; a segment's charge is added before it is mapped
      and taken off only once its mapping is gone (its root Lease's
      callback), not when the lender drops it: the borrower's arrays keep
      a dropped segment mapped;
    - :class:`Borrowed`: the root Leases of one lender's segments, by id;
      ``map()`` checks a fd (``trust.check_fd``), charges the caps, maps it
      (read-only unless writable) and keeps no fd.

    The channel's segments are richer (expandable ranges, pinning), so its
    ``RxSegment`` keeps its own record, charged through the same Caps.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable

from .. import _native
from .._errors import ProtocolError
from .._fd import Fd
from ..segment import Flags, Segment
from .trust import check_fd, default_max_peer_bytes, default_max_peer_segments, locally

__all__ = ["Lender", "Caps", "Charge", "Borrowed", "default_caps", "populate"]

_TOTAL_PEERS_SHARE = 4  # all lenders together may hold this many times one lender's caps


class Lender:
    """One lender as a borrower knows it, named `name` in errors: what its segments cost here
    (Note [Caps per peer])."""

    __slots__ = ("name", "reserved", "nmaps", "__weakref__")

    def __init__(self, name: str = "the lender") -> None:
        self.name = name
        self.reserved = 0  # bytes of address space its segments take here
        self.nmaps = 0  # mappings its segments take here

    @property
    def who(self) -> str:
        """Name the lender in an error (the channel's senders say their current pid)."""
        return self.name


class Charge:
    """What one segment costs its borrower, until its mapping is gone (Note [Caps per peer]).

    Called as the on_release of the segment's root Lease -- at any bytecode
    of any thread (the garbage collector) -- so it only queues itself; the
    caps take the charge off at their next ``charge()``.
    """

    __slots__ = ("peer", "nbytes", "nmaps", "done")

    def __init__(self, peer: Lender, nbytes: int, nmaps: int,
                 done: collections.deque[Charge]) -> None:
        self.peer, self.nbytes, self.nmaps, self.done = peer, nbytes, nmaps, done

    def __call__(self) -> None:
        self.done.append(self)


class Caps:
    """What all lenders hold here, against the caps (Note [Caps per peer]). `hint` ends the
    error: how the borrower raises a cap."""

    def __init__(self, max_peer_bytes: int, max_peer_segments: int,
                 hint: str = "raise it (listen(..., max_peer_bytes=)) or give the sender a "
                             "smaller pool (limit=)") -> None:
        self.max_peer_bytes = max_peer_bytes
        self.max_peer_segments = max_peer_segments
        self.hint = hint
        self.reserved = self.nmaps = 0  # what all lenders together hold
        self.uncharged: collections.deque[Charge] = collections.deque()  # mappings gone

    def new_charge(self, peer: Lender) -> Charge:
        """Return an empty charge for a segment of `peer`'s."""
        return Charge(peer, 0, 0, self.uncharged)

    def add(self, charge: Charge, nbytes: int, nmaps: int) -> None:
        charge.nbytes += nbytes
        charge.nmaps += nmaps
        charge.peer.reserved += nbytes
        charge.peer.nmaps += nmaps
        self.reserved += nbytes
        self.nmaps += nmaps

    def settle(self) -> None:
        """Take off the charges of the mappings gone since."""
        done = self.uncharged
        while done:
            c = done.popleft()
            self.add(c, -c.nbytes, -c.nmaps)

    def charge(self, peer: Lender, nbytes: int, nmaps: int) -> None:
        """Refuse what would take `peer`, or all lenders, past the caps (Note [Caps per peer])."""
        self.settle()
        if peer.reserved + nbytes > self.max_peer_bytes:
            raise ProtocolError(
                f"{peer.who} announced segments of {peer.reserved + nbytes} bytes in all, past "
                f"this receiver's max_peer_bytes={self.max_peer_bytes}; {self.hint}")
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


def default_caps(hint: str) -> Caps:
    """Caps that follow the host (Note [Caps per peer]); `hint` says how to raise them."""
    return Caps(default_max_peer_bytes(), default_max_peer_segments(), hint)


class Borrowed:
    """The root Leases of one lender's segments as mapped here, by segment id (Note [One
    borrower]). Every view of a segment owns its root, and the root the mapping: a segment
    forgotten here stays mapped while views of it live, and its charge goes with the mapping."""

    __slots__ = ("lender", "caps", "roots")

    def __init__(self, lender: Lender, caps: Caps) -> None:
        self.lender = lender
        self.caps = caps
        self.roots: dict[int, _native.Lease] = {}

    def get(self, seg_id: int) -> _native.Lease | None:
        return self.roots.get(seg_id)

    def __len__(self) -> int:
        return len(self.roots)

    def map(self, seg_id: int, fd: Fd, size: int, *, writable: bool, trust_unsealed: bool = False,
            backed: int | None = None, charged: bool = True) -> _native.Lease:
        """Check `fd` (Note [Trust no fd]), charge the caps (unless not `charged`), map `size`
        bytes of it shared and keep the root as `seg_id`'s. The fd is taken: closed once mapped,
        as on any error."""
        try:
            if seg_id in self.roots:
                raise ProtocolError(f"{self.lender.who} sent segment {seg_id} again")
            if charged:
                self.caps.charge(self.lender, size, 1)
            check_fd(fd.fileno(), size, trust_unsealed=trust_unsealed, writable=writable,
                     backed=backed)
            flags = Flags.FROMFD if writable else Flags.FROMFD | Flags.READONLY
            seg = locally(Segment.from_fd, fd, size, flags)
        except BaseException:
            fd.close()
            raise
        try:
            charge = self.caps.new_charge(self.lender) if charged else None
            root = _native.Lease(seg.lease, seg.address, seg.size, not writable, charge)
            if charge is not None:
                self.caps.add(charge, size, 1)
        finally:
            seg.close()  # no fd kept: the root keeps the mapping while views of it live
        self.roots[seg_id] = root
        return root

    def map_private(self, fd: Fd, size: int, on_release: Callable[[], None] | None = None
                    ) -> _native.Lease:
        """A copy-on-write mapping of `fd`'s first `size` bytes after the same check, kept by
        its views only (asked for by the borrower, one per view: not charged)."""
        check_fd(fd.fileno(), size, trust_unsealed=False, writable=False)
        address = _native.mmap(size, fd.fileno(), 0, writable=True, shared=False)
        return _native.Lease(None, address, size, False, on_release, unmap=True)

    def drop(self, seg_id: object) -> _native.Lease | None:
        """The lender let go of `seg_id`: forget its root, and return it (its views keep the
        mapping; the caller may let the last reference go where an munmap may take time)."""
        return self.roots.pop(seg_id, None) if type(seg_id) is int else None

    def __contains__(self, seg_id: object) -> bool:
        return seg_id in self.roots

    def clear(self) -> None:
        self.roots.clear()


def populate(root: _native.Lease, off: int, size: int) -> None:
    """Fill this process's page tables for `size` bytes at `off` of a mapped segment (the store's
    ``get(..., populate=True)``).

    Note [Populate on request]
        The store's get maps an object's segment (once per segment) but
        leaves its pages to fault in as they are read: ``get(...,
        populate=True)`` asks the kernel for them all at once
        (``MADV_POPULATE_READ``; by hand, a read of each page, where the
        kernel lacks it), on up to 4 threads from 16 MiB on, so that the
        reads after it take no fault. It is not faster here: through the
        store (a client process, get then a read of a byte a page, medians
        of 4), 64 MiB took 5.1 ms without, 6.7 ms populated on 2 threads,
        8.0 ms on one; 256 MiB 13.6, 14.6 and 25.5 ms. The kernel's
        fault-around maps 16 pages a fault, which populating does not use,
        and a pre-read on 2 threads was no faster either (6.5 and 14.8 ms).
        So it is for a reader that must not fault later (the faults taken
        before a timed section) or a kernel whose faults cost more, not a
        default and not a size rule. It is advice: where the kernel cannot
        populate, the get returns all the same and the pages fault in as
        they are read.
    """
    page = _native.PAGE_SIZE
    start = root.address + off
    lo = start - start % page  # the mapping starts on a page: lo stays within it
    hi = min(root.address + root.nbytes, -(-(start + size) // page) * page)
    threads = 1 if size < _POPULATE_THREADS_FROM else min(4, os.cpu_count() or 1)
    with contextlib.suppress(OSError):
        _native.prefault(lo, hi - lo, threads)


_POPULATE_THREADS_FROM = 16 << 20  # bytes from which populating runs on several threads
