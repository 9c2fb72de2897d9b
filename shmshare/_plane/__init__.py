"""The data plane's core, under every service that lends shared memory to another process.

The channel's ``Sender``, the multiprocessing ``Owner`` and (in time) the
store's daemon each lend blocks of a pool to borrowers; what they have in
common lives here and they hold it, rather than each keeping a copy:

- :class:`LendingPool` (``pool.py``): the caching allocator over sealed
  memfds, the segments a borrower was told of (:class:`SegmentBook`,
  ``segments.py``), the blocks held by local views, by leases or as spares
  (Note [Spare blocks]).
- ``trust.py``: what a borrower checks of every fd a lender sends before
  it maps it, and the caps on what one peer may make it hold (Note [Trust
  no fd], Note [Caps per peer]).
- :class:`Borrowed`, :class:`Lender`, :class:`Caps` (``borrow.py``): what a
  borrower maps of each lender's segments, and what each lender may make it
  hold (Note [One borrower]).
- ``flusher.py``: the one release flusher (a thread per borrower, woken by a
  :class:`WakePipe`, ``wake.py``, safe to poke from a finalizer) that the
  channel's receiver, the multiprocessing client and the store's client
  each host (Note [One release path]).

Services sit above this layer and import from here, never from one another's
private modules (docs/architecture.md, the layers).
"""

from .borrow import Borrowed, Caps, Charge, Lender, default_caps
from .pool import SPARE_BYTES, Held, LendingPool, Retirer, host_cause
from .segments import SegmentBook
from .wake import WakePipe

__all__ = ["Borrowed", "Caps", "Charge", "Lender", "default_caps",
           "LendingPool", "Held", "Retirer", "SegmentBook", "SPARE_BYTES", "host_cause", "WakePipe"]
