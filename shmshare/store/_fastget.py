"""A client's gets without a round trip (Note [Gets without a round trip] in ``_index.py``)."""

from __future__ import annotations

import collections
import os
import select
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native, tensors
from .._errors import ShmshareError
from .._plane.borrow import populate as populate_pages
from .._plane.trust import check_fd
from . import _inherited as inherited
from ._index import WORDS, new_counts
from ._packing import build

if TYPE_CHECKING:
    from ._client import Store

__all__ = ["FastGets", "MISS"]

MISS = object()  # not got here: ask the daemon
_KNOWN = 4096  # names a client remembers the place of
_HUP = select.POLLHUP | select.POLLERR
_LOOK_EVERY = 0.001  # s: a fast get looks whether the daemon hung up at most this often


class FastGets:
    """The client's side: its counts (written here), the daemon's index (read here), and the
    places of the objects it got (by name)."""

    __slots__ = ("counts", "index", "known", "tried", "fork_holds", "fork_pending", "poller",
                 "looked", "places")

    def __init__(self) -> None:
        self.counts: _native.Lease | None = None  # our counts, mapped read-write
        self.index: _native.Lease | None = None  # the daemon's index, mapped read-only
        # name -> (slot, generation, meta, segment, offset, size, one array's layout or None),
        # from the daemon's replies
        self.known: collections.OrderedDict[str, tuple[int, int, bytes, int, int, int, Any]] = \
            collections.OrderedDict()
        self.tried = False  # the daemon was asked for its index (once per connection)
        self.fork_holds: collections.deque[int] = collections.deque()  # counts held at fork
        self.fork_pending: collections.deque[int] = collections.deque()  # ... in its pipe yet?
        self.poller: Any = None  # on the daemon's socket: hung up?
        self.looked = 0.0  # when it was last seen not hung up
        self.places: dict[int, tuple[int, int]] = {}  # slot -> (address, size) of its object

    def set_up(self, store: Store, timeout: float | None) -> None:
        """Send our counts and map the daemon's index (under the Store's lock); on any trouble
        (no fd, an old daemon) gets go through the daemon, as they always could."""
        self.tried = True
        try:
            fd, address = new_counts()
        except (OSError, ShmshareError):
            return
        counts = _native.Lease(None, address, WORDS, False, None, unmap=True)
        try:
            h, fds = store._call_locked({"k": "fast"}, [fd], timeout)
        except (OSError, ShmshareError):
            return
        finally:
            os.close(fd)
        try:
            if len(fds) != 1 or h.get("n") != WORDS:
                return
            check_fd(fds[0].fileno(), WORDS, trust_unsealed=False, writable=False, backed=WORDS)
            index = _native.mmap(WORDS, fds[0].fileno(), 0, writable=False, shared=True)
        except (OSError, ShmshareError):
            return
        finally:
            for f in fds:
                f.close()
        self.index = _native.Lease(None, index, WORDS, True, None, unmap=True)
        self.counts = counts

    def remember(self, name: str, h: dict[Any, Any], root: _native.Lease) -> None:
        """Keep the place a get's reply gave (its value built from it already: the meta is
        sound), if the daemon published it for fast gets."""
        slot, gen = h.get("x"), h.get("g")
        if type(slot) is not int or type(gen) is not int or not 0 <= slot < WORDS // 8:
            return
        self.known[name] = (slot, gen, h["m"], h["i"], h["off"], h["s"], _one_array(h["m"]))
        self.places[slot] = (root.address + h["off"], h["s"])  # where its views lie (at fork)
        self.known.move_to_end(name)
        if len(self.known) > _KNOWN:
            self.known.popitem(last=False)

    def get(self, store: Store, name: str, populate: bool) -> Any:
        """The value under `name` from its remembered place, or MISS."""
        got = self.known.get(name)
        counts, index = self.counts, self.index
        if got is None or counts is None or index is None or store._closed:
            return MISS
        slot, gen, meta, seg, off, size, one = got
        root = store._segs.roots.get(seg)
        if root is None:
            return MISS
        now = time.monotonic()
        if now > self.looked + _LOOK_EVERY:  # the daemon's socket, at most this often
            if not self._connected(store):
                return MISS
            self.looked = now
        ref = counts.address + 8 * slot
        _native.add64(ref, 1)  # counted first, then looked at (the daemon: retire, then read)
        if _native.load64(index.address + 8 * slot) != gen:
            _native.add64(ref, -1)
            self.known.pop(name, None)
            return MISS
        # the count goes back when the views die: one atomic add, in any thread at any
        # bytecode (never from a forked child's inherited views: Unref knows a fork)
        # views keep the Store (hence the connection, whose end would free the objects) and
        # the counts' mapping, beyond the garbage collector's reach (a cycle it clears must
        # never unmap the word a view's count goes back to)
        done = _native.Unref(ref, counts, store)
        try:
            if populate:
                populate_pages(root, off, size)
            if one is None:  # (a forked child copies its views by our counts: in_child)
                return build(meta, root.address + off, size, root, True, done, True)
            lease = _native.Lease(root, root.address + off, size, True, done)
            shape, dtype, at, strides = one  # read-only: the lease is
            if strides is None:
                return np.ndarray(shape, dtype, lease, at)  # type: ignore[arg-type]
            return np.ndarray(shape, dtype, lease, at, strides)  # type: ignore[arg-type]
        except BaseException:
            done()
            raise

    def _connected(self, store: Store) -> bool:
        """Whether the daemon may still be there (its socket not hung up): a get of a dead
        daemon's object raises StoreGone from the slow path, as every request does."""
        if store._gone is not None:
            return False
        poller = self.poller
        if poller is None:
            poller = self.poller = select.poll()
            try:
                poller.register(store._conn._sock.fileno(), select.POLLIN)
            except (OSError, ValueError, AttributeError):
                return False
        try:
            return not any(ev & _HUP for _, ev in poller.poll(0))
        except RuntimeError:  # another thread polls it now: ask the daemon this time
            return False

    def out(self) -> bool:
        """Whether views of fast gets are alive (their counts not all back)."""
        counts = self.counts
        if counts is None:
            return False
        return bool(np.frombuffer(memoryview(counts), np.uint64).any())

    def hold_for_fork(self) -> bool:
        """Before a fork: one more count on every slot our views hold, until the children have
        copied theirs (:meth:`take_back`): our views may die before they copy. Whether any."""
        counts = self.counts
        if counts is None:
            return False
        slots = np.flatnonzero(np.frombuffer(memoryview(counts), np.uint64).copy())  # (others count meanwhile)
        for slot in slots:
            ref = counts.address + 8 * int(slot)
            _native.add64(ref, 1)
            self.fork_pending.append(ref)
        return len(slots) > 0

    def forked(self) -> None:
        """In the parent, once the fork's pipe is among those copies_made() waits for: the
        holds may be taken back after it."""
        while self.fork_pending:
            self.fork_holds.append(self.fork_pending.popleft())

    def take_back(self) -> None:
        """The counts held for forked children, once they copied (the flusher's, no lock held:
        it may wait for them)."""
        holds = []
        while self.fork_holds:
            holds.append(self.fork_holds.popleft())
        if not holds:
            return
        inherited.copies_made()  # every child forked before these holds moved, at least
        for ref in holds:
            _native.add64(ref, -1)

    def live_views(self) -> list[tuple[int, int]]:
        """(address, size) of the objects our views hold (counted), for a forked child to copy:
        an object whose count is above 0 cannot move, so its place is still the one kept."""
        counts = self.counts
        if counts is None:
            return []
        slots = np.flatnonzero(np.frombuffer(memoryview(counts), np.uint64).copy())  # (others count meanwhile)
        return [self.places[int(k)] for k in slots if int(k) in self.places]

    def drop(self) -> None:
        """The Store is shut down (no view of a fast get is alive): its mappings go."""
        self.known.clear()
        self.places.clear()
        self.counts = self.index = None
        self.poller = None

    def in_child(self) -> None:
        """In a forked child: nothing here is used again. The inherited views' counts are the
        parent's, and their releases (``_native.Unref``) do nothing here: made before the fork."""
        self.places.clear()
        self.known.clear()
        self.counts = self.index = None
        self.poller = None
        self.fork_holds.clear()
        self.fork_pending.clear()


class _One:
    __slots__ = ()


_ONE = _One()


def _one_array(meta: bytes) -> Any:
    """(shape, dtype, offset, strides or None) when `meta` is one plain numpy array of the
    object's bytes (the common value), to make it without decoding the meta; else None."""
    found: list[Any] = []

    def grab(seg: int, block: int, offset: int, lay: tensors.Layout) -> Any:
        found.append((seg, offset, lay))
        return _ONE

    try:
        top = tensors.decode(meta, grab)
    except ValueError:
        return None
    if top is not _ONE or len(found) != 1:
        return None
    seg, offset, lay = found[0]
    if seg != 1 or lay.torch_dtype is not None or lay.dtype.hasobject:
        return None
    return lay.shape, lay.dtype, offset, None if lay.dense else lay.strides
